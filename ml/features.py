"""Anomaly features: one set of DataFrame functions for the batch trainer and the streaming scorer.

Every feature of a reading is a function of that reading and of its device's readings in the
``history`` seconds before it (``IOTMON_FEATURE_HISTORY``) and nothing else. That bound is what lets
the two paths agree exactly: the trainer applies ``reading_features`` to the whole archive, the scorer
to a micro-batch plus the silver rows of the same devices in the ``history`` before the batch's first
reading; a reading's frame holds the same rows either way, so its features are the same.

Features are per metric and scale-free, each metric measured against its device's own recent noise, so
one model serves every metric of every device type (per-device normalisation rather than per-type):

* ``level``: distance of the value from the mean of the history, in history standard deviations
  (spikes, drifts, level shifts);
* ``step``: the jump from the latest unsuspected reading, in the same unit (spikes, the edges of episodes);
* ``repeats``: how many of the previous readings (up to ``REPEAT_DEPTH``) repeat the value exactly: a
  live sensor's noise does not repeat itself, a stuck one does;
* ``spread``: the standard deviation of the last ``SPREAD_DEPTH`` readings against the history's (noise
  bursts).

The model sees one row per (reading, metric) with the four features, so it learns what a normal metric
looks like; a reading's score is its most anomalous metric's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from iotmon.config import Settings, interval_seconds
from iotmon.schema import DEVICE_ID, EVENT_TIME, METRIC_NAMES, SEQ

FEATURE_COLUMNS: tuple[str, ...] = ("level", "step", "repeats", "spread")
REPEAT_DEPTH = 5
SPREAD_DEPTH = 5
SUSPECT_AT = 4.0
"""Noise multiples from the history's mean (or from the previous reading) that make a reading suspect."""
SUSPECT_REPEATS = 2
MIN_HISTORY = 5
"""Reading-to-reading changes a history needs before its noise estimate is trusted."""
RESOLUTION = 0.01
"""Smallest difference a reading can show (the simulator sends two decimals); the floor of the noise."""
_MICROS = "_event_us"


@dataclass(frozen=True)
class FeatureSpec:
    history_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.history_s > 0:
            raise ValueError(f"feature history must be positive, not {self.history_s}")

    @property
    def lookback_s(self) -> float:
        """History a reading's features depend on: its own, and that of the readings in it (suspicion)."""
        return 2 * self.history_s

    @classmethod
    def from_settings(cls, settings: Settings) -> FeatureSpec:
        return cls(interval_seconds(settings.feature_history))


def _previous_column(metric: str, lag: int) -> str:
    return f"_{metric}_{lag}"


def _with_previous(readings: DataFrame, spec: FeatureSpec) -> DataFrame:
    """Add each metric's previous values, ``_<metric>_<k>`` for k readings back, when within the history
    (else null: the scorer would not see them either)."""
    device = Window.partitionBy(DEVICE_ID).orderBy(_MICROS, SEQ)
    depth = max(REPEAT_DEPTH, SPREAD_DEPTH - 1)
    limit = int(spec.history_s * 1_000_000)
    columns = {}
    for lag in range(1, depth + 1):
        in_history = (F.col(_MICROS) - F.lag(_MICROS, lag).over(device)) <= limit
        for metric in METRIC_NAMES:
            columns[_previous_column(metric, lag)] = F.when(in_history, F.lag(metric, lag).over(device))
    return readings.withColumns(columns)


def _history_stats(value: Column, jump: Column, history: Window) -> tuple[Column, Column, Column]:
    """Mean, noise and whether enough is known, from a history's values and reading-to-reading changes.

    Noise comes from the changes, not the spread: a slow trend (daily cycle, a drifting sensor) does not
    inflate it. For white noise E|x_t - x_t-1| = 2 sigma / sqrt(pi).
    """
    noise = F.greatest(F.avg(jump).over(history) * (math.sqrt(math.pi) / 2), F.lit(RESOLUTION))
    return F.avg(value).over(history), noise, F.count(jump).over(history) >= MIN_HISTORY


