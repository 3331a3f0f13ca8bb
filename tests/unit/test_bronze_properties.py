"""Property tests of the bronze parser: whatever arrives, one row per record, a reading or a known reason.

Hypothesis draws the records (good readings, designed corruptions, random bytes, with arbitrary keys and
headers), fresh each run; they are parsed as one DataFrame, since each Spark job costs seconds of planning.
A failure lists the records that broke a property; add them to ``REGRESSIONS`` once fixed.
"""

from __future__ import annotations

import datetime as dt
import math

from pyspark.sql import SparkSession

from ingest.bronze import PayloadRules, parse_records
from iotmon.schema import METRIC_NAMES, READING_COLUMNS
from tests.bad_input import (
    ANY_REASON,
    Record,
    acceptable_reading,
    draw_records,
    is_known_reason,
    reason_codes,
    records,
)

KAFKA_TS = dt.datetime(2026, 11, 22, 1, 0, 0)
RULES = PayloadRules(max_payload_bytes=8192, max_clock_skew_seconds=3600, min_event_time="2000-01-01T00:00:00Z")
GOOD = (
    b'{"device_id":"dev-1","seq":7,"event_time":"2026-11-22T00:59:58.250Z","temperature":21.5,'
    b'"humidity":40,"vibration":2.25,"pressure":101.3,"battery":97.5}'
)
KAFKA_COLUMNS = (
    "topic string, partition int, offset long, timestamp timestamp, key binary, value binary, "
    "timestampType int, headers array<struct<key:string,value:binary>>"
)


def _parse(spark: SparkSession, batch: list[Record]) -> list:
    rows = [
        ("readings", 0, offset, KAFKA_TS, record.key, record.value, 0, list(record.headers))
        for offset, record in enumerate(batch)
    ]
    return parse_records(spark.createDataFrame(rows, KAFKA_COLUMNS), RULES).orderBy("offset").collect()


def _check(record: Record, row) -> None:
    """The properties of one record's bronze row (``row.offset`` is the record's place in the batch)."""
    assert row.value == (None if record.value is None else bytearray(record.value))
    if record.key is not None and _is_utf8(record.key):
        assert row.key == record.key.decode("utf-8")
    assert (row.key is None) == (record.key is None)
    reading = {name: getattr(row, name) for name in READING_COLUMNS.fieldNames()}
    if row.parse_error is None:
        # Accepted: the contract, checked independently, must agree on every value.
        assert record.expected in (None, ANY_REASON), f"accepted, expected {record.expected}: {record.value!r}"
        assert reading == acceptable_reading(record.value, KAFKA_TS, RULES), record.value
        assert all(math.isfinite(reading[name]) for name in METRIC_NAMES)
        if record.reading is not None:
            assert reading == record.reading
        return
    codes = reason_codes(row.parse_error)
    assert codes and all(is_known_reason(code) for code in codes), row.parse_error
    assert set(reading.values()) == {None}, "a rejected row carries no reading"
    assert record.expected is not None, f"rejected a good reading ({row.parse_error}): {record.value!r}"
    if record.expected == ANY_REASON:
        assert acceptable_reading(record.value, KAFKA_TS, RULES) is None, f"{row.parse_error}: {record.value!r}"
    else:
        assert record.expected in codes, f"{row.parse_error} instead of {record.expected}: {record.value!r}"


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


REGRESSIONS = [
    # from_json stops after the first JSON value: these were archived as readings.
    Record(b"dev-1", GOOD + b" trailing", expected="invalid_json"),
    Record(b"dev-1", GOOD + GOOD, expected="invalid_json"),
    Record(None, GOOD + b"]", expected="invalid_json"),
    Record(None, GOOD + b"] x", expected="invalid_json"),
    # Spark's cast to double reads Java literal suffixes: "21.5d" was archived as 21.5.
    Record(b"\xff", GOOD.replace(b"21.5", b'"21.5d"'), expected="mistyped_field:temperature"),
    Record(b"", GOOD.replace(b"97.5", b'"97.5f"'), expected="mistyped_field:battery"),
]


def test_every_record_is_one_reading_or_one_known_reason(spark: SparkSession) -> None:
    batch = [*REGRESSIONS, *draw_records(records(KAFKA_TS, RULES), 300)]
    rows = _parse(spark, batch)
    assert [row.offset for row in rows] == list(range(len(batch))), "one row per record"
    failures = []
    for record, row in zip(batch, rows, strict=True):
        try:
            _check(record, row)
        except AssertionError as exc:
            failures.append(f"{record!r}: {exc}")
    assert not failures, f"{len(failures)} of {len(batch)} records:\n" + "\n".join(failures[:10])
