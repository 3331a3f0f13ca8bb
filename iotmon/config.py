"""Typed settings with local defaults, overridable by ``IOTMON_*`` environment variables.

Every stage reads its configuration from here, so the same code runs against the embedded broker and a
local lake, or against a Kafka cluster, a Spark master and an object store, by environment alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "IOTMON_"
REDACTED = "***"
KAFKA_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
KAFKA_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


class ConfigError(ValueError):
    """A setting has a value that cannot be used; the message names the environment variable."""


def _parse_bool(raw: str) -> bool:
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError("expected one of true/false/1/0/yes/no/on/off")


def _number(parse: Callable[[str], T], raw: str) -> T:
    """``int``/``float`` with a message for people ("expected a number"), not Python's own."""
    try:
        return parse(raw)
    except ValueError:
        raise ValueError(f"expected {'an integer' if parse is int else 'a number'}") from None


def _parse_positive_int(raw: str) -> int:
    value = _number(int, raw)
    if value <= 0:
        raise ValueError("expected a positive integer")
    return value


def _parse_non_negative_int(raw: str) -> int:
    value = _number(int, raw)
    if value < 0:
        raise ValueError("expected an integer of 0 or more")
    return value


def _parse_optional_positive_int(raw: str) -> int | None:
    if raw.strip().lower() in {"", "none", "0"}:
        return None
    return _parse_positive_int(raw)


def _parse_port(raw: str) -> int:
    value = _number(int, raw)
    if not 0 < value < 65536:
        raise ValueError("expected a TCP port between 1 and 65535")
    return value


def _parse_percentage(raw: str) -> float:
    value = _number(float, raw)
    if not 0.0 <= value <= 100.0:  # also rejects nan
        raise ValueError("expected a percentage between 0 and 100")
    return value


def _parse_memory(raw: str) -> str:
    """A JVM memory size such as ``512m`` or ``3g``, as both ``-Xmx`` and Spark read it."""
    if not re.fullmatch(r"[1-9][0-9]*[kKmMgGtT]?", raw.strip()):
        raise ValueError("expected a size such as 512m or 3g")
    return raw.strip()


def _parse_utc_time(raw: str) -> str:
    """An ISO-8601 time such as ``2000-01-01T00:00:00Z``, returned unchanged for Spark to cast."""
    text = raw.strip()
    try:
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|[+-]\d{2}:?\d{2})?)?", text):
            raise ValueError
        datetime.fromisoformat(text)
    except ValueError:
        raise ValueError("expected an ISO-8601 time such as 2000-01-01T00:00:00Z") from None
    return text


def _parse_bootstrap(raw: str) -> str:
    """Comma-separated ``host:port`` servers (a ``PROTOCOL://`` prefix allowed)."""
    for server in raw.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port[,host:port...], e.g. 127.0.0.1:9092")
    return raw.strip()


