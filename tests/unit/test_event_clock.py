"""The event-time clock's decisions: tick only when the source has nothing unread, after the newest reading."""

from __future__ import annotations

import datetime as dt
import io
import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
from deltalake import write_deltalake

from iotmon.config import Settings
from iotmon.schema import ANOMALIES, EVENT_TIME, INGEST, SILVER, STREAM_CLOCK
from pipeline.clock import EventClock, Observed, delta_end, kafka_end, resumed_event_time, ticks_due

NEWEST = dt.datetime(2026, 11, 20, 8, 0, tzinfo=dt.UTC)


def _observed(**changes) -> Observed:
    base = {"kafka_unread": 0, "newest_event": NEWEST, "idle_s": 45.0, "complete": {SILVER: True, ANOMALIES: True}}
    return Observed(**{**base, **changes})


def test_a_tick_follows_the_newest_reading_at_wall_pace_once_the_source_is_idle() -> None:
    due = ticks_due(_observed(), idle_after_s=30.0)
    assert due == {SILVER: NEWEST + dt.timedelta(seconds=45), ANOMALIES: NEWEST + dt.timedelta(seconds=45)}


def test_no_tick_while_kafka_holds_unread_records_or_cannot_be_asked() -> None:
    """A stalled or restarted upstream looks idle downstream; at the source it does not."""
    assert ticks_due(_observed(kafka_unread=3), idle_after_s=30.0) == {}
    assert ticks_due(_observed(kafka_unread=None), idle_after_s=30.0) == {}


def test_no_tick_before_the_idle_time_or_before_any_reading() -> None:
    assert ticks_due(_observed(idle_s=29.0), idle_after_s=30.0) == {}
    assert ticks_due(_observed(newest_event=None), idle_after_s=30.0) == {}


def test_a_table_behind_its_source_gets_no_tick() -> None:
    """The scorer has not scored all of silver: alerts must not see time move past what it will still write."""
    assert ticks_due(_observed(complete={SILVER: True, ANOMALIES: False}), idle_after_s=30.0).keys() == {SILVER}


def test_offsets_read_from_progress_reports() -> None:
    delta = {"sources": [{"endOffset": json.dumps({"reservoirVersion": 7, "index": -1, "isStartingVersion": False})}]}
    assert delta_end(delta) == 7
    kafka = {"sources": [{"endOffset": {"topic": {"0": 10, "1": 4}}}]}
    assert kafka_end(kafka) == {0: 10, 1: 4} and kafka_end(None) == {} and delta_end(None) is None


def _clock() -> EventClock:
    """A clock fed by hand, in a session without queries to ask."""
    return EventClock(SimpleNamespace(streams=SimpleNamespace(active=[])), Settings.from_env({}), threading.Event())


def _not_asked(*_: object) -> dict[int, int]:
    raise AssertionError("asked while readings were arriving")


def test_the_clock_reads_idleness_from_the_ingest_reports_and_completeness_from_table_versions() -> None:
    ingest = {
        "name": INGEST,
        "batchId": 3,
        "numInputRows": 0,
        "eventTime": {"max": "2026-11-20T08:00:00.000Z"},
        "sources": [{"endOffset": {"t": {"0": 10, "1": 4}}}],
    }
    scorer = {"name": ANOMALIES, "batchId": 2, "sources": [{"endOffset": {"reservoirVersion": 8, "index": -1}}]}
    clock = _clock()
    for report in (ingest, scorer, {"name": "device_status", "batchId": 9, "numInputRows": 50}):
        clock.progressed(report)
    clock.last_record_at = time.monotonic() - 40
    versions = {SILVER: 9}
    observed = clock.observe(lambda: {0: 10, 1: 4}, versions.__getitem__)
    assert observed.kafka_unread == 0 and observed.newest_event == NEWEST and observed.idle_s >= 40
    assert observed.complete == {SILVER: True, ANOMALIES: False}  # the scorer read silver up to 8 of 9
    assert clock.observe(lambda: {0: 12, 1: 4}, versions.__getitem__).kafka_unread == 2

    def broker_down() -> dict[int, int]:
        raise ConnectionError("broker down")

    assert clock.observe(broker_down, versions.__getitem__).kafka_unread is None
    # A batch that read records resets the idle time; while records arrive, neither Kafka nor a table's log is
    # asked (a round every trigger interval of a live fleet), and no tick is due.
    clock.progressed({**ingest, "batchId": 4, "numInputRows": 5})
    observed = clock.observe(_not_asked, _not_asked)
    assert observed.idle_s < 1.0 and observed.kafka_unread is None and ticks_due(observed, 30.0) == {}
    # A batch without readings (Spark runs one to move the watermark on) reports no newest event time: the
    # clock keeps the one it saw.
    clock.progressed({**ingest, "batchId": 5, "numInputRows": 0, "eventTime": {"watermark": "2026-11-20T07:59:55Z"}})
    assert clock.observe(_not_asked, _not_asked).newest_event == NEWEST


