"""Verification of truth rows whose offset the broker did not report: found in bronze by content, in the
stretch of the partition their neighbours' offsets leave, each bronze row used once; otherwise missing."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from ingest.silver import LatenessRules, lateness
from ingest.verify import _truth_check, resolve_unknown_offsets
from simulators.truth import OFFSET_UNKNOWN, TRUTH_SCHEMA
from streaming.verify import _silver_against_truth

TOPIC = "iotmon.readings"
U = OFFSET_UNKNOWN
# send_index, device, seq, is_duplicate, malformed_kind, payload_bytes, partition, offset
SENDS = [
    (0, "dev-a", 1, False, None, 150, 0, 10),
    (1, "dev-a", 2, False, None, 151, 0, U),  # bronze at 11
    (2, "dev-b", 1, False, None, 152, 0, U),  # bronze at 12
    (3, "dev-b", 2, False, None, 153, 0, 13),
    (4, "dev-c", 1, False, None, 154, 0, U),  # not in bronze after 13; an older copy at 5 must not count
    (5, "dev-a", 3, False, "truncated", 7, 0, U),  # quarantined at 15
    (6, "dev-d", 1, False, None, 160, 1, U),  # a reading and its duplicate, both without offset: 0 and 1
    (7, "dev-d", 1, True, None, 160, 1, U),
]
# partition, offset, device_id, seq, parse_error, key, payload_bytes
BRONZE_ROWS = [
    (0, 5, "dev-c", 1, None, "dev-c", 154),
    (0, 10, "dev-a", 1, None, "dev-a", 150),
    (0, 11, "dev-a", 2, None, "dev-a", 151),
    (0, 12, "dev-b", 1, None, "dev-b", 152),
    (0, 13, "dev-b", 2, None, "dev-b", 153),
    (0, 15, None, None, "truncated JSON", "dev-a", 7),
    (1, 0, "dev-d", 1, None, "dev-d", 160),
    (1, 1, "dev-d", 1, None, "dev-d", 160),
]


WHEN = datetime(2026, 11, 22, 1, tzinfo=UTC)


def write_truth(path: Path, sends: list[tuple] = SENDS) -> Path:
    when = WHEN
    rows = [
        {
            "send_index": i,
            "device_id": device,
            "seq": seq,
            "event_time": when,
            "send_time": when,
            "delay_s": 0.0,
            "late_kind": "on_time",
            "is_duplicate": duplicate,
            "malformed_kind": malformed,
            "anomaly_type": None,
            "anomaly_metric": None,
            "payload_bytes": size,
            "topic": TOPIC,
            "partition": partition,
            "offset": offset,
            "delivered": True,
        }
        for i, device, seq, duplicate, malformed, size, partition, offset in sends
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=TRUTH_SCHEMA), path)
    return path


def bronze_frame(spark: SparkSession):
    return spark.createDataFrame(
        [(TOPIC, *row) for row in BRONZE_ROWS],
        "topic string, partition int, offset long, device_id string, seq long, parse_error string, "
        "key string, payload_bytes int",
    )


def test_unknown_offsets_are_found_by_content_in_their_stretch(spark: SparkSession, tmp_path: Path) -> None:
    truth = spark.read.parquet(str(write_truth(tmp_path / "run.parquet")))
    resolved = resolve_unknown_offsets(truth, bronze_frame(spark))
    offsets = {row["send_index"]: row["offset"] for row in resolved.collect()}
    assert offsets == {0: 10, 1: 11, 2: 12, 3: 13, 4: U, 5: 15, 6: 0, 7: 1}


def test_verify_accounts_for_every_send_without_offset(spark: SparkSession, tmp_path: Path) -> None:
    check = _truth_check(spark, bronze_frame(spark), [write_truth(tmp_path / "run.parquet")])
    assert (check.sends, check.delivered, check.offsets_unknown) == (8, 8, 6)
    assert check.missing_from_bronze == 1, "dev-c's reading is not in bronze; its older copy at offset 5 is not it"
    assert check.parsed_differently == 0 and check.malformed_accepted == 0


def test_silver_against_truth_uses_the_offsets_found_in_bronze(spark: SparkSession, tmp_path: Path) -> None:
    rules = LatenessRules()
    # silver: each valid reading once, at its first copy's offset
    silver = spark.createDataFrame(
        [
            ("dev-a", 1, WHEN, 0, 10),
            ("dev-a", 2, WHEN, 0, 11),
            ("dev-b", 1, WHEN, 0, 12),
            ("dev-b", 2, WHEN, 0, 13),
            ("dev-d", 1, WHEN, 1, 0),
        ],
        "device_id string, seq long, event_time timestamp, partition int, offset long",
    ).withColumn("lateness", lateness(F.lit(0.0), rules))
    in_bronze = [send for send in SENDS if send[1] != "dev-c"]
    truth = write_truth(tmp_path / "in-bronze.parquet", in_bronze)
    assert _silver_against_truth(spark, silver, bronze_frame(spark), [truth], rules) == []
    with_missing = write_truth(tmp_path / "all.parquet")
    problems = _silver_against_truth(spark, silver, bronze_frame(spark), [with_missing], rules)
    assert problems == ["silver vs ground truth: 1 rows of the batch recomputation are missing"], "dev-c's reading"
