"""The event-time clock's decisions, from progress reports: tick only when idle, from the newest reading."""

from __future__ import annotations

import datetime as dt
import threading
import time
from types import SimpleNamespace

from pyspark.sql import Row

from iotmon.config import Settings
from streaming.jobs import EventClock
from streaming.sources import ARRIVALS


def _progress(batch: int, readings: int, newest: str | None) -> dict:
    event_time = {"max": newest} if newest else {}
    return {"batchId": batch, "observedMetrics": {ARRIVALS: Row(readings=readings)}, "eventTime": event_time}


def _clock() -> EventClock:
    return EventClock(None, Settings.from_env({}, idle_tick_after="30 seconds"), threading.Event())  # type: ignore[arg-type]


def test_no_tick_before_any_reading_or_while_readings_flow() -> None:
    clock = _clock()
    assert clock.tick_time() is None
    clock.observe(SimpleNamespace(recentProgress=[_progress(0, 10, "2026-11-20T08:00:00.000Z")]))
    assert clock.last_event_time == dt.datetime(2026, 11, 20, 8, 0, tzinfo=dt.UTC)
    assert clock.tick_time() is None  # readings arrived just now


def test_ticks_advance_from_the_newest_reading_at_wall_pace_once_idle() -> None:
    clock = _clock()
    clock.observe(SimpleNamespace(recentProgress=[_progress(0, 10, "2026-11-20T08:00:00.000Z")]))
    clock.last_reading_at = time.monotonic() - 45
    tick = clock.tick_time()
    assert tick is not None
    assert dt.timedelta(seconds=45) <= tick - clock.last_event_time < dt.timedelta(seconds=46)


def test_batches_of_ticks_alone_do_not_count_as_readings() -> None:
    clock = _clock()
    clock.observe(SimpleNamespace(recentProgress=[_progress(0, 10, "2026-11-20T08:00:00.000Z")]))
    clock.last_reading_at = idle_since = time.monotonic() - 45
    tick_batch = _progress(1, 0, "2026-11-20T08:00:45.000Z")
    clock.observe(SimpleNamespace(recentProgress=[_progress(0, 10, "2026-11-20T08:00:00.000Z"), tick_batch]))
    assert clock.last_reading_at == idle_since
    assert clock.last_event_time == dt.datetime(2026, 11, 20, 8, 0, tzinfo=dt.UTC)
