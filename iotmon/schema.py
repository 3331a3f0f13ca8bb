"""The event contract shared by the simulator, the archive and every later stage.

A sensor reading travels as one JSON object per Kafka record, keyed by ``device_id``::

    {"device_id": "dev-000042", "seq": 17, "event_time": "2026-11-22T01:02:03.456Z",
     "temperature": 21.4, "humidity": 41.0, "vibration": 2.1, "pressure": 101.2, "battery": 97.5}

``seq`` increases by one per reading of a device, so ``(device_id, seq)`` identifies a reading even when
it is sent twice. Unknown extra fields are ignored (forward-compatible producers); a missing or mistyped
required field makes the record malformed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DateType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)


@dataclass(frozen=True)
class Metric:
    name: str
    unit: str
    low: float
    high: float
    """Physically plausible range; readings outside it are sensor faults, not weather."""


METRICS: tuple[Metric, ...] = (
    Metric("temperature", "°C", -40.0, 150.0),
    Metric("humidity", "%", 0.0, 100.0),
    Metric("vibration", "mm/s", 0.0, 100.0),
    Metric("pressure", "kPa", 0.0, 2000.0),
    Metric("battery", "%", 0.0, 100.0),
)
METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in METRICS)

DEVICE_ID = "device_id"
SEQ = "seq"
EVENT_TIME = "event_time"


def as_utc(moment: datetime) -> datetime:
    """An event time in UTC; a naive one is UTC already (the Spark session's time zone, the payload's Z)."""
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)


REQUIRED_FIELDS: tuple[str, ...] = (DEVICE_ID, SEQ, EVENT_TIME, *METRIC_NAMES)

DEVICE_TYPES: tuple[str, ...] = ("pump", "motor", "chiller", "compressor")

# What the simulator can do to a reading; the ground-truth file uses these names.
LATE_KINDS = ("on_time", "late", "very_late")
MALFORMED_KINDS = (
    "invalid_json",
    "missing_field",
    "mistyped_field",
    "non_finite",
    "absurd_timestamp",
    "oversized",
)
ANOMALY_TYPES = ("spike", "stuck", "drift", "noise_burst")

# Tables of the lake, addressed by ``Settings.table_path(name)``. Streaming queries are named after the
# (first) table they write, and so are their checkpoints, except these two: the ingest query writes bronze,
# quarantine, silver and the too-late readings; late arrivals are silver's second writer.
INGEST = "ingest"
"""The query landing Kafka's records in bronze, quarantine and silver, and handing the too-late readings on."""
LATE_ARRIVALS = "late_arrivals"
"""The query landing in silver the readings Kafka delivered later than the watermark."""
BRONZE = "bronze"
QUARANTINE = "quarantine"
DEVICES = "devices"
SILVER = "silver"
TOO_LATE_READINGS = "too_late_readings"
"""The readings Kafka delivered later than the watermark, as silver's rows, each copy once: the ingest query's
hand-off to the late-arrivals query, which looks them up in silver a minute's worth at a time."""
DEVICE_WINDOWS = "device_windows"
SITE_WINDOWS = "site_windows"
DEVICE_SESSIONS = "device_sessions"
LIVE_WINDOWS = "device_windows_live"
DEVICE_STATUS = "device_status"
DEVICE_STATUS_CHANGES = "device_status_changes"
QUERY_PROGRESS = "query_progress"
STREAM_CLOCK = "stream_clock"
ANOMALIES = "anomalies"
ALERTS = "alerts"
LAKE_TABLES: tuple[str, ...] = (
    BRONZE,
    QUARANTINE,
    DEVICES,
    SILVER,
    TOO_LATE_READINGS,
    DEVICE_WINDOWS,
    SITE_WINDOWS,
    DEVICE_SESSIONS,
    LIVE_WINDOWS,
    DEVICE_STATUS,
    DEVICE_STATUS_CHANGES,
    QUERY_PROGRESS,
    STREAM_CLOCK,
    ANOMALIES,
    ALERTS,
)
FRESHNESS_COLUMNS: dict[str, str] = {
    BRONZE: EVENT_TIME,
    SILVER: EVENT_TIME,
    DEVICE_WINDOWS: "window_end",
    SITE_WINDOWS: "window_end",
    DEVICE_SESSIONS: "session_end",
    LIVE_WINDOWS: "window_end",
    DEVICE_STATUS: "last_seen",
    DEVICE_STATUS_CHANGES: "changed_at",
    ANOMALIES: EVENT_TIME,
    ALERTS: "last_anomaly_at",
}
"""The event-time column that says how recent each table of readings or results is: its newest value, set
against the newest event Kafka holds, is how far the table is behind (``iotmon status``, the dashboard)."""

# How late a reading reached Kafka (Kafka timestamp minus event time), as silver records it in ``LATENESS``.
LATENESS = "lateness"
ON_TIME, LATE, TOO_LATE = "on_time", "late", "too_late"
LATENESS_LEVELS: tuple[str, ...] = (ON_TIME, LATE, TOO_LATE)

