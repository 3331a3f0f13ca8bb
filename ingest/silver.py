"""Bronze -> silver: typed, validated, enriched and deduplicated readings.

Pure ``DataFrame -> DataFrame`` functions, run on each micro-batch of Kafka records by the ingest query
(``ingest.landing``) and on a bronze snapshot by ``iotmon backfill`` and ``iotmon verify``, so all produce the
same rows. Two rules have a second form for rows already on the driver, for the ingest query's batch (tested
equal): ``first_copies`` is ``distinct_readings`` over Arrow, and ``rejected`` is ``rejected_rows``.

* **Enrichment** is a join with the device registry: in the stream a stream-static join, re-read at every
  micro-batch, so a device registered later is recognised from then on. A reading of an unregistered
  device is rejected to quarantine (``unregistered_device``) rather than guessed at.
* **Validation** flags metrics outside their plausible range in ``out_of_range`` but keeps the reading:
  a sensor reporting 180 °C is exactly what monitoring must see, and the anomaly model learns from it.
* **Lateness** is how long a reading took to reach Kafka (``kafka_timestamp - event_time``): ``on_time`` up
  to ``IOTMON_LATE_AFTER``, ``late`` up to the watermark, ``too_late`` beyond it. Every late reading stays
  in silver; only the windowed aggregates leave ``too_late`` ones out, by this flag, so a batch
  recomputation excludes exactly what the stream excluded.
* **Deduplication** is exact on ``(device_id, seq, event_time)``: the copy that reached Kafka first wins
  (``distinct_readings``, ``first_copies``). How the stream knows which readings silver already holds is
  ``ingest.landing``'s part: state within the watermark, the table itself beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from ingest.bronze import quarantine_table
from iotmon.config import Settings, interval_seconds
from iotmon.schema import (
    DEVICE_ID,
    EVENT_TIME,
    LATE,
    LATENESS,
    METRICS,
    ON_TIME,
    PARSE_ERROR,
    QUARANTINE_SCHEMA,
    REGISTRY_COLUMNS,
    SEQ,
    SILVER_SCHEMA,
    TOO_LATE,
)

SILVER_STAGE = "silver"
UNREGISTERED_DEVICE = "unregistered_device"
READING_KEY: tuple[str, ...] = (DEVICE_ID, SEQ, EVENT_TIME)
"""What makes two rows the same reading. ``seq`` alone would merge readings across a device's counter reset."""

REJECT_REASON = "_reject_reason"
"""The column of a classified row that says why silver rejects it; null for a reading it takes."""
_COPY_ORDER: tuple[str, ...] = ("kafka_timestamp", "partition", "offset")
"""Which copy of a reading is first: the one that reached Kafka first, ties broken by where it lies."""


@dataclass(frozen=True)
class LatenessRules:
    late_after_s: float = 1.0
    too_late_after_s: float = 120.0

    @classmethod
    def from_settings(cls, settings: Settings) -> LatenessRules:
        return cls(interval_seconds(settings.late_after), interval_seconds(settings.watermark))


def _out_of_range() -> Column:
    """Comma-separated names of the metrics outside their plausible range; null when all are plausible."""
    flags = [F.when(~F.col(m.name).between(m.low, m.high), F.lit(m.name)) for m in METRICS]
    return F.nullif(F.concat_ws(",", *flags), F.lit(""))


def lateness(delay_s: Column, rules: LatenessRules) -> Column:
    return (
        F.when(delay_s <= rules.late_after_s, F.lit(ON_TIME))
        .when(delay_s <= rules.too_late_after_s, F.lit(LATE))
        .otherwise(F.lit(TOO_LATE))
    )


