"""What the driver's Delta writes (``append_once``, ``merge_once``) put in a file: the rows as the table stores them,
and statistics readers can prune with, never past the data."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import pyarrow as pa
import pytest

from iotmon.lake import conformed, file_statistics


def test_bounds_are_widened_to_the_millisecond_and_floats_left_out() -> None:
    rows = pa.table(
        {
            "at": pa.array(
                [datetime(2026, 11, 28, 12, 0, 0, 999_999, UTC), datetime(2026, 11, 28, 12, 0, 1, 500, UTC)],
                pa.timestamp("us", tz="UTC"),
            ),
            "device_id": ["dev-b", "dev-a"],
            "readings": pa.array([3, None], pa.int64()),
            "mean": [math.nan, 1.0],
            "note": pa.array([None, None], pa.string()),
        }
    )
    stats = json.loads(file_statistics(rows))
    assert stats["numRecords"] == 2
    # The oldest cut down, the newest rounded up: each bound holds its column's values in full.
    assert stats["minValues"] == {"at": "2026-11-28T12:00:00.999Z", "device_id": "dev-a", "readings": 3}
    assert stats["maxValues"] == {"at": "2026-11-28T12:00:01.001Z", "device_id": "dev-b", "readings": 3}
    assert stats["nullCount"] == {"at": 0, "device_id": 0, "readings": 1, "mean": 0, "note": 2}


def test_rows_a_table_cannot_take_are_refused_as_deltas_schema_enforcement_refuses_them() -> None:
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("at", pa.timestamp("us", tz="UTC")),
            pa.field("v", pa.string()),
        ]
    )
    fits = pa.table(
        {
            "v": pa.array(["a"], pa.large_string()),
            "id": pa.array([1], pa.int32()),
            "at": pa.array([datetime(2026, 11, 29)], pa.timestamp("ms")),
        }
    )
    assert conformed(fits, schema).schema == schema  # the table's order and representation
    assert conformed(pa.table({"id": [1], "at": pa.nulls(1), "v": pa.nulls(1)}), schema).num_rows == 1
    for rows, problem in (
        (pa.table({"id": [1], "at": pa.nulls(1), "v": [2]}), "v is int64, the table's string"),
        (pa.table({"id": [1.5], "at": pa.nulls(1), "v": ["a"]}), "id is double"),
        (pa.table({"id": [1], "v": ["a"]}), "at is missing"),
        (pa.table({"id": [1], "at": pa.nulls(1), "v": ["a"], "w": [1]}), "w is not a column of the table"),
        (pa.table({"id": pa.array([None], pa.int64()), "at": pa.nulls(1), "v": ["a"]}), "id holds nulls"),
    ):
        with pytest.raises(TypeError, match="schema mismatch") as refused:
            conformed(rows, schema)
        assert problem in str(refused.value)


def test_a_string_column_with_bytes_that_are_not_utf8_has_no_bounds() -> None:
    # Spark's strings hold any bytes: bronze's key is the Kafka key cast to a string.
    keys = pa.array([b"\xf5\x01", b"dev-1"], pa.binary()).cast(pa.string(), safe=False)
    stats = json.loads(file_statistics(pa.table({"key": keys, "n": [1, 2]})))
    assert "key" not in stats["minValues"] and stats["nullCount"]["key"] == 0
    assert stats["minValues"]["n"] == 1 and stats["maxValues"]["n"] == 2
