"""How long a reading takes to become readable in the lake: from its event to the Delta commit holding it.

A row is readable once the commit that added its data file is in the table's log, so the moment that log
entry was written (its file's modification time, as ``DESCRIBE HISTORY`` reports it) is when a dashboard or
query could first see the row. Measured against the lake alone, after the fact: nothing is added to the
pipeline's hot path.

Only on-time readings count (silver's ``lateness``): the simulator holds late readings back on purpose,
and their delay is the sensor's, not the pipeline's.

A window row is measured from the window's end to the commit holding the row (``window_latency``). Not from
the newest event in it: the row does not carry that time, and the window's end is the moment its last
on-time reading could at the earliest have happened, so the figure is what a dashboard user waits after a
minute closes. A final window (``device_windows``) is written only once the watermark has passed its end,
so its figure includes ``IOTMON_WATERMARK`` by design; the live table (``device_windows_live``) is MERGEd at
every batch, and its row's latest commit is measured (a row still open at its window's end can be negative).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from iotmon.config import Settings
from iotmon.lake import list_files
from iotmon.schema import (
    ANOMALIES,
    BRONZE,
    DEVICE_ID,
    DEVICE_WINDOWS,
    EVENT_TIME,
    LATENESS,
    LIVE_WINDOWS,
    ON_TIME,
    PARSE_ERROR,
    SEQ,
    SILVER,
)

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
WINDOW_TABLES: tuple[str, ...] = (DEVICE_WINDOWS, LIVE_WINDOWS)
WINDOW_END = "window_end"

_LOG_SCHEMA = StructType([StructField("add", StructType([StructField("path", StringType())]))])


@dataclass(frozen=True)
class Latency:
    table: str
    rows: int
    seconds: tuple[float, ...]
    """The percentiles of ``QUANTILES``, in seconds; empty when no row matched."""

    def to_dict(self) -> dict[str, float | int | str | None]:
        named = {f"p{round(q * 100)}_s": None for q in QUANTILES}
        named.update({f"p{round(q * 100)}_s": round(s, 3) for q, s in zip(QUANTILES, self.seconds, strict=False)})
        return {"table": self.table, "rows": self.rows, **named}


def commit_times(spark: SparkSession, table_path: str) -> DataFrame:
    """``(data_file, committed_at)`` for every data file the table's JSON log adds."""
    # Listed here rather than globbed: Spark warns, with a stack trace, that a glob has no sink metadata.
    commits = list_files(spark, f"{table_path.rstrip('/')}/_delta_log", ".json")
    log = spark.read.schema(_LOG_SCHEMA).json(commits) if commits else spark.createDataFrame([], _LOG_SCHEMA)
    return log.where(F.col("add.path").isNotNull()).select(
        F.col("add.path").alias("data_file"), F.col("_metadata.file_modification_time").alias("committed_at")
    )


def with_data_file(table: DataFrame) -> DataFrame:
    """A freshly loaded table's rows with the name of the data file holding each (tables are unpartitioned)."""
    return table.withColumn("data_file", F.element_at(F.split(F.col("_metadata.file_path"), "/"), -1))


def visibility_latency(rows: DataFrame, commits: DataFrame, reference: str) -> DataFrame:
    """``latency_s`` per row (from ``with_data_file``): its file's commit time minus its ``reference`` time."""
    joined = rows.join(commits, "data_file")
    micros = F.unix_micros("committed_at") - F.unix_micros(reference)
    return joined.select((micros / 1e6).alias("latency_s"))


def percentiles(latencies: DataFrame, table: str) -> Latency:
    row = latencies.agg(
        F.count("*").alias("rows"), F.percentile_approx("latency_s", list(QUANTILES), 10_000).alias("p")
    ).first()
    return Latency(table, row["rows"], tuple(row["p"] or ()))


def measure(spark: SparkSession, settings: Settings, since: datetime, until: datetime | None = None) -> list[Latency]:
    """Event → bronze, silver and anomalies rows, for on-time readings with events in ``[since, until)``."""

    def load(name: str) -> DataFrame:
        return with_data_file(spark.read.format("delta").load(settings.table_path(name)))

    def in_range(column: str) -> F.Column:
        window = F.col(column) >= F.lit(since)
        return window & (F.col(column) < F.lit(until)) if until is not None else window

    silver = load(SILVER).where(in_range(EVENT_TIME) & (F.col(LATENESS) == ON_TIME))
    on_time = silver.select(DEVICE_ID, SEQ)
    bronze = load(BRONZE).where(in_range("kafka_timestamp") & F.col(PARSE_ERROR).isNull())
    anomalies = load(ANOMALIES).where(in_range(EVENT_TIME)).join(on_time, [DEVICE_ID, SEQ], "left_semi")
    measured = ((BRONZE, bronze, "kafka_timestamp"), (SILVER, silver, EVENT_TIME), (ANOMALIES, anomalies, EVENT_TIME))
    return [
        percentiles(visibility_latency(rows, commit_times(spark, settings.table_path(name)), reference), name)
        for name, rows, reference in measured
    ]


def window_latency(
    spark: SparkSession, settings: Settings, table: str, since: datetime, until: datetime | None = None
) -> Latency:
    """Window end -> commit of the row, for windows ending in ``[since, until)`` (see the module docstring)."""
    rows = with_data_file(spark.read.format("delta").load(settings.table_path(table)))
    in_range = F.col(WINDOW_END) >= F.lit(since)
    if until is not None:
        in_range = in_range & (F.col(WINDOW_END) <= F.lit(until))
    commits = commit_times(spark, settings.table_path(table))
    return percentiles(visibility_latency(rows.where(in_range), commits, WINDOW_END), table)


def render(results: list[Latency]) -> str:
    head = f"{'table':<12}{'rows':>10}" + "".join(f"{f'p{round(q * 100)}':>9}" for q in QUANTILES)
    lines = [head]
    for r in results:
        cells = "".join(f"{s:>8.2f}s" for s in r.seconds) if r.seconds else f"{'no rows':>9}"
        lines.append(f"{r.table:<12}{r.rows:>10,}{cells}")
    return "\n".join(lines)
