"""The ingest stage's edges: Kafka records land in bronze and quarantine, distinct readings in silver.

Exactly once, end to end: Kafka is replayable by offset, each query checkpoints the offsets of each batch
before running it, and each table holds each batch id of a query at most once (``iotmon.lake.BatchLedger``).
A batch interrupted anywhere (SIGKILL included) is re-run from the same offsets with the same state, and a
table that already holds it is skipped.

Two queries:

* **ingest** reads one micro-batch of Kafka records and writes all four tables from it: every record
  parsed (``ingest.bronze``) into bronze, those that failed parsing or name an unregistered device into
  quarantine with the reason, and each distinct reading once into silver (``ingest.silver``: the registry
  joined, validated, lateness classified), except those Kafka delivered later than the watermark
  (``too_late``), which go to ``too_late_readings`` for the late-arrivals query. Deduplication within the
  watermark is Spark's state store: ``dropDuplicates`` on the reading key, whose event time carries the
  watermark, remembers every key until the watermark passes it, so a batch learns which of its readings are
  new without reading silver. The plan reads the batch's records twice, once whole and once for the keys the
  state has not seen (Spark does not share a source scan between the branches of a union), which costs a second
  parse of each record; a chain of two queries through bronze costs a second micro-batch with its fixed costs
  and a Delta hop (docs/cost-model.md).
* **late_arrivals** lands the too-late readings, which no state remembers: silver itself is looked up for
  them, a slow trigger's worth at a time, on the driver (``iotmon.lake.absent``: only the silver files whose
  statistics do not rule the readings out, only their key columns). It streams the small hand-off table, not
  bronze: about one reading in two hundred, where a read of bronze would parse and classify every record again
  every minute (docs/cost-model.md, "The late arrivals' own table").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
from iotmon.config import Settings, interval_seconds
from iotmon.kafka import spark_kafka_options
from iotmon.lake import (
    BatchLedger,
    StaleRead,
    absent,
    append_once,
    collected,
    create_table,
    held,
    planned_watermark,
    table_version,
)
from iotmon.queries import QuerySpec, Trigger, query_settings
from iotmon.schema import (
    BRONZE,
    BRONZE_SCHEMA,
    DEVICES,
    DEVICES_SCHEMA,
    EVENT_TIME,
    INGEST,
    LATE_ARRIVALS,
    LATENESS,
    QUARANTINE,
    QUARANTINE_SCHEMA,
    SILVER,
    SILVER_SCHEMA,
    TOO_LATE,
    TOO_LATE_READINGS,
)

FIRST_SEEN = "_first_seen"
"""Marks the rows of an ingest batch that are reading keys seen for the first time, not records."""
_RECORDS = "records"
_RECORD_COLUMNS: tuple[str, ...] = tuple(dict.fromkeys([*BRONZE_SCHEMA.fieldNames(), *SILVER_SCHEMA.fieldNames()]))
"""What the ingest writer collects of each record: bronze's row, and silver's for a reading."""
_RECENT = "_recent"
"""Marks the collected records that are readings the ingest query lands itself: accepted, not too late."""
_TOO_LATE = "_too_late"
"""Marks the collected records that are readings for the late-arrivals query: accepted, too late."""
BatchWriter = Callable[[DataFrame, int], None]
LOOKUP_ATTEMPTS = 5
"""How often a late-arrivals batch looks silver up again after an ingest commit conflicted with its append."""


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
    create_table(
        spark,
        table(TOO_LATE_READINGS),
        SILVER_SCHEMA,
        "Valid readings Kafka delivered later than the watermark, each copy once, for the late-arrivals query.",
    )


def kafka_records(spark: SparkSession, settings: Settings, admission: Mapping[str, str] | None = None) -> DataFrame:
    """The readings topic as an unbounded table of Kafka records; ``admission``: the source's options that say
    when a batch may start (``early_batches``)."""
    reader = (
        spark.readStream.format("kafka")
        .options(**spark_kafka_options(settings))
        .option("subscribe", settings.topic)
        .option("startingOffsets", "earliest")
        # A gap between checkpoint and broker must stop the archive loudly, never skip silently.
        .option("failOnDataLoss", "true")
        .options(**(admission or {}))
    )
    if settings.max_offsets_per_trigger:
        reader = reader.option("maxOffsetsPerTrigger", settings.max_offsets_per_trigger)
    return reader.load()


@dataclass(frozen=True)
class EarlyBatches:
    """How the ingest query runs under a processing-time trigger: it asks Kafka every ``EARLY_POLL_SECONDS`` how
    many records wait (``trigger``), and starts a batch once ``IOTMON_INGEST_BATCH_RECORDS`` do or its interval is
    up since the last one (``options``: the Kafka source's ``minOffsetsPerTrigger`` and ``maxTriggerDelay``).

    A batch costs about a second of CPU whatever its records (docs/cost-model.md, "The floor"), and a record
    waits for the next batch to start and then for it to end. At the demo's rate one batch an interval keeps
    the CPU down, as a plain trigger does; at ten times the rate, the records that pile up in an interval wait
    for a batch that takes longer than the interval, so the batches start as soon as enough wait: each is
    shorter, and a record waits about one batch before its own instead of an interval.
    """

    trigger: Trigger
    options: dict[str, str]
    conf: dict[str, str]
    """The query's own session settings (``iotmon.queries.query_settings``)."""


EARLY_POLL_SECONDS = 1.0
"""How often an ingest query with early batches asks Kafka how many records wait: one metadata request."""
NO_DATA_BATCHES = "spark.sql.streaming.noDataMicroBatches.enabled"


def early_batches(trigger: Trigger, settings: Settings) -> EarlyBatches | None:
    """The ingest query's trigger for a processing-time ``trigger`` longer than a poll (None otherwise, the
    available-now trigger included: it reads what there is, whatever its count).

    The interval is counted from the poll that started the last batch, so the delay is half a poll short of it:
    the poll that ends the interval starts the batch, and not the one after it. The query runs no batches
    without records: Spark runs one after every batch that moved the watermark (to evict the deduplication's
    expired keys), which at the demo's rate, with a poll between batches, would double the ingest query's
    batches; the next batch with records evicts them instead.
    """
    interval = trigger.get("processingTime")
    if interval is None or interval_seconds(interval) <= EARLY_POLL_SECONDS:
        return None
    delay_ms = round((interval_seconds(interval) - EARLY_POLL_SECONDS / 2) * 1000)
    return EarlyBatches(
        trigger={"processingTime": f"{round(EARLY_POLL_SECONDS * 1000)} milliseconds"},
        options={"minOffsetsPerTrigger": str(settings.ingest_batch_records), "maxTriggerDelay": f"{delay_ms}ms"},
        conf={NO_DATA_BATCHES: "false"},
    )


def registry(spark: SparkSession, settings: Settings) -> DataFrame:
    """The device registry as a static table: a stream joined with it re-reads it at every micro-batch."""
    return spark.read.format("delta").load(settings.table_path(DEVICES))


def first_seen_keys(readings: DataFrame, watermark: str) -> DataFrame:
    """The key of each reading seen for the first time, by state within ``watermark``.

    ``readings`` are accepted, not ``too_late`` (the late-arrivals query's part). The rare reading whose
    event time the watermark has passed anyway is dropped here, and recognised by the batch writer. So the
    state need not remember a key once the watermark has passed its event time, which is when Spark evicts a
    key that holds the watermark's column: ``dropDuplicatesWithinWatermark`` would keep each for a watermark
    longer, twice the keys for every batch to scan (docs/cost-model.md, "The deduplication's state").
    """
    return (
        readings.withWatermark(EVENT_TIME, watermark)
        .dropDuplicates(list(READING_KEY))
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
    readings into silver, its too-late ones into ``too_late_readings``; each table skipped if it already holds
    the batch.

    One Spark action over the held batch (``iotmon.lake.collected``) brings the driver the classified records
    (bronze's columns and silver's, and whether each is a reading this query lands or hands on), the keys the
    state saw first and the rejects. The too-late readings go as they are to ``too_late_readings``. Silver's
    new readings are picked from the rest in Arrow: the readings whose keys the state saw first, one copy each
    (``ingest.silver.first_copies``), a sort of the batch's rows on the driver where Spark would shuffle and
    sort them in stages of tasks of their own (docs/cost-model.md, "Silver's readings picked on the driver").
    The readings behind the watermark the state was not asked about are looked up in silver
    (``append_to_silver``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.checkpoint = settings.checkpoint_path(INGEST)
        self.ledger = BatchLedger(self.checkpoint)

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        spark, table = batch.sparkSession, self.settings.table_path
        with held(batch) as rows:
            classified = rows.where(~F.col(FIRST_SEEN))
            too_late = F.col(LATENESS) == TOO_LATE
            flags = ((accepted() & ~too_late).alias(_RECENT), (accepted() & too_late).alias(_TOO_LATE))
            out = collected(
                {
                    _RECORDS: classified.select(*_RECORD_COLUMNS, *flags),
                    FIRST_SEEN: rows.where(F.col(FIRST_SEEN)).select(*READING_KEY),
                    QUARANTINE: quarantine_rows(classified).unionByName(rejected_rows(classified)),
                }
            )
        records, first_seen = out[_RECORDS], out[FIRST_SEEN]
        readings = records.filter(records[_RECENT]).select(SILVER_SCHEMA.fieldNames())
        append_once(records.select(BRONZE_SCHEMA.fieldNames()), table(BRONZE), self.ledger, batch_id, spark)
        if out[QUARANTINE].num_rows:
            append_once(out[QUARANTINE], table(QUARANTINE), self.ledger, batch_id, spark)
        too_late = records.filter(records[_TOO_LATE]).select(SILVER_SCHEMA.fieldNames())
        if too_late.num_rows:
            append_once(too_late, table(TOO_LATE_READINGS), self.ledger, batch_id, spark)
        new = first_copies(readings.join(first_seen, list(READING_KEY), join_type="left semi"))
        lookup = self._behind(readings, first_seen, batch_id, spark)
        append_to_silver(self.settings, self.ledger, batch_id, new, lookup, spark)

    def _behind(self, readings: pa.Table, first_seen: pa.Table, batch_id: int, spark: SparkSession) -> pa.Table | None:
        """The batch's readings at or behind its watermark that the state did not see first, one copy each, for
        silver to answer: the state may not have been asked about them (None when there are none)."""
        watermark = planned_watermark(spark, self.checkpoint, batch_id)
        if watermark is None:
            return None
        bound = pa.scalar(watermark.replace(tzinfo=UTC), readings.schema.field(EVENT_TIME).type)
        behind = readings.filter(pc.less_equal(readings[EVENT_TIME], bound))
        behind = first_copies(behind.join(first_seen, list(READING_KEY), join_type="left anti"))
        return behind if behind.num_rows else None


def start_ingest(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """Kafka -> bronze, quarantine and silver from one micro-batch, deduplicated by state, joined with the
    static registry (a stream-static join); under a processing-time trigger, a batch sooner once enough records
    wait (``early_batches``)."""
    early = early_batches(trigger, settings)
    records = kafka_records(spark, settings, early.options if early else None)
    rows = ingest_rows(records, registry(spark, settings), settings)
    writer = (
        rows.writeStream.queryName(INGEST)
        .foreachBatch(IngestWriter(settings))
        .option("checkpointLocation", settings.checkpoint_path(INGEST))
        .trigger(**(early.trigger if early else trigger))
    )
    with query_settings(spark, early.conf if early else {}):
        return writer.start()


def append_to_silver(
    settings: Settings,
    ledger: BatchLedger,
    batch_id: int,
    new: pa.Table | None,
    lookup: pa.Table | None,
    spark: SparkSession,
) -> None:
    """Append to silver the readings ``new`` and those of ``lookup`` that silver lacks (nothing when both come
    to nothing). Both are rows on the driver, and so is the lookup (``iotmon.lake.absent``: the silver files
    whose statistics do not rule the readings out, their key columns only).

    Silver has two writers, the ingest query and the late-arrivals query, and either may hold a copy of a
    reading the other holds another copy of. A lookup reads silver at a version, and the append commits right
    after that version or not at all (``iotmon.lake.append_once``'s ``read_version``), as a Delta transaction
    that read the table is refused when another commit came first: the other writer may have added a reading
    the lookup missed. That is not a failure of the query, only a stale lookup, so it is done again on the new
    silver, up to ``LOOKUP_ATTEMPTS`` times, before the conflict fails the batch (and the supervisor restarts
    the query). Without a lookup the append is blind: the state said the readings are new.
    """
    path = settings.table_path(SILVER)
    if lookup is None:
        if new is not None:
            append_once(new, path, ledger, batch_id, spark)
        return
    for attempt in range(1, LOOKUP_ATTEMPTS + 1):
        version = table_version(path)
        missing = absent(lookup, path, READING_KEY, version)
        if new is None and missing.num_rows == 0:
            return
        if new is not None:
            missing = pa.concat_tables([new, missing.select(new.column_names).cast(new.schema)])
        try:
            append_once(missing, path, ledger, batch_id, spark, read_version=version)
            return
        except StaleRead:
            if attempt == LOOKUP_ATTEMPTS:
                raise


def write_late_arrivals(settings: Settings, ledger: BatchLedger) -> BatchWriter:
    """The late-arrivals query's ``foreachBatch``: its readings collected in one Spark action, one copy of each
    (``ingest.silver.first_copies``), looked up in silver and appended where silver lacks them
    (``append_to_silver``)."""

    def write(batch: DataFrame, batch_id: int) -> None:
        readings = first_copies(batch.toArrow())
        append_to_silver(settings, ledger, batch_id, None, readings, batch.sparkSession)

    return write


def start_late_arrivals(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """Too-late readings -> silver: rare, so looked up in silver itself, a whole trigger's worth at once."""
    checkpoint = settings.checkpoint_path(LATE_ARRIVALS)
    late = spark.readStream.format("delta").load(settings.table_path(TOO_LATE_READINGS))
    return (
        late.writeStream.queryName(LATE_ARRIVALS)
        .foreachBatch(write_late_arrivals(settings, BatchLedger(checkpoint)))
        .option("checkpointLocation", checkpoint)
        .trigger(**trigger)
        .start()
    )


INGEST_QUERY = QuerySpec(INGEST, start_ingest, source_reads=2, state_operators=("dedupe",))
"""Its plan reads each Kafka batch twice: the classified records, and the first-seen keys (state: ``dropDuplicates``,
where versions before 2026-12-07 kept ``dropDuplicatesWithinWatermark``'s)."""
LATE_ARRIVALS_QUERY = QuerySpec(LATE_ARRIVALS, start_late_arrivals)
