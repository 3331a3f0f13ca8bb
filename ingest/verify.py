"""Reconcile Kafka and the lake: the archive holds every record exactly once, and nothing else.

Per partition, bronze's offsets must be exactly Kafka's ``[low, high)`` (the producer is idempotent and
not transactional, so offsets are contiguous). Offsets below ``low`` are records archived before Kafka's
retention deleted them, which is what an archive is for. Quarantine's bronze stage must be exactly bronze's
malformed rows, and its silver stage (readings of unregistered devices) must hold no record twice. Given the
simulator's ground truth, every delivered send must sit in bronze at the offset the broker acknowledged,
parsed as what was sent, and every corrupted send must be quarantined. A send the broker acknowledged
without an offset (``OFFSET_UNKNOWN``) is found by its content instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from ingest.bronze import BRONZE_STAGE
from ingest.silver import SILVER_STAGE
from iotmon.config import Settings
from iotmon.kafka import partition_offsets
from iotmon.schema import BRONZE, DEVICE_ID, PARSE_ERROR, QUARANTINE, SEQ
from simulators.truth import OFFSET_UNKNOWN


@dataclass(frozen=True)
class PartitionCheck:
    partition: int
    kafka_low: int
    kafka_high: int
    bronze_rows: int
    missing: int
    duplicates: int
    beyond_high: int

    @property
    def ok(self) -> bool:
        return self.missing == 0 and self.duplicates == 0 and self.beyond_high == 0


@dataclass(frozen=True)
class TruthCheck:
    sends: int
    delivered: int
    missing_from_bronze: int
    parsed_differently: int
    """Well-formed sends whose bronze row is not that (device_id, seq), or was rejected."""
    malformed_accepted: int
    """Corrupted sends that bronze parsed as valid readings."""
    offsets_unknown: int = 0
    """Delivered sends the broker acknowledged without an offset, looked up in bronze by content."""

    @property
    def ok(self) -> bool:
        return self.missing_from_bronze == 0 and self.parsed_differently == 0 and self.malformed_accepted == 0


@dataclass
class Reconciliation:
    topic: str
    partitions: list[PartitionCheck]
    bronze_malformed: int
    quarantine_rows: int
    quarantine_not_in_bronze: int
    quarantine_duplicates: int
    rejects_repeated: int = 0
    """Extra copies of readings rejected at the silver stage (unregistered devices): each record is quarantined once."""
    truth: TruthCheck | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        found = [
            f"partition {p.partition}: {p.missing:,} Kafka records missing, {p.duplicates:,} duplicated, "
            f"{p.beyond_high:,} beyond Kafka's high watermark"
            for p in self.partitions
            if not p.ok
        ]
        if self.quarantine_not_in_bronze:
            found.append(f"{self.quarantine_not_in_bronze:,} quarantine rows are not in bronze")
        if self.quarantine_duplicates:
            found.append(f"{self.quarantine_duplicates:,} quarantine rows are duplicated")
        if self.rejects_repeated:
            found.append(f"{self.rejects_repeated:,} rejected readings are quarantined more than once")
        if self.quarantine_rows - self.quarantine_duplicates != self.bronze_malformed - self.quarantine_not_in_bronze:
            found.append(
                f"quarantine holds {self.quarantine_rows:,} rows but bronze has {self.bronze_malformed:,} "
                "malformed records (is the quarantine query behind? run `iotmon stream --until-idle`)"
            )
        if self.truth and not self.truth.ok:
            found.append(
                f"ground truth: {self.truth.missing_from_bronze:,} delivered sends missing from bronze, "
                f"{self.truth.parsed_differently:,} parsed differently, "
                f"{self.truth.malformed_accepted:,} corrupted sends accepted"
            )
        return found

    def report(self) -> str:
        lines = [f"Reconciliation of topic {self.topic!r} with the lake", ""]
        lines.append(
            f"{'partition':>9} {'kafka low':>12} {'kafka high':>12} {'bronze rows':>12} {'missing':>8} {'dupes':>6}  ok"
        )
        for p in self.partitions:
            lines.append(
                f"{p.partition:>9} {p.kafka_low:>12,} {p.kafka_high:>12,} {p.bronze_rows:>12,} "
                f"{p.missing:>8,} {p.duplicates:>6,}  {'yes' if p.ok else 'NO'}"
            )
        total = sum(p.bronze_rows for p in self.partitions)
        lines.append(
            f"{'total':>9} {'':>12} {sum(p.kafka_high - p.kafka_low for p in self.partitions):>12,} {total:>12,}"
        )
        lines.append("")
        lines.append(f"malformed in bronze: {self.bronze_malformed:,}   quarantine rows: {self.quarantine_rows:,}")
        if self.truth:
            t = self.truth
            lines.append(
                f"ground truth: {t.sends:,} sends, {t.delivered:,} delivered; missing from bronze "
                f"{t.missing_from_bronze:,}, parsed differently {t.parsed_differently:,}, "
                f"corrupted but accepted {t.malformed_accepted:,}"
            )
        lines.extend(self.notes)
        lines.append("")
        problems = self.problems
        lines.append("RESULT: exact" if not problems else "RESULT: MISMATCH\n  " + "\n  ".join(problems))
        return "\n".join(lines)


def _partition_checks(
    spark: SparkSession, bronze: DataFrame, offsets: dict[int, tuple[int, int]]
) -> list[PartitionCheck]:
    bounds = spark.createDataFrame(
        [(p, low, high) for p, (low, high) in offsets.items()], "partition int, low long, high long"
    )
    offset, low, high = F.col("offset"), F.coalesce(F.col("low"), F.lit(0)), F.coalesce(F.col("high"), F.lit(0))
    rows = (
        bronze.join(F.broadcast(bounds), "partition", "full")
        .groupBy("partition")
        .agg(
            F.first(low).alias("low"),
            F.first(high).alias("high"),
            F.count(offset).alias("rows"),
            F.count_distinct(offset).alias("distinct_offsets"),
            F.count_distinct(F.when((offset >= low) & (offset < high), offset)).alias("distinct_in_range"),
            F.count(F.when(offset >= high, offset)).alias("beyond_high"),
        )
        .orderBy("partition")
        .collect()
    )
    return [
        PartitionCheck(
            partition=row["partition"],
            kafka_low=row["low"],
            kafka_high=row["high"],
            bronze_rows=row["rows"],
            missing=(row["high"] - row["low"]) - row["distinct_in_range"],
            duplicates=row["rows"] - row["distinct_offsets"],
            beyond_high=row["beyond_high"],
        )
        for row in rows
    ]


def bronze_identity(bronze: DataFrame) -> DataFrame:
    """What ``resolve_unknown_offsets`` needs of bronze: a record's coordinates and content identity."""
    return bronze.select("topic", "partition", "offset", "key", F.octet_length("value").alias("payload_bytes"), SEQ)


