"""The bronze parser on tiny in-memory frames: each kind of bad input gets its reason, good input its values."""

from __future__ import annotations

import datetime as dt

import pytest
from pyspark.sql import DataFrame, SparkSession

from ingest.bronze import PayloadRules, parse_records, quarantine_rows, quarantined
from iotmon.schema import BRONZE_SCHEMA, QUARANTINE_SCHEMA
from iotmon.spark import HOTSPOT_HUGE_METHOD_BYTES

KAFKA_TS = dt.datetime(2026, 11, 22, 1, 0, 0)
GOOD = (
    b'{"device_id":"dev-000001","seq":7,"event_time":"2026-11-22T00:59:58.250Z","temperature":21.5,'
    b'"humidity":40,"vibration":2.25,"pressure":101.3,"battery":"97.5","firmware":"1.2"}'
)
OVERSIZED = b'{"device_id":"dev-1","seq":7' + b" " * 1100 + b"}"
RULES = PayloadRules(max_payload_bytes=1024, max_clock_skew_seconds=3600, min_event_time="2000-01-01T00:00:00Z")


def _kafka_frame(spark: SparkSession, values: list[bytes | None]) -> DataFrame:
    return spark.createDataFrame(
        [("readings", 0, offset, KAFKA_TS, b"dev-000001", value, 0) for offset, value in enumerate(values)],
        "topic string, partition int, offset long, timestamp timestamp, key binary, value binary, timestampType int",
    )


def _parse(spark: SparkSession, values: list[bytes | None]) -> list:
    return parse_records(_kafka_frame(spark, values), RULES).orderBy("offset").collect()


def test_output_has_the_bronze_schema(spark: SparkSession) -> None:
    bronze = parse_records(_kafka_frame(spark, [GOOD]), RULES)
    assert [(f.name, f.dataType) for f in bronze.schema] == [(f.name, f.dataType) for f in BRONZE_SCHEMA]
    quarantine = quarantine_rows(bronze)
    assert [(f.name, f.dataType) for f in quarantine.schema] == [(f.name, f.dataType) for f in QUARANTINE_SCHEMA]


def test_no_generated_method_of_the_parse_is_too_large_for_hotspot_to_compile(spark: SparkSession) -> None:
    """The parse's whole-stage code is over 8,000 bytes of bytecode, which HotSpot runs interpreted: the session
    makes Spark run such a subtree without whole-stage code generation instead."""
    plan = parse_records(_kafka_frame(spark, [GOOD]), RULES)._jdf.queryExecution().debug().codegenToSeq()
    stage_sizes = [plan.apply(i)._3().maxMethodCodeSize() for i in range(plan.size())]
    assert max(stage_sizes) > HOTSPOT_HUGE_METHOD_BYTES  # if not, the session's limit may no longer matter
    assert int(spark.conf.get("spark.sql.codegen.hugeMethodLimit")) == HOTSPOT_HUGE_METHOD_BYTES


def test_a_good_reading_is_fully_typed(spark: SparkSession) -> None:
    [row] = _parse(spark, [GOOD])
    values = row.asDict()
    ingest_time = values.pop("ingest_time")
    assert isinstance(ingest_time, dt.datetime)
    assert values == {
        "topic": "readings",
        "partition": 0,
        "offset": 0,
        "kafka_timestamp": KAFKA_TS,
        "key": "dev-000001",
        "value": bytearray(GOOD),
        "device_id": "dev-000001",
        "seq": 7,
        "event_time": dt.datetime(2026, 11, 22, 0, 59, 58, 250000),
        "temperature": 21.5,
        "humidity": 40.0,
        "vibration": 2.25,
        "pressure": 101.3,
        "battery": 97.5,
        "parse_error": None,
    }


