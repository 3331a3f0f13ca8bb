"""When the periodic trainer trains, and when it waits (decided from silver's extent, without Spark)."""

from __future__ import annotations

from datetime import datetime, timedelta

from ml.features import FeatureSpec
from ml.train import MIN_READINGS, MIN_SPAN_HISTORIES, ArchiveExtent, reason_to_wait

SPEC = FeatureSpec(10.0)
START = datetime(2026, 1, 1)


def extent(version: int, readings: int, span_s: float) -> ArchiveExtent:
    return ArchiveExtent(version, readings, START, START + timedelta(seconds=span_s))


def test_an_archive_trains_once_it_spans_enough_histories_with_enough_readings() -> None:
    enough_span = MIN_SPAN_HISTORIES * SPEC.history_s
    assert reason_to_wait(extent(3, MIN_READINGS, enough_span), SPEC, trained_on=None) is None
    short = reason_to_wait(extent(3, MIN_READINGS, enough_span - 1), SPEC, trained_on=None)
    assert short and f"over {enough_span:.0f}s" in short
    sparse = reason_to_wait(extent(3, MIN_READINGS - 1, enough_span), SPEC, trained_on=None)
    assert sparse and f"needs {MIN_READINGS:,}" in sparse
    assert reason_to_wait(ArchiveExtent(0, 0, None, None), SPEC, trained_on=None)
    assert reason_to_wait(None, SPEC, trained_on=None) == "no silver table yet"


def test_a_periodic_trainer_waits_while_silver_has_not_changed_since_its_last_run() -> None:
    ready = extent(7, 10 * MIN_READINGS, 10 * SPEC.history_s)
    assert reason_to_wait(ready, SPEC, trained_on=7) == "silver v7 has not changed since the last run"
    assert reason_to_wait(ready, SPEC, trained_on=6) is None
