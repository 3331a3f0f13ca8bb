"""A real single-node Apache Kafka broker (KRaft) run from Maven Central jars, for local use and tests.

It listens on loopback only, keeps its data under ``$IOTMON_HOME/kafka`` and survives restarts with its
data intact, so a restarted broker serves the same offsets to a resumed stream.
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from iotmon.config import Settings
from iotmon.jars import kafka_broker_bundle, resolve

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
NODE_ID = 1


class BrokerError(RuntimeError):
    """The broker could not be started or stopped; the message says why and what to do."""


@dataclass(frozen=True)
class BrokerPaths:
    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def log_config(self) -> Path:
        return self.root / "log4j2.properties"

    @property
    def log(self) -> Path:
        return self.root / "broker.log"

    @property
    def pid_file(self) -> Path:
        return self.root / "broker.pid"


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str
    data_dir: Path

    def report(self) -> str:
        state = f"running (pid {self.pid})" if self.running else "stopped"
        return f"kafka broker: {state}\n  bootstrap: {self.bootstrap}\n  data: {self.data_dir}"


def broker_paths(settings: Settings) -> BrokerPaths:
    return BrokerPaths((settings.home / "kafka").absolute())


def _client_listener(settings: Settings) -> dict[str, object]:
    """Properties of the clients' listener: PLAINTEXT, or SASL_PLAINTEXT with PLAIN when the settings ask.

    The one user is the one the settings name (``user_<name>`` in the listener's JAAS line); the controller
    listener stays PLAINTEXT, on loopback like the clients'.
    """
    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    if protocol != "SASL_PLAINTEXT" or settings.kafka_sasl_mechanism != "PLAIN":
        raise BrokerError(
            f"The embedded broker serves PLAINTEXT or SASL_PLAINTEXT with PLAIN, not {protocol}"
            f"{'/' + settings.kafka_sasl_mechanism if protocol.startswith('SASL_') else ''}; "
            "run your own broker for SSL or SCRAM, or change IOTMON_KAFKA_SECURITY_PROTOCOL."
        )
    from iotmon.kafka import JAAS_LOGIN_MODULES, jaas_config, jaas_quote, sasl_credentials

    username, password = sasl_credentials(settings)
    # The broker's own login (inter-broker) followed by the users it accepts.
    own_login = jaas_config(JAAS_LOGIN_MODULES["PLAIN"], username, password).removesuffix(";")
    accepted = f"user_{username}={jaas_quote(password)}"
    return {
        "sasl.enabled.mechanisms": "PLAIN",
        "sasl.mechanism.inter.broker.protocol": "PLAIN",
        f"listener.name.{protocol.lower()}.plain.sasl.jaas.config": f"{own_login} {accepted};",
    }


def _server_properties(settings: Settings, paths: BrokerPaths) -> str:
    host, port = settings.kafka_host_port
    controller = settings.kafka_controller_port
    listener = settings.kafka_security_protocol
    security = _client_listener(settings)
    props = {
        "process.roles": "broker,controller",
        "node.id": NODE_ID,
        "controller.quorum.voters": f"{NODE_ID}@{host}:{controller}",
        "listeners": f"{listener}://{host}:{port},CONTROLLER://{host}:{controller}",
        "advertised.listeners": f"{listener}://{host}:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": listener,
        "listener.security.protocol.map": f"{listener}:{listener},CONTROLLER:PLAINTEXT",
        **security,
        "log.dirs": paths.data,
        "num.partitions": settings.topic_partitions,
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": 1,
        "offsets.topic.num.partitions": 4,
        "transaction.state.log.replication.factor": 1,
        "transaction.state.log.min.isr": 1,
        "share.coordinator.state.topic.replication.factor": 1,
        "share.coordinator.state.topic.min.isr": 1,
        "group.initial.rebalance.delay.ms": 0,
        # The archive is reconciled against what Kafka holds: keep data until told otherwise.
        "log.retention.hours": -1,
        "log.segment.bytes": 256 * 1024 * 1024,
    }
    # Java properties: a backslash escapes, so the JAAS line's own escapes are doubled.
    return "".join(f"{key}={str(value).replace(chr(92), chr(92) * 2)}\n" for key, value in props.items())


_LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
"""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); ask the kernel for its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _read_pid(paths: BrokerPaths) -> int | None:
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _check_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError("Java 17+ is needed for the embedded Kafka broker; install a JDK and try again.")
    result = subprocess.run([java, "-version"], capture_output=True, text=True)
    first = (result.stderr or result.stdout).splitlines()[0] if (result.stderr or result.stdout) else ""
    try:
        major = int(first.split('"')[1].split(".")[0])
    except (IndexError, ValueError):
        major = 0
    if major and major < 17:
        raise BrokerError(f"The embedded Kafka broker needs Java 17+, found: {first}")
    return java