def resolve_unknown_offsets(truth: DataFrame, bronze: DataFrame) -> DataFrame:
    """``truth`` with each ``OFFSET_UNKNOWN`` of a delivered send replaced by the offset of its bronze row.

    The send's row must lie in its partition between the known offsets of the sends before and after it
    (offsets follow send order per partition), at an offset no other truth row names, with the send's key,
    payload length and, if well-formed, seq. Sends of equal content are paired with such rows in order, each
    row used once; a send left without one keeps ``OFFSET_UNKNOWN`` and so is missing from bronze.
    ``bronze`` has the columns of ``bronze_identity``.
    """
    unknown = F.col("delivered") & (F.col("offset") == OFFSET_UNKNOWN)
    if truth.where(unknown).isEmpty():
        return truth
    in_partition = Window.partitionBy("topic", "partition").orderBy("send_index")
    known = F.when(F.col("delivered") & (F.col("offset") >= 0), F.col("offset"))
    identity = ["topic", "partition", "_key", "payload_bytes", "_seq"]
    bounded = truth.select(
        *truth.columns,
        F.last(known, ignorenulls=True).over(in_partition.rowsBetween(Window.unboundedPreceding, -1)).alias("_low"),
        F.first(known, ignorenulls=True).over(in_partition.rowsBetween(1, Window.unboundedFollowing)).alias("_high"),
    )
    sends = bounded.where(unknown).select(
        *bounded.columns,
        F.col(DEVICE_ID).alias("_key"),
        F.coalesce(F.when(F.col("malformed_kind").isNull(), F.col(SEQ)), F.lit(-1)).alias("_seq"),
    )
    claimed = truth.where(F.col("delivered") & (F.col("offset") >= 0)).select("topic", "partition", "offset")
    rows = bronze.join(claimed, ["topic", "partition", "offset"], "left_anti").select(
        "topic",
        "partition",
        F.col("offset").alias("_offset"),
        F.col("key").alias("_key"),
        "payload_bytes",
        F.coalesce(F.col(SEQ), F.lit(-1)).alias("_seq"),
    )
    in_range = (F.col("_low").isNull() | (F.col("_offset") > F.col("_low"))) & (
        F.col("_high").isNull() | (F.col("_offset") < F.col("_high"))
    )
    candidates = sends.join(rows, identity).where(in_range).select(*identity, "_offset").distinct()
    candidates = candidates.withColumn("_rank", F.row_number().over(Window.partitionBy(*identity).orderBy("_offset")))
    ranked = sends.withColumn("_rank", F.row_number().over(Window.partitionBy(*identity).orderBy("send_index")))
    paired = ranked.join(candidates, [*identity, "_rank"], "left").withColumn(
        "offset", F.when(in_range, F.col("_offset")).otherwise(F.lit(OFFSET_UNKNOWN)).cast("long")
    )
    return truth.where(~unknown).unionByName(paired.select(*truth.columns))


