"""``python -m bench.detectability``: how much of each anomaly type can be told from noise at all.

The simulator labels every reading of an episode anomalous, but the first readings of a drift and the
readings of a noise burst that land near the normal value look like noise. This measures the ceiling that
sets on per-reading detection with an *oracle*: a detector that knows each reading's noise-free normal value
and its metric's noise, and flags a reading whose anomalous metric is more than ``k`` noise units off (a stuck
sensor: once it has repeated itself ``SUSPECT_REPEATS`` times, as the features count it). No causal detector,
which must estimate the normal value and the noise from history, does better than the oracle at the same
false-alarm rate, so its F1 is an upper bound for the model's per-reading F1.

Episodes come from the simulator's own schedule and shapes (``AnomalySchedule`` over a fleet of drawn signal
parameters); false alarms are analytic: a normal reading is flagged when any metric's Gaussian noise exceeds
``k`` noise units.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from iotmon.logs import say
from iotmon.schema import ANOMALY_TYPES, DEVICE_TYPES, METRIC_NAMES
from ml.features import SUSPECT_REPEATS
from simulators.options import SimulationOptions
from simulators.signals import NO_ANOMALY, AnomalySchedule, draw_signal_params

THRESHOLDS: tuple[float, ...] = (3.0, 3.5, 4.0, 4.5, 5.0, 6.0)
"""Noise units at which the oracle flags a reading."""
STUCK = ANOMALY_TYPES.index("stuck")


@dataclass(frozen=True)
class Ceiling:
    """The oracle at one threshold: recall per type and overall, false alarms, precision and F1."""

    threshold: float
    recall: dict[str, float]
    overall_recall: float
    false_alarm_rate: float
    precision: float

    @property
    def f1(self) -> float:
        total = self.precision + self.overall_recall
        return 2 * self.precision * self.overall_recall / total if total else 0.0


def anomalous_readings(devices: int, ticks: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Per anomalous reading, its type code and how far off it is in noise units (stuck readings: how
    many times in a row they have repeated); and the share of readings that are anomalous."""
    rng = np.random.default_rng(seed)
    params = draw_signal_params(rng.integers(0, len(DEVICE_TYPES), devices), rng)
    deviation = np.zeros((ticks, devices, len(METRIC_NAMES)))
    kinds, metrics = AnomalySchedule(params, fraction, rng).apply(deviation, 0)
    tick, device = np.nonzero(kinds != NO_ANOMALY)
    metric = metrics[tick, device]
    noise = rng.standard_normal(len(tick))
    off = np.abs(deviation[tick, device, metric] / params.noise_sd[device, metric] + noise)
    # A stuck reading carries no noise: what gives it away is how long the run of repeats is so far.
    stuck = kinds == STUCK
    run = np.zeros(kinds.shape, dtype=np.int64)
    for t in range(1, ticks):
        run[t] = np.where(stuck[t] & stuck[t - 1], run[t - 1] + 1, 0)
    kind = kinds[tick, device]
    off = np.where(kind == STUCK, run[tick, device], off)
    return kind, off, len(tick) / (ticks * devices)


def ceilings(kind: np.ndarray, off: np.ndarray, share: float, thresholds: Sequence[float]) -> list[Ceiling]:
    result = []
    for k in thresholds:
        flagged = np.where(kind == STUCK, off >= SUSPECT_REPEATS, off > k)
        recall = {
            t: float(flagged[kind == code].mean()) for code, t in enumerate(ANOMALY_TYPES) if (kind == code).any()
        }
        overall = float(flagged.mean())
        false_alarm = 1.0 - (1.0 - math.erfc(k / math.sqrt(2.0))) ** len(METRIC_NAMES)
        hits, alarms = overall * share, false_alarm * (1.0 - share)
        result.append(Ceiling(k, recall, overall, false_alarm, hits / (hits + alarms) if hits + alarms else 0.0))
    return result


def report(rows: Sequence[Ceiling], share: float) -> str:
    types = list(rows[0].recall)
    lines = [
        f"anomalous readings: {share:.2%} of all; oracle flags a reading more than k noise units off",
        f"{'k':>5} {'recall':>7} "
        + " ".join(f"{t:>11}" for t in types)
        + f" {'false alarms':>13} {'precision':>9} {'F1':>6}",
    ]
    for row in rows:
        lines.append(
            f"{row.threshold:>5.1f} {row.overall_recall:>7.3f} "
            + " ".join(f"{row.recall[t]:>11.3f}" for t in types)
            + f" {row.false_alarm_rate:>13.4%} {row.precision:>9.3f} {row.f1:>6.3f}"
        )
    best = max(rows, key=lambda row: row.f1)
    lines.append(f"best per-reading F1 of the oracle: {best.f1:.3f} (k = {best.threshold:g})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detectability", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=3000, help="readings per device")
    parser.add_argument("--fraction", type=float, default=SimulationOptions.anomaly_fraction)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    kind, off, share = anomalous_readings(args.devices, args.ticks, args.fraction, args.seed)
    say(report(ceilings(kind, off, share, THRESHOLDS), share))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
