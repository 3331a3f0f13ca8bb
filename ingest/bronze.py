"""Kafka records -> bronze rows: every record kept, parsed where it can be, with the reason where not.

Pure ``DataFrame -> DataFrame`` functions; the same code runs on a streaming read of Kafka and on a
batch read (tests, backfills). One rule has a second form for rows already on the driver: ``quarantined`` is
``quarantine_rows`` over Arrow, for the ingest query's batch (tested equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import reduce

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType

from iotmon.config import Settings
from iotmon.schema import (
    DEVICE_ID,
    EVENT_TIME,
    METRIC_NAMES,
    PARSE_ERROR,
    QUARANTINE_SCHEMA,
    RAW_PAYLOAD_SCHEMA,
    READING_COLUMNS,
    SEQ,
)

BRONZE_STAGE = "bronze"
PARSE_ERROR_CODES: tuple[str, ...] = (
    "empty_payload",
    "oversized_payload",
    "invalid_utf8",
    "invalid_json",
    "missing_field",
    "mistyped_field",
    "non_finite",
    "absurd_event_time",
)
"""What ``parse_error`` lists (``code`` or ``code:detail``): the first four alone, the others per field."""
_DEVICE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_INFINITIES = (float("inf"), float("-inf"))
# What a number may look like, in JSON or in a JSON string: Spark's cast alone also takes "21.5d" or "7L".
_INTEGER_PATTERN = r"^\s*[+-]?\d{1,19}\s*$"
_DECIMAL_PATTERN = r"^\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*$"
_NON_FINITE_PATTERN = r"^\s*[+-]?(?i:nan|inf|infinity)\s*$"
_ISO_TIMESTAMP_PATTERN = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?(Z|[+-]\d{2}:?\d{2})?$"


@dataclass(frozen=True)
class PayloadRules:
    """What makes a payload acceptable, beyond being JSON with the required fields of the right types."""

    max_payload_bytes: int = 64 * 1024
    max_clock_skew_seconds: int = 86_400
    min_event_time: str = "2000-01-01T00:00:00Z"

    @classmethod
    def from_settings(cls, settings: Settings) -> PayloadRules:
        return cls(settings.max_payload_bytes, settings.max_clock_skew_seconds, settings.min_event_time)


def _typed_fields(raw: Column) -> dict[str, Column]:
    """Each required field converted from its raw JSON text; null when absent or of the wrong type.

    Numbers given as JSON strings ("97") are accepted. Spark hands the bare tokens NaN/Infinity back
    quoted, hence the trim, so they are reported as non-finite rather than mistyped.
    """
    typed = {
        DEVICE_ID: F.when(raw[DEVICE_ID].rlike(_DEVICE_ID_PATTERN), raw[DEVICE_ID]),
        SEQ: F.when(raw[SEQ].rlike(_INTEGER_PATTERN), raw[SEQ].try_cast("bigint")),
        EVENT_TIME: F.when(raw[EVENT_TIME].rlike(_ISO_TIMESTAMP_PATTERN), raw[EVENT_TIME].try_cast("timestamp")),
    }
    for name in METRIC_NAMES:
        text = F.btrim(raw[name], F.lit('"'))
        typed[name] = F.when(text.rlike(_DECIMAL_PATTERN) | text.rlike(_NON_FINITE_PATTERN), text.try_cast("double"))
    return typed


def _errors(value: Column, raw: Column, typed: dict[str, Column], kafka_ts: Column, rules: PayloadRules) -> Column:
    """Every problem of a record as a comma-separated list of ``code[:field]``, or null when it is clean.

    A clean record is told by a few comparisons, and only the others pay for the list's strings: built for
    every record, they were a third of the parse (docs/cost-model.md, "The parse: a method too large to compile")."""
    size = F.octet_length(value)
    empty, oversized = value.isNull() | (size == 0), size > rules.max_payload_bytes
    invalid_utf8, invalid_json = ~F.is_valid_utf8(value.cast("string")), raw.isNull()
    event_time = typed[EVENT_TIME]
    absurd_time = (event_time < F.lit(rules.min_event_time).cast("timestamp")) | (
        F.unix_seconds(event_time) > F.unix_seconds(kafka_ts) + rules.max_clock_skew_seconds
    )
    non_finite = {name: F.isnan(typed[name]) | typed[name].isin(*_INFINITIES) for name in METRIC_NAMES}
    clean = reduce(
        Column.__and__,
        [
            ~(empty | oversized | invalid_utf8 | invalid_json),
            *(column.isNotNull() for column in typed.values()),
            *(~problem for problem in non_finite.values()),
            ~absurd_time,
        ],
    )
    structural = (
        F.when(empty, F.lit("empty_payload"))
        .when(oversized, F.concat(F.lit("oversized_payload:"), size.cast("string")))
        .when(invalid_utf8, F.lit("invalid_utf8"))
        .when(invalid_json, F.lit("invalid_json"))
    )
    field_problems = [
        F.when(raw[name].isNull(), F.lit(f"missing_field:{name}")).when(
            column.isNull(), F.lit(f"mistyped_field:{name}")
        )
        for name, column in typed.items()
    ]
    field_problems += [F.when(problem, F.lit(f"non_finite:{name}")) for name, problem in non_finite.items()]
    field_problems.append(F.when(absurd_time, F.lit("absurd_event_time")))
    # concat_ws skips nulls, so only the problems that occurred are listed.
    described = F.coalesce(structural, F.nullif(F.concat_ws(", ", *field_problems), F.lit("")))
    # Null where a check met a null (no clean record does): described, like any record that is not clean.
    return F.when(clean, F.lit(None).cast("string")).otherwise(described)


def _in_array(text: Column) -> Column:
    """The payload parsed inside ``[...]``: exactly one element when it is one JSON value and nothing more.

    ``from_json`` alone stops after the first value, so ``{...}{...}`` or ``{...} junk`` would pass; inside
    ``[...]`` anything after the value is an error or a second element, except text that starts with ``]``.
    """
    return F.from_json(F.concat(F.lit("["), text, F.lit("]")), ArrayType(RAW_PAYLOAD_SCHEMA), {"mode": "PERMISSIVE"})


def _closed(text: Column) -> Column:
    """False for the text ``_in_array`` misses (``{...}] junk``): parsed inside ``{"v": ...}``, a ``]`` after
    the object is an error. Only payloads holding a ``]`` pay for this second parse; readings hold none."""
    in_object = F.from_json(F.concat(F.lit('{"v":'), text, F.lit("}")), "v string", {"mode": "PERMISSIVE"})
    return ~text.contains("]") | in_object["v"].isNotNull()


def parse_records(kafka_records: DataFrame, rules: PayloadRules) -> DataFrame:
    """Kafka source rows (key, value, topic, partition, offset, timestamp) -> rows of ``BRONZE_SCHEMA``.

    Oversized payloads are not parsed at all, so one huge message costs no JSON work. Reading columns are
    null whenever ``parse_error`` is set: a row is either a complete reading or a described failure.
    ``ingest_time`` is wall-clock; that is safe because the Delta sink commits a batch at most once, and a
    batch that never committed is recomputed as a whole.
    """
    value = F.col("value")
    # Each step is its own projection so the JSON parse and the typed casts run once per record.
    parsed = kafka_records.withColumn(
        "_values", F.when(F.octet_length(value) <= rules.max_payload_bytes, _in_array(value.cast("string")))
    )
    one_object = F.when(F.size("_values") == 1, F.when(_closed(value.cast("string")), F.col("_values")[0]))
    with_raw = parsed.withColumn("_raw", one_object)
    typed_names = {name: f"_typed_{name}" for name in READING_COLUMNS.fieldNames()}
    with_typed = with_raw.withColumns(
        {typed_names[name]: column for name, column in _typed_fields(F.col("_raw")).items()}
    )
    typed = {name: F.col(column) for name, column in typed_names.items()}
    with_error = with_typed.withColumn(PARSE_ERROR, _errors(value, F.col("_raw"), typed, F.col("timestamp"), rules))
    clean = F.col(PARSE_ERROR).isNull()
    return with_error.select(
        F.col("topic"),
        F.col("partition"),
        F.col("offset"),
        F.col("timestamp").alias("kafka_timestamp"),
        F.col("key").cast("string").alias("key"),
        value.alias("value"),
        F.current_timestamp().alias("ingest_time"),
        *[F.when(clean, column).cast(READING_COLUMNS[name].dataType).alias(name) for name, column in typed.items()],
        F.col(PARSE_ERROR),
    )


def quarantine_rows(bronze: DataFrame) -> DataFrame:
    """Bronze rows that failed parsing, as rows of ``QUARANTINE_SCHEMA`` (later stages add their own)."""
    return bronze.where(F.col(PARSE_ERROR).isNotNull()).select(
        F.lit(BRONZE_STAGE).alias("stage"),
        "topic",
        "partition",
        "offset",
        "kafka_timestamp",
        "key",
        "value",
        F.col(PARSE_ERROR).alias("reason"),
        "ingest_time",
    )


def quarantined(bronze: pa.Table) -> pa.Table:
    """``quarantine_rows`` for bronze rows on the driver as Arrow (the ingest query's micro-batch)."""
    failed = bronze.filter(pc.is_valid(bronze[PARSE_ERROR]))
    return quarantine_table(failed, BRONZE_STAGE, failed[PARSE_ERROR])


def quarantine_table(rows: pa.Table, stage: str, reason: pa.ChunkedArray) -> pa.Table:
    """Rows on the driver as ``QUARANTINE_SCHEMA``'s columns, each with the stage that rejected it and why."""
    given = {"stage": pa.repeat(pa.scalar(stage, reason.type), rows.num_rows), "reason": reason}
    return pa.table({name: given[name] if name in given else rows[name] for name in QUARANTINE_SCHEMA.fieldNames()})
