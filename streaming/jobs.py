"""The analytics stage's edges: the gold streaming queries over silver, their tables and their sinks.

Every sink is exactly once across crashes. A micro-batch that is replayed after a crash recomputes the
same rows (no wall-clock values) and each write is tagged with the query's id and the batch id
(``iotmon.lake.BatchLedger``), so a table that already holds the batch is skipped.

The gold queries read silver with the event-time clock's ticks (``pipeline.clock``), so their watermark,
windows and offline timers keep moving while the fleet is silent.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructType

from iotmon.config import Settings, interval_seconds
from iotmon.lake import (
    BatchLedger,
    append_once,
    collected,
    create_table,
    held,
    merge_once,
    planned_watermark,
    table_property,
)
from iotmon.queries import QuerySpec, Trigger
from iotmon.schema import (
    DEVICE_ID,
    DEVICE_SESSIONS,
    DEVICE_WINDOWS,
    LIVE_WINDOWS,
    SILVER_SCHEMA,
    SITE_WINDOWS,
)
from streaming.alerts import ensure_alerts_table
from streaming.device_status import ensure_device_status_tables
from streaming.sources import ensure_anomalies_table, ensure_clock_table, watermarked_readings
from streaming.windows import (
    END_COLUMN,
    FINAL_TABLES,
    SESSION_COLUMNS,
    TUMBLING,
    TUMBLING_COLUMNS,
    WindowSpec,
    device_sessions,
    site_rollups,
    sliding_device_windows,
    tumbling_device_windows,
    with_kinds,
)

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

    def schema_of(compute: Callable[[DataFrame, WindowSpec], DataFrame]) -> Callable[[], StructType]:
        """The schema of what ``compute`` makes of silver: planned only if its table is missing."""
        return lambda: compute(empty_silver(spark), spec).schema

    for table, compute in FINAL_TABLES.items():
        create_table(spark, settings.table_path(table), schema_of(compute), comments[table])
    create_table(
        spark,
        settings.table_path(LIVE_WINDOWS),
        schema_of(tumbling_device_windows),
        "Per-device tumbling windows, updated in place.",
    )
    ensure_clock_table(spark, settings)
    ensure_device_status_tables(spark, settings)
    ensure_anomalies_table(spark, settings)
    ensure_alerts_table(spark, settings)


# --- gold: final windows ----------------------------------------------------------------------------------


def final_through(spark: SparkSession, settings: Settings) -> datetime | None:
    value = table_property(spark, settings.table_path(DEVICE_WINDOWS), FINAL_THROUGH)
    return datetime.fromisoformat(value) if value else None


class FinalWindowsWriter:
    """The final windows query's ``foreachBatch``: the batch's tumbling windows and sessions, plus the sliding
    windows and site roll-ups combined from tumbling windows (``streaming.windows``).

    A batch emits the tumbling windows whose end its watermark passed (``planned_watermark``), so the sliding
    windows due are those ending between the previous batch's watermark and this one's; their earlier
    tumbling windows were written by earlier batches, and are read back from the table. All of a window's
    devices come out together, so a site roll-up needs only the batch.
    """

    def __init__(self, settings: Settings, after: datetime | None) -> None:
        self.settings, self.after = settings, after
        self.spec = WindowSpec.from_settings(settings)
        self.checkpoint = settings.checkpoint_path(DEVICE_WINDOWS)
        self.ledger = BatchLedger(self.checkpoint)
        self.sliding_s = interval_seconds(self.spec.sliding_window)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        with held(batch) as rows:
            tumbling = rows.where(F.col(_TABLE) == TUMBLING).select(*TUMBLING_COLUMNS)
            sessions = rows.where(F.col(_TABLE) == DEVICE_SESSIONS).select(*SESSION_COLUMNS)
            sliding = self.sliding_due(spark, tumbling, batch_id)
            frames = {
                DEVICE_WINDOWS: with_kinds(tumbling, sliding),
                SITE_WINDOWS: site_rollups(tumbling, self.spec),
                DEVICE_SESSIONS: sessions,
            }
            if self.after is not None:
                frames = {table: f.where(F.col(END_COLUMN[table]) > F.lit(self.after)) for table, f in frames.items()}
            for table, out in collected(frames).items():
                if out.num_rows:
                    append_once(out, self.settings.table_path(table), self.ledger, batch_id, spark)

    def sliding_due(self, spark: SparkSession, tumbling: DataFrame, batch_id: int) -> DataFrame:
        """The sliding windows ending between the previous batch's watermark and this batch's."""
        upper = planned_watermark(spark, self.checkpoint, batch_id)
        lower = planned_watermark(spark, self.checkpoint, batch_id - 1) if batch_id > 0 else None
        if upper is None or upper == lower:
            return sliding_device_windows(tumbling.limit(0), self.spec)
        written = (
            spark.read.format("delta")
            .load(self.settings.table_path(DEVICE_WINDOWS))
            .where(F.col("window_kind") == TUMBLING)
            .select(*TUMBLING_COLUMNS)
            .join(tumbling.select(DEVICE_ID, "window_start"), [DEVICE_ID, "window_start"], "left_anti")
        )
        if lower is not None:
            horizon = lower - timedelta(seconds=self.sliding_s)
            written = written.where((F.col("window_end") <= F.lit(lower)) & (F.col("window_start") >= F.lit(horizon)))
        due = F.col("window_end") <= F.lit(upper)
        if lower is not None:
            due = due & (F.col("window_end") > F.lit(lower))
        return sliding_device_windows(tumbling.unionByName(written), self.spec).where(due)


def start_final_windows(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """All final gold tables from one stateful query: one read of silver, one watermark, one checkpoint.

    Append mode: a window or session is emitted once, in the batch in which the watermark passes its end.
    Two aggregations of the readings (tumbling windows, sessions); the rest is combined from the tumbling.
    """
    spec = WindowSpec.from_settings(settings)
    readings = watermarked_readings(spark, settings)
    tumbling = tumbling_device_windows(readings, spec).withColumn(_TABLE, F.lit(TUMBLING))
    sessions = device_sessions(readings, spec).withColumn(_TABLE, F.lit(DEVICE_SESSIONS))
    union = tumbling.unionByName(sessions, allowMissingColumns=True)
    writer = FinalWindowsWriter(settings, final_through(spark, settings))
    return (
        union.writeStream.queryName(DEVICE_WINDOWS)
        .outputMode("append")
        .foreachBatch(writer)
        .option("checkpointLocation", settings.checkpoint_path(DEVICE_WINDOWS))
        .trigger(**trigger)
        .start()
    )


# --- gold: live windows -----------------------------------------------------------------------------------


def write_live_batch(settings: Settings, ledger: BatchLedger) -> BatchWriter:
    path = settings.table_path(LIVE_WINDOWS)

    def write(batch: DataFrame, batch_id: int) -> None:
        rows = batch.toArrow()  # one Spark job: the batch is read once, so it need not be held
        if rows.num_rows:
            merge_once(rows, path, ("window_start", "device_id"), ledger, batch_id, batch.sparkSession)

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