def _cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding, not starting with '-'."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            return cid


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def status(settings: Settings) -> BrokerStatus:
    paths = broker_paths(settings)
    pid = _read_pid(paths)
    return BrokerStatus(pid is not None, pid, settings.kafka_bootstrap, paths.data)


def _broker_answers(settings: Settings) -> bool:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from iotmon.kafka import client_config

    if not _port_open(*settings.kafka_host_port):
        return False
    client = AdminClient(client_config(settings))
    try:
        client.list_topics(timeout=2)
    except KafkaException:
        return False
    return True


def start(settings: Settings, timeout: float = 90.0) -> BrokerStatus:
    """Start the broker unless it already runs; return once it answers metadata requests."""
    host, port = settings.kafka_host_port
    if host not in LOOPBACK:
        raise BrokerError(
            f"IOTMON_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} is not a loopback address: the embedded "
            "broker only runs locally. Use your cluster directly, or point the variable at 127.0.0.1."
        )
    paths = broker_paths(settings)
    current = status(settings)
    if current.running:
        _wait_until_ready(settings, paths, current.pid, timeout)
        return current
    for name, busy_port in (
        ("IOTMON_KAFKA_BOOTSTRAP", port),
        ("IOTMON_KAFKA_CONTROLLER_PORT", settings.kafka_controller_port),
    ):
        if _port_open(host, busy_port):
            raise BrokerError(
                f"Port {busy_port} on {host} is already in use by another process, so the embedded broker "
                f"cannot listen there. Stop that process or choose another port with {name}."
            )
    java = _check_java()
    classpath = os.pathsep.join(str(jar) for jar in resolve(settings, kafka_broker_bundle()))
    paths.root.mkdir(parents=True, exist_ok=True)
    # It may hold the SASL user's password: readable by this user only, and outside the lake.
    paths.properties.touch(mode=0o600)
    paths.properties.chmod(0o600)
    paths.properties.write_text(_server_properties(settings, paths))
    paths.log_config.write_text(_LOG4J2.format(log=paths.log))
    jvm = [
        java,
        f"-Xms{settings.kafka_heap}",
        f"-Xmx{settings.kafka_heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        f"-Dlog4j2.configurationFile={paths.log_config}",
        "-cp",
        classpath,
    ]
    if not (paths.data / "meta.properties").exists():
        formatted = subprocess.run(
            [*jvm, "kafka.tools.StorageTool", "format", "-t", _cluster_id(), "-c", str(paths.properties)],
            capture_output=True,
            text=True,
        )
        if formatted.returncode != 0:
            raise BrokerError(f"Formatting Kafka storage failed:\n{formatted.stdout}{formatted.stderr}")
    with open(paths.root / "broker.out", "ab") as out:
        process = subprocess.Popen(
            [*jvm, "kafka.Kafka", str(paths.properties)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    paths.pid_file.write_text(str(process.pid))
    _wait_until_ready(settings, paths, process.pid, timeout)
    return status(settings)


def _wait_until_ready(settings: Settings, paths: BrokerPaths, pid: int | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid is not None and not _pid_alive(pid):
            raise BrokerError(
                f"The Kafka broker exited during start-up. Last lines of {paths.log}:\n{_tail(paths.log)}\n"
                f"and of {paths.root / 'broker.out'}:\n{_tail(paths.root / 'broker.out')}"
            )
        if _broker_answers(settings):
            return
        time.sleep(0.2)
    raise BrokerError(f"The Kafka broker did not answer within {timeout:.0f}s; see {paths.log}.")


def stop(settings: Settings, timeout: float = 60.0) -> bool:
    """Stop the broker gracefully (SIGTERM, then SIGKILL after ``timeout``); False if it was not running."""
    paths = broker_paths(settings)
    pid = _read_pid(paths)
    if pid is None:
        paths.pid_file.unlink(missing_ok=True)
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
        while _pid_alive(pid):
            time.sleep(0.05)
    # Reap it if this process started it, so it does not linger as a zombie.
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    paths.pid_file.unlink(missing_ok=True)
    return True
