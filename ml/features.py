"""Anomaly features: one definition, computed by one numpy function, for the trainer and the streaming scorer.

A reading's features depend only on its device's *on-time* readings in the ``history`` before it: the
window ``(t - history, t - settle]`` (``IOTMON_FEATURE_HISTORY``, ``IOTMON_LATE_AFTER``), and on whether
*those* readings looked suspect against their own windows, which uses the jump of each of them from the
reading before it. So on at most ``lookback = 3 x history`` of the device's past, and on nothing else. An
on-time reading reached Kafka within ``settle`` of its event time, so every reading of a reading's window
reached Kafka before it: the scorer always has them, and a reading's features never change once computed.

Features are per metric and scale-free, each metric measured against its device's own recent noise
(estimated from reading-to-reading changes, which a slow trend does not inflate), so one model serves
every metric of every device type:

* ``level``: distance of the value from the window's mean, in noise units (spikes, drifts, shifts);
* ``step``: the jump from the latest unsuspected reading, in the same unit (spikes, episode edges);
* ``repeats``: how many of the previous readings (up to ``REPEAT_DEPTH``) repeat the value exactly: a
  live sensor's noise does not repeat itself, a stuck one does;
* ``spread``: the spread of the last ``SPREAD_DEPTH`` readings, in noise units (noise bursts).

The window's mean and noise leave out readings that were *suspect* against a plain window (more than
``SUSPECT_AT`` noise units off, or repeating): otherwise a drift drags its own baseline along and stays
invisible, and the readings after any anomaly are measured against a polluted history and look anomalous
themselves. The model sees one row per (reading, metric), so it learns what a normal metric looks like;
a reading's score is its most anomalous metric's.

**How they are computed.** ``device_features`` is the definition: numpy over one device's readings in
event-time order, vectorised (no loop per reading). Window sums are taken from prefix sums that restart at
every ``history``-aligned bucket of event time, so a window's sum depends on the readings of its (at most
two) buckets only, never on how much earlier history the caller passed: the trainer over the whole archive
and the scorer over a batch and its lookback get bit-identical values. ``reading_features`` runs it per
device on a Spark frame (``applyInArrow``): the trainer, the reconciliation and the scorer all call it.
Spark's window functions computed the same before (``FEATURE_VERSION`` 2): a frame sorted and scanned
several times per batch, 1 ms of CPU per reading (docs/cost-model.md); numpy takes microseconds.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, StructField, StructType

from iotmon.config import Settings, interval_seconds
from iotmon.schema import DEVICE_ID, EVENT_TIME, LATENESS, METRIC_NAMES, ON_TIME, SEQ

FEATURE_VERSION = 3
"""Bumped whenever the features change meaning: a model trained on other features is not served."""
FEATURE_COLUMNS: tuple[str, ...] = ("level", "step", "repeats", "spread")
REPEAT_DEPTH = 5
SPREAD_DEPTH = 5
SUSPECT_AT = 4.0
"""Noise multiples from the window's mean (or from the previous reading) that make a reading suspect."""
SUSPECT_REPEATS = 2
MIN_HISTORY = 5
"""Reading-to-reading changes a window needs before its noise estimate is trusted."""
RESOLUTION = 0.01
"""Smallest difference a reading can show (the simulator sends two decimals); the floor of the noise."""
_NOISE_PER_JUMP = math.sqrt(math.pi) / 2
"""For white noise E|x_t - x_t-1| = 2 sigma / sqrt(pi)."""
_PREVIOUS = max(REPEAT_DEPTH, SPREAD_DEPTH - 1)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_Micros = TypeVar("_Micros", int, np.ndarray)
"""Epoch microseconds: one, or an array of them."""


def _epoch_us(moment: dt.datetime) -> int:
    """A naive UTC time (as Spark hands them to Python) in epoch microseconds."""
    return (moment.replace(tzinfo=dt.UTC) - _EPOCH) // dt.timedelta(microseconds=1)


