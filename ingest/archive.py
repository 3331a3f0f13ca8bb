"""The archive's edges: read Kafka, write the bronze and quarantine Delta tables.

Exactly once, end to end: Kafka is replayable by offset, the query checkpoints the offsets of each batch
before running it, and the Delta sink commits each batch id at most once. A batch interrupted anywhere
(SIGKILL included) is re-run from the same offsets, and a batch that already committed is skipped.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from ingest.bronze import PayloadRules, parse_records, quarantine_rows
from iotmon.config import Settings
from iotmon.kafka import spark_kafka_options
from iotmon.lake import create_table
from iotmon.queries import QuerySpec, Trigger
from iotmon.schema import BRONZE, BRONZE_SCHEMA, QUARANTINE, QUARANTINE_SCHEMA


def ensure_archive_tables(spark: SparkSession, settings: Settings) -> None:
    """Create bronze and quarantine up front, so readers and downstream streams find them from the start."""
    create_table(
        spark,
        settings.table_path(BRONZE),
        BRONZE_SCHEMA,
        "Every Kafka record exactly once, parsed where possible.",
        append_only=True,
    )
    create_table(
        spark,
        settings.table_path(QUARANTINE),
        QUARANTINE_SCHEMA,
        "Records that failed parsing or validation, with the reason.",
    )


def kafka_records(spark: SparkSession, settings: Settings) -> DataFrame:
    """The readings topic as an unbounded table of Kafka records."""
    reader = (
        spark.readStream.format("kafka")
        .options(**spark_kafka_options(settings))
        .option("subscribe", settings.topic)
        .option("startingOffsets", "earliest")
        # A gap between checkpoint and broker must stop the archive loudly, never skip silently.
        .option("failOnDataLoss", "true")
    )
    if settings.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", settings.max_offsets_per_trigger)
    return reader.load()


def start_bronze(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    bronze = parse_records(kafka_records(spark, settings), PayloadRules.from_settings(settings))
    return (
        bronze.writeStream.format("delta")
        .queryName(BRONZE)
        .outputMode("append")
        .option("checkpointLocation", settings.checkpoint_path(BRONZE))
        .trigger(**trigger)
        .start(settings.table_path(BRONZE))
    )


def start_quarantine(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """Bronze's malformed rows, streamed from the bronze Delta table itself (bronze stays the one truth)."""
    bronze = spark.readStream.format("delta").load(settings.table_path(BRONZE))
    return (
        quarantine_rows(bronze)
        .writeStream.format("delta")
        .queryName(QUARANTINE)
        .outputMode("append")
        .option("checkpointLocation", settings.checkpoint_path(QUARANTINE))
        .trigger(**trigger)
        .start(settings.table_path(QUARANTINE))
    )


ARCHIVE_QUERIES: tuple[QuerySpec, ...] = (
    QuerySpec(BRONZE, start_bronze),
    QuerySpec(QUARANTINE, start_quarantine),
)
