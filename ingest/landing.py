"""The ingest stage's edges: Kafka records land in bronze and quarantine, distinct readings in silver.

Exactly once, end to end: Kafka is replayable by offset, the query checkpoints the offsets of each batch
before running it, and each table holds each batch id of the query at most once (``iotmon.lake.BatchLedger``).
A batch interrupted anywhere (SIGKILL included) is re-run from the same offsets with the same state, and a
table that already holds it is skipped.

One query, **ingest**, reads one micro-batch of Kafka records and writes all three tables from it: every
record parsed (``ingest.bronze``) into bronze, those that failed parsing or name an unregistered device into
quarantine with the reason, and each distinct reading once into silver (``ingest.silver``: the registry
joined, validated, lateness classified). It is silver's only writer. How a batch knows which of its readings
silver lacks:

* **within the watermark, by state**: ``dropDuplicatesWithinWatermark`` on the reading key remembers every key
  for ``IOTMON_WATERMARK`` of event time, so a batch learns which of its readings are new without reading
  silver. The plan reads the batch's records twice, once whole and once for the keys the state has not seen
  (Spark does not share a source scan between the branches of a union), which costs a second parse of each
  record; a chain of two queries through bronze costs a second micro-batch with its fixed costs and a Delta
  hop (docs/cost-model.md).
* **beyond it, by silver itself**: the readings Kafka delivered later than the watermark (``too_late``), which
  no state remembers, and the rare ones behind the batch's watermark, which the state drops unasked, are
  looked up on the driver (``iotmon.lake.absent``: only the silver files whose statistics do not rule the
  readings out, only their key columns). A few dozen readings a batch: milliseconds (docs/cost-model.md,
  "Late arrivals in the ingest writer").
"""

from __future__ import annotations

from datetime import UTC

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from ingest.bronze import PayloadRules, parse_records, quarantine_rows
from ingest.silver import (
    READING_KEY,
    LatenessRules,
    accepted,
    classify_readings,
    classify_records,
    first_copies,
    rejected_rows,
    silver_rows,
)
from iotmon.config import Settings
from iotmon.kafka import spark_kafka_options
from iotmon.lake import (
    BatchLedger,
    absent,
    append_once,
    collected,
    create_table,
    held,
    planned_watermark,
    table_version,
)
from iotmon.queries import QuerySpec, Trigger
from iotmon.schema import (
    BRONZE,
    BRONZE_SCHEMA,
    DEVICES,
    DEVICES_SCHEMA,
    EVENT_TIME,
    INGEST,
    LATENESS,
    QUARANTINE,
    QUARANTINE_SCHEMA,
    SILVER,
    SILVER_SCHEMA,
    TOO_LATE,
)

FIRST_SEEN = "_first_seen"
"""Marks the rows of an ingest batch that are reading keys seen for the first time, not records."""
_RECORDS = "records"
_RECORD_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys([*BRONZE_SCHEMA.fieldNames(), *SILVER_SCHEMA.fieldNames()]))
"""What the ingest writer collects of each record: bronze's row, and silver's for a reading."""
_ACCEPTED = "_accepted"
"""Marks the collected records that are readings silver takes (``ingest.silver.accepted``)."""


def ensure_landing_tables(spark: SparkSession, settings: Settings) -> None:
    """Create the ingest stage's tables up front, so readers and downstream streams find them from the start."""
    table = settings.table_path
    create_table(
        spark, table(BRONZE), BRONZE_SCHEMA, "Every Kafka record exactly once, parsed where possible.", append_only=True
    )
    create_table(
        spark, table(QUARANTINE), QUARANTINE_SCHEMA, "Records that failed parsing or validation, with the reason."
    )
    create_table(spark, table(DEVICES), DEVICES_SCHEMA, "The device registry (static reference).")
    create_table(spark, table(SILVER), SILVER_SCHEMA, "Distinct valid readings, enriched.")


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


def registry(spark: SparkSession, settings: Settings) -> DataFrame:
    """The device registry as a static table: a stream joined with it re-reads it at every micro-batch."""
    return spark.read.format("delta").load(settings.table_path(DEVICES))


def first_seen_keys(readings: DataFrame, watermark: str) -> DataFrame:
    """The key of each reading seen for the first time, by state within ``watermark``.

    ``readings`` are accepted, not ``too_late``: those are looked up in silver, and would only hold the
    watermark's state to no use. The rare reading whose event time the watermark has passed anyway is dropped
    here, and looked up too (``IngestWriter``).
    """
    return (
        readings.withWatermark(EVENT_TIME, watermark)
        .dropDuplicatesWithinWatermark(list(READING_KEY))
        .select(*READING_KEY)
        .withColumn(FIRST_SEEN, F.lit(True))
    )


def ingest_rows(records: DataFrame, devices: DataFrame, settings: Settings) -> DataFrame:
    """Kafka records -> what one ingest batch needs: every record as a classified bronze row
    (``ingest.silver.classify_records``), plus (``FIRST_SEEN``) the keys of the readings seen for the first
    time. Pure; on a stream the keys are state."""
    bronze = parse_records(records, PayloadRules.from_settings(settings))
    lateness = LatenessRules.from_settings(settings)
    classified = classify_records(bronze, devices, lateness).withColumn(FIRST_SEEN, F.lit(False))
    recent = silver_rows(classify_readings(bronze, devices, lateness)).where(F.col(LATENESS) != TOO_LATE)
    return classified.unionByName(first_seen_keys(recent, settings.watermark), allowMissingColumns=True)