@dataclass(frozen=True)
class FeatureSpec:
    history_s: float = 60.0
    settle_s: float = 1.0
    """On-time readings of the last ``settle_s`` before a reading, and late ones, are not in its window: an
    on-time reading older than that had reached Kafka before it, so the scorer always has it too."""

    def __post_init__(self) -> None:
        if not self.history_s > self.settle_s >= 0:
            raise ValueError(f"feature history must exceed the settle time, not {self.history_s} / {self.settle_s}")

    @property
    def lookback_s(self) -> float:
        """History a reading's features depend on: its own window, the windows of the readings in it
        (suspicion), and the reading before each of *those* (their jumps)."""
        return 3 * self.history_s

    @property
    def history_us(self) -> int:
        return round(self.history_s * 1_000_000)

    @property
    def settle_us(self) -> int:
        return round(self.settle_s * 1_000_000)

    def lookback_start_us(self, first_us: _Micros) -> _Micros:
        """Where the readings a feature from ``first_us`` on depends on begin: the start of the bucket holding
        ``first_us - lookback``, so that every window sum sees whole buckets."""
        return (first_us - 3 * self.history_us) // self.history_us * self.history_us

    def lookback_start(self, first: dt.datetime) -> dt.datetime:
        """``lookback_start_us`` for a naive UTC time, as Spark hands timestamps to Python."""
        start_us = self.lookback_start_us(_epoch_us(first))
        return (_EPOCH + dt.timedelta(microseconds=start_us)).replace(tzinfo=None)

    @classmethod
    def from_settings(cls, settings: Settings) -> FeatureSpec:
        return cls(interval_seconds(settings.feature_history), interval_seconds(settings.late_after))


# -- The definition: one device, numpy ----------------------------------------------------------------------


