"""Security basics against the real thing: every listener on loopback, and a SASL broker end to end.

The password must reach Kafka and nothing else: not ``iotmon config``, not the stream's output, not a file
of the lake or the checkpoints, not the ``query_progress`` table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import ipaddress
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from ingest.landing import kafka_records
from ingest.verify import reconcile
from iotmon import broker
from iotmon.config import Secret, Settings
from iotmon.kafka import KafkaUnavailable, partition_offsets
from iotmon.ops import install_progress_recorder
from iotmon.schema import BRONZE, INGEST, QUARANTINE, QUERY_PROGRESS
from pipeline.stream import drain_until_idle
from pipeline.topology import ensure_tables
from simulators.options import SimulationOptions
from simulators.publish import run_simulation
from tests.support import free_port, wait_for, with_own_broker

pytestmark = pytest.mark.integration

IOTMON = [sys.executable, "-m", "iotmon.cli"]
PASSWORD = "s3cr3t-Zq7-not-anywhere"
LISTEN = "0A"


# --- listening sockets from /proc ------------------------------------------------------------------------


def _descendants(root: int) -> set[int]:
    """``root`` and every process below it (the broker, Spark JVMs, Python workers, UI servers)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(") ", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def _socket_inodes(pids: Iterable[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[len("socket:[") : -1])
    return inodes


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """A /proc/net/tcp* address: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_address)
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(ordered) == 4:
        return ipaddress.IPv4Address(ordered)
    address = ipaddress.IPv6Address(ordered)
    return address.ipv4_mapped or address


def listening(pids: Iterable[int]) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = _socket_inodes(pids)
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                host, port = local.split(":")
                sockets.add((str(_address(host)), int(port, 16)))
    return sockets


@contextlib.contextmanager
def _process(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """A child in a process group of its own, stopped with its whole group (the UIs fork workers)."""
    process = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


_SPARK_WITH_UI = """
import sys
from iotmon.config import Settings
from iotmon.spark import spark_session
spark = spark_session(Settings.from_env(), "iotmon-loopback-check")
spark.range(10).count()
print("ui", spark.sparkContext.uiWebUrl, flush=True)
sys.stdin.read()
"""


def test_every_listener_the_project_starts_is_on_loopback(kafka: Settings, spark: SparkSession, tmp_path: Path):
    settings = dataclasses.replace(
        kafka,
        home=tmp_path,
        cache_dir=kafka.cache,
        spark_ui=True,
        spark_driver_memory="1g",
        dashboard_port=free_port(),
        mlflow_ui_port=free_port(),
    )
    env = settings.child_env()
    spark_log, dashboard_log, mlflow_log = tmp_path / "spark.log", tmp_path / "dashboard.log", tmp_path / "mlflow.log"
    with (
        _process([sys.executable, "-c", _SPARK_WITH_UI], env, spark_log) as spark_child,
        _process([*IOTMON, "dashboard"], env, dashboard_log) as dashboard,
        _process([*IOTMON, "mlflow"], env, mlflow_log) as mlflow_ui,
    ):
        children = {spark_child.pid, dashboard.pid, mlflow_ui.pid}

        def ui_port() -> int | None:
            for line in spark_log.read_text().splitlines():
                if line.startswith("ui http"):
                    return int(line.rsplit(":", 1)[1].strip("/"))
            assert spark_child.poll() is None, spark_log.read_text()
            return None

        spark_ui = wait_for(ui_port, 120, "a Spark session with its UI", poll=0.5)

        def everything_listens() -> set[tuple[str, int]] | None:
            for child, log in ((dashboard, dashboard_log), (mlflow_ui, mlflow_log)):
                assert child.poll() is None, log.read_text()
            sockets = listening(_descendants(os.getpid()))
            ports = {port for _, port in sockets}
            wanted = {settings.dashboard_port, settings.mlflow_ui_port, spark_ui}
            return sockets if wanted <= ports else None

        sockets = wait_for(everything_listens, 120, "the dashboard and the MLflow UI to listen", poll=0.5)
        assert children <= _descendants(os.getpid())

    _, port = kafka.kafka_host_port
    ports = {port for _, port in sockets}
    # The session's broker (both listeners) and Spark driver, and the children's UIs, are all seen ...
    if kafka.kafka_bootstrap.startswith("127.0.0.1"):  # the embedded broker, not a container's
        assert {port, kafka.kafka_controller_port} <= ports
    assert int(spark.sparkContext.getConf().get("spark.driver.port")) in ports
    assert spark.sparkContext.getConf().get("spark.driver.bindAddress") == "127.0.0.1"
    # ... and not one socket listens beyond loopback.
    exposed = {(address, p) for address, p in sockets if not ipaddress.ip_address(address).is_loopback}
    assert not exposed, f"listening beyond loopback: {sorted(exposed)}"


# --- a SASL broker, end to end ---------------------------------------------------------------------------


def _files_containing(root: Path, needle: bytes) -> list[str]:
    return [str(path) for path in root.rglob("*") if path.is_file() and needle in path.read_bytes()]


def test_archive_from_a_sasl_broker_keeps_the_password_to_kafka(
    base_settings: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    secured = with_own_broker(
        base_settings,
        tmp_path / "home",
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_mechanism="PLAIN",
        kafka_sasl_username="iotmon",
        kafka_sasl_password=Secret(PASSWORD),
        topic="secured.readings",
    )
    truth = tmp_path / "truth.parquet"
    broker.start(secured)
    try:
        options = SimulationOptions(devices=20, seed=5, events=2_000, truth_path=truth, progress=False)
        assert run_simulation(secured, options).failed == 0

        # Without credentials, or with wrong ones, the broker is not reachable.
        anonymous = dataclasses.replace(secured, kafka_security_protocol="PLAINTEXT", kafka_sasl_password=None)
        with pytest.raises(KafkaUnavailable):
            partition_offsets(anonymous, timeout=5)
        wrong = dataclasses.replace(secured, kafka_sasl_password=Secret("not-the-password"))
        with pytest.raises(KafkaUnavailable) as refused:
            partition_offsets(wrong, timeout=5)
        assert "not-the-password" not in str(refused.value)

        # Spark shows the Kafka source's options in plans (and the SQL tab of its UI): the JAAS line is masked.
        plan = kafka_records(spark, secured)._jdf.queryExecution().toString()
        assert "kafka.sasl.jaas.config=*********(redacted)" in plan and PASSWORD not in plan

        # The real bronze query, as `iotmon stream` runs it, with its progress recorded to query_progress.
        ensure_tables(spark, secured)
        stream_output = io.StringIO()
        with install_progress_recorder(spark, secured, flush_every=0.5):
            drained = drain_until_idle(spark, secured, [BRONZE, QUARANTINE], out=stream_output)
        assert drained[INGEST] == 2_000
        env = secured.child_env()
        config = subprocess.run([*IOTMON, "config"], env=env, capture_output=True, text=True, timeout=60)
        assert config.returncode == 0 and "IOTMON_KAFKA_SASL_PASSWORD" in config.stdout

        # Bronze holds exactly what the SASL broker holds.
        result = reconcile(spark, secured, [truth])
        assert result.problems == [], result.report()
        assert spark.read.format("delta").load(secured.table_path(BRONZE)).count() == 2_000
        progress = spark.read.format("delta").load(secured.table_path(QUERY_PROGRESS))
        ingest_progress = progress.where(f"query_name = '{INGEST}'").collect()
        assert ingest_progress, "the ingest query's progress was recorded"
    finally:
        broker.stop(secured)

    # The password went nowhere it should not.
    for what, text in (
        ("iotmon config", config.stdout + config.stderr),
        ("the stream's output", stream_output.getvalue()),
    ):
        assert PASSWORD not in text, what
    for row in progress.collect():
        assert PASSWORD not in str(row.asDict()), row.query_name
    assert any("Kafka" in row.progress_json for row in ingest_progress)  # the source is described, unmasked
    # Every file of the lake, the checkpoints, the run file and the broker's data and logs; the one place it
    # is stored is the broker's own configuration, readable by its owner only.
    needle = PASSWORD.encode()
    properties = broker.broker_paths(secured).properties
    assert secured.lake_root.startswith(str(secured.home)) and secured.checkpoint_root.startswith(str(secured.home))
    assert _files_containing(secured.home, needle) == [str(properties)]
    assert properties.stat().st_mode & 0o077 == 0
