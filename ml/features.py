"""Anomaly features: one set of DataFrame functions for the batch trainer and the streaming scorer.

A reading's features depend on its device's readings in the ``history`` before it
(``IOTMON_FEATURE_HISTORY``), and on whether *those* readings looked suspect against their own history,
which uses the jump of each reading in it from the reading before: so on at most ``lookback = 3 x
history`` of the device's past, and on nothing else. That bound is what
lets the two paths agree exactly: the trainer applies ``reading_features`` to the whole archive, the
scorer to a micro-batch plus the silver rows of the same devices in the lookback before the batch's
first reading; each reading sees the same rows either way, so its features are the same.

Features are per metric and scale-free, each metric measured against its device's own recent noise
(estimated from reading-to-reading changes, which a slow trend does not inflate), so one model serves
every metric of every device type:

* ``level``: distance of the value from the history's mean, in noise units (spikes, drifts, shifts);
* ``step``: the jump from the latest unsuspected reading, in the same unit (spikes, episode edges);
* ``repeats``: how many of the previous readings (up to ``REPEAT_DEPTH``) repeat the value exactly: a
  live sensor's noise does not repeat itself, a stuck one does;
* ``spread``: the spread of the last ``SPREAD_DEPTH`` readings, in noise units (noise bursts).

The history's mean and noise leave out readings that were *suspect* against a plain history (more than
``SUSPECT_AT`` noise units off, or repeating): otherwise a drift drags its own baseline along and stays
invisible, and the readings after any anomaly are measured against a polluted history and look anomalous
themselves. The model sees one row per (reading, metric), so it learns what a normal metric looks like;
a reading's score is its most anomalous metric's.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from iotmon.config import Settings, interval_seconds
from iotmon.schema import DEVICE_ID, EVENT_TIME, LATENESS, METRIC_NAMES, ON_TIME, SEQ

FEATURE_VERSION = 2
"""Bumped whenever the features change meaning: a model trained on other features is not served."""
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
PREVIOUS_ROWS = 16
"""Rows looked back through for the previous values: enough for devices reporting up to 16 times within
the settle time."""
_MICROS, _ON_TIME = "_event_us", "_on_time"


@dataclass(frozen=True)
class FeatureSpec:
    history_s: float = 60.0
    settle_s: float = 1.0
    """Readings of the last ``settle_s`` before a reading, and late ones, are not in its history: an
    on-time reading older than that had reached Kafka before it, so the scorer always has it too."""

    def __post_init__(self) -> None:
        if not self.history_s > self.settle_s >= 0:
            raise ValueError(f"feature history must exceed the settle time, not {self.history_s} / {self.settle_s}")

    @property
    def lookback_s(self) -> float:
        """History a reading's features depend on: its own, that of the readings in it (suspicion), and
        the reading before each of *those* (their jumps)."""
        return 3 * self.history_s

    @classmethod
    def from_settings(cls, settings: Settings) -> FeatureSpec:
        return cls(interval_seconds(settings.feature_history), interval_seconds(settings.late_after))


def _previous_column(metric: str, lag: int) -> str:
    return f"_{metric}_{lag}"


def _with_previous(readings: DataFrame, spec: FeatureSpec) -> DataFrame:
    """Add each metric's previous values in the history, ``_<metric>_<k>`` for the k-th latest (null when
    there is none): the latest on-time readings at least ``settle_s`` and at most ``history_s`` older."""
    # Ascending, like the history window, so one sort serves both; the list is reversed to newest first.
    before = Window.partitionBy(DEVICE_ID).orderBy(_MICROS, SEQ).rowsBetween(-PREVIOUS_ROWS, -1)
    now = F.col(_MICROS)
    earlier = F.collect_list(F.struct(F.col(_MICROS).alias("us"), F.col(_ON_TIME).alias("ok"), *METRIC_NAMES))
    candidates = F.filter(
        F.reverse(earlier.over(before)),
        lambda r: (
            r["ok"]
            & (r["us"] <= now - int(spec.settle_s * 1_000_000))
            & (r["us"] > now - int(spec.history_s * 1_000_000))
        ),
    )
    depth = max(REPEAT_DEPTH, SPREAD_DEPTH - 1)
    with_candidates = readings.withColumn("_previous", candidates)
    columns = {
        _previous_column(metric, lag): F.try_element_at("_previous", F.lit(lag))[metric]
        for lag in range(1, depth + 1)
        for metric in METRIC_NAMES
    }
    return with_candidates.withColumns(columns).drop("_previous")


def _history_stats(value: Column, jump: Column, history: Window) -> tuple[Column, Column, Column]:
    """Mean, noise and whether enough is known, from a history's values and reading-to-reading changes.

    Noise comes from the changes, not the spread: a slow trend (daily cycle, a drifting sensor) does not
    inflate it. For white noise E|x_t - x_t-1| = 2 sigma / sqrt(pi).
    """
    noise = F.greatest(F.avg(jump).over(history) * (math.sqrt(math.pi) / 2), F.lit(RESOLUTION))
    return F.avg(value).over(history), noise, F.count(jump).over(history) >= MIN_HISTORY


def _first_pass(metric: str, history: Window) -> dict[str, Column]:
    """Per metric: the jump from the previous reading, the run of exact repeats, the plain history's
    statistics (kept for the second pass), and whether the reading is suspect against them (far from the
    mean, a big jump, or repeating itself)."""
    value, previous, on_time = F.col(metric), F.col(_previous_column(metric, 1)), F.col(_ON_TIME)
    jump = F.abs(value - previous)
    mean, noise, known = _history_stats(F.when(on_time, value), F.when(on_time, jump), history)
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
        f"_{metric}_plain_mean": mean,
        f"_{metric}_plain_noise": noise,
        f"_{metric}_plain_known": known,
        f"_{metric}_clean": on_time & ~F.coalesce(suspect, F.lit(False)),
    }


def _spread(values: list[Column]) -> Column:
    """Sample standard deviation of the non-null ``values``, as plain column arithmetic: array lambdas
    get no generated code and are interpreted row by row."""
    count, total, squares = F.lit(0), F.lit(0.0), F.lit(0.0)
    for v in values:
        count, total = count + v.isNotNull().cast("int"), total + F.coalesce(v, F.lit(0.0))
    mean = total / count
    for v in values:
        squares = squares + F.coalesce((v - mean) * (v - mean), F.lit(0.0))
    return F.sqrt(squares / F.greatest(count - 1, F.lit(1)))


def _metric_features(metric: str, history: Window) -> Column:
    """The four features against the history's unsuspected readings, so that an anomaly neither hides
    itself (a drift dragging its own baseline) nor haunts the readings after it."""
    value, clean = F.col(metric), F.col(f"_{metric}_clean")
    jump = F.col(f"_{metric}_jump")
    mean, noise, known = _history_stats(F.when(clean, value), F.when(clean, jump), history)
    plain_mean, plain_noise, plain_known = (F.col(f"_{metric}_plain_{stat}") for stat in ("mean", "noise", "known"))
    # A history made only of suspects (deep inside a long episode) falls back to the plain one.
    mean, noise = F.when(known, mean).otherwise(plain_mean), F.when(known, noise).otherwise(plain_noise)
    spread = _spread([value, *[F.col(_previous_column(metric, lag)) for lag in range(1, SPREAD_DEPTH)]])
    # From the latest unsuspected reading, so the return from a spike is not a second spike.
    last_clean = F.last(F.when(clean, value), ignorenulls=True).over(history)
    features = {
        "level": (value - mean) / noise,
        "step": (value - F.coalesce(last_clean, value)) / noise,
        "repeats": F.col(f"_{metric}_repeats"),
        "spread": spread / noise,
    }
    # Too short a history (a device's first readings, the return from a dropout) says nothing yet.
    return F.struct(
        *[F.when(plain_known, features[name]).otherwise(F.lit(0.0)).alias(name) for name in FEATURE_COLUMNS]
    )


def reading_features(readings: DataFrame, spec: FeatureSpec, since: dt.datetime | None = None) -> DataFrame:
    """Silver readings with one struct column of features per metric (``f_<metric>``), same rows.

    ``readings`` must hold, for each reading to be featurised, its device's readings in the
    ``spec.lookback_s`` before it (the scorer adds them; the archive has them). With ``since``, only the
    readings at or after it are featurised and returned; the rows before it are history, and each step
    drops those that no wanted feature depends on any more (most of a scorer's context is history).
    """
    history_us = int(spec.history_s * 1_000_000)
    history = Window.partitionBy(DEVICE_ID).orderBy(_MICROS).rangeBetween(-history_us, -int(spec.settle_s * 1_000_000))

    def still_needed(frame: DataFrame, histories_left: int) -> DataFrame:
        if since is None:
            return frame
        return frame.where(F.col(_MICROS) >= F.unix_micros(F.lit(since)) - histories_left * history_us)

    marked = readings.withColumns({_MICROS: F.unix_micros(EVENT_TIME), _ON_TIME: F.col(LATENESS) == ON_TIME})
    with_previous = still_needed(_with_previous(marked, spec), 2)
    first = with_previous.withColumns({k: v for m in METRIC_NAMES for k, v in _first_pass(m, history).items()})
    features = {f"f_{m}": _metric_features(m, history) for m in METRIC_NAMES}
    helpers = [c for c in first.columns if c not in readings.columns]
    return still_needed(still_needed(first, 1).withColumns(features), 0).drop(*helpers)


def metric_rows(featured: DataFrame, keep: tuple[str, ...] = ()) -> DataFrame:
    """One row per (reading, metric): the reading key, ``keep`` columns, ``metric`` and the four features."""
    per_metric = F.explode(
        F.array(*[F.struct(F.lit(m).alias("metric"), F.col(f"f_{m}.*")) for m in METRIC_NAMES])
    ).alias("_m")
    return featured.select(DEVICE_ID, SEQ, EVENT_TIME, *keep, per_metric).select(
        DEVICE_ID, SEQ, EVENT_TIME, *keep, "_m.metric", *[F.col(f"_m.{c}").alias(c) for c in FEATURE_COLUMNS]
    )


def model_input(feature: Column) -> Column:
    """A feature as the model sees it: its magnitude, log-compressed so that no single extreme dominates."""
    return F.log1p(F.abs(feature))


def model_inputs(rows: DataFrame) -> DataFrame:
    """Per (reading, metric) row, the model's inputs (``MODEL_INPUT_COLUMNS``)."""
    return rows.select("*", *[model_input(F.col(c)).alias(f"x_{c}") for c in FEATURE_COLUMNS])


MODEL_INPUT_COLUMNS: tuple[str, ...] = tuple(f"x_{c}" for c in FEATURE_COLUMNS)