# Device health as the status operator tracks it.
ONLINE, DEGRADED, OFFLINE = "online", "degraded", "offline"
DEVICE_STATES: tuple[str, ...] = (ONLINE, DEGRADED, OFFLINE)

# Alert lifecycle.
OPEN, CLEARED = "open", "cleared"
ALERT_STATES: tuple[str, ...] = (OPEN, CLEARED)

# The payload as it is read: every field as raw JSON text, typed afterwards so that a mistyped field
# is reported by name instead of nulling the whole record.
RAW_PAYLOAD_SCHEMA = StructType([StructField(name, StringType()) for name in REQUIRED_FIELDS])

READING_COLUMNS = StructType(
    [
        StructField(DEVICE_ID, StringType()),
        StructField(SEQ, LongType()),
        StructField(EVENT_TIME, TimestampType()),
        *[StructField(name, DoubleType()) for name in METRIC_NAMES],
    ]
)

PARSE_ERROR = "parse_error"
"""Bronze's column saying why a record could not be parsed (null for a parsed reading)."""
BRONZE_SCHEMA = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("kafka_timestamp", TimestampType()),
        StructField("key", StringType()),
        StructField("value", BinaryType()),
        StructField("ingest_time", TimestampType()),
        *READING_COLUMNS.fields,
        StructField(PARSE_ERROR, StringType()),
    ]
)

QUARANTINE_SCHEMA = StructType(
    [
        StructField("stage", StringType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("kafka_timestamp", TimestampType()),
        StructField("key", StringType()),
        StructField("value", BinaryType()),
        StructField("reason", StringType()),
        StructField("ingest_time", TimestampType()),
    ]
)

REGISTRY_COLUMNS: tuple[str, ...] = ("device_type", "site", "model")

SILVER_SCHEMA = StructType(
    [
        *READING_COLUMNS.fields,
        StructField("device_type", StringType()),
        StructField("site", StringType()),
        StructField("model", StringType()),
        StructField("out_of_range", StringType()),
        StructField("arrival_delay_s", DoubleType()),
        StructField(LATENESS, StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("kafka_timestamp", TimestampType()),
    ]
)
"""One row per distinct reading: registry columns joined in, ``out_of_range`` lists metrics outside their
plausible range (kept: a sensor fault is what monitoring is for), ``partition``/``offset`` point at the first
copy that reached Kafka."""

DEVICES_SCHEMA = StructType(
    [
        StructField(DEVICE_ID, StringType(), False),
        StructField("device_type", StringType(), False),
        StructField("site", StringType(), False),
        StructField("model", StringType(), False),
        StructField("install_date", DateType(), False),
    ]
)

QUERY_PROGRESS_SCHEMA = StructType(
    [
        StructField("query_name", StringType()),
        StructField("query_id", StringType()),
        StructField("run_id", StringType()),
        StructField("batch_id", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("input_rows", LongType()),
        StructField("input_rows_per_second", DoubleType()),
        StructField("processed_rows_per_second", DoubleType()),
        StructField("batch_duration_ms", LongType()),
        StructField("watermark", TimestampType()),
        StructField("event_time_max", TimestampType()),
        StructField("state_rows", LongType()),
        StructField("state_memory_bytes", LongType()),
        StructField("rows_dropped_by_watermark", LongType()),
        StructField("kafka_lag", LongType()),
        StructField("observed_metrics", StringType()),
        StructField("sink_description", StringType()),
        StructField("progress_json", StringType()),
    ]
)
"""One row per executed micro-batch of any query (``iotmon.ops``). State and watermark columns are null for
stateless queries, ``kafka_lag`` for queries without a Kafka source: null means "not applicable", not zero."""

ANOMALIES_SCHEMA = StructType(
    [
        StructField(DEVICE_ID, StringType()),
        StructField(SEQ, LongType()),
        StructField(EVENT_TIME, TimestampType()),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField(LATENESS, StringType()),
        StructField("score", DoubleType()),
        StructField("threshold", DoubleType()),
        StructField("is_anomaly", BooleanType()),
        StructField("top_metric", StringType()),
        StructField("model_name", StringType()),
        StructField("model_version", IntegerType()),
    ]
)
"""One row per scored silver reading (the reading's key, Kafka coordinates and lateness), anomalous or not:
``top_metric`` is the metric whose features stand out most, ``model_version`` the registered version used."""

ALERTS_SCHEMA = StructType(
    [
        StructField("alert_id", StringType(), False),
        StructField(DEVICE_ID, StringType(), False),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
        StructField("status", StringType(), False),
        StructField("opened_at", TimestampType(), False),
        StructField("last_anomaly_at", TimestampType(), False),
        StructField("cleared_at", TimestampType()),
        StructField("anomalies", LongType(), False),
        StructField("max_score", DoubleType()),
        StructField("top_metric", StringType()),
        StructField("model_version", IntegerType()),
    ]
)
"""One row per incident (a device's anomaly episode), updated in place from ``open`` to ``cleared``."""
