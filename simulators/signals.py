"""Sensor signals: a vectorised model of normal readings and the anomaly episodes laid over them.

A normal reading is a smooth, stateless function of device and time (baseline, daily cycle, slow drift,
battery discharge) plus white noise. Being stateless, any block of ``ticks x devices`` is computed in one
numpy expression and the result does not depend on how the run is cut into blocks. Anomaly episodes are
sparse, so they are scheduled per device and applied episode by episode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from iotmon.schema import ANOMALY_TYPES, DEVICE_TYPES, METRIC_NAMES, METRICS

SECONDS_PER_DAY = 86_400.0
TAU = 2.0 * np.pi


@dataclass(frozen=True)
class MetricProfile:
    """How one metric behaves on one device type; the per-device values scatter around these."""

    mean: float
    offset_sd: float
    """Spread of the per-device calibration offset."""
    daily_amplitude: float
    noise_sd: float
    drift_amplitude: float
    """Size of the slow wander (periods of days): ageing, fouling, seasonal load."""


@dataclass(frozen=True)
class BatteryProfile:
    """Batteries run down linearly and are swapped when they reach ``replace_at``."""

    discharge_per_day: tuple[float, float] = (1.0, 4.0)
    replace_at: float = 15.0
    full: float = 100.0
    noise_sd: float = 0.05


BATTERY_METRIC = "battery"
if BATTERY_METRIC not in METRIC_NAMES:
    raise ImportError(f"the battery model needs a {BATTERY_METRIC!r} metric in {METRIC_NAMES}")
BATTERY = BatteryProfile()

# mean, device offset sd, daily amplitude, noise sd, drift amplitude. Chillers are cold and damp, motors
# vibrate most, compressors run hot at high pressure, motors sit at ambient pressure.
TYPE_PROFILES: dict[str, dict[str, MetricProfile]] = {
    "pump": {
        "temperature": MetricProfile(42.0, 3.0, 3.0, 0.4, 1.5),
        "humidity": MetricProfile(55.0, 5.0, 6.0, 0.8, 2.0),
        "vibration": MetricProfile(3.5, 0.5, 0.3, 0.25, 0.4),
        "pressure": MetricProfile(420.0, 25.0, 8.0, 3.0, 10.0),
    },
    "motor": {
        "temperature": MetricProfile(58.0, 4.0, 4.0, 0.6, 2.0),
        "humidity": MetricProfile(40.0, 4.0, 5.0, 0.8, 2.0),
        "vibration": MetricProfile(6.5, 1.0, 0.5, 0.5, 0.8),
        "pressure": MetricProfile(101.3, 0.8, 0.6, 0.15, 0.5),
    },
    "chiller": {
        "temperature": MetricProfile(6.0, 1.5, 1.5, 0.25, 0.8),
        "humidity": MetricProfile(72.0, 4.0, 4.0, 0.7, 2.0),
        "vibration": MetricProfile(1.8, 0.25, 0.15, 0.12, 0.2),
        "pressure": MetricProfile(350.0, 20.0, 10.0, 2.5, 8.0),
    },
    "compressor": {
        "temperature": MetricProfile(74.0, 5.0, 5.0, 0.8, 2.5),
        "humidity": MetricProfile(35.0, 4.0, 5.0, 0.8, 2.0),
        "vibration": MetricProfile(5.0, 0.8, 0.4, 0.4, 0.6),
        "pressure": MetricProfile(780.0, 40.0, 15.0, 5.0, 20.0),
    },
}
_SMOOTH_METRICS = tuple(name for name in METRIC_NAMES if name != BATTERY_METRIC)
if set(TYPE_PROFILES) != set(DEVICE_TYPES) or any(set(p) != set(_SMOOTH_METRICS) for p in TYPE_PROFILES.values()):
    raise ImportError(f"TYPE_PROFILES must cover {DEVICE_TYPES} x {_SMOOTH_METRICS}")

DRIFT_PERIOD_DAYS = (2.0, 9.0)
SCALE_SPREAD = (0.6, 1.4)
"""Per-device multipliers of the type's amplitudes and noise."""
METRIC_LOW = np.array([m.low for m in METRICS])
METRIC_HIGH = np.array([m.high for m in METRICS])
BATTERY_INDEX = METRIC_NAMES.index(BATTERY_METRIC)


