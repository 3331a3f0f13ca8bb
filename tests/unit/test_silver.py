"""Silver's transforms on tiny frames: registry join, range flags, lateness, rejects and exact dedup."""

from __future__ import annotations

import datetime as dt

from pyspark.sql import DataFrame, SparkSession

from ingest.silver import (
    LatenessRules,
    classify_readings,
    classify_records,
    distinct_readings,
    first_copies,
    rejected,
    rejected_rows,
    silver_from_bronze,
    silver_rows,
)
from iotmon.schema import BRONZE_SCHEMA, DEVICES_SCHEMA, QUARANTINE_SCHEMA, SILVER_SCHEMA

T0 = dt.datetime(2026, 11, 22, 12, 0, 0)
RULES = LatenessRules(late_after_s=1.0, too_late_after_s=120.0)
HEALTHY = (20.0, 40.0, 2.0, 101.0, 90.0)


def _bronze(spark: SparkSession, rows: list[tuple]) -> DataFrame:
    """Rows of (partition, offset, device_id, seq, event_s, delay_s, metrics, parse_error)."""
    records = []
    for partition, offset, device, seq, event_s, delay_s, metrics, error in rows:
        event_time = T0 + dt.timedelta(seconds=event_s)
        kafka_ts = event_time + dt.timedelta(seconds=delay_s)
        reading = (device, seq, event_time, *metrics) if error is None else (None,) * 8
        records.append(("t", partition, offset, kafka_ts, device, b"{}", kafka_ts, *reading, error))
    return spark.createDataFrame(records, BRONZE_SCHEMA)


def _devices(spark: SparkSession) -> DataFrame:
    return spark.createDataFrame(
        [
            ("dev-1", "pump", "site-a", "P-100", dt.date(2024, 1, 1)),
            ("dev-2", "motor", "site-b", "M-7", dt.date(2024, 1, 1)),
        ],
        DEVICES_SCHEMA,
    )


def test_clean_readings_are_enriched_flagged_and_classified(spark: SparkSession) -> None:
    bronze = _bronze(
        spark,
        [
            (0, 0, "dev-1", 1, 0, 0.2, HEALTHY, None),
            (0, 1, "dev-1", 2, 1, 30.0, (180.0, 40.0, 2.0, 101.0, -3.0), None),
            (1, 0, "dev-2", 1, 2, 600.0, HEALTHY, None),
            (1, 1, None, None, 0, 0.0, HEALTHY, "invalid_json"),
        ],
    )
    silver = silver_rows(classify_readings(bronze, _devices(spark), RULES))
    assert [(f.name, f.dataType) for f in silver.schema] == [(f.name, f.dataType) for f in SILVER_SCHEMA]
    got = [
        (r.device_id, r.seq, r.device_type, r.site, r.model, r.out_of_range, round(r.arrival_delay_s, 3), r.lateness)
        for r in silver.orderBy("device_id", "seq").collect()
    ]
    assert got == [
        ("dev-1", 1, "pump", "site-a", "P-100", None, 0.2, "on_time"),
        ("dev-1", 2, "pump", "site-a", "P-100", "temperature,battery", 30.0, "late"),
        ("dev-2", 1, "motor", "site-b", "M-7", None, 600.0, "too_late"),
    ]


def test_unregistered_devices_are_rejected_with_their_record(spark: SparkSession) -> None:
    bronze = _bronze(spark, [(0, 0, "dev-1", 1, 0, 0.0, HEALTHY, None), (2, 5, "dev-9", 1, 0, 0.0, HEALTHY, None)])
    classified = classify_readings(bronze, _devices(spark), RULES)
    assert [r.device_id for r in silver_rows(classified).collect()] == ["dev-1"]
    rejects = rejected_rows(classified)
    assert [(f.name, f.dataType) for f in rejects.schema] == [(f.name, f.dataType) for f in QUARANTINE_SCHEMA]
    assert [(r.stage, r.partition, r.offset, r.key, r.reason) for r in rejects.collect()] == [
        ("silver", 2, 5, "dev-9", "unregistered_device")
    ]


