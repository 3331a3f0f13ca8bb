"""The shared anomaly features on tiny frames, and the property the scorer relies on: a reading's features
computed from its lookback alone equal those computed from the whole archive."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from iotmon.schema import METRIC_NAMES
from ml.features import MIN_HISTORY, FeatureSpec, Judgements, device_features, metric_rows, reading_features
from tests.readings import at, silver_frame, silver_row

SPEC = FeatureSpec(history_s=20.0)


def _series(device: str, temperatures: list[float], every_s: float = 1.0, start_s: float = 0.0) -> list[dict]:
    """A device reporting every ``every_s``; temperature as given, other metrics gently noisy."""
    rng = np.random.default_rng(sum(map(ord, device)))
    return [
        silver_row(
            device,
            i + 1,
            start_s + i * every_s,
            temperature=float(t),
            humidity=round(float(40 + rng.normal(0, 0.5)), 2),
            vibration=round(float(2 + rng.normal(0, 0.1)), 2),
            pressure=round(float(101 + rng.normal(0, 0.2)), 2),
            battery=round(float(90 + rng.normal(0, 0.05)), 2),
        )
        for i, t in enumerate(temperatures)
    ]


def _noisy(n: int, seed: int = 1) -> list[float]:
    return [round(float(20 + x), 2) for x in np.random.default_rng(seed).normal(0, 0.3, n)]


def _temperature_features(spark: SparkSession, rows: list[dict]) -> dict[int, dict[str, float]]:
    featured = metric_rows(reading_features(silver_frame(spark, rows), SPEC)).where(F.col("metric") == "temperature")
    return {r["seq"]: r.asDict() for r in featured.collect()}


def test_a_spike_stands_out_in_level_and_step(spark: SparkSession) -> None:
    temperatures = _noisy(30)
    temperatures[25] = 35.0
    features = _temperature_features(spark, _series("dev-1", temperatures))
    spike = features.pop(26)
    assert spike["level"] > 20 and spike["step"] > 20
    # Every other reading, the ones after the spike too (the spike was suspect, so it is left out of
    # their history and of their step), is far below it.
    assert max(abs(f[name]) for f in features.values() for name in ("level", "step")) < spike["level"] / 3


def test_a_stuck_sensor_repeats_itself(spark: SparkSession) -> None:
    temperatures = _noisy(30)
    temperatures[20:30] = [temperatures[20]] * 10
    features = _temperature_features(spark, _series("dev-1", temperatures))
    assert [features[seq]["repeats"] for seq in (21, 22, 23, 24, 26, 30)] == [0, 1, 2, 3, 5, 5]
    assert all(features[seq]["repeats"] == 0 for seq in range(MIN_HISTORY + 2, 20))


def test_a_first_readings_and_a_return_from_silence_have_no_features_yet(spark: SparkSession) -> None:
    rows = _series("dev-1", _noisy(10)) + _series("dev-1", _noisy(10, seed=2), start_s=100.0)
    for i, row in enumerate(rows):
        row["seq"] = i + 1
    features = _temperature_features(spark, rows)
    quiet = {name: 0.0 for name in ("level", "step", "repeats", "spread")}
    for seq in (1, MIN_HISTORY, 11, 10 + MIN_HISTORY):  # too little history before these
        assert {k: features[seq][k] for k in quiet} == quiet
    assert features[MIN_HISTORY + 2]["spread"] > 0


def test_features_from_the_lookback_alone_equal_those_from_the_whole_archive(spark: SparkSession) -> None:
    """What makes the scorer's features the trainer's: the scorer only ever sees the lookback."""
    temperatures = _noisy(120)
    temperatures[60:70] = [temperatures[60]] * 10
    temperatures[90] = 40.0
    rows = _series("dev-1", temperatures, every_s=0.7) + _series("dev-2", _noisy(150, seed=3), every_s=0.5)
    archive = silver_frame(spark, rows)
    batch_start, batch_end = at(55), at(70)
    lookback = [r for r in rows if _lookback_start(batch_start) <= r["event_time"] <= batch_end]
    assert len(lookback) < len(rows)
    whole = _features_between(reading_features(archive, SPEC), batch_start, batch_end)
    # As the scorer asks: from the batch's first reading on, the rows before it being history only.
    scorer = _features_between(reading_features(silver_frame(spark, lookback), SPEC, since=batch_start))
    assert len(whole) > 40
    # Identical, not close: window sums never depend on how much earlier history was passed.
    assert scorer == whole


def test_the_lookback_reaches_the_reading_before_the_oldest_jump_a_feature_depends_on(spark: SparkSession) -> None:
    """The longest chain: a reading's features use whether each reading ``h`` in its history was suspect;
    that uses the jumps of the readings in ``h``'s own history, and a jump reaches back to the reading
    before it. So a jump at the far edge, made by a spike just before it, decides the first reading of a
    batch (the demo once scored a late reading against a context that missed such a spike)."""
    history = SPEC.history_s
    batch_start = 3 * history + 10.0
    temperatures = _noisy(int(batch_start) + 10)
    temperatures[int(batch_start - 2 * history - 1)] = 60.0  # the spike before the far edge's jump
    temperatures[int(batch_start - history)] = temperatures[int(batch_start - history)] + 3.0  # borderline
    rows = _series("dev-1", temperatures)
    lookback = [r for r in rows if _lookback_start(at(batch_start)) <= r["event_time"]]
    window = (at(batch_start), at(batch_start))
    whole = _features_between(reading_features(silver_frame(spark, rows), SPEC), *window)
    scorer = _features_between(reading_features(silver_frame(spark, lookback), SPEC, since=window[0]), *window)
    assert len(whole) == 1 and scorer == whole


def _lookback_start(first: dt.datetime) -> dt.datetime:
    """Where the scorer starts reading history for a batch beginning at ``first`` (a bucket boundary)."""
    start = SPEC.lookback_start(first)
    assert (
        first - dt.timedelta(seconds=SPEC.lookback_s + SPEC.history_s)
        < start
        <= first - dt.timedelta(seconds=SPEC.lookback_s)
    )
    return start


def _features_between(featured: DataFrame, start: dt.datetime | None = None, end: dt.datetime | None = None) -> dict:
    """Features by reading key, of the readings between ``start`` and ``end`` (all when not given)."""
    if start is not None and end is not None:
        featured = featured.where(F.col("event_time").between(start, end))
    rows = featured.collect()
    return {(r["device_id"], r["seq"]): {m: r[f"f_{m}"].asDict() for m in METRIC_NAMES} for r in rows}


@pytest.mark.parametrize("history", [0.0, -5.0])
def test_feature_spec_needs_a_positive_history(history: float) -> None:
    with pytest.raises(ValueError, match="history"):
        FeatureSpec(history_s=history)


def test_late_readings_and_the_last_settle_seconds_are_not_history(spark: SparkSession) -> None:
    """A late reading may reach the scorer after the readings it precedes were scored, so no reading's
    features may depend on it; neither on readings just before it, which may still be on their way."""
    temperatures = _noisy(60)
    rows = _series("dev-1", temperatures, every_s=0.5)
    late = [dict(row, lateness="late", temperature=row["temperature"] + 7.0) for row in rows[20:40:3]]
    on_time = [row for row in rows if row not in rows[20:40:3]]
    with_late = _temperature_features(spark, on_time + late)
    without = _temperature_features(spark, on_time)
    assert {seq: with_late[seq] for seq in without} == without
    # A reading's own value is still judged: the late ones stand out against their (on-time) history.
    assert min(abs(with_late[row["seq"]]["level"]) for row in late) > 5
    # Nor on the readings of its last settle_s, which may still be on their way when it is scored.
    target = rows[50]["seq"]
    recent = [row for row in on_time if 0 < (rows[50]["event_time"] - row["event_time"]).total_seconds() < 1.0]
    assert recent
    trimmed = _temperature_features(spark, [row for row in on_time if row not in recent])
    assert trimmed[target] == without[target]


def test_a_device_with_no_on_time_reading_has_no_history_and_quiet_features(spark: SparkSession) -> None:
    # All of a device's readings late (e.g. a batch of readings Kafka delivered after a long outage): nothing
    # is history, so every feature is that of a first reading.
    rows = [dict(row, lateness="late") for row in _series("dev-1", _noisy(12))]
    features = _temperature_features(spark, rows)
    quiet = {name: 0.0 for name in ("level", "step", "repeats", "spread")}
    assert sorted(features) == list(range(1, 13))
    assert all({k: f[k] for k in quiet} == quiet for f in features.values())


def test_the_features_of_some_readings_are_those_of_the_whole_computation() -> None:
    """The scorer asks only for its batch's features (``wanted``), and passes what it judged in earlier batches:
    the suspicion and the jumps it then leaves out, or takes as known, must be those no wanted window needs
    anew, for any readings wanted, bit for bit; and what it judges must be what the whole computation does."""
    rng = np.random.default_rng(5)
    n = 400
    event_us = np.sort(rng.integers(0, 200_000_000, n))  # 200 s: ten buckets of SPEC's 20 s history
    values = np.round(rng.normal(20.0, 0.3, (n, len(METRIC_NAMES))), 2)
    values[100:112, 0] = values[100, 0]  # stuck
    values[[150, 151, 260], 1] = 60.0  # spikes, one at a bucket's edge
    values[300:330, 2] += 5.0  # a shift
    some_late = rng.random(n) > 0.05  # late readings are context, never history
    silent_after = some_late & (event_us < 100_000_000)  # from 100 s on, only late readings arrive
    for on_time in (some_late, silent_after):
        judged = Judgements.none(n, len(METRIC_NAMES))
        whole = device_features(event_us, values, on_time, SPEC, judgements=judged)
        assert judged.judged[on_time].all() and judged.jumped[on_time].all()
        for first in [1, 37, 99, 150, 151, 200, 261, 350, 399]:
            wanted = np.arange(first, n)
            assert np.array_equal(device_features(event_us, values, on_time, SPEC, wanted), whole[first:])
            # As the scorer asks: the readings before the batch judged earlier, its own not yet.
            kept = _judged_before(judged, first)
            assert np.array_equal(device_features(event_us, values, on_time, SPEC, wanted, kept), whole[first:])
            computed = kept.judged & on_time
            assert np.array_equal(kept.suspect[computed], judged.suspect[computed])
            assert np.array_equal(kept.jumps[kept.jumped], judged.jumps[kept.jumped], equal_nan=True)
        # A batch with late readings: a few readings scattered among others that are context only.
        for wanted in [np.array([37, 150, 151, 399]), np.sort(rng.choice(n, 40, replace=False)), np.array([260])]:
            assert np.array_equal(device_features(event_us, values, on_time, SPEC, wanted), whole[wanted])
            kept = _judged_before(judged, int(wanted[0]))
            assert np.array_equal(device_features(event_us, values, on_time, SPEC, wanted, kept), whole[wanted])
        assert device_features(event_us, values, on_time, SPEC, np.arange(0)).shape == (0, len(METRIC_NAMES), 4)


def _judged_before(judged: Judgements, first: int) -> Judgements:
    """A copy of ``judged`` that knows only the readings before ``first``."""
    kept = Judgements(judged.jumps.copy(), judged.suspect.copy(), judged.jumped.copy(), judged.judged.copy())
    kept.jumps[first:], kept.suspect[first:], kept.jumped[first:], kept.judged[first:] = np.nan, False, False, False
    return kept