class IngestWriter:
    """The ingest query's ``foreachBatch``: every record into bronze, rejects into quarantine, the batch's new
    readings into silver; each table skipped if it already holds the batch.

    One Spark action over the held batch (``iotmon.lake.collected``) brings the driver the classified
    records (bronze's columns and silver's, and whether each is a reading silver takes), the keys the state
    saw first and the rejects. Silver's readings are picked from them in Arrow: those whose keys the state saw
    first, one copy each (``ingest.silver.first_copies``), a sort of the batch's rows on the driver where Spark
    would shuffle and sort them in stages of tasks of their own (docs/cost-model.md, "Silver's readings picked
    on the driver"); and those of the rest the state cannot vouch for, where silver lacks them
    (``_doubtful``, ``append_to_silver``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.checkpoint = settings.checkpoint_path(INGEST)
        self.ledger = BatchLedger(self.checkpoint)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        spark, table = batch.sparkSession, self.settings.table_path
        with held(batch) as rows:
            classified = rows.where(~F.col(FIRST_SEEN))
            out = collected(
                {
                    _RECORDS: classified.select(*_RECORD_COLUMNS, accepted().alias(_ACCEPTED)),
                    FIRST_SEEN: rows.where(F.col(FIRST_SEEN)).select(*READING_KEY),
                    QUARANTINE: quarantine_rows(classified).unionByName(rejected_rows(classified)),
                }
            )
        records, first_seen = out[_RECORDS], out[FIRST_SEEN]
        readings = records.filter(records[_ACCEPTED]).select(SILVER_SCHEMA.fieldNames())
        append_once(records.select(BRONZE_SCHEMA.fieldNames()), table(BRONZE), self.ledger, batch_id, spark)
        if out[QUARANTINE].num_rows:
            append_once(out[QUARANTINE], table(QUARANTINE), self.ledger, batch_id, spark)
        # The first copy of a key the state saw first: a too-late copy of it reached Kafka later, so never wins.
        new = first_copies(readings.join(first_seen, list(READING_KEY), join_type="left semi"))
        unseen = readings.join(first_seen, list(READING_KEY), join_type="left anti")
        lookup = self._doubtful(unseen, batch_id, spark)
        append_to_silver(self.settings, self.ledger, batch_id, new, lookup, spark)

    def _doubtful(self, unseen: pa.Table, batch_id: int, spark: SparkSession) -> pa.Table | None:
        """Of the batch's readings whose keys the state did not see first, those it cannot vouch for, one copy
        each, for silver to answer (None when there are none): the ones Kafka delivered later than the
        watermark, which the state was never asked about, and the ones at or behind the batch's watermark,
        which it drops unasked. The others are copies of readings the state saw within the watermark, which an
        earlier batch landed."""
        doubtful = pc.equal(unseen[LATENESS], TOO_LATE)
        watermark = planned_watermark(spark, self.checkpoint, batch_id)
        if watermark is not None:
            bound = pa.scalar(watermark.replace(tzinfo=UTC), unseen.schema.field(EVENT_TIME).type)
            doubtful = pc.or_(doubtful, pc.less_equal(unseen[EVENT_TIME], bound))
        looked_up = first_copies(unseen.filter(doubtful))
        return looked_up if looked_up.num_rows else None


def start_ingest(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """Kafka -> bronze, quarantine and silver from one micro-batch, deduplicated by state, joined with the
    static registry (a stream-static join)."""
    rows = ingest_rows(kafka_records(spark, settings), registry(spark, settings), settings)
    return (
        rows.writeStream.queryName(INGEST)
        .foreachBatch(IngestWriter(settings))
        .option("checkpointLocation", settings.checkpoint_path(INGEST))
        .trigger(**trigger)
        .start()
    )


def append_to_silver(
    settings: Settings,
    ledger: BatchLedger,
    batch_id: int,
    new: pa.Table,
    lookup: pa.Table | None,
    spark: SparkSession,
) -> None:
    """Append to silver the readings ``new`` and those of ``lookup`` that silver lacks. Both are rows on the
    driver, and so is the lookup (``iotmon.lake.absent``: the silver files whose statistics do not rule the
    readings out, their key columns only). Without a lookup the append is blind: the state said the readings
    are new.

    The ingest query is silver's only writer, so nothing changes silver between its lookup and its append.
    The append still commits right after the version looked up or not at all (``iotmon.lake.append_once``'s
    ``read_version``): a second writer (another stream on the same lake, a backfill while the stream runs)
    then fails the batch, whose replay looks silver up again, where a blind commit would duplicate a reading.
    """
    path = settings.table_path(SILVER)
    if lookup is None:
        append_once(new, path, ledger, batch_id, spark)
        return
    version = table_version(path)
    missing = absent(lookup, path, READING_KEY, version)
    rows = pa.concat_tables([new, missing.select(new.column_names).cast(new.schema)])
    append_once(rows, path, ledger, batch_id, spark, read_version=version)


INGEST_QUERY = QuerySpec(INGEST, start_ingest, source_reads=2)
"""Its plan reads each Kafka batch twice: the classified records, and the first-seen keys (state)."""
