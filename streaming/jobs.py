"""The analytics stage's edges: the gold streaming queries over silver, their tables and their sinks.

Every sink is exactly once across crashes. A micro-batch that is replayed after a crash recomputes the
same rows (no wall-clock values) and each write is tagged with the query's id and the batch id
(``iotmon.lake.BatchLedger``), so a table that already holds the batch is skipped.

Event time only moves with data, so when the whole fleet falls silent the last windows would wait for
the next reading. ``EventClock`` ticks instead: after ``IOTMON_IDLE_TICK_AFTER`` of wall time without
readings it appends ticks to the ``stream_clock`` table, advancing event time as fast as wall time from
the last reading seen. The gold queries read the ticks with the readings, so their watermark, windows
and offline timers keep moving; ticks are data in a Delta table, so a replayed batch sees the same ones.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import TextIO

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from iotmon.config import Settings, interval_seconds
from iotmon.lake import BatchLedger, append_once, create_table, merge_once, table_property
from iotmon.queries import QuerySpec, Trigger, explain
from iotmon.schema import (
    DEVICE_SESSIONS,
    DEVICE_WINDOWS,
    LIVE_WINDOWS,
    SILVER_SCHEMA,
    SITE_WINDOWS,
    STREAM_CLOCK,
)
from streaming.alerts import ensure_alerts_table
from streaming.device_status import ensure_device_status_tables
from streaming.scoring import ensure_anomalies_table
from streaming.sources import ARRIVALS, CLOCK_SCHEMA, ensure_clock_table, watermarked_readings
from streaming.windows import END_COLUMN, FINAL_TABLES, WindowSpec, tumbling_device_windows

FINAL_THROUGH = "iotmon.finalThrough"
"""Table property of ``device_windows`` set by ``iotmon backfill``: final rows up to this time are already
written, so a gold query re-deriving its state from the start skips them."""
_TABLE = "_table"
BatchWriter = Callable[[DataFrame, int], None]
"""A ``foreachBatch`` function: the micro-batch and its id."""


def empty_silver(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame([], SILVER_SCHEMA)


def ensure_analytics_tables(spark: SparkSession, settings: Settings) -> None:
    """Create gold and the clock up front; gold schemas come from the functions that fill them."""
    spec = WindowSpec.from_settings(settings)
    comments = {
        DEVICE_WINDOWS: "Final per-device tumbling and sliding window statistics, each written once.",
        SITE_WINDOWS: "Final per-site and device-type tumbling window statistics, each written once.",
        DEVICE_SESSIONS: "Final per-device activity sessions (gap-based), each written once.",
    }
    for table, compute in FINAL_TABLES.items():
        create_table(spark, settings.table_path(table), compute(empty_silver(spark), spec).schema, comments[table])
    live = tumbling_device_windows(empty_silver(spark), spec).schema
    create_table(spark, settings.table_path(LIVE_WINDOWS), live, "Per-device tumbling windows, updated in place.")
    ensure_clock_table(spark, settings)
    ensure_device_status_tables(spark, settings)
    ensure_anomalies_table(spark, settings)
    ensure_alerts_table(spark, settings)


# --- gold: final windows ----------------------------------------------------------------------------------


def final_through(spark: SparkSession, settings: Settings) -> datetime | None:
    value = table_property(spark, settings.table_path(DEVICE_WINDOWS), FINAL_THROUGH)
    return datetime.fromisoformat(value) if value else None


def write_final_batch(
    settings: Settings, ledger: BatchLedger, after: datetime | None, columns: dict[str, list[str]]
) -> BatchWriter:
    """Split the tagged union into its tables; ``columns`` are each table's own."""

    def write(batch: DataFrame, batch_id: int) -> None:
        batch.persist()
        try:
            for table in FINAL_TABLES:
                rows = batch.where(F.col(_TABLE) == table).select(*columns[table])
                if after is not None:
                    rows = rows.where(F.col(END_COLUMN[table]) > F.lit(after))
                if not rows.isEmpty():
                    append_once(rows, settings.table_path(table), ledger, batch_id)
        finally:
            batch.unpersist()

    return write


