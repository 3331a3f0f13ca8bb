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
  (``too_late``), which go to ``too_late_readings`` for the late-arrivals query. The plan reads and parses each
  record once, under an event-time watermark. Deduplication within the watermark is the writer's, on the
  driver where the batch is: the keys of the readings it landed whose event time the watermark has not passed
  (``ingest.seen``), which silver itself holds for a writer that starts. Spark's ``dropDuplicates`` kept them
  in its state store for a third of the batch's fixed CPU and half its CPU per record: a second read and parse
  of the batch in a second branch of the plan (a union's branches share no scan), a shuffle, and a scan of the
  whole state at every batch (docs/cost-model.md, "The deduplication on the driver"). A chain of two queries
  through bronze would cost a second micro-batch with its fixed costs and a Delta hop.
* **late_arrivals** lands the too-late readings, which no state remembers: silver itself is looked up for
  them, a slow trigger's worth at a time, on the driver (``iotmon.lake.absent``: only the silver files whose
  statistics do not rule the readings out, only their key columns). It streams the small hand-off table, not
  bronze: about one reading in two hundred, where a read of bronze would parse and classify every record again
  every minute (docs/cost-model.md, "The late arrivals' own table").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from ingest.bronze import PayloadRules, parse_records, quarantined
from ingest.seen import SeenReadings
from ingest.silver import (
    READING_KEY,
    REJECT_REASON,
    LatenessRules,
    accepted,
    classify_records,
    first_copies,
    rejected,
)
from iotmon.config import Settings, interval_seconds
from iotmon.kafka import spark_kafka_options
from iotmon.lake import (
    BatchLedger,
    StaleRead,
    absent,
    append_once,
    create_table,
    planned_watermark,
    rows_after,
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
    LATE_ARRIVALS,
    LATENESS,
    QUARANTINE,
    QUARANTINE_SCHEMA,
    SILVER,
    SILVER_SCHEMA,
    TOO_LATE,
    TOO_LATE_READINGS,
)

_RECORD_COLUMNS: tuple[str, ...] = tuple(
    dict.fromkeys([*BRONZE_SCHEMA.fieldNames(), *SILVER_SCHEMA.fieldNames(), REJECT_REASON])
)
"""What the ingest writer collects of each record: bronze's row, silver's for a reading, and why silver rejects
it."""
_RECENT_TIME = "_recent_event_time"
"""The event time of a record that is a reading the ingest query lands itself (accepted, not too late), else
null: the watermark's column."""
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


EARLY_POLL_SECONDS = 1.0
"""How often an ingest query with early batches asks Kafka how many records wait: one metadata request."""


def early_batches(trigger: Trigger, settings: Settings) -> EarlyBatches | None:
    """The ingest query's trigger for a processing-time ``trigger`` longer than a poll (None otherwise, the
    available-now trigger included: it reads what there is, whatever its count).

    The interval is counted from the poll that started the last batch, so the delay is half a poll short of it:
    the poll that ends the interval starts the batch, and not the one after it. The query runs no batch without
    records: Spark runs those only for a stateful operator whose watermark moved, and the ingest query has none.
    """
    interval = trigger.get("processingTime")
    if interval is None or interval_seconds(interval) <= EARLY_POLL_SECONDS:
        return None
    delay_ms = round((interval_seconds(interval) - EARLY_POLL_SECONDS / 2) * 1000)
    return EarlyBatches(
        trigger={"processingTime": f"{round(EARLY_POLL_SECONDS * 1000)} milliseconds"},
        options={"minOffsetsPerTrigger": str(settings.ingest_batch_records), "maxTriggerDelay": f"{delay_ms}ms"},
    )


def registry(spark: SparkSession, settings: Settings) -> DataFrame:
    """The device registry as a static table: a stream joined with it re-reads it at every micro-batch."""
    return spark.read.format("delta").load(settings.table_path(DEVICES))


def ingest_rows(records: DataFrame, devices: DataFrame, settings: Settings) -> DataFrame:
    """Kafka records -> every record as a classified bronze row (``ingest.silver.classify_records``), under the
    readings' event-time watermark. Pure; one read and one parse of each record.

    The watermark is on ``_recent_event_time``, a reading's event time when silver takes it from this query
    (accepted, not ``too_late``), so only those move it; Spark counts the other rows' null as the epoch, which
    leaves the newest event time, and so the watermark, as it is."""
    bronze = parse_records(records, PayloadRules.from_settings(settings))
    classified = classify_records(bronze, devices, LatenessRules.from_settings(settings))
    recent = accepted() & (F.col(LATENESS) != TOO_LATE)
    return classified.withColumn(_RECENT_TIME, F.when(recent, F.col(EVENT_TIME))).withWatermark(
        _RECENT_TIME, settings.watermark
    )