def _first_pass(metric: str, history: Window) -> dict[str, Column]:
    """Per metric: the jump from the previous reading, the run of exact repeats, and whether the reading
    is suspect against its plain history (far from its mean, a big jump, or repeating itself)."""
    value, previous = F.col(metric), F.col(_previous_column(metric, 1))
    jump = F.abs(value - previous)
    mean, noise, known = _history_stats(value, jump, history)
    # Consecutive exact repeats: the run stops at the first differing (or missing) previous value.
    repeats, run = F.lit(0), F.lit(1)
    for lag in range(1, REPEAT_DEPTH + 1):
        run = run * F.coalesce((F.col(_previous_column(metric, lag)) == value).cast("int"), F.lit(0))
        repeats = repeats + run
    suspect = known & (
        (F.abs(value - mean) > SUSPECT_AT * noise) | (jump > SUSPECT_AT * noise) | (repeats >= SUSPECT_REPEATS)
    )
    return {
        f"_{metric}_jump": jump,
        f"_{metric}_repeats": repeats.cast("double"),
        f"_{metric}_suspect": F.coalesce(suspect, F.lit(False)),
    }


def _metric_features(metric: str, history: Window) -> Column:
    """The four features against the history's unsuspected readings, so that an anomaly neither hides
    itself (a drift dragging its own baseline) nor haunts the readings after it."""
    value, suspect = F.col(metric), F.col(f"_{metric}_suspect")
    jump = F.col(f"_{metric}_jump")
    mean, noise, known = _history_stats(F.when(~suspect, value), F.when(~suspect, jump), history)
    plain_mean, plain_noise, plain_known = _history_stats(value, jump, history)
    # A history made only of suspects (deep inside a long episode) falls back to the plain one.
    mean, noise = F.when(known, mean).otherwise(plain_mean), F.when(known, noise).otherwise(plain_noise)
    recent = F.filter(
        F.array(value, *[F.col(_previous_column(metric, lag)) for lag in range(1, SPREAD_DEPTH)]),
        lambda v: v.isNotNull(),
    )
    recent_mean = F.aggregate(recent, F.lit(0.0), lambda acc, v: acc + v) / F.size(recent)
    squares = F.aggregate(recent, F.lit(0.0), lambda acc, v: acc + (v - recent_mean) * (v - recent_mean))
    spread = F.sqrt(squares / F.greatest(F.size(recent) - 1, F.lit(1)))
    features = {
        "level": (value - mean) / noise,
        # From the latest unsuspected reading, so the return from a spike is not a second spike.
        "step": (value - F.coalesce(F.last(F.when(~suspect, value), ignorenulls=True).over(history), value)) / noise,
        "repeats": F.col(f"_{metric}_repeats"),
        "spread": spread / noise,
    }
    # Too short a history (a device's first readings, the return from a dropout) says nothing yet.
    return F.struct(
        *[F.when(plain_known, features[name]).otherwise(F.lit(0.0)).alias(name) for name in FEATURE_COLUMNS]
    )


def reading_features(readings: DataFrame, spec: FeatureSpec) -> DataFrame:
    """Silver readings with one struct column of features per metric (``f_<metric>``), same rows.

    ``readings`` must hold, for each reading to be featurised, its device's readings in the
    ``spec.lookback_s`` before it (the scorer adds them; the archive has them).
    """
    history = Window.partitionBy(DEVICE_ID).orderBy(_MICROS).rangeBetween(-int(spec.history_s * 1_000_000), -1)
    with_previous = _with_previous(readings.withColumn(_MICROS, F.unix_micros(EVENT_TIME)), spec)
    first = with_previous.withColumns({k: v for m in METRIC_NAMES for k, v in _first_pass(m, history).items()})
    features = {f"f_{m}": _metric_features(m, history) for m in METRIC_NAMES}
    helpers = [c for c in first.columns if c not in readings.columns]
    return first.withColumns(features).drop(*helpers)


def metric_rows(featured: DataFrame, keep: tuple[str, ...] = ()) -> DataFrame:
    """One row per (reading, metric): the reading key, ``keep`` columns, ``metric`` and the four features."""
    per_metric = F.explode(
        F.array(*[F.struct(F.lit(m).alias("metric"), F.col(f"f_{m}.*")) for m in METRIC_NAMES])
    ).alias("_m")
    return featured.select(DEVICE_ID, SEQ, EVENT_TIME, *keep, per_metric).select(
        DEVICE_ID, SEQ, EVENT_TIME, *keep, "_m.metric", *[F.col(f"_m.{c}").alias(c) for c in FEATURE_COLUMNS]
    )


def model_inputs(rows: DataFrame) -> DataFrame:
    """The features as the model sees them: magnitudes, log-compressed so that no single extreme dominates."""
    return rows.select("*", *[F.log1p(F.abs(F.col(c))).alias(f"x_{c}") for c in FEATURE_COLUMNS])


MODEL_INPUT_COLUMNS: tuple[str, ...] = tuple(f"x_{c}" for c in FEATURE_COLUMNS)
