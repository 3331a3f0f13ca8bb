"""A dashboard page left open, without a browser: the steady phase's dashboard load, and its freshness record.

Issue 17 measures the steady state with the dashboard running, and an open page is what makes a dashboard cost
anything: at every ``IOTMON_DASHBOARD_REFRESH`` its four sections (the fleet and events, one device's chart, the
pipeline with every table's freshness, the models) read the lake through ``dashboard.app.Views``. This process
does the same reads on the same schedule (the server's work for one page; not the rendering to JSON), and
writes down what the pipeline section showed of each table's freshness: how far its newest event is behind the
newest event in Kafka (``FRESHNESS_COLUMNS``). The bench reads those samples to tell whether a table fell behind
over the run (``freshness_trend``): "lag 0" on the queries' side can hide a table that is minutes old.

Run as ``python -m bench.viewer SAMPLES`` with the phase's ``IOTMON_*`` environment; SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from statistics import median
from typing import Any

from iotmon.config import Settings, interval_seconds
from iotmon.logs import say
from iotmon.schema import ALERTS, DEVICE_SESSIONS, DEVICE_STATUS_CHANGES, FRESHNESS_COLUMNS, METRICS

EVENT_DRIVEN: frozenset[str] = frozenset({DEVICE_STATUS_CHANGES, ALERTS, DEVICE_SESSIONS})
"""Tables whose newest event moves only when something happens (a status change, an incident, a session's end):
their freshness grows between events by design, so a trend says nothing about keeping up."""
TROUGH_SLICE_S = 75.0
"""The shortest slice of a run whose trough ``_trough_growth_s_per_min`` takes: a minute's trigger and its batch."""
TROUGH_SLICES = 6
GROWTH_LIMIT_S_PER_MIN = 1.0
"""A table keeps up when its freshness grows by at most this over the run (seconds a minute, ``freshness_trend``):
a stream that falls 2 % behind its fleet loses about 1.2 s of event time a minute; one that keeps up wobbles
around a level its trigger sets."""


def view(settings: Settings, samples: Path, stop: threading.Event) -> int:
    """Refresh like an open page until ``stop``; one JSON line per refresh into ``samples``; refreshes made."""
    from dashboard.app import Views
    from dashboard.lake import LakeReader

    views = Views(settings, LakeReader(settings))
    refresh_s = interval_seconds(settings.dashboard_refresh)
    metric, device, refreshes = METRICS[0].name, None, 0
    with samples.open("a") as out:
        while not stop.is_set():
            started = time.monotonic()
            _, _, choices, default = views.overview()
            device = device if device in choices else default  # as the page keeps the operator's choice
            views.device(device, metric)
            views.pipeline()
            views.models()
            newest = {name: views.reader.newest(name, column) for name, column in FRESHNESS_COLUMNS.items()}
            out.write(json.dumps(freshness_sample(time.time(), newest, views.kafka_newest())) + "\n")
            out.flush()
            refreshes += 1
            stop.wait(max(0.0, refresh_s - (time.monotonic() - started)))
    return refreshes


def freshness_sample(at: float, newest: Mapping[str, datetime | None], kafka_newest: datetime | None) -> dict:
    """One refresh's record: when (epoch seconds), and each table's seconds behind Kafka (None: unknown)."""
    from iotmon.status import freshness

    return {"at": at, "behind_kafka_s": {name: freshness(event, kafka_newest) for name, event in newest.items()}}


def read_samples(path: Path) -> list[dict[str, Any]]:
    """The samples a viewer wrote (none if it never refreshed); a line cut by a kill is left out."""
    if not path.exists():
        return []
    samples = []
    for line in path.read_text().splitlines():
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return samples


def freshness_trend(samples: Iterable[Mapping[str, Any]], since: float, until: float) -> dict[str, dict[str, Any]]:
    """Per table, its freshness over the samples taken between ``since`` and ``until`` (epoch seconds): first,
    last, max and mean seconds behind Kafka, and its growth in seconds a minute; a table whose newest event moves
    with every reading is ``growing`` when that growth exceeds ``GROWTH_LIMIT_S_PER_MIN``. Pure.

    The growth is the troughs' (``_trough_growth_s_per_min``): a table that keeps up comes back to the same
    freshness after each write, however far a slow batch (a retraining beside it, a final-windows batch) let it
    fall behind before; one that does not keep up comes back less far each time. Its peaks say neither: a table
    written once a trigger is a saw tooth whose peaks jitter by a batch's time, and a single stall of 20 s in the
    last third of a run read as 2 s a minute of growth for a table at 0 s behind at its first and last samples
    (docs/cost-model.md, "Which targets exclude each other")."""
    series: dict[str, list[tuple[float, float]]] = {}
    for sample in samples:
        if since <= sample["at"] <= until:
            for name, behind in sample["behind_kafka_s"].items():
                if behind is not None:
                    series.setdefault(name, []).append((sample["at"], behind))
    trend = {}
    for name, points in sorted(series.items()):
        growth = _trough_growth_s_per_min(sorted(points))
        trend[name] = {
            "samples": len(points),
            "first_s": round(points[0][1], 1),
            "last_s": round(points[-1][1], 1),
            "max_s": round(max(b for _, b in points), 1),
            "mean_s": round(sum(b for _, b in points) / len(points), 1),
            "growth_s_per_min": None if growth is None else round(growth, 3),
            "growing": None if name in EVENT_DRIVEN or growth is None else growth > GROWTH_LIMIT_S_PER_MIN,
        }
    return trend


def fastest_growth(trend: Mapping[str, Mapping[str, Any]]) -> tuple[str, float] | None:
    """The table (of those a trend is judged on) whose freshness grew fastest, and by how much a minute."""
    judged = [(name, t["growth_s_per_min"]) for name, t in trend.items() if t["growing"] is not None]
    return max(judged, key=lambda item: item[1]) if judged else None


def _trough_growth_s_per_min(points: list[tuple[float, float]]) -> float | None:
    """The trend of a freshness series' troughs, in seconds a minute; None for a series too short to tell.

    The run is cut into ``TROUGH_SLICES`` slices of equal time (fewer, but at least three, for a shorter run),
    each at least ``TROUGH_SLICE_S`` long so that it holds a write of a table written once a minute, and the
    trend is the median of the slopes between every two slices' lowest samples (Theil and Sen's estimator): a
    slice whose trough a stall hid moves it no more than any other single slice. A stall that outlasts the run's
    last slices moves it little too; the latencies' percentiles judge stalls.
    """
    span = points[-1][0] - points[0][0]
    slices = min(TROUGH_SLICES, int(span // TROUGH_SLICE_S))
    if slices < 3:
        return None
    width = span / slices
    grouped: list[list[tuple[float, float]]] = [[] for _ in range(slices)]
    for at, behind in points:
        grouped[min(slices - 1, int((at - points[0][0]) // width))].append((at, behind))
    troughs = [min(group, key=lambda point: point[1]) for group in grouped if group]
    slopes = [
        (later - earlier) / (t_later - t_earlier) * 60.0
        for i, (t_earlier, earlier) in enumerate(troughs)
        for t_later, later in troughs[i + 1 :]
    ]
    return median(slopes)


def main(argv: list[str] | None = None) -> int:
    from iotmon import logs
    from ml.registry import import_mlflow

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        say("usage: python -m bench.viewer SAMPLES.jsonl (settings from IOTMON_*)", sys.stderr)
        return 2
    settings = Settings.from_env()
    logs.setup(settings, "viewer")
    import_mlflow()  # the model section reads MLflow; its first import is not thread-safe
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    refreshes = view(settings, Path(args[0]), stop)
    say(f"viewer: {refreshes} refreshes, stopped at {datetime.now(UTC):%H:%M:%S}", sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