def start_final_windows(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """All final gold tables from one stateful query: one read of silver, one watermark, one checkpoint.

    Append mode: a window or session is emitted once, in the batch in which the watermark passes its end.
    """
    spec = WindowSpec.from_settings(settings)
    readings = watermarked_readings(spark, settings)
    tables = {table: compute(readings, spec) for table, compute in FINAL_TABLES.items()}
    tagged = [frame.withColumn(_TABLE, F.lit(table)) for table, frame in tables.items()]
    union = tagged[0]
    for frame in tagged[1:]:
        union = union.unionByName(frame, allowMissingColumns=True)
    checkpoint = settings.checkpoint_path(DEVICE_WINDOWS)
    columns = {table: frame.columns for table, frame in tables.items()}
    writer = write_final_batch(settings, BatchLedger(checkpoint), final_through(spark, settings), columns)
    return (
        union.writeStream.queryName(DEVICE_WINDOWS)
        .outputMode("append")
        .foreachBatch(writer)
        .option("checkpointLocation", checkpoint)
        .trigger(**trigger)
        .start()
    )


# --- gold: live windows -----------------------------------------------------------------------------------


def write_live_batch(settings: Settings, ledger: BatchLedger) -> BatchWriter:
    path = settings.table_path(LIVE_WINDOWS)

    def write(batch: DataFrame, batch_id: int) -> None:
        batch.persist()
        try:
            first = batch.agg(F.min("window_start")).first()
            if first is None or first[0] is None:
                return
            condition = (
                (F.col("t.window_start") >= F.lit(first[0]))
                & (F.col("t.window_start") == F.col("s.window_start"))
                & (F.col("t.device_id") == F.col("s.device_id"))
            )
            merge_once(batch, path, condition, ledger, batch_id, update=True)
        finally:
            batch.unpersist()

    return write


def start_live_windows(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """Update mode: every batch MERGEs the windows it changed, so late readings correct them in place."""
    windows = tumbling_device_windows(watermarked_readings(spark, settings), WindowSpec.from_settings(settings))
    checkpoint = settings.checkpoint_path(LIVE_WINDOWS)
    return (
        windows.writeStream.queryName(LIVE_WINDOWS)
        .outputMode("update")
        .foreachBatch(write_live_batch(settings, BatchLedger(checkpoint)))
        .option("checkpointLocation", checkpoint)
        .trigger(**trigger)
        .start()
    )


FINAL_WINDOWS_QUERY = QuerySpec(DEVICE_WINDOWS, start_final_windows)
LIVE_WINDOWS_QUERY = QuerySpec(LIVE_WINDOWS, start_live_windows)


# --- the event-time clock ---------------------------------------------------------------------------------


class EventClock(threading.Thread):
    """Ticks event time forward while no readings arrive (see the module docstring)."""

    def __init__(self, spark: SparkSession, settings: Settings, stop: threading.Event, out: TextIO = sys.stderr):
        super().__init__(name="iotmon-event-clock", daemon=True)
        self.spark, self.settings, self.stop, self.out = spark, settings, stop, out
        self.idle_after = interval_seconds(settings.idle_tick_after)
        self.every = interval_seconds(settings.trigger_interval)
        self.last_batch = -1
        self.last_event_time: datetime | None = None
        self.last_reading_at = time.monotonic()
        self.ticks = 0

    def observe(self, query: StreamingQuery) -> None:
        """Note the latest event time and when readings last arrived, from the windows query's progress."""
        for progress in query.recentProgress:
            if progress["batchId"] <= self.last_batch:
                continue
            self.last_batch = progress["batchId"]
            counts = progress.get("observedMetrics", {}).get(ARRIVALS)  # a Row (or dict)
            readings = counts["readings"] if counts is not None else 0
            latest = progress.get("eventTime", {}).get("max")
            if readings:
                self.last_reading_at = time.monotonic()
                if latest:
                    self.last_event_time = datetime.fromisoformat(latest.replace("Z", "+00:00"))

    def tick_time(self) -> datetime | None:
        idle = time.monotonic() - self.last_reading_at
        if self.last_event_time is None or idle < self.idle_after:
            return None
        return self.last_event_time + timedelta(seconds=idle)

    def tick_if_idle(self) -> None:
        query = next((q for q in self.spark.streams.active if q.name == DEVICE_WINDOWS), None)
        if query is None:
            return
        self.observe(query)
        tick = self.tick_time()
        if tick is not None:
            clock = self.spark.createDataFrame([(tick,)], CLOCK_SCHEMA)
            clock.write.format("delta").mode("append").save(self.settings.table_path(STREAM_CLOCK))
            self.ticks += 1

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.tick_if_idle()
            except Exception as exc:  # a missed tick only delays finalisation; the next one catches up
                print(f"event clock: tick failed ({explain(exc)}); retrying", file=self.out, flush=True)
