"""Every streaming query's progress during a benchmark, kept in memory and sliced per phase.

The bench's own listener, not ``iotmon.ops``'s recorder: the recorder buffers rows into a Delta table for
dashboards, while a phase needs its rows at once, in this process, to sum inputs and read state sizes.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
)

from iotmon.ops import progress_row
from iotmon.queries import JsonEventListener

BATCH_PHASES: tuple[str, ...] = ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets")
"""The phases of a micro-batch its progress times (``durationMs``): the source's new offsets, the batch's data
frame, planning, running it into the sink, and the offset and commit logs. Their sum is most of the batch."""


class ProgressCollector(JsonEventListener):
    """Progress rows (``iotmon.ops.progress_row`` without the raw JSON) of every query of one session."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._rows: list[dict[str, Any]] = []
        self._started: set[str] = set()
        self._terminated: set[str] = set()

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        with self._lock:
            self._started.add(str(event.runId))

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        progress = json.loads(event.progress.json)
        row = progress_row(progress)
        row.pop("progress_json", None)
        row["phases_ms"] = {
            phase: ms for phase, ms in (progress.get("durationMs") or {}).items() if phase in BATCH_PHASES
        }
        with self._lock:
            self._rows.append(row)
            self._lock.notify_all()

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        """Idle triggers run no batch: nothing to record."""

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        with self._lock:
            self._terminated.add(str(event.runId))
            self._lock.notify_all()

    def install(self, spark: SparkSession) -> ProgressCollector:
        spark.streams.addListener(self)
        return self

    def mark(self) -> int:
        """Where a phase starts: pass it to ``since``."""
        with self._lock:
            return len(self._rows)

    def since(self, mark: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows[mark:])

    def settle(self, timeout: float = 10.0) -> None:
        """Events arrive on Spark's listener bus after the fact: wait until every stopped query's last ones did."""
        with self._lock:
            self._lock.wait_for(lambda: self._started <= self._terminated, timeout)

    def input_rows(self, mark: int) -> dict[str, int]:
        """Rows each query has read since ``mark``."""
        totals: dict[str, int] = {}
        for row in self.since(mark):
            name = row["query_name"] or row["query_id"]
            totals[name] = totals.get(name, 0) + (row["input_rows"] or 0)
        return totals

    def batch_costs(self, mark: int) -> list[dict[str, Any]]:
        """Per query since ``mark``: batches run, rows read, and seconds spent in them (mean and max, and the mean
        of each phase): what a batch costs whatever its size is the fixed part of the cost model
        (docs/cost-model.md)."""
        per_query: dict[str, list[dict[str, Any]]] = {}
        for row in self.since(mark):
            per_query.setdefault(row["query_name"] or row["query_id"], []).append(row)
        costs = []
        for name, rows in per_query.items():
            seconds = [(r["batch_duration_ms"] or 0) / 1000 for r in rows]
            phases = {
                phase: round(sum((r.get("phases_ms") or {}).get(phase, 0) for r in rows) / 1000 / len(rows), 3)
                for phase in BATCH_PHASES
            }
            costs.append(
                {
                    "name": name,
                    "batches": len(rows),
                    "rows": sum(r["input_rows"] or 0 for r in rows),
                    "batch_seconds": round(sum(seconds), 3),
                    "mean_batch_s": round(sum(seconds) / len(rows), 3),
                    "max_batch_s": round(max(seconds), 3),
                    "mean_phase_s": phases,
                }
            )
        return costs
