"""The analytics stage's edges: the gold streaming queries over silver, their tables and their sinks.

Every sink is exactly once across crashes. A micro-batch that is replayed after a crash recomputes the
same rows (no wall-clock values) and each write is tagged with the query's id and the batch id
(``iotmon.lake.BatchLedger``), so a table that already holds the batch is skipped.

The gold queries read silver with the event-time clock's ticks (``pipeline.clock``), so their watermark,
windows and offline timers keep moving while the fleet is silent.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery
from pyspark.sql.types import StructType

from iotmon.config import Settings, interval_seconds
from iotmon.lake import (
    BatchLedger,
    append_once,
    create_table,
    merge_once,
    planned_watermark,
    rows_after,
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
    site_rollup_rows,
    sliding_device_window_rows,
    tumbling_device_windows,
    with_kind_rows,
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

    The batch is collected once, and combined on the driver (``combined_rows``): a batch holds a few thousand
    windows, and a Spark job for each combination cost more than its rows (docs/cost-model.md, "The final
    windows combined on the driver").
    """

    def __init__(self, settings: Settings, after: datetime | None) -> None:
        self.settings, self.after = settings, after
        self.spec = WindowSpec.from_settings(settings)
        self.checkpoint = settings.checkpoint_path(DEVICE_WINDOWS)
        self.ledger = BatchLedger(self.checkpoint)
        self.sliding_s = interval_seconds(self.spec.sliding_window)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        rows = batch.toArrow()  # one Spark job: the batch is read once, so it need not be held
        tumbling = rows.filter(pc.equal(rows.column(_TABLE), TUMBLING)).select(list(TUMBLING_COLUMNS))
        sessions = rows.filter(pc.equal(rows.column(_TABLE), DEVICE_SESSIONS)).select(list(SESSION_COLUMNS))
        frames = {
            DEVICE_WINDOWS: with_kind_rows(tumbling, self.sliding_due(spark, tumbling, batch_id)),
            SITE_WINDOWS: site_rollup_rows(tumbling, self.spec),
            DEVICE_SESSIONS: sessions,
        }
        for table, out in frames.items():
            if self.after is not None:
                end = out.column(END_COLUMN[table])
                out = out.filter(pc.greater(end, pa.scalar(self.after.replace(tzinfo=UTC), end.type)))
            if out.num_rows:
                append_once(out, self.settings.table_path(table), self.ledger, batch_id, spark)

    def sliding_due(self, spark: SparkSession, tumbling: pa.Table, batch_id: int) -> pa.Table:
        """The sliding windows ending between the previous batch's watermark and this batch's."""
        upper = planned_watermark(spark, self.checkpoint, batch_id)
        lower = planned_watermark(spark, self.checkpoint, batch_id - 1) if batch_id > 0 else None
        if upper is None or upper == lower:
            return sliding_device_window_rows(tumbling.slice(0, 0), self.spec)
        kind = tumbling.schema.field("window_end").type

        def at(moment: datetime) -> pa.Scalar:
            return pa.scalar(moment.replace(tzinfo=UTC), kind)

        horizon = None if lower is None else lower - timedelta(seconds=self.sliding_s, microseconds=1)
        columns = ["window_kind", *TUMBLING_COLUMNS]
        written = rows_after(self.settings.table_path(DEVICE_WINDOWS), columns, "window_start", horizon)
        kept = pc.equal(written.column("window_kind"), TUMBLING)
        if lower is not None:
            kept = pc.and_(kept, pc.less_equal(written.column("window_end"), at(lower)))
        written = written.filter(kept).select(list(TUMBLING_COLUMNS)).cast(tumbling.schema)
        keys = [DEVICE_ID, "window_start"]
        earlier = written.join(tumbling.select(keys), keys, join_type="left anti")  # a replayed batch's are in both
        earlier = earlier.select(tumbling.column_names).cast(tumbling.schema)  # a join forgets what is not null
        sliding = sliding_device_window_rows(pa.concat_tables([tumbling, earlier]), self.spec)
        due = pc.less_equal(sliding.column("window_end"), at(upper))
        if lower is not None:
            due = pc.and_(due, pc.greater(sliding.column("window_end"), at(lower)))
        return sliding.filter(due)


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
