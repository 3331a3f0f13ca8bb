"""How long a reading takes to become readable in the lake: from its event to the Delta commit holding it.

A row is readable once the commit that added its data file is in the table's log, so the moment that log
entry was written (its file's modification time, as ``DESCRIBE HISTORY`` reports it) is when a dashboard or
query could first see the row. Measured against the lake alone, after the fact: nothing is added to the
pipeline's hot path.

Only on-time readings count (silver's ``lateness``): the simulator holds late readings back on purpose,
and their delay is the sensor's, not the pipeline's.

A reading's live window (``device_windows_live``) is measured from its event to the first commit whose row for
the reading's device and window counts it (``live_window_latency``): the table is MERGEd at every batch, and
a MERGE rewrites every file it touches whole, so a row's current file says when the row was last rewritten
(often minutes after its last change), not when it took the reading in. Every version of a row stays in the
data files the log added (the project never vacuums), and a window's readings reach the live query in Kafka
offset order (one partition per device), so the reading that is the window's k-th by offset is counted from
the first version whose ``readings`` is at least k.

A device that goes silent (``offline_latency``) is measured from its last reading to the commit of its offline row in
``device_status_changes`` (an append: a row's file is its commit), for every silence the simulator's ground
truth scheduled that the run could see through; ``IOTMON_OFFLINE_AFTER`` of it is by design.

A final window (``device_windows``) is written once, when the watermark has passed its end, and is
measured from the window's end to its commit (``window_latency``): its figure includes ``IOTMON_WATERMARK``
by design, and it is what a dashboard user waits for a minute's final row after the minute closes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType

from iotmon.config import Settings, interval_seconds
from iotmon.lake import list_files
from iotmon.schema import (
    ANOMALIES,
    BRONZE,
    DEVICE_ID,
    DEVICE_STATUS_CHANGES,
    EVENT_TIME,
    LATE,
    LATENESS,
    LIVE_WINDOWS,
    OFFLINE,
    ON_TIME,
    PARSE_ERROR,
    SEQ,
    SILVER,
)
from streaming.windows import WindowSpec

QUANTILES: tuple[float, ...] = (0.5, 0.95, 0.99)
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
    """Event → bronze, silver, anomalies and live-window rows, for on-time readings with events in
    ``[since, until)``."""

    def load(name: str) -> DataFrame:
        return with_data_file(spark.read.format("delta").load(settings.table_path(name)))

    silver = load(SILVER).where(_in_range(EVENT_TIME, since, until) & (F.col(LATENESS) == ON_TIME))
    on_time = silver.select(DEVICE_ID, SEQ)
    bronze = load(BRONZE).where(_in_range("kafka_timestamp", since, until) & F.col(PARSE_ERROR).isNull())
    anomalies = load(ANOMALIES).where(_in_range(EVENT_TIME, since, until)).join(on_time, [DEVICE_ID, SEQ], "left_semi")
    measured = ((BRONZE, bronze, "kafka_timestamp"), (SILVER, silver, EVENT_TIME), (ANOMALIES, anomalies, EVENT_TIME))
    return [
        *(
            percentiles(visibility_latency(rows, commit_times(spark, settings.table_path(name)), reference), name)
            for name, rows, reference in measured
        ),
        live_window_latency(spark, settings, since, until),
    ]


def _in_range(column: str, since: datetime, until: datetime | None) -> F.Column:
    after = F.col(column) >= F.lit(since)
    return after & (F.col(column) < F.lit(until)) if until is not None else after


def row_versions(spark: SparkSession, table_path: str, since: datetime | None = None) -> DataFrame:
    """Every version of every row an unpartitioned table has held, with ``committed_at``, the time of the commit
    that wrote it: the rows of every data file its log added (from ``since`` on), the files later MERGEs removed
    included."""
    commits = commit_times(spark, table_path)
    if since is not None:
        commits = commits.where(F.col("committed_at") >= F.lit(since))
    added = {row["data_file"] for row in commits.select("data_file").collect()}
    files = [path for path in list_files(spark, table_path, ".parquet") if path.rsplit("/", 1)[-1] in added]
    if not files:
        return spark.createDataFrame([], "data_file string, committed_at timestamp")
    return with_data_file(spark.read.parquet(*files)).join(commits, "data_file")


def live_window_latency(
    spark: SparkSession, settings: Settings, since: datetime, until: datetime | None = None
) -> Latency:
    """Event -> the first commit of ``device_windows_live`` counting the reading, for on-time readings with
    events in ``[since, until)`` (see the module docstring). A reading no version counts yet is left out."""
    length = WindowSpec.from_settings(settings).window
    window_start = F.window(EVENT_TIME, length).start
    # Every countable reading of each window a measured reading is in, so that ranks count from its start.
    margin = timedelta(seconds=interval_seconds(length))
    around = _in_range(EVENT_TIME, since - margin, until + margin if until is not None else None)
    silver = spark.read.format("delta").load(settings.table_path(SILVER))
    by_offset = Window.partitionBy(DEVICE_ID, "window_start").orderBy("partition", "offset")
    readings = (
        silver.where(around & F.col(LATENESS).isin(ON_TIME, LATE))
        .withColumn("window_start", window_start)
        .withColumn("rank", F.row_number().over(by_offset))
        .where(_in_range(EVENT_TIME, since, until) & (F.col(LATENESS) == ON_TIME))
        .select(DEVICE_ID, SEQ, EVENT_TIME, "window_start", "rank")
    )
    # A reading is committed after its event, give or take a sensor clock's skew: older files cannot count it.
    versions = row_versions(spark, settings.table_path(LIVE_WINDOWS), since - margin).select(
        DEVICE_ID, "window_start", F.col("readings").alias("counted"), "committed_at"
    )
    counted = readings.join(versions, [DEVICE_ID, "window_start"]).where(F.col("counted") >= F.col("rank"))
    first = counted.groupBy(DEVICE_ID, SEQ, EVENT_TIME).agg(F.min("committed_at").alias("committed_at"))
    micros = F.unix_micros("committed_at") - F.unix_micros(EVENT_TIME)
    return percentiles(first.select((micros / 1e6).alias("latency_s")), LIVE_WINDOWS)


def window_latency(
    spark: SparkSession, settings: Settings, table: str, since: datetime, until: datetime | None = None
) -> Latency:
    """Window end -> commit of the row, for windows ending in ``[since, until)``, in a table that writes each row
    once (the final windows; see the module docstring)."""
    rows = with_data_file(spark.read.format("delta").load(settings.table_path(table)))
    commits = commit_times(spark, settings.table_path(table))
    return percentiles(visibility_latency(rows.where(_in_range(WINDOW_END, since, until)), commits, WINDOW_END), table)


SILENCE_MATCH_S = 10.0
"""How far before a scheduled silence's start the device's last reading may be (its reading interval, and a
reading sent late that became its latest) for an offline row to answer that silence."""
SETTLE_S = 30.0
"""A silence must have been due offline this long before the fleet stopped to count as one the run could see
through: the status query's watermark lags the newest event by its lateness, and its trigger comes on top."""