BAD_RECORDS: list[tuple[bytes | None, str]] = [
    (None, "empty_payload"),
    (b"", "empty_payload"),
    (OVERSIZED, f"oversized_payload:{len(OVERSIZED)}"),
    (b"\xff\xfe{}", "invalid_utf8"),
    (b'{"device_id":"dev-1","seq":7', "invalid_json"),
    (b"[1,2,3]", "invalid_json"),
    (b'"just a string"', "invalid_json"),
    (GOOD.replace(b'"seq":7,', b""), "missing_field:seq"),
    (GOOD.replace(b'"seq":7', b'"seq":null'), "missing_field:seq"),
    (GOOD.replace(b'"seq":7', b'"seq":"abc"'), "mistyped_field:seq"),
    (GOOD.replace(b'"seq":7', b'"seq":7.5'), "mistyped_field:seq"),
    (GOOD.replace(b'"temperature":21.5', b'"temperature":"hot"'), "mistyped_field:temperature"),
    (GOOD.replace(b'"temperature":21.5', b'"temperature":true'), "mistyped_field:temperature"),
    (GOOD.replace(b'"2026-11-22T00:59:58.250Z"', b"1795310398"), "mistyped_field:event_time"),
    (GOOD.replace(b'"device_id":"dev-000001"', b'"device_id":{"id":1}'), "mistyped_field:device_id"),
    (GOOD.replace(b'"temperature":21.5', b'"temperature":NaN'), "non_finite:temperature"),
    (GOOD.replace(b'"pressure":101.3', b'"pressure":-Infinity'), "non_finite:pressure"),
    (GOOD.replace(b"2026-11-22T00:59", b"1970-01-01T00:00"), "absurd_event_time"),
    (GOOD.replace(b"2026-11-22T00:59", b"2026-11-22T02:59"), "absurd_event_time"),
    (
        GOOD.replace(b'"seq":7', b'"seq":"x"').replace(b'"humidity":40,', b""),
        "mistyped_field:seq, missing_field:humidity",
    ),
]


@pytest.fixture(scope="module")
def parsed_bad_records(spark: SparkSession) -> list:
    """All bad records parsed in one frame: one Spark job instead of one per case."""
    return _parse(spark, [payload for payload, _ in BAD_RECORDS])


@pytest.mark.parametrize("case", range(len(BAD_RECORDS)), ids=[reason for _, reason in BAD_RECORDS])
def test_bad_records_are_kept_with_their_reason(parsed_bad_records: list, case: int) -> None:
    payload, reason = BAD_RECORDS[case]
    row = parsed_bad_records[case]
    assert row.parse_error == reason
    assert row.value == (None if payload is None else bytearray(payload))
    assert (row.device_id, row.seq, row.event_time, row.temperature) == (None, None, None, None)


def test_quarantine_is_exactly_the_bad_records(spark: SparkSession) -> None:
    bronze = parse_records(_kafka_frame(spark, [GOOD, b"{", GOOD, b""]), RULES)
    rows = quarantine_rows(bronze).orderBy("offset").collect()
    assert [(r.stage, r.offset, r.reason, r.value) for r in rows] == [
        ("bronze", 1, "invalid_json", bytearray(b"{")),
        ("bronze", 3, "empty_payload", bytearray(b"")),
    ]


def test_quarantined_on_the_driver_are_the_quarantine_rows(spark: SparkSession) -> None:
    """The ingest writer's Arrow form of the rule quarantines the same records, with the same columns."""
    payloads = [GOOD, *(payload for payload, _ in BAD_RECORDS), GOOD]
    bronze = parse_records(_kafka_frame(spark, payloads), RULES).localCheckpoint()  # one ingest_time for both
    by_spark = quarantine_rows(bronze).toArrow().sort_by("offset")
    by_arrow = quarantined(bronze.toArrow().take(list(reversed(range(len(payloads)))))).sort_by("offset")
    assert [(f.name, f.type) for f in by_arrow.schema] == [(f.name, f.type) for f in by_spark.schema]
    assert by_arrow.to_pylist() == by_spark.to_pylist()
    assert by_arrow["offset"].to_pylist() == list(range(1, len(BAD_RECORDS) + 1))
    assert quarantined(bronze.limit(0).toArrow()).num_rows == 0