def truth_sends(spark: SparkSession, truth_files: Sequence[Path]) -> DataFrame:
    """The simulator's ground truth, one row per send, read by Spark (after a run: its files are final)."""
    return spark.read.parquet(*[str(path) for path in truth_files])


def _truth_check(spark: SparkSession, bronze: DataFrame, truth_files: Sequence[Path]) -> TruthCheck:
    truth = truth_sends(spark, truth_files)
    delivered = resolve_unknown_offsets(truth.where(F.col("delivered")), bronze)
    joined = delivered.alias("t").join(
        bronze.alias("b"),
        (F.col("t.topic") == F.col("b.topic"))
        & (F.col("t.partition") == F.col("b.partition"))
        & (F.col("t.offset") == F.col("b.offset")),
        "left",
    )
    well_formed = F.col("t.malformed_kind").isNull()
    found = F.col("b.offset").isNotNull()
    row = joined.agg(
        F.sum(F.when(~found, 1).otherwise(0)).alias("missing"),
        F.sum(
            F.when(
                found
                & well_formed
                & (
                    F.col("b.parse_error").isNotNull()
                    | ~F.col(f"b.{DEVICE_ID}").eqNullSafe(F.col(f"t.{DEVICE_ID}"))
                    | ~F.col(f"b.{SEQ}").eqNullSafe(F.col(f"t.{SEQ}"))
                ),
                1,
            ).otherwise(0)
        ).alias("different"),
        F.sum(F.when(found & ~well_formed & F.col("b.parse_error").isNull(), 1).otherwise(0)).alias("accepted"),
    ).first()
    return TruthCheck(
        sends=truth.count(),
        delivered=truth.where(F.col("delivered")).count(),
        missing_from_bronze=row["missing"] or 0,
        parsed_differently=row["different"] or 0,
        malformed_accepted=row["accepted"] or 0,
        offsets_unknown=truth.where(F.col("delivered") & (F.col("offset") == OFFSET_UNKNOWN)).count(),
    )


def reconcile(spark: SparkSession, settings: Settings, truth_files: Sequence[Path] = ()) -> Reconciliation:
    offsets = partition_offsets(settings)
    bronze = (
        spark.read.format("delta")
        .load(settings.table_path(BRONZE))
        .where(F.col("topic") == settings.topic)
        .select(
            "topic",
            "partition",
            "offset",
            PARSE_ERROR,
            DEVICE_ID,
            SEQ,
            "key",
            F.octet_length("value").alias("payload_bytes"),
        )
        .cache()
    )
    quarantined = (
        spark.read.format("delta").load(settings.table_path(QUARANTINE)).where(F.col("topic") == settings.topic)
    )
    keys = ["topic", "partition", "offset"]
    # Each stage's rows and their extra copies, in one action. Silver's rejects were judged by the registry of
    # their day, so they are not recomputed, but no record may be among them twice.
    copies = quarantined.groupBy("stage", *keys).count()
    stages = {
        row["stage"]: (row["rows"], row["repeated"])
        for row in copies.groupBy("stage")
        .agg(F.sum("count").alias("rows"), F.sum(F.col("count") - 1).alias("repeated"))
        .collect()
    }
    quarantine_rows, quarantine_duplicates = stages.get(BRONZE_STAGE, (0, 0))
    quarantine = quarantined.where(F.col("stage") == BRONZE_STAGE)
    result = Reconciliation(
        topic=settings.topic,
        partitions=_partition_checks(spark, bronze, offsets),
        bronze_malformed=bronze.where(F.col(PARSE_ERROR).isNotNull()).count(),
        quarantine_rows=quarantine_rows,
        quarantine_not_in_bronze=quarantine.join(bronze, keys, "left_anti").count(),
        quarantine_duplicates=quarantine_duplicates,
        rejects_repeated=stages.get(SILVER_STAGE, (0, 0))[1],
        truth=_truth_check(spark, bronze, truth_files) if truth_files else None,
    )
    if not offsets:
        result.notes.append(f"note: topic {settings.topic!r} does not exist on {settings.kafka_bootstrap}")
    bronze.unpersist()
    return result
