"""The analytics stage's streaming inputs: silver with the event-time clock's ticks, watermarked and observed.

Ticks are rows with only ``event_time`` that move the watermark when the fleet is silent; consumers drop
them after the watermark has seen them. A tick names the table it follows (``FOLLOWS``): it says that table
holds every reading Kafka had, so a query reads only its own source's ticks (``pipeline.clock`` writes
them). Sources are read without a limit of files per batch: a tick in a batch comes with every reading
committed before it. ``observe_arrivals`` matters for that: Spark pushes a filter below
the watermark operator unless the filter mentions the event-time column, so ``WHERE device_id IS NOT
NULL`` (or any lateness filter) would drop the ticks before they could move anything. Filters do not cross
an observation, so every consumer observes its input right after the watermark, and gets the batch's
counts in its progress report (``observedMetrics``) as well.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType, TimestampType

from iotmon.config import Settings
from iotmon.lake import create_table
from iotmon.schema import (
    ANOMALIES,
    ANOMALIES_SCHEMA,
    DEVICE_ID,
    EVENT_TIME,
    LATE,
    LATENESS,
    ON_TIME,
    SILVER,
    STREAM_CLOCK,
    TOO_LATE,
)

FOLLOWS = "follows"
"""The clock's column naming the table a tick follows."""
CLOCK_SCHEMA = StructType([StructField(EVENT_TIME, TimestampType(), False), StructField(FOLLOWS, StringType(), False)])
MAX_FILES_PER_TRIGGER = 1_000_000
"""Files a downstream batch may read of its source: all there are. Delta's default (1,000) would split a
backlog into batches, and let a tick read in the first overtake the readings of the next."""
ARRIVALS = "arrivals"
"""Name of the observed metric: ``readings``, ``on_time``, ``late``, ``too_late`` and ``ticks`` per batch."""


def ensure_clock_table(spark: SparkSession, settings: Settings) -> None:
    create_table(spark, settings.table_path(STREAM_CLOCK), CLOCK_SCHEMA, "Event-time ticks while input is idle.")


def ensure_anomalies_table(spark: SparkSession, settings: Settings) -> None:
    """The scorer's table, which the alerts read: here, so that the alerts' Python workers, which import the
    alerts' module, need not import the scorer's (pyspark.ml, scipy) to create it."""
    create_table(
        spark,
        settings.table_path(ANOMALIES),
        ANOMALIES_SCHEMA,
        "One row per scored silver reading: anomaly score, threshold and verdict of a registered model.",
    )


def delta_stream(spark: SparkSession, settings: Settings, table: str) -> DataFrame:
    reader = spark.readStream.format("delta").option("maxFilesPerTrigger", MAX_FILES_PER_TRIGGER)
    return reader.load(settings.table_path(table))


def with_ticks(spark: SparkSession, settings: Settings, table: str) -> DataFrame:
    """A table's rows as a stream, plus the clock's ticks that follow it (null ``device_id``), not yet
    watermarked."""
    ticks = delta_stream(spark, settings, STREAM_CLOCK).where(F.col(FOLLOWS) == table).select(EVENT_TIME)
    return delta_stream(spark, settings, table).unionByName(ticks, allowMissingColumns=True)


def readings_and_ticks(spark: SparkSession, settings: Settings) -> DataFrame:
    """Silver readings plus the clock's ticks (null ``device_id``), not yet watermarked."""
    return with_ticks(spark, settings, SILVER)


def observe_arrivals(frame: DataFrame) -> DataFrame:
    """Count the batch's readings by lateness, and the ticks; apply it right after the watermark."""
    lateness, device = F.col(LATENESS), F.col(DEVICE_ID)
    return frame.observe(
        ARRIVALS,
        F.count(device).alias("readings"),
        F.count(F.when(lateness == ON_TIME, 1)).alias(ON_TIME),
        F.count(F.when(lateness == LATE, 1)).alias(LATE),
        F.count(F.when(lateness == TOO_LATE, 1)).alias(TOO_LATE),
        F.count(F.when(device.isNull(), 1)).alias("ticks"),
    )


def watermarked_readings(spark: SparkSession, settings: Settings) -> DataFrame:
    """What the gold queries consume: readings and ticks under one watermark, observed (ticks still in)."""
    frame = readings_and_ticks(spark, settings).withWatermark(EVENT_TIME, settings.watermark)
    return observe_arrivals(frame)
