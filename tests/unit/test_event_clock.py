"""The event-time clock's decisions: tick only when the source has nothing unread, after the newest reading."""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from dataclasses import replace
from types import SimpleNamespace

from iotmon.config import Settings
from iotmon.schema import ANOMALIES, INGEST, SILVER
from pipeline.clock import EventClock, Observed, delta_end, kafka_end, ticks_due

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


def _query(name: str, *reports: dict) -> SimpleNamespace:
    """A query whose recent reports are ``reports``, the last one last."""
    return SimpleNamespace(name=name, lastProgress=reports[-1], recentProgress=list(reports))


def test_the_clock_reads_idleness_from_the_ingest_query_and_completeness_from_table_versions() -> None:
    ingest = {
        "batchId": 3,
        "numInputRows": 0,
        "eventTime": {"max": "2026-11-20T08:00:00.000Z"},
        "sources": [{"endOffset": {"t": {"0": 10, "1": 4}}}],
    }
    scorer = {"batchId": 2, "sources": [{"endOffset": {"reservoirVersion": 8, "index": -1}}]}
    spark = SimpleNamespace(streams=SimpleNamespace(active=[_query(INGEST, ingest), _query(ANOMALIES, scorer)]))
    clock = EventClock(spark, Settings.from_env({}), threading.Event())
    clock.last_record_at = time.monotonic() - 40
    versions = {SILVER: 9}
    observed = clock.observe(lambda: {0: 10, 1: 4}, versions.__getitem__)
    assert observed.kafka_unread == 0 and observed.newest_event == NEWEST and observed.idle_s >= 40
    assert observed.complete == {SILVER: True, ANOMALIES: False}  # the scorer read silver up to 8 of 9
    assert clock.observe(lambda: {0: 12, 1: 4}, versions.__getitem__).kafka_unread == 2

    def broker_down() -> dict[int, int]:
        raise ConnectionError("broker down")

    assert clock.observe(broker_down, versions.__getitem__).kafka_unread is None
    # A batch that read records resets the idle time.
    ingest.update(batchId=4, numInputRows=5)
    assert clock.observe(lambda: {0: 10, 1: 4}, versions.__getitem__).idle_s < 1.0
    # A batch without readings (Spark runs one to move the watermark on) reports no newest event time: the
    # clock keeps the one it saw.
    ingest.update(batchId=5, numInputRows=0, eventTime={"watermark": "2026-11-20T07:59:55.000Z"})
    assert clock.observe(lambda: {0: 10, 1: 4}, versions.__getitem__).newest_event == NEWEST


def test_the_clock_sees_a_batch_of_readings_that_another_batch_followed_between_two_rounds() -> None:
    # The ingest query's only batch of readings, then at once one without readings (its watermark moved): the
    # clock's round sees the second as the last report, and must still learn the newest event time from the
    # first, or it would never tick and the fleet's last windows would wait for readings forever.
    readings = {"batchId": 0, "numInputRows": 3062, "eventTime": {"max": "2026-11-20T08:00:00.000Z"}}
    watermark_only = {"batchId": 1, "numInputRows": 0, "eventTime": {"watermark": "2026-11-20T07:59:55.000Z"}}
    for report in (readings, watermark_only):
        report["sources"] = [{"endOffset": {"t": {"0": 3062}}}]
    spark = SimpleNamespace(streams=SimpleNamespace(active=[_query(INGEST, readings, watermark_only)]))
    clock = EventClock(spark, Settings.from_env({}), threading.Event())
    observed = clock.observe(lambda: {0: 3062}, {SILVER: 1}.__getitem__)
    assert observed.newest_event == NEWEST and observed.kafka_unread == 0
    assert ticks_due(replace(observed, idle_s=60.0), 2.0)[SILVER] == NEWEST + dt.timedelta(seconds=60)