def _parse_topic(raw: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", raw):
        raise ValueError("expected a Kafka topic name: 1-249 of letters, digits, '.', '_', '-'")
    return raw


def _parse_fraction(raw: str) -> float:
    value = _number(float, raw)
    if not 0.0 < value < 0.5:
        raise ValueError("expected a fraction between 0 and 0.5, e.g. 0.01")
    return value


def _parse_interval(raw: str) -> str:
    """Validate a Spark interval such as ``5 seconds`` or ``2 minutes`` and return it unchanged."""
    parts = raw.strip().split()
    units = {"second", "seconds", "minute", "minutes", "hour", "hours", "millisecond", "milliseconds"}
    if len(parts) != 2 or not re.fullmatch(r"[0-9]+", parts[0]) or parts[1].lower() not in units:
        raise ValueError("expected '<number> seconds|minutes|hours', e.g. '5 seconds'")
    return raw.strip()


def _parse_positive_interval(raw: str) -> str:
    interval = _parse_interval(raw)
    if interval_seconds(interval) <= 0:
        raise ValueError("expected a length above zero, e.g. '1 minute'")
    return interval


def interval_seconds(interval: str) -> float:
    """Seconds in a Spark interval string accepted by ``_parse_interval``."""
    amount, unit = interval.split()
    scale = {"millisecond": 0.001, "second": 1, "minute": 60, "hour": 3600}[unit.lower().rstrip("s")]
    return int(amount) * scale


class Secret:
    """A setting's value that must never be shown: ``str``, ``repr`` and f-strings give ``***``.

    Only the code that hands it to a client (``reveal()``) sees the value, so a setting printed, logged or
    put in an exception by mistake shows the mask instead.
    """

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __str__(self) -> str:
        return REDACTED

    def __repr__(self) -> str:
        return f"Secret({REDACTED!r})"

    def __format__(self, spec: str) -> str:
        return format(REDACTED, spec)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


def _parse_choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().upper()
        if value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value

    return parse


def _setting(env: str, default: Any, parse: Callable[[str], Any] = str, doc: str = "", secret: bool = False) -> Any:
    """A setting; ``secret`` ones hold a ``Secret`` and are masked wherever settings are shown."""
    return field(default=default, metadata={"env": env, "parse": parse, "doc": doc, "secret": secret})


@dataclass(frozen=True)
class Settings:
    """All knobs of the pipeline; ``Settings.from_env()`` is the only way the CLI builds one."""

    home: Path = _setting("HOME", Path("var"), Path, "Local state: broker data, lake, checkpoints, ground-truth files.")
    cache_dir: Path | None = _setting(
        "CACHE_DIR",
        None,
        Path,
        "Downloaded jars, the Maven repository and the JVM's class archive (default: $IOTMON_HOME/cache).",
    )
    lake: str | None = _setting(
        "LAKE", None, str, "Root of the Delta tables: a path or an object-store URI (default: $IOTMON_HOME/lake)."
    )
    checkpoints: str | None = _setting(
        "CHECKPOINTS", None, str, "Root of streaming checkpoints (default: $IOTMON_HOME/checkpoints)."
    )
    kafka_bootstrap: str = _setting("KAFKA_BOOTSTRAP", "127.0.0.1:9092", _parse_bootstrap, "Kafka bootstrap servers.")
    kafka_controller_port: int = _setting(
        "KAFKA_CONTROLLER_PORT", 9093, _parse_port, "Controller port of the embedded broker."
    )
    kafka_heap: str = _setting("KAFKA_HEAP", "512m", _parse_memory, "Java heap of the embedded broker.")
    topic: str = _setting("TOPIC", "iotmon.readings", _parse_topic, "Topic the sensors publish to.")
    topic_partitions: int = _setting(
        "TOPIC_PARTITIONS", 4, _parse_positive_int, "Partitions of the readings topic when iotmon creates it."
    )
    kafka_security_protocol: str = _setting(
        "KAFKA_SECURITY_PROTOCOL",
        "PLAINTEXT",
        _parse_choice(*KAFKA_SECURITY_PROTOCOLS),
        "How every Kafka client connects: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL.",
    )
    kafka_sasl_mechanism: str = _setting(
        "KAFKA_SASL_MECHANISM",
        "PLAIN",
        _parse_choice(*KAFKA_SASL_MECHANISMS),
        "SASL mechanism (SASL_* protocols): PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512.",
    )
    kafka_sasl_username: str | None = _setting(
        "KAFKA_SASL_USERNAME", None, str, "SASL user name (required by the SASL_* protocols)."
    )
    kafka_sasl_password: Secret | None = _setting(
        "KAFKA_SASL_PASSWORD",
        None,
        Secret,
        "SASL password (required by SASL_*); secret: shown as *** and never logged or stored.",
        secret=True,
    )
    kafka_ssl_ca_location: str | None = _setting(
        "KAFKA_SSL_CA_LOCATION",
        None,
        str,
        "PEM file of the CA that signed the brokers' certificates (SSL, SASL_SSL; default: each client's own CAs).",
    )
    spark_master: str = _setting("SPARK_MASTER", "local[2]", str, "Spark master URL.")
    spark_driver_memory: str = _setting("SPARK_DRIVER_MEMORY", "3g", _parse_memory, "Spark driver memory.")
    spark_driver_java_options: str = _setting(
        "SPARK_DRIVER_JAVA_OPTIONS",
        "",
        str,
        "Extra JVM flags for the Spark driver (in local mode, the whole engine), added to the project's own; "
        "class-sharing flags (-Xshare, -XX:SharedArchiveFile) replace its class archive.",
    )
    spark_ui: bool = _setting("SPARK_UI", True, _parse_bool, "Serve Spark's web UI (on loopback, port 4040 up).")
    shuffle_partitions: int = _setting(
        "SHUFFLE_PARTITIONS",
        2,
        _parse_positive_int,
        "spark.sql.shuffle.partitions, and so the state store partitions of each stateful operator (fixed into a "
        "query's checkpoint at its first run): every partition is a task, and a state store commit, per batch.",
    )
    # The triggers set the stream's CPU: every batch has a fixed cost whatever its rows (about 0.35 s of CPU for a
    # gold query's at the demo's rate; docs/cost-model.md, "The floor" and "A calm trigger for the demo's rate").
    # These defaults ask for about 0.6 batches a second, about half a core at 500 events/s, and leave the rest of
    # 2 cores to the broker, the simulator, the dashboard and the trainer; shorter ones add CPU at any rate.
    trigger_interval: str = _setting(
        "TRIGGER_INTERVAL",
        "5 seconds",
        _parse_interval,
        "Processing-time trigger of the ingest query: every record in bronze and silver within seconds. The "
        "longest a record waits for a batch to start: one starts sooner once IOTMON_INGEST_BATCH_RECORDS wait.",
    )
    ingest_batch_records: int = _setting(
        "INGEST_BATCH_RECORDS",
        10_000,
        _parse_positive_int,
        "Records waiting in Kafka that start the ingest query's next batch before its trigger interval is up: "
        "at a high rate batches come as fast as they run, and stay short; at a low one, a batch an interval.",
    )
    gold_trigger_interval: str = _setting(
        "GOLD_TRIGGER_INTERVAL",
        "15 seconds",
        _parse_interval,
        "Processing-time trigger of the gold queries due within seconds (scores, alerts, device status, live "
        "windows) while their input is calm: each batch takes three ingest batches' readings for one batch's fixed "
        "costs, which keeps the stream at about half a core at the demo's rate.",
    )
    busy_trigger_interval: str = _setting(
        "BUSY_TRIGGER_INTERVAL",
        "5 seconds",
        _parse_interval,
        "Processing-time trigger of those gold queries while their input is busy (IOTMON_BUSY_ROWS_PER_SECOND): "
        "more batches, each with its fixed cost, which a calm stream's CPU budget cannot spare, and a shorter wait "
        "for the next one.",
    )
    busy_rows_per_second: int = _setting(
        "BUSY_ROWS_PER_SECOND",
        2_000,
        _parse_positive_int,
        "Input rate (rows a second) at which a gold query due within seconds moves to IOTMON_BUSY_TRIGGER_INTERVAL, "
        "once three batches in a row read at least that; three below it move it back.",
    )
    final_trigger_interval: str = _setting(
        "FINAL_TRIGGER_INTERVAL",
        "60 seconds",
        _parse_interval,
        "Processing-time trigger of the final windows and of the late arrivals: what they write can only be "
        "due once the watermark has moved on.",
    )
    max_offsets_per_trigger: int | None = _setting(
        "MAX_OFFSETS_PER_TRIGGER", 1_000_000, _parse_optional_positive_int, "Cap on Kafka records per batch."
    )
    max_payload_bytes: int = _setting(
        "MAX_PAYLOAD_BYTES", 64 * 1024, _parse_positive_int, "Larger payloads are quarantined unparsed."
    )
    max_clock_skew_seconds: int = _setting(
        "MAX_CLOCK_SKEW_SECONDS", 86_400, _parse_positive_int, "How far event time may lead the Kafka timestamp."
    )
    min_event_time: str = _setting(
        "MIN_EVENT_TIME", "2000-01-01T00:00:00Z", _parse_utc_time, "Earliest plausible event time."
    )
    watermark: str = _setting(
        "WATERMARK", "2 minutes", _parse_interval, "How late a reading may arrive and still update its window."
    )
    late_after: str = _setting(
        "LATE_AFTER",
        "1 second",
        _parse_interval,
        "Delay (Kafka time - event time) from which silver marks a reading late.",
    )
    window: str = _setting("WINDOW", "1 minute", _parse_positive_interval, "Length of the tumbling windows.")
    sliding_window: str = _setting(
        "SLIDING_WINDOW", "5 minutes", _parse_positive_interval, "Length of the sliding windows."
    )
    slide: str = _setting("SLIDE", "1 minute", _parse_positive_interval, "How often a sliding window starts.")
    session_gap: str = _setting(
        "SESSION_GAP",
        "1 minute",
        _parse_positive_interval,
        "Silence (event time) that ends a device's activity session.",
    )
    offline_after: str = _setting(
        "OFFLINE_AFTER",
        "1 minute",
        _parse_positive_interval,
        "Silence (event time) after which a device counts as offline.",
    )
    status_lateness: str = _setting(
        "STATUS_LATENESS",
        "5 seconds",
        _parse_interval,
        "How late a reading may reach Kafka and still count for device status; offline is declared this long "
        "after OFFLINE_AFTER of silence.",
    )
    low_battery: float = _setting(
        "LOW_BATTERY", 15.0, _parse_percentage, "Battery percentage below which a reporting device counts as degraded."
    )
    idle_tick_after: str = _setting(
        "IDLE_TICK_AFTER",
        "30 seconds",
        _parse_interval,
        "Wall time without readings after which the stream's event-time clock ticks on by itself.",
    )
    feature_history: str = _setting(
        "FEATURE_HISTORY",
        "1 minute",
        _parse_interval,
        "Event time before a reading that its anomaly features look at (the scorer reads as much history).",
    )
    train_max_readings: int = _setting(
        "TRAIN_MAX_READINGS",
        50_000,
        _parse_positive_int,
        "The trainer fits on a share of the devices holding about this many readings, each device's whole "
        "history, so training time stays flat as the archive grows.",
    )
    scorer_batch_bytes: int = _setting(
        "SCORER_BATCH_BYTES",
        8 * 1024 * 1024,
        _parse_positive_int,
        "Silver bytes a scorer batch reads at most (Delta's maxBytesPerTrigger, a soft cap: whole files): a "
        "backlog is scored in batches, each visible when done. A cap per trigger is a rate limit: keep it far "
        "above what arrives in a trigger (the default is about 300,000 readings).",
    )
    model_name: str = _setting("MODEL_NAME", "iotmon-anomaly", str, "Registered MLflow model the scorer serves.")
    mlflow_tracking_uri: str | None = _setting(
        "MLFLOW_TRACKING_URI",
        None,
        str,
        "MLflow tracking and registry (default: SQLite and artifacts under $IOTMON_HOME/mlflow).",
    )
    anomaly_contamination: float = _setting(
        "ANOMALY_CONTAMINATION",
        0.01,
        _parse_fraction,
        "Expected share of anomalous readings; the trainer's threshold flags this share of its training data.",
    )
    alert_clear_after: str = _setting(
        "ALERT_CLEAR_AFTER",
        "1 minute",
        _parse_interval,
        "Event time without anomalies after which a device's open alert is cleared.",
    )
    query_restarts: int = _setting(
        "QUERY_RESTARTS",
        5,
        _parse_non_negative_int,
        "Times in a row `iotmon stream` restarts a failing query (no batch written in between) before giving up.",
    )
    dashboard_host: str = _setting(
        "DASHBOARD_HOST", "127.0.0.1", str, "Address `iotmon dashboard` listens on (loopback: this machine only)."
    )
    dashboard_port: int = _setting("DASHBOARD_PORT", 8050, _parse_port, "Port `iotmon dashboard` listens on.")
    dashboard_refresh: str = _setting(
        "DASHBOARD_REFRESH", "5 seconds", _parse_positive_interval, "How often the dashboard page re-reads the lake."
    )
    dashboard_lookback: str = _setting(
        "DASHBOARD_LOOKBACK",
        "30 minutes",
        _parse_interval,
        "Event time before each table's newest row that the dashboard reads; older rows are not read.",
    )
    mlflow_ui_host: str = _setting(
        "MLFLOW_UI_HOST", "127.0.0.1", str, "Address `iotmon mlflow` (the MLflow UI) listens on."
    )
    mlflow_ui_port: int = _setting("MLFLOW_UI_PORT", 5000, _parse_port, "Port `iotmon mlflow` listens on.")
    log_level: str = _setting(
        "LOG_LEVEL",
        "",
        _parse_choice("", "DEBUG", "INFO", "WARNING", "ERROR"),
        "Empty: the console shows only the project's own lines, and Spark, Kafka clients, MLflow and the web "
        "servers log to $IOTMON_HOME/logs. A level (e.g. INFO, as `--verbose` sets) shows their lines of that "
        "level and above on the console too.",
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Build settings from ``IOTMON_*`` variables; bad values raise ``ConfigError`` naming the variable."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = ENV_PREFIX + f.metadata["env"]
            raw = environ.get(name)
            if raw is None or f.name in overrides:
                continue
            try:
                values[f.name] = f.metadata["parse"](raw)
            except ValueError as exc:
                raise ConfigError(f"{name}={raw!r} is not valid: {exc}") from None
        values.update(overrides)
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        """The ``IOTMON_*`` variables that reproduce these settings in a child process."""
        env = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                env[ENV_PREFIX + f.metadata["env"]] = value.reveal() if isinstance(value, Secret) else str(value)
            elif f.default is not None:  # an optional setting switched off
                env[ENV_PREFIX + f.metadata["env"]] = "none"
        return env

    def child_env(self) -> dict[str, str]:
        """The environment of a child process (an ``iotmon`` command, a Spark JVM's builder) that runs with these
        settings: this process's, its ``IOTMON_*`` variables replaced by these settings' own."""
        env = {key: value for key, value in os.environ.items() if not key.startswith(ENV_PREFIX)}
        return env | self.to_env()

    def secret_values(self) -> list[str]:
        """The values of the settings marked secret, for ``redact``."""
        values = (getattr(self, f.name) for f in fields(self) if f.metadata["secret"])
        return [value.reveal() for value in values if isinstance(value, Secret) and value.reveal()]

    def redact(self, text: str) -> str:
        """``text`` with every secret setting's value replaced by ``***``: the last guard before output."""
        for value in self.secret_values():
            text = text.replace(value, REDACTED)
        return text

    @property
    def cache(self) -> Path:
        return (self.cache_dir or self.home / "cache").absolute()

    @property
    def spark_is_local(self) -> bool:
        """Spark runs in this process's JVM (``local[...]``), not on a cluster's executors."""
        return self.spark_master.startswith("local")

    @property
    def lake_root(self) -> str:
        return self.lake or str((self.home / "lake").absolute())

    @property
    def checkpoint_root(self) -> str:
        return self.checkpoints or str((self.home / "checkpoints").absolute())

    @property
    def truth_dir(self) -> Path:
        """Where the simulator writes ground-truth files and ``iotmon verify --all-truth`` finds them."""
        return self.home / "truth"

    def table_path(self, table: str) -> str:
        """Location of a Delta table; tables are addressed by path so non-Spark readers find them too."""
        return f"{self.lake_root.rstrip('/')}/{table}"

    def checkpoint_path(self, query: str) -> str:
        return f"{self.checkpoint_root.rstrip('/')}/{query}"

    @property
    def mlflow_home(self) -> Path:
        return (self.home / "mlflow").absolute()

    @property
    def mlflow_database(self) -> Path:
        """The local SQLite tracking and registry database (used unless ``IOTMON_MLFLOW_TRACKING_URI`` is set)."""
        return self.mlflow_home / "mlflow.db"

    @property
    def tracking_uri(self) -> str:
        """The MLflow tracking (and registry) URI; local SQLite unless ``IOTMON_MLFLOW_TRACKING_URI`` is set."""
        return self.mlflow_tracking_uri or f"sqlite:///{self.mlflow_database}"

    @property
    def kafka_host_port(self) -> tuple[str, int]:
        """Host and port of the first bootstrap server, which is where the embedded broker listens."""
        first = self.kafka_bootstrap.split(",")[0].strip()
        host, _, port = first.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"IOTMON_KAFKA_BOOTSTRAP={self.kafka_bootstrap!r} is not host:port")
        return host, int(port)


def describe_settings() -> list[tuple[str, str, str]]:
    """(variable, default, meaning) for every setting: the configuration reference."""
    rows = []
    for f in fields(Settings):
        default = f.default
        shown = "" if default is None else REDACTED if f.metadata["secret"] else str(default)
        rows.append((ENV_PREFIX + f.metadata["env"], shown, f.metadata["doc"]))
    return rows