def dropout_episodes(truth: Path) -> list[tuple[str, datetime]]:
    """``(device_id, start)`` of every silence a simulator run scheduled (its ``.summary.json``), naive UTC."""
    document = json.loads(truth.with_name(truth.name + ".summary.json").read_text())
    return [(e["device_id"], datetime.fromisoformat(e["start"]).replace(tzinfo=None)) for e in document["dropouts"]]


def offline_delays(
    episodes: Iterable[tuple[str, datetime]],
    offline_rows: Iterable[tuple[str, datetime, datetime]],
    since: datetime,
    until: datetime,
    offline_after_s: float,
    measured_at: datetime,
) -> dict[str, Any]:
    """Seconds from a silent device's last reading to the commit of its offline row, for each silence that
    started in ``[since, until)`` and was due offline ``SETTLE_S`` before ``until`` (the fleet's stop); a
    silence without an offline row counts as still waiting at ``measured_at`` (the figure is then a lower
    bound, and ``missed`` says how many). ``offline_rows`` are ``(device_id, last_seen, committed_at)``. Pure."""
    due = timedelta(seconds=offline_after_s + SETTLE_S)
    rows: dict[str, list[tuple[datetime, datetime]]] = {}
    for device, last_seen, committed_at in offline_rows:
        rows.setdefault(device, []).append((last_seen, committed_at))
    delays, missed = [], 0
    for device, start in episodes:
        if not (since <= start and start + due <= until):
            continue
        answers = [
            (last_seen, committed_at)
            for last_seen, committed_at in rows.get(device, [])
            if start - timedelta(seconds=SILENCE_MATCH_S) <= last_seen <= start
        ]
        if answers:
            last_seen, committed_at = max(answers)
            delays.append((committed_at - last_seen).total_seconds())
        else:
            missed += 1
            delays.append((measured_at - start).total_seconds())
    delays.sort()
    return {
        "silences": len(delays),
        "missed": missed,
        "offline_after_s": offline_after_s,
        "p50_s": round(delays[len(delays) // 2], 3) if delays else None,
        "max_s": round(delays[-1], 3) if delays else None,
    }


def offline_latency(
    spark: SparkSession, settings: Settings, truth: Path, since: datetime, until: datetime, measured_at: datetime
) -> dict[str, Any]:
    """Silence -> offline row, for the silences the fleet's ground truth ``truth`` scheduled (``offline_delays``)."""
    path = settings.table_path(DEVICE_STATUS_CHANGES)
    offline = with_data_file(spark.read.format("delta").load(path)).where(
        (F.col("status") == OFFLINE) & (F.col("last_seen") >= F.lit(since - timedelta(seconds=SILENCE_MATCH_S)))
    )
    committed = offline.join(commit_times(spark, path), "data_file").select(DEVICE_ID, "last_seen", "committed_at")
    rows = [(r[DEVICE_ID], r["last_seen"], r["committed_at"]) for r in committed.collect()]
    return offline_delays(
        dropout_episodes(truth), rows, since, until, interval_seconds(settings.offline_after), measured_at
    )


def render(results: list[Latency]) -> str:
    """One line per table; columns stay apart however wide a figure is (a simulated past is days old)."""
    head = f"{'table':<20}{'rows':>10}" + "".join(f" {f'p{round(q * 100)}':>9}" for q in QUANTILES)
    lines = [head]
    for r in results:
        cells = "".join(f" {s:>8.2f}s" for s in r.seconds) if r.seconds else f" {'no rows':>9}"
        lines.append(f"{r.table:<20}{r.rows:>10,}{cells}")
    return "\n".join(lines)
