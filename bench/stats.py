"""Pure arithmetic of the benchmark: percentiles, rates, per-query summaries of progress, targets.

Kept free of Spark and Kafka so each figure's definition is unit-tested on small hand-made inputs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

BOUNDED_GROWTH = 1.25
"""State counts as bounded when its peak over the last third of batches is at most this many times its
peak over the middle third: by then event time has moved past the watermark and the longest window, so
state that still grows is growing with the data, not with the windows in flight."""
MIN_BATCHES_FOR_BOUNDED = 6


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) with linear interpolation between the closest ranks; None if empty."""
    if not values:
        return None
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], not {q}")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def rate(count: int | float, seconds: float) -> float:
    """Per second, 0 for an empty or instant measurement (never a division by zero)."""
    return count / seconds if seconds > 0 else 0.0


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def cpu_bound(events: int, cpu_seconds: float | None, cores: float | None) -> float | None:
    """The most events a second ``cores`` could drain at the CPU a drain spent per event: every core busy with
    nothing else, so a bound that no scheduling beats, only less CPU per event (None without a figure)."""
    if not cpu_seconds or not cores or events <= 0:
        return None
    return cores * events / cpu_seconds


def state_bounded(state_rows: Sequence[int]) -> bool | None:
    """Whether state stopped growing (see ``BOUNDED_GROWTH``); None with too few batches to tell."""
    if len(state_rows) < MIN_BATCHES_FOR_BOUNDED:
        return None
    third = len(state_rows) // 3
    middle, last = state_rows[third : 2 * third], state_rows[2 * third :]
    return max(last) <= BOUNDED_GROWTH * max(max(middle), 1)


@dataclass(frozen=True)
class QuerySummary:
    """One query's batches in one phase, from its progress rows (``iotmon.ops.progress_row``)."""

    name: str
    batches: int
    input_rows: int
    batch_seconds: float
    state_rows_last: int | None
    state_rows_max: int | None
    state_memory_bytes_last: int | None
    state_memory_bytes_max: int | None
    state_rows_series: tuple[int, ...]
    state_bounded: bool | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "batches": self.batches,
            "input_rows": self.input_rows,
            "batch_seconds": round(self.batch_seconds, 3),
            "state_rows_last": self.state_rows_last,
            "state_rows_max": self.state_rows_max,
            "state_memory_bytes_last": self.state_memory_bytes_last,
            "state_memory_bytes_max": self.state_memory_bytes_max,
            "state_rows_series": list(self.state_rows_series),
            "state_bounded": self.state_bounded,
        }


def summarise_progress(rows: Iterable[Mapping[str, Any]]) -> dict[str, QuerySummary]:
    """Per query name, in batch order: input rows, time in batches, state rows and state memory."""
    by_query: dict[str, list[Mapping[str, Any]]] = {}
    for row in rows:
        by_query.setdefault(row["query_name"] or row["query_id"], []).append(row)
    summaries = {}
    for name, batches in by_query.items():
        batches.sort(key=lambda r: (r["timestamp"], r["batch_id"]))
        states = [r["state_rows"] for r in batches if r.get("state_rows") is not None]
        memory = [r["state_memory_bytes"] for r in batches if r.get("state_memory_bytes") is not None]
        summaries[name] = QuerySummary(
            name=name,
            batches=len(batches),
            input_rows=sum(r.get("input_rows") or 0 for r in batches),
            batch_seconds=sum(r.get("batch_duration_ms") or 0 for r in batches) / 1000,
            state_rows_last=states[-1] if states else None,
            state_rows_max=max(states) if states else None,
            state_memory_bytes_last=memory[-1] if memory else None,
            state_memory_bytes_max=max(memory) if memory else None,
            state_rows_series=tuple(states),
            state_bounded=state_bounded(states) if states else None,
        )
    return summaries


@dataclass(frozen=True)
class Target:
    """One of the issue's targets, against what was measured (None when its phase did not run)."""

    what: str
    goal: str
    measured: float | None
    limit: float
    at_most: bool = False
    """True for a ceiling (latency), False for a floor (throughput)."""
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.limit if self.at_most else self.measured >= self.limit

    def to_dict(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "goal": self.goal,
            "measured": self.measured,
            "limit": self.limit,
            "met": self.met,
            "note": self.note,
        }
