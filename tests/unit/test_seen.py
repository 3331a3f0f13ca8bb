"""The ingest writer's keys on the driver: which readings ahead of the watermark silver already holds."""

from __future__ import annotations

import datetime as dt

import pyarrow as pa

from ingest.seen import SeenReadings
from iotmon.schema import DEVICE_ID, EVENT_TIME, SEQ

T0 = dt.datetime(2026, 12, 7, 14, 0, 30)


def _keys(*rows: tuple[str, int, dt.datetime]) -> pa.Table:
    devices, sequences, times = zip(*rows, strict=True) if rows else ((), (), ())
    return pa.table(
        {
            DEVICE_ID: pa.array(devices, pa.string()),
            SEQ: pa.array(sequences, pa.int64()),
            EVENT_TIME: pa.array(times, pa.timestamp("us", "UTC")),
        }
    )


def test_a_key_is_seen_only_whole_device_seq_and_event_time_alike() -> None:
    seen = SeenReadings()
    seen.add(_keys(("dev-a", 1, T0), ("dev-a", -7, T0)))
    asked = _keys(
        ("dev-a", 1, T0),
        ("dev-a", -7, T0),  # a counter may be negative
        ("dev-b", 1, T0),  # another device
        ("dev-a", 2, T0),  # another seq
        ("dev-a", 1, T0 + dt.timedelta(microseconds=1)),  # another event time, a microsecond on
        ("dev-a", 1, T0 + dt.timedelta(seconds=10)),  # the same moment of the next bucket
    )
    assert seen.unseen(asked).to_pylist() == [False, False, True, True, True, True]
    assert len(seen) == 2
    assert seen.unseen(_keys()).to_pylist() == []


def test_event_times_in_any_unit_are_the_same_keys() -> None:
    seen = SeenReadings()
    seen.add(_keys(("dev-a", 1, T0)))
    in_ms = _keys(("dev-a", 1, T0)).cast(
        pa.schema([(DEVICE_ID, pa.string()), (SEQ, pa.int64()), (EVENT_TIME, pa.timestamp("ms"))])
    )
    assert seen.unseen(in_ms).to_pylist() == [False]


def test_a_bucket_of_10_s_is_forgotten_whole_once_the_watermark_has_passed_its_end() -> None:
    seen = SeenReadings()
    start = T0.replace(second=20)  # a bucket's start: 10 s buckets from the epoch
    seen.add(
        _keys(
            ("dev-a", 1, start - dt.timedelta(microseconds=1)),  # the bucket before
            ("dev-a", 2, start),
            ("dev-a", 3, start + dt.timedelta(seconds=9)),
        )
    )
    seen.forget(None)  # no watermark yet
    assert len(seen) == 3
    seen.forget(start + dt.timedelta(seconds=5))  # past one of the bucket's keys, not its end
    assert len(seen) == 2
    # Held, though the watermark passed seq 2: only a reading after the watermark asks, so this never answers.
    assert seen.unseen(_keys(("dev-a", 2, start), ("dev-a", 3, start + dt.timedelta(seconds=9)))).to_pylist() == [
        False,
        False,
    ]
    seen.forget(start + dt.timedelta(seconds=10))
    assert len(seen) == 0
    assert seen.unseen(_keys(("dev-a", 3, start + dt.timedelta(seconds=9)))).to_pylist() == [True]