@dataclass(frozen=True)
class SignalParams:
    """Per-device, per-metric parameters, arrays of shape ``(devices, metrics)`` in ``METRIC_NAMES`` order."""

    baseline: np.ndarray
    daily_amplitude: np.ndarray
    daily_phase: np.ndarray
    noise_sd: np.ndarray
    drift_amplitude: np.ndarray
    drift_period_s: np.ndarray
    drift_phase: np.ndarray
    battery_drained_at_epoch: np.ndarray
    """Battery drawn (in %) at the Unix epoch, shape ``(devices,)``; the level is a sawtooth in time."""
    battery_discharge_per_s: np.ndarray
    anomaly_scale: np.ndarray
    """Typical variability, the unit anomaly magnitudes are expressed in."""

    @property
    def devices(self) -> int:
        return self.baseline.shape[0]


def _profile_matrix(type_codes: np.ndarray, attribute: str) -> np.ndarray:
    """``(devices, metrics)`` of one profile attribute; the battery column is zero (modelled separately)."""
    table = np.zeros((len(DEVICE_TYPES), len(METRIC_NAMES)))
    for t, kind in enumerate(DEVICE_TYPES):
        for m, name in enumerate(METRIC_NAMES):
            if name != BATTERY_METRIC:
                table[t, m] = getattr(TYPE_PROFILES[kind][name], attribute)
    return table[type_codes]


def draw_signal_params(type_codes: np.ndarray, rng: np.random.Generator) -> SignalParams:
    """Scatter each device around its type's profile (draws in a fixed order)."""
    shape = (len(type_codes), len(METRIC_NAMES))
    offsets = np.clip(rng.standard_normal(shape), -2.5, 2.5) * _profile_matrix(type_codes, "offset_sd")
    daily = _profile_matrix(type_codes, "daily_amplitude") * rng.uniform(*SCALE_SPREAD, shape)
    noise = _profile_matrix(type_codes, "noise_sd") * rng.uniform(*SCALE_SPREAD, shape)
    drift = _profile_matrix(type_codes, "drift_amplitude") * rng.uniform(*SCALE_SPREAD, shape)
    daily_phase = rng.uniform(0.0, TAU, shape)
    drift_period = rng.uniform(*DRIFT_PERIOD_DAYS, shape) * SECONDS_PER_DAY
    drift_phase = rng.uniform(0.0, TAU, shape)
    battery_rate = rng.uniform(*BATTERY.discharge_per_day, len(type_codes)) / SECONDS_PER_DAY
    battery_phase = rng.uniform(0.0, BATTERY.full - BATTERY.replace_at, len(type_codes))
    noise[:, BATTERY_INDEX] = BATTERY.noise_sd
    scale = np.maximum(daily + drift, 6.0 * noise)
    return SignalParams(
        baseline=_profile_matrix(type_codes, "mean") + offsets,
        daily_amplitude=daily,
        daily_phase=daily_phase,
        noise_sd=noise,
        drift_amplitude=drift,
        drift_period_s=drift_period,
        drift_phase=drift_phase,
        battery_drained_at_epoch=battery_phase,
        battery_discharge_per_s=battery_rate,
        anomaly_scale=scale,
    )