def test_rejected_on_the_driver_are_the_rejected_rows(spark: SparkSession) -> None:
    """The ingest writer's Arrow form of the rule rejects the same readings, with the same columns; a record that
    failed parsing is bronze's to quarantine, not silver's."""
    bronze = _bronze(
        spark,
        [
            (0, 0, "dev-1", 1, 0, 0.0, HEALTHY, None),
            (2, 5, "dev-9", 1, 0, 0.0, HEALTHY, None),
            (1, 1, None, None, 0, 0.0, HEALTHY, "invalid_json"),
            (2, 7, "dev-8", 4, 0, 0.0, HEALTHY, None),
        ],
    )
    classified = classify_records(bronze, _devices(spark), RULES)
    by_spark = rejected_rows(classified).toArrow().sort_by("offset")
    by_arrow = rejected(classified.toArrow()).sort_by("offset")
    assert [(f.name, f.type) for f in by_arrow.schema] == [(f.name, f.type) for f in by_spark.schema]
    assert by_arrow.to_pylist() == by_spark.to_pylist()
    assert [(r["key"], r["reason"]) for r in by_arrow.to_pylist()] == [
        ("dev-9", "unregistered_device"),
        ("dev-8", "unregistered_device"),
    ]


def test_dedup_keeps_the_first_copy_to_reach_kafka(spark: SparkSession) -> None:
    bronze = _bronze(
        spark,
        [
            (0, 7, "dev-1", 1, 0, 3.0, HEALTHY, None),  # the retransmission, arriving later
            (0, 3, "dev-1", 1, 0, 0.5, HEALTHY, None),  # the first copy
            (0, 4, "dev-1", 2, 1, 0.0, HEALTHY, None),
            (0, 5, "dev-1", 2, 61, 0.0, HEALTHY, None),  # same seq, other time: a counter reset, kept
        ],
    )
    distinct = distinct_readings(silver_rows(classify_readings(bronze, _devices(spark), RULES)))
    got = [(r.seq, r.offset, r.lateness) for r in distinct.orderBy("offset").collect()]
    assert got == [(1, 3, "on_time"), (2, 4, "on_time"), (2, 5, "on_time")]


def test_first_copies_on_the_driver_are_the_distinct_readings(spark: SparkSession) -> None:
    """The ingest writer's Arrow form of the rule picks the same copy of every reading as Spark's, ties of
    Kafka time broken by partition, then offset."""
    bronze = _bronze(
        spark,
        [
            (0, 7, "dev-1", 1, 0, 3.0, HEALTHY, None),  # a retransmission, arriving later
            (1, 2, "dev-1", 1, 0, 0.5, HEALTHY, None),  # the first copy
            (0, 9, "dev-1", 2, 1, 0.5, HEALTHY, None),  # the same Kafka time: partition 0 first
            (1, 1, "dev-1", 2, 1, 0.5, HEALTHY, None),
            (2, 6, "dev-2", 2, 1, 0.5, HEALTHY, None),  # the same Kafka time and partition: offset 5 first
            (2, 5, "dev-2", 2, 1, 0.5, HEALTHY, None),
            (2, 8, "dev-2", 2, 61, 0.0, HEALTHY, None),  # same seq, other time: a counter reset, kept
            (0, 3, "dev-2", 1, 0, 0.0, HEALTHY, None),  # the only copy
        ],
    )
    readings = silver_rows(classify_readings(bronze, _devices(spark), RULES))
    by_spark = [(r.device_id, r.seq, r.partition, r.offset) for r in distinct_readings(readings).collect()]
    by_arrow = first_copies(readings.toArrow().take([7, 6, 5, 4, 3, 2, 1, 0]))
    assert by_arrow.schema.names == readings.columns
    got = list(zip(*(by_arrow[name].to_pylist() for name in ("device_id", "seq", "partition", "offset")), strict=True))
    assert (
        sorted(got)
        == sorted(by_spark)
        == [
            ("dev-1", 1, 1, 2),
            ("dev-1", 2, 0, 9),
            ("dev-2", 1, 0, 3),
            ("dev-2", 2, 2, 5),
            ("dev-2", 2, 2, 8),
        ]
    )
    assert first_copies(readings.limit(0).toArrow()).num_rows == 0


def test_silver_from_bronze_is_the_composition(spark: SparkSession) -> None:
    bronze = _bronze(
        spark,
        [(0, 0, "dev-1", 1, 0, 0.0, HEALTHY, None), (0, 1, "dev-1", 1, 0, 2.0, HEALTHY, None)],
    )
    assert silver_from_bronze(bronze, _devices(spark), RULES).collect() == [
        r for r in silver_rows(classify_readings(bronze, _devices(spark), RULES)).collect() if r.offset == 0
    ]
