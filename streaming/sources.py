"""The analytics stage's streaming inputs: silver, and silver with the event-time clock's ticks."""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructField, StructType, TimestampType

from iotmon.config import Settings
from iotmon.schema import EVENT_TIME, SILVER, STREAM_CLOCK

CLOCK_SCHEMA = StructType([StructField(EVENT_TIME, TimestampType(), False)])


def delta_stream(spark: SparkSession, settings: Settings, table: str) -> DataFrame:
    return spark.readStream.format("delta").load(settings.table_path(table))


def readings_and_ticks(spark: SparkSession, settings: Settings) -> DataFrame:
    """Silver readings plus the clock's ticks: rows with only ``event_time`` that move the watermark when
    the fleet is silent. Consumers watermark the union and drop the ticks (null ``device_id``) after it."""
    ticks = delta_stream(spark, settings, STREAM_CLOCK)
    return delta_stream(spark, settings, SILVER).unionByName(ticks, allowMissingColumns=True)