def normal_values(params: SignalParams, time_s: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Readings of healthy sensors, shape ``(ticks, devices, metrics)``, clipped to the plausible ranges.

    ``time_s`` holds Unix seconds per ``(tick, device)``; ``noise`` standard normals per reading.
    """
    t = time_s[:, :, None]
    values = (
        params.baseline
        + params.daily_amplitude * np.sin(TAU * t / SECONDS_PER_DAY + params.daily_phase)
        + params.drift_amplitude * np.sin(TAU * t / params.drift_period_s + params.drift_phase)
        + params.noise_sd * noise
    )
    span = BATTERY.full - BATTERY.replace_at
    drained = np.mod(params.battery_drained_at_epoch + params.battery_discharge_per_s * time_s, span)
    battery_noise = params.noise_sd[:, BATTERY_INDEX] * noise[:, :, BATTERY_INDEX]
    values[:, :, BATTERY_INDEX] = BATTERY.full - drained + battery_noise
    return np.clip(values, METRIC_LOW, METRIC_HIGH, out=values)


# ---------------------------------------------------------------------------------------------------------
# Anomaly episodes

# Length range (readings, inclusive) and magnitude range (in units of the metric's anomaly scale).
EPISODE_LENGTHS: dict[str, tuple[int, int]] = {
    "spike": (1, 1),
    "stuck": (10, 60),
    "drift": (30, 120),
    "noise_burst": (10, 40),
}
EPISODE_MAGNITUDES: dict[str, tuple[float, float]] = {
    "spike": (4.0, 8.0),
    "stuck": (0.0, 0.0),
    "drift": (3.0, 6.0),
    "noise_burst": (2.0, 4.0),
}
if set(EPISODE_LENGTHS) != set(ANOMALY_TYPES) or set(EPISODE_MAGNITUDES) != set(ANOMALY_TYPES):
    raise ImportError(f"episode shapes must cover exactly {ANOMALY_TYPES}")
MEAN_EPISODE_LENGTH = float(np.mean([(lo + hi) / 2 for lo, hi in EPISODE_LENGTHS.values()]))
NO_ANOMALY = -1


@dataclass
class Episode:
    """One anomaly on one metric of one device, over ticks ``[start, start + length)``."""

    device: int
    kind: int
    """Index into ``ANOMALY_TYPES``."""
    metric: int
    start: int
    length: int
    magnitude: float
    """Signed, in the metric's units."""
    frozen_value: float | None = None

    @property
    def end(self) -> int:
        return self.start + self.length


def _spike(episode: Episode, block: np.ndarray, steps: np.ndarray, rng: np.random.Generator) -> None:
    block += episode.magnitude


def _stuck(episode: Episode, block: np.ndarray, steps: np.ndarray, rng: np.random.Generator) -> None:
    if episode.frozen_value is None:
        episode.frozen_value = float(block[0])
    block[:] = episode.frozen_value


def _drift(episode: Episode, block: np.ndarray, steps: np.ndarray, rng: np.random.Generator) -> None:
    block += episode.magnitude * (steps + 1) / episode.length


def _noise_burst(episode: Episode, block: np.ndarray, steps: np.ndarray, rng: np.random.Generator) -> None:
    block += abs(episode.magnitude) * rng.standard_normal(len(block))


EpisodeShape = Callable[[Episode, np.ndarray, np.ndarray, np.random.Generator], None]
EPISODE_SHAPES: dict[str, EpisodeShape] = {
    "spike": _spike,
    "stuck": _stuck,
    "drift": _drift,
    "noise_burst": _noise_burst,
}
if set(EPISODE_SHAPES) != set(ANOMALY_TYPES):
    raise ImportError(f"EPISODE_SHAPES must cover exactly {ANOMALY_TYPES}")
_SHAPES_BY_CODE = tuple(EPISODE_SHAPES[name] for name in ANOMALY_TYPES)
_LENGTHS_BY_CODE = np.array([EPISODE_LENGTHS[name] for name in ANOMALY_TYPES])
_MAGNITUDES_BY_CODE = np.array([EPISODE_MAGNITUDES[name] for name in ANOMALY_TYPES])


def mean_gap_ticks(fraction: float) -> float:
    """Mean healthy stretch between episodes such that ``fraction`` of ticks fall inside one."""
    return MEAN_EPISODE_LENGTH * (1.0 - fraction) / fraction


@dataclass
class AnomalySchedule:
    """Per-device renewal process of anomaly episodes in tick time, applied block by block."""

    params: SignalParams
    fraction: float
    rng: np.random.Generator
    next_start: np.ndarray = field(init=False)
    active: list[Episode] = field(default_factory=list, init=False)
    episodes_started: np.ndarray = field(init=False)
    """Episodes begun so far, per ``ANOMALY_TYPES`` code."""

    def __post_init__(self) -> None:
        """Start in the steady state: ``fraction`` of the devices are already inside an episode."""
        self.episodes_started = np.zeros(len(ANOMALY_TYPES), dtype=np.int64)
        devices = self.params.devices
        gaps = self._gaps(np.zeros(devices, dtype=np.int64))
        ongoing = self.rng.random(devices) < self.fraction
        elapsed = self.rng.integers(0, round(MEAN_EPISODE_LENGTH), devices)
        self.next_start = np.where(ongoing, -elapsed, gaps)

    def _gaps(self, after: np.ndarray) -> np.ndarray:
        if self.fraction <= 0.0:
            return np.full(len(after), np.iinfo(np.int64).max // 2, dtype=np.int64)
        p = 1.0 / (1.0 + mean_gap_ticks(self.fraction))
        return after + self.rng.geometric(p, len(after)) - 1

    def _schedule(self, devices: np.ndarray, starts: np.ndarray) -> None:
        """Draw episodes starting at ``starts`` for ``devices`` and the gap that follows each."""
        n = len(devices)
        kinds = self.rng.integers(0, len(ANOMALY_TYPES), n)
        metrics = self.rng.integers(0, len(METRIC_NAMES), n)
        lo, hi = _LENGTHS_BY_CODE[kinds].T
        lengths = self.rng.integers(lo, hi + 1)
        mag_lo, mag_hi = _MAGNITUDES_BY_CODE[kinds].T
        signs = self.rng.choice(np.array([-1.0, 1.0]), n)
        magnitudes = signs * self.rng.uniform(mag_lo, mag_hi) * self.params.anomaly_scale[devices, metrics]
        np.add.at(self.episodes_started, kinds, 1)
        for row in zip(
            devices.tolist(),
            kinds.tolist(),
            metrics.tolist(),
            starts.tolist(),
            lengths.tolist(),
            magnitudes.tolist(),
            strict=True,
        ):
            self.active.append(Episode(*row))
        self.next_start[devices] = self._gaps(starts + lengths)

    def apply(self, values: np.ndarray, first_tick: int) -> tuple[np.ndarray, np.ndarray]:
        """Overlay episodes on ``values[tick - first_tick, device, metric]`` in place.

        Returns the anomaly type code and metric index per ``(tick, device)``, ``NO_ANOMALY`` where normal.
        """
        ticks = values.shape[0]
        end_tick = first_tick + ticks
        while True:
            due = np.flatnonzero(self.next_start < end_tick)
            if len(due) == 0:
                break
            self._schedule(due, self.next_start[due])
        kind_codes = np.full(values.shape[:2], NO_ANOMALY, dtype=np.int8)
        metric_codes = np.full(values.shape[:2], NO_ANOMALY, dtype=np.int8)
        still_active = []
        for episode in self.active:
            lo = max(episode.start, first_tick)
            hi = min(episode.end, end_tick)
            if lo < hi:
                rows = slice(lo - first_tick, hi - first_tick)
                block = values[rows, episode.device, episode.metric]
                _SHAPES_BY_CODE[episode.kind](episode, block, np.arange(lo, hi) - episode.start, self.rng)
                kind_codes[rows, episode.device] = episode.kind
                metric_codes[rows, episode.device] = episode.metric
            if episode.end > end_tick:
                still_active.append(episode)
        self.active = still_active
        return kind_codes, metric_codes
