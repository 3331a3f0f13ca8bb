"""Which readings silver already holds, among those ahead of the ingest query's watermark: kept on the driver.

The ingest query's ``foreachBatch`` has its whole batch on the driver already (``ingest.landing.IngestWriter``), so
it deduplicates there, against the keys of the readings it landed in silver whose event time the watermark has
not passed. Silver itself is this state's log: a writer that starts (a restart after a crash included) reads the
keys back from silver's newest files (``iotmon.lake.rows_after``) instead of from a state store of its own. Spark's
``dropDuplicates`` would read each batch's records a second time in the plan (a union's branches share no scan),
parse and join them again, shuffle their keys and scan its whole state at every batch to evict
(docs/cost-model.md, "The deduplication on the driver").

Pure Python over Arrow columns; tested without Spark (tests/unit/test_seen.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pyarrow as pa
import pyarrow.compute as pc

from iotmon.schema import DEVICE_ID, EVENT_TIME, SEQ

_SPAN_US = 10_000_000
"""The event time one bucket of keys spans: a bucket is forgotten whole once the watermark has passed its end."""
_LOW_64 = (1 << 64) - 1


def _micros(times: pa.ChunkedArray | pa.Array) -> list[int]:
    """Timestamps as integer microseconds since the epoch, whatever their unit."""
    kind = times.type
    return pc.cast(pc.cast(times, pa.timestamp("us", kind.tz)), pa.int64()).to_pylist()


class SeenReadings:
    """The keys ``(device_id, seq, event_time)`` of readings silver holds, in buckets of 10 s of event time.

    Exact for any reading whose event time is after the watermark of the last ``forget``: it holds every key
    added (or loaded) with a later event time. It may hold older ones too, up to a bucket's span behind the
    watermark; those never answer for a later reading, the event time being part of the key. Each key is one
    integer (the device's number here, the ``seq`` and the event time, side by side), so at 5,000 readings a
    second and a 2-minute watermark the driver holds up to 700,000 of them in about 80 MB, and asks about a
    batch of 12,000 and adds them in about 10 ms of CPU (docs/cost-model.md, "The deduplication on the driver")."""

    def __init__(self) -> None:
        self._buckets: dict[int, set[int]] = {}
        self._devices: dict[str, int] = {}
        """Each device's number in the keys, for as long as this lives: one entry per device of the fleet."""

    def __len__(self) -> int:
        return sum(len(keys) for keys in self._buckets.values())

    def _keys(self, readings: pa.Table) -> Iterator[tuple[int, int]]:
        """Each reading's bucket and key."""
        devices, numbers = readings[DEVICE_ID].to_pylist(), self._devices
        for device, seq, micros in zip(devices, readings[SEQ].to_pylist(), _micros(readings[EVENT_TIME]), strict=True):
            number = numbers.setdefault(device, len(numbers))
            yield micros // _SPAN_US, number << 128 | (seq & _LOW_64) << 64 | (micros & _LOW_64)

    def unseen(self, readings: pa.Table) -> pa.Array:
        """Per row of ``readings`` (its key columns at least), whether its key is not held."""
        buckets = self._buckets
        return pa.array([key not in buckets.get(bucket, ()) for bucket, key in self._keys(readings)], pa.bool_())

    def add(self, readings: pa.Table) -> None:
        """Hold the keys of ``readings``."""
        buckets = self._buckets
        for bucket, key in self._keys(readings):
            buckets.setdefault(bucket, set()).add(key)

    def forget(self, watermark: datetime | None) -> None:
        """Let go of the buckets the watermark (naive UTC; None before there is one) has passed the end of."""
        if watermark is None:
            return
        passed = (watermark - datetime(1970, 1, 1)) // timedelta(microseconds=1) // _SPAN_US
        for bucket in [bucket for bucket in self._buckets if bucket < passed]:
            del self._buckets[bucket]
