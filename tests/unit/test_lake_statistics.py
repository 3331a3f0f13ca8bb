"""The Delta statistics ``merge_once`` writes for its files: bounds readers can prune with, never past the data."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime

import pyarrow as pa

from iotmon.lake import file_statistics


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