class IngestWriter:
    """The ingest query's ``foreachBatch``: every record into bronze, rejects into quarantine, the batch's new
    readings into silver, its too-late ones into ``too_late_readings``; each table skipped if it already holds
    the batch.

    One Spark action brings the driver the batch's classified records: bronze's columns and silver's, why silver
    rejects a reading, and whether each is a reading this query lands or hands on. The plan has one branch, so
    the batch is collected as it is computed, without holding it for several frames first (docs/cost-model.md,
    "The batch collected once"). Quarantine's rows are picked from the records in Arrow
    (``ingest.bronze.quarantined``, ``ingest.silver.rejected``); the too-late readings go as they are to
    ``too_late_readings``. Silver's new readings are picked from the rest in Arrow, one copy of each reading
    (``ingest.silver.first_copies``: a sort of the batch's rows on the driver where Spark would shuffle and sort
    them in stages of tasks of their own; docs/cost-model.md, "Silver's readings picked on the driver"):

    * those ahead of the batch's watermark whose keys silver does not hold, by the keys this writer landed
      (``ingest.seen.SeenReadings``: read back from silver when the writer starts, and whenever a batch is not
      the one after its last);
    * those at or behind it, which no such key answers for, looked up in silver itself (``append_to_silver``).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.checkpoint = settings.checkpoint_path(INGEST)
        self.ledger = BatchLedger(self.checkpoint)
        self.seen = SeenReadings()
        self.next_batch: int | None = None
        """The batch ``seen`` is up to date for; None until it is read from silver."""

    def __call__(self, batch: DataFrame, batch_id: int) -> None:
        spark, table = batch.sparkSession, self.settings.table_path
        handed_on = accepted() & (F.col(LATENESS) == TOO_LATE)
        records = batch.select(*_RECORD_COLUMNS, _RECENT_TIME, handed_on.alias(_TOO_LATE)).toArrow()
        append_once(records.select(BRONZE_SCHEMA.fieldNames()), table(BRONZE), self.ledger, batch_id, spark)
        quarantine = pa.concat_tables([quarantined(records), rejected(records)])
        if quarantine.num_rows:
            append_once(quarantine, table(QUARANTINE), self.ledger, batch_id, spark)
        too_late = records.filter(records[_TOO_LATE]).select(SILVER_SCHEMA.fieldNames())
        if too_late.num_rows:
            append_once(too_late, table(TOO_LATE_READINGS), self.ledger, batch_id, spark)
        readings = records.filter(pc.is_valid(records[_RECENT_TIME])).select(SILVER_SCHEMA.fieldNames())
        watermark = planned_watermark(spark, self.checkpoint, batch_id)
        if self.next_batch != batch_id:
            self.seen = SeenReadings()
            self.seen.add(rows_after(table(SILVER), READING_KEY, EVENT_TIME, watermark))
        ahead, behind = _split(readings, watermark)
        new = ahead.filter(self.seen.unseen(ahead))
        append_to_silver(self.settings, self.ledger, batch_id, new, behind, spark)
        self.seen.add(new)
        self.seen.forget(watermark)
        self.next_batch = batch_id + 1


def _split(readings: pa.Table, watermark: datetime | None) -> tuple[pa.Table, pa.Table | None]:
    """A batch's readings, one copy of each: those ahead of its watermark, and those at or behind it (None when
    there are none)."""
    if watermark is None:
        return first_copies(readings), None
    bound = pa.scalar(watermark.replace(tzinfo=UTC), readings.schema.field(EVENT_TIME).type)
    at_or_behind = pc.less_equal(readings[EVENT_TIME], bound)
    behind = first_copies(readings.filter(at_or_behind))
    return first_copies(readings.filter(pc.invert(at_or_behind))), behind if behind.num_rows else None


def start_ingest(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """Kafka -> bronze, quarantine and silver from one micro-batch, deduplicated on the driver, joined with the
    static registry (a stream-static join); under a processing-time trigger, a batch sooner once enough records
    wait (``early_batches``)."""
    early = early_batches(trigger, settings)
    records = kafka_records(spark, settings, early.options if early else None)
    rows = ingest_rows(records, registry(spark, settings), settings)
    return (
        rows.writeStream.queryName(INGEST)
        .foreachBatch(IngestWriter(settings))
        .option("checkpointLocation", settings.checkpoint_path(INGEST))
        .trigger(**(early.trigger if early else trigger))
        .start()
    )


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


INGEST_QUERY = QuerySpec(INGEST, start_ingest, state_operators=())
"""Its plan keeps no state. Versions before 2026-12-07 deduplicated in Spark's state (``dropDuplicates``, earlier
``dropDuplicatesWithinWatermark``), in a plan that read Kafka twice: their checkpoints record the operator, and
name two sources, which Spark refuses to continue with one."""
LATE_ARRIVALS_QUERY = QuerySpec(LATE_ARRIVALS, start_late_arrivals)