def classify_records(bronze: DataFrame, devices: DataFrame, rules: LatenessRules) -> DataFrame:
    """Every bronze row, the parsed ones with registry columns, validation and lateness; ``_reject_reason``
    marks the parsed readings rejected here (a record that failed parsing is bronze's reject, not silver's)."""
    registry = F.broadcast(devices.select(DEVICE_ID, *REGISTRY_COLUMNS))
    delay_s = (F.unix_micros("kafka_timestamp") - F.unix_micros(EVENT_TIME)) / 1_000_000.0
    parsed = F.col(PARSE_ERROR).isNull()
    return (
        bronze.join(registry, DEVICE_ID, "left")
        .withColumn("out_of_range", _out_of_range())
        .withColumn("arrival_delay_s", delay_s)
        .withColumn(LATENESS, lateness(F.col("arrival_delay_s"), rules))
        .withColumn(REJECT_REASON, F.when(parsed & F.col("device_type").isNull(), F.lit(UNREGISTERED_DEVICE)))
    )


def classify_readings(bronze: DataFrame, devices: DataFrame, rules: LatenessRules) -> DataFrame:
    """Parsed bronze rows with registry columns, validation and lateness; ``_reject_reason`` marks rejects.

    Bronze's own malformed rows are not here: the archive already quarantined them.
    """
    return classify_records(bronze.where(F.col(PARSE_ERROR).isNull()), devices, rules)


def accepted() -> Column:
    """Whether a classified row is a reading silver takes: parsed, and not rejected here."""
    return F.col(REJECT_REASON).isNull() & F.col(PARSE_ERROR).isNull()


def silver_rows(classified: DataFrame) -> DataFrame:
    """Accepted readings as rows of ``SILVER_SCHEMA`` (still with duplicates)."""
    return classified.where(accepted()).select(*SILVER_SCHEMA.fieldNames())


def rejected_rows(classified: DataFrame) -> DataFrame:
    """Rejected readings as rows of ``QUARANTINE_SCHEMA``, stage ``silver``."""
    columns = {"stage": F.lit(SILVER_STAGE), "reason": F.col(REJECT_REASON)}
    return classified.where(F.col(REJECT_REASON).isNotNull()).select(
        *[columns.get(name, F.col(name)).alias(name) for name in QUARANTINE_SCHEMA.fieldNames()]
    )


def rejected(classified: pa.Table) -> pa.Table:
    """``rejected_rows`` for classified rows on the driver as Arrow (the ingest query's micro-batch)."""
    rejects = classified.filter(pc.is_valid(classified[REJECT_REASON]))
    return quarantine_table(rejects, SILVER_STAGE, rejects[REJECT_REASON])


def distinct_readings(readings: DataFrame) -> DataFrame:
    """One row per reading: the copy that reached Kafka first (a static frame: a batch or a micro-batch)."""
    first = Window.partitionBy(*READING_KEY).orderBy(*_COPY_ORDER)
    return readings.withColumn("_copy", F.row_number().over(first)).where(F.col("_copy") == 1).drop("_copy")


def first_copies(readings: pa.Table) -> pa.Table:
    """``distinct_readings`` for readings on the driver as Arrow (a micro-batch's), ordered by reading key.

    A micro-batch's few thousand rows are sorted here in milliseconds, where Spark's window shuffles and
    sorts them in stages of their own (docs/cost-model.md, "Silver's readings picked on the driver")."""
    ordered = readings.sort_by([(name, "ascending") for name in (*READING_KEY, *_COPY_ORDER)])
    if ordered.num_rows < 2:
        return ordered
    earlier, later = ordered.slice(0, ordered.num_rows - 1), ordered.slice(1)
    new_key = reduce(pc.or_, (pc.not_equal(later[name], earlier[name]) for name in READING_KEY))
    return ordered.filter(pa.concat_arrays([pa.array([True]), new_key.combine_chunks()]))


def silver_from_bronze(bronze: DataFrame, devices: DataFrame, rules: LatenessRules) -> DataFrame:
    """The whole silver table from a bronze snapshot: what the stream builds batch by batch."""
    return distinct_readings(silver_rows(classify_readings(bronze, devices, rules)))