class _WindowSums:
    """Sums over index ranges ``[lo, hi)`` of a device's on-time readings, from prefix sums restarting at
    every bucket of ``history``: a window (shorter than a bucket) spans at most two buckets, and its sum
    depends on nothing outside them."""

    def __init__(self, event_us: np.ndarray, bucket_us: int) -> None:
        n = len(event_us)
        starts = ends = np.empty(0, dtype=np.int64)  # no on-time readings: no buckets
        if n:
            bucket = event_us // bucket_us
            starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
            ends = np.r_[starts[1:], n].astype(np.int64)
        self._segments = list(zip(starts.tolist(), ends.tolist(), strict=True))
        sizes = ends - starts
        self.segment_start = np.repeat(starts, sizes)
        self.segment_end = np.repeat(ends, sizes)
        self.n = n

    def prefix(self, values: np.ndarray) -> np.ndarray:
        out = np.empty_like(values)
        for start, end in self._segments:
            np.cumsum(values[start:end], axis=0, out=out[start:end])
        return out

    def sum(self, values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``values[lo:hi].sum(axis=0)`` per window, bucket by bucket (0 for an empty window)."""
        shape = (len(lo), *values.shape[1:])
        if self.n == 0:
            return np.zeros(shape)
        prefix = self.prefix(values)
        empty = hi <= lo
        first = np.minimum(lo, self.n - 1)
        last = np.maximum(hi - 1, 0)
        start, end = self.segment_start[first], self.segment_end[first]
        # The part in the first window's bucket: its prefix up to the window's end (or the bucket's), minus
        # its prefix before the window's start.
        head_end = np.minimum(last, end - 1)
        before = np.where(_column(lo > start, values), prefix[np.maximum(lo - 1, 0)], 0.0)
        head = prefix[head_end] - before
        tail = np.where(_column(last >= end, values), prefix[last], 0.0)
        return np.where(_column(empty, values), 0.0, head + tail)


def _column(mask: np.ndarray, like: np.ndarray) -> np.ndarray:
    """A per-window mask shaped to broadcast against per-window, per-metric values."""
    return mask.reshape(-1, *([1] * (like.ndim - 1)))


def _stats(sums: _WindowSums, values: np.ndarray, jumps: np.ndarray, counted: np.ndarray, lo, hi):
    """Mean of the counted values, noise from their jumps, and whether enough jumps are known; per window
    and metric. ``counted`` masks the window's readings (per metric); a jump is counted where it is known.
    The four sums are taken side by side, one prefix pass for all of them."""
    with_jump = counted & ~np.isnan(jumps)
    stacked = np.concatenate(
        [counted, with_jump, np.where(counted, values, 0.0), np.where(with_jump, jumps, 0.0)], axis=1, dtype=np.float64
    )
    count, jump_count, total, jump_total = np.split(sums.sum(stacked, lo, hi), 4, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / count, np.nan)
        noise = np.where(jump_count > 0, jump_total / jump_count * _NOISE_PER_JUMP, np.nan)
    return mean, np.fmax(noise, RESOLUTION), jump_count >= MIN_HISTORY


@dataclass
class Judgements:
    """What the windows of later readings need of each on-time reading: its jump from the reading before it, and
    whether it looked suspect against its own window (``(n, metrics)`` each), with which readings have them.

    Both depend only on readings that reached Kafka before the reading itself (its window's), so they never
    change once computed: the scorer keeps them beside its history (``streaming.history``) and computes them
    only for the readings it has not judged yet, where the archive's whole computation judges every reading."""

    jumps: np.ndarray
    """Per reading and metric: its distance from the latest on-time reading of its window (nan where the window
    holds none)."""
    suspect: np.ndarray
    jumped: np.ndarray
    """Per reading: its jump is known."""
    judged: np.ndarray
    """Per reading: its suspicion is known."""

    @classmethod
    def none(cls, n: int, metrics: int) -> Judgements:
        unknown = np.zeros(n, dtype=bool)
        return cls(np.full((n, metrics), np.nan), np.zeros((n, metrics), dtype=bool), unknown, unknown.copy())

    def take(self, rows: np.ndarray | slice) -> Judgements:
        return Judgements(self.jumps[rows], self.suspect[rows], self.jumped[rows], self.judged[rows])

    @staticmethod
    def concatenated(parts: list[Judgements]) -> Judgements:
        fields = ("jumps", "suspect", "jumped", "judged")
        return Judgements(*(np.concatenate([getattr(p, field) for p in parts]) for field in fields))


def device_features(
    event_us: np.ndarray,
    values: np.ndarray,
    on_time: np.ndarray,
    spec: FeatureSpec,
    wanted: np.ndarray | None = None,
    judgements: Judgements | None = None,
) -> np.ndarray:
    """The features of one device's readings at the indices ``wanted`` (ascending; every reading by default):
    ``(len(wanted), metrics, 4)`` in ``FEATURE_COLUMNS`` order. The other readings are context only.

    Readings must be sorted by (event time, seq); ``values`` is ``(n, metrics)``. Each reading's features
    are right when the readings passed include the device's readings from ``spec.lookback_start_us`` of it
    on (the archive does; the scorer passes that much).

    Only what the wanted features depend on is computed: their windows need the suspicion of the on-time
    readings from the bucket holding the first one's window start on, and every window summed needs the jumps
    of the on-time readings of its buckets. ``judgements`` are what a caller already knows of those (none by
    default); what is computed here is added to them, for the next call. Window sums restart at every bucket,
    so the values are those of the whole computation, bit for bit; a scorer whose batch is a few seconds of a
    lookback of minutes computes a fraction of it.
    """
    n, metrics = values.shape
    wanted = np.arange(n) if wanted is None else np.asarray(wanted, dtype=np.int64)
    features = np.zeros((len(wanted), metrics, len(FEATURE_COLUMNS)))
    history = np.flatnonzero(on_time)
    if len(history) == 0 or len(wanted) == 0:  # nothing to judge against (a device's first readings), or nothing wanted
        return features
    known = Judgements.none(n, metrics) if judgements is None else judgements
    h_us, h_values = event_us[history], values[history]
    first, last = int(wanted[0]), int(wanted[-1])
    # No window reaches past the last wanted reading: the on-time readings after it play no part.
    history_end = int(np.searchsorted(history, last, side="right"))
    # Suspicion is needed of the on-time readings from the bucket holding the first wanted window's start on.
    judged_from = (int(event_us[first]) - spec.history_us) // spec.history_us * spec.history_us
    suspects = history[int(np.searchsorted(h_us, judged_from, side="left")) : history_end]
    suspects = suspects[~known.judged[suspects]]
    # Sums over windows (the suspects' and the wanted readings') start at the bucket holding the earliest
    # window's start; they need the jumps of the on-time readings from there on.
    earliest = min(int(event_us[first]), int(event_us[suspects[0]])) if len(suspects) else int(event_us[first])
    summed = int(np.searchsorted(h_us, (earliest - spec.history_us) // spec.history_us * spec.history_us, side="left"))
    if summed >= history_end:  # no window of a wanted reading holds a reading: none says anything yet
        return features
    jumpers = history[summed:history_end]
    jumpers = jumpers[~known.jumped[jumpers]]

    # Each of those readings' window: the on-time readings in (t - history, t - settle], oldest first.
    windowed = np.union1d(np.union1d(suspects, jumpers), wanted)
    lo = np.searchsorted(h_us, event_us[windowed] - spec.history_us, side="right")
    hi = np.searchsorted(h_us, event_us[windowed] - spec.settle_us, side="right")
    previous = np.full((len(windowed), _PREVIOUS, metrics), np.nan)
    for k in range(1, _PREVIOUS + 1):
        found = hi - k >= lo
        previous[found, k - 1] = h_values[hi[found] - k]
    known.jumps[jumpers] = np.abs(values[jumpers] - previous[np.searchsorted(windowed, jumpers), 0])
    known.jumped[jumpers] = True

    # The windows' sums, over the on-time readings from ``summed`` on: they start anew at every bucket.
    h_values, h_jumps = h_values[summed:history_end], known.jumps[history[summed:history_end]]
    sums = _WindowSums(h_us[summed:history_end], spec.history_us)
    lo, hi = lo - summed, hi - summed
    # The plain windows' statistics, of the suspects (their suspicion) and of the wanted readings (a fallback).
    stated = np.union1d(suspects, wanted)
    stated_windows = np.searchsorted(windowed, stated)
    stated_values, previous_stated = values[stated], previous[stated_windows]
    repeats = np.zeros((len(stated), metrics))
    run = np.ones((len(stated), metrics), dtype=bool)
    for k in range(REPEAT_DEPTH):
        run &= previous_stated[:, k] == stated_values
        repeats += run
    everything = np.ones_like(h_values, dtype=bool)
    plain_mean, plain_noise, plain_known = _stats(
        sums, h_values, h_jumps, everything, lo[stated_windows], hi[stated_windows]
    )
    if len(suspects):
        of = np.searchsorted(stated, suspects)
        with np.errstate(invalid="ignore"):
            known.suspect[suspects] = plain_known[of] & (
                (np.abs(stated_values[of] - plain_mean[of]) > SUSPECT_AT * plain_noise[of])
                | (known.jumps[suspects] > SUSPECT_AT * plain_noise[of])
                | (repeats[of] >= SUSPECT_REPEATS)
            )
        known.judged[suspects] = True
    clean = ~known.suspect[history[summed:history_end]]

    # From here on, per wanted reading.
    of, windows = np.searchsorted(stated, wanted), np.searchsorted(windowed, wanted)
    lo, hi, previous, repeats = lo[windows], hi[windows], previous[windows], repeats[of]
    plain_mean, plain_noise, plain_known = plain_mean[of], plain_noise[of], plain_known[of]
    wanted_values = values[wanted]
    clean_mean, clean_noise, clean_known = _stats(sums, h_values, h_jumps, clean, lo, hi)
    # A window made only of suspects (deep inside a long episode) falls back to the plain one.
    mean = np.where(clean_known, clean_mean, plain_mean)
    noise = np.where(clean_known, clean_noise, plain_noise)

    # From the latest unsuspected reading of the window, so the return from a spike is not a second spike.
    latest_clean = np.maximum.accumulate(np.where(clean, np.arange(len(h_values))[:, None], -1), axis=0)
    last_clean_index = latest_clean[np.maximum(hi - 1, 0)]
    has_clean = (hi > lo)[:, None] & (last_clean_index >= lo[:, None])
    last_clean = np.where(has_clean, h_values[np.maximum(last_clean_index, 0), np.arange(metrics)], wanted_values)

    features[..., 0] = (wanted_values - mean) / noise
    features[..., 1] = (wanted_values - last_clean) / noise
    features[..., 2] = repeats
    features[..., 3] = _spread(wanted_values, previous[:, : SPREAD_DEPTH - 1]) / noise
    # Too short a window (a device's first readings, the return from a dropout) says nothing yet.
    features[~plain_known] = 0.0
    return features


def _spread(values: np.ndarray, previous: np.ndarray) -> np.ndarray:
    """Sample standard deviation of each reading's value and its previous ones that exist."""
    stack = np.concatenate([values[:, None], previous], axis=1)
    present = ~np.isnan(stack)
    count = present.sum(axis=1)
    mean = np.where(present, stack, 0.0).sum(axis=1) / count
    squares = np.where(present, (stack - mean[:, None]) ** 2, 0.0).sum(axis=1)
    return np.sqrt(squares / np.maximum(count - 1, 1))


# -- On Spark frames --------------------------------------------------------------------------------------

_FEATURE_STRUCT = StructType([StructField(name, DoubleType()) for name in FEATURE_COLUMNS])


@dataclass(frozen=True)
class DeviceReadings:
    """One device's readings as ``device_features`` takes them: sorted by (event time, seq), the metrics a matrix."""

    order: np.ndarray
    """Each sorted reading's row in the table it came from."""
    event_us: np.ndarray
    values: np.ndarray
    on_time: np.ndarray

    @classmethod
    def of(cls, table: pa.Table) -> DeviceReadings:
        """The readings of ``table`` (one device's silver rows, any order)."""
        event_us = table.column(EVENT_TIME).cast(pa.timestamp("us")).to_numpy().astype(np.int64)
        order = np.lexsort((table.column(SEQ).to_numpy(), event_us))
        values = np.column_stack([table.column(m).to_numpy() for m in METRIC_NAMES])[order].astype(np.float64)
        on_time = pc.equal(table.column(LATENESS), ON_TIME).to_numpy(zero_copy_only=False)[order]
        return cls(order, event_us[order], values, on_time)


def featured_table(table: pa.Table, spec: FeatureSpec, since_us: int | None = None) -> pa.Table:
    """One device's readings (Arrow, any order) with a ``f_<metric>`` struct of features each, sorted by event
    time; with ``since_us``, only the readings from then on (the rest were history)."""
    readings = DeviceReadings.of(table)
    first = 0 if since_us is None else int(np.searchsorted(readings.event_us, since_us, side="left"))
    wanted = np.arange(first, len(readings.event_us))
    features = device_features(readings.event_us, readings.values, readings.on_time, spec, wanted)
    table = table.take(pa.array(readings.order[first:]))
    for m, name in enumerate(METRIC_NAMES):
        fields = [pa.array(features[:, m, k]) for k in range(len(FEATURE_COLUMNS))]
        table = table.append_column(f"f_{name}", pa.StructArray.from_arrays(fields, names=list(FEATURE_COLUMNS)))
    return table


def reading_features(readings: DataFrame, spec: FeatureSpec, since: dt.datetime | None = None) -> DataFrame:
    """Silver readings with one struct column of features per metric (``f_<metric>``), same rows.

    ``readings`` must hold, for each reading to be featurised, its device's readings from
    ``spec.lookback_start_us`` of it on (the scorer adds them; the archive has them). With ``since``, only
    the readings at or after it are featurised and returned; the rows before it are history. Each device's
    readings go to ``device_features`` as one Arrow table (``applyInArrow``: no pandas in between).
    """
    since_us = None if since is None else _epoch_us(since)
    schema = StructType([*readings.schema.fields, *[StructField(f"f_{m}", _FEATURE_STRUCT) for m in METRIC_NAMES]])
    return readings.groupBy(DEVICE_ID).applyInArrow(lambda table: featured_table(table, spec, since_us), schema)


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