def test_a_tick_follows_a_batch_of_readings_that_a_batch_without_readings_followed() -> None:
    # The ingest query's only batch of readings, then at once one without readings (its watermark moved): the
    # last report has no event time, and the clock must still tick after the first's, or it would never tick
    # and the fleet's last windows would wait for readings forever.
    readings = {"batchId": 0, "numInputRows": 3062, "eventTime": {"max": "2026-11-20T08:00:00.000Z"}}
    watermark_only = {"batchId": 1, "numInputRows": 0, "eventTime": {"watermark": "2026-11-20T07:59:55.000Z"}}
    clock = _clock()
    for report in (readings, watermark_only):
        clock.progressed({**report, "name": INGEST, "sources": [{"endOffset": {"t": {"0": 3062}}}]})
    clock.last_record_at = time.monotonic() - 60
    observed = clock.observe(lambda: {0: 3062}, {SILVER: 1}.__getitem__)
    assert observed.newest_event == NEWEST and observed.kafka_unread == 0
    assert ticks_due(replace(observed, idle_s=60.0), 2.0)[SILVER] == NEWEST + dt.timedelta(seconds=60)


def test_a_restarted_clock_resumes_where_event_time_stood(tmp_path: Path) -> None:
    """Restarted while the fleet is silent, the clock ticks on from the newest reading or tick in the lake; from
    nothing it would wait for a reading that may never come."""
    settings = Settings.from_env({"IOTMON_HOME": str(tmp_path)})
    assert resumed_event_time(settings) is None  # a new lake
    times = [NEWEST - dt.timedelta(minutes=2), NEWEST - dt.timedelta(minutes=1)]
    write_deltalake(settings.table_path(SILVER), pa.table({"device_id": ["d1", "d2"], EVENT_TIME: times}))
    assert resumed_event_time(settings) == NEWEST - dt.timedelta(minutes=1)
    ticks = pa.table({EVENT_TIME: [NEWEST], "follows": [SILVER]})
    write_deltalake(settings.table_path(STREAM_CLOCK), ticks)
    assert resumed_event_time(settings) == NEWEST


def test_a_query_that_reported_nothing_since_the_clock_started_is_asked_once_the_source_is_idle() -> None:
    # A stream restarted on a source with nothing new runs no batch, so the bus hands over no report: the
    # ingest query's own last progress (an idle trigger's) still says what it has read.
    idle = {"name": INGEST, "batchId": 7, "numInputRows": 0, "sources": [{"endOffset": {"t": {"0": 3062}}}]}
    asked: list[str] = []

    class Query(SimpleNamespace):
        @property
        def lastProgress(self) -> dict:
            asked.append(self.name)
            return idle

    spark = SimpleNamespace(streams=SimpleNamespace(active=[Query(name=INGEST)]))
    clock = EventClock(spark, Settings.from_env({}), threading.Event())
    clock.newest_event = NEWEST  # as resumed at its start
    assert clock.observe(_not_asked, _not_asked).kafka_unread is None and asked == []  # not idle long enough yet
    clock.last_record_at = time.monotonic() - 45
    observed = clock.observe(lambda: {0: 3062}, {SILVER: 1}.__getitem__)
    assert asked == [INGEST] and observed.kafka_unread == 0 and observed.complete == {SILVER: True, ANOMALIES: False}
    assert ticks_due(observed, 30.0).keys() == {SILVER}


def test_a_clock_that_cannot_read_where_event_time_stood_says_so_and_still_runs(tmp_path: Path) -> None:
    settings = Settings.from_env({"IOTMON_HOME": str(tmp_path)})
    log = Path(settings.table_path(SILVER)) / "_delta_log"
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("not a Delta log\n")
    listening: list[object] = []
    streams = SimpleNamespace(active=[], addListener=listening.append, removeListener=listening.remove)
    out, stop = io.StringIO(), threading.Event()
    stop.set()  # its thread ends at once, and stops listening
    clock = EventClock(SimpleNamespace(streams=streams), settings, stop, out)
    clock.start()
    clock.join(10)
    assert clock.newest_event is None and not clock.is_alive() and listening == []
    assert "cannot tell where event time stood" in out.getvalue()
