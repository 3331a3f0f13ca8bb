"""The event-time clock: event time moves on without readings only when the source has nothing unread.

Event time only moves with data, so when the whole fleet falls silent the last windows, offline timers and
alert clearings would wait for the next reading. The clock ticks instead: it appends rows of event time to
the ``stream_clock`` table, which the stateful queries read with their source (``streaming.sources``).

Whether the fleet is silent is decided at the source, never downstream: a query that saw no readings for a
while may only be behind (a stalled scorer, a broker restart), and ticking then would move its watermark
past readings still on their way, which it would drop. So a tick that follows a table is written only
when Kafka holds nothing the ingest query has not read, that table holds everything read, and nothing new
has arrived for ``IOTMON_IDLE_TICK_AFTER``. Its time is the newest event time seen plus the wall time since
the last record arrived: event time advancing at the wall clock's pace, as a live fleet's does. A stalled or
restarted upstream therefore delays windows, and never drops readings from them.

Ticks are data in a Delta table, so a replayed batch sees the same ones.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from iotmon.config import Settings, interval_seconds
from iotmon.ops import source_offsets
from iotmon.queries import explain
from iotmon.schema import ANOMALIES, EVENT_TIME, INGEST, SILVER, STREAM_CLOCK
from streaming.sources import FOLLOWS

TICKED: dict[str, tuple[str, str | None]] = {SILVER: (INGEST, None), ANOMALIES: (ANOMALIES, SILVER)}
"""Each table ticks follow, with the query writing it and the table that query reads (None: Kafka, which a
tick already requires the ingest query to have read whole)."""


@dataclass(frozen=True)
class Observed:
    """What the clock reads of the pipeline in one round."""

    kafka_unread: int | None
    """Records Kafka holds that the ingest query has not read; None when Kafka cannot be asked."""
    newest_event: datetime | None
    """The newest event time silver has seen."""
    idle_s: float
    """Wall seconds since the ingest query last read a record."""
    complete: Mapping[str, bool]
    """Per ticked table: whether it holds everything its query's source holds."""


def ticks_due(observed: Observed, idle_after_s: float) -> dict[str, datetime]:
    """The tick to append for each table now (none while anything is unread or still arriving); pure."""
    if observed.kafka_unread != 0 or observed.newest_event is None or observed.idle_s < idle_after_s:
        return {}
    tick = observed.newest_event + timedelta(seconds=observed.idle_s)
    return {table: tick for table, complete in observed.complete.items() if complete}


def delta_end(progress: Mapping[str, Any] | None) -> int | None:
    """The table version a Delta-sourced query has read up to: every version before it is read. (Once a
    query has read version v whole, its offset points at the start of v + 1.)"""
    for source in (progress or {}).get("sources") or []:
        end = source_offsets(source.get("endOffset"))
        if end is not None and "reservoirVersion" in end:
            return int(end["reservoirVersion"])
    return None


def kafka_end(progress: Mapping[str, Any] | None) -> dict[int, int]:
    """The Kafka offsets, per partition, that a query has read up to (its last batch's end)."""
    for source in (progress or {}).get("sources") or []:
        end = source_offsets(source.get("endOffset"))
        if end and all(isinstance(v, dict) for v in end.values()):
            return {int(p): int(o) for partitions in end.values() for p, o in partitions.items()}
    return {}


class EventClock(threading.Thread):
    """Ticks event time forward while the source is idle (see the module docstring)."""

    def __init__(self, spark: Any, settings: Settings, stop: threading.Event, out: TextIO = sys.stderr) -> None:
        super().__init__(name="iotmon-event-clock", daemon=True)
        self.spark, self.settings, self.stop, self.out = spark, settings, stop, out
        self.idle_after = interval_seconds(settings.idle_tick_after)
        self.every = interval_seconds(settings.trigger_interval)
        self.last_record_at = time.monotonic()
        self.ingest_batch = -1
        self.newest_event: datetime | None = None
        """The newest event time the ingest query has reported: a batch without readings (Spark runs one to
        move the watermark on) reports none."""
        self.ticks = 0

    def _query(self, name: str) -> Any:
        return next((q for q in self.spark.streams.active if q.name == name), None)

    def _progress(self, name: str) -> Mapping[str, Any] | None:
        query = self._query(name)
        return query.lastProgress if query is not None else None

    def observe(self, kafka_high: Callable[[], Mapping[int, int]], table_version: Callable[[str], int]) -> Observed:
        query = self._query(INGEST)
        ingest = query.lastProgress if query is not None else None
        # Every report since the last round, not only the last one: a batch of readings followed at once by a
        # batch without any (Spark runs one to move the watermark on) must still set the newest event time.
        reports: list[Mapping[str, Any]] = []
        if ingest is not None and ingest["batchId"] > self.ingest_batch + 1:
            reports = query.recentProgress  # up to a hundred, parsed from the JVM: only when one was missed
        elif ingest is not None:
            reports = [ingest]
        for report in reports:
            if report["batchId"] <= self.ingest_batch:
                continue
            self.ingest_batch = report["batchId"]
            if report.get("numInputRows"):
                self.last_record_at = time.monotonic()
            if newest := report.get("eventTime", {}).get("max"):
                reported = datetime.fromisoformat(newest.replace("Z", "+00:00"))
                self.newest_event = max(self.newest_event or reported, reported)
        try:
            read, high = kafka_end(ingest), kafka_high()
            unread = sum(max(0, offset - read.get(partition, 0)) for partition, offset in high.items())
        except Exception:  # Kafka cannot say: nothing is known to be idle
            unread = None
        complete = {}
        for table, (query, source) in TICKED.items():
            if source is None:
                complete[table] = ingest is not None
                continue
            end = delta_end(self._progress(query))
            complete[table] = end is not None and end > table_version(source)
        return Observed(
            kafka_unread=unread,
            newest_event=self.newest_event,
            idle_s=time.monotonic() - self.last_record_at,
            complete=complete,
        )

    def tick_if_idle(self) -> None:
        from iotmon.kafka import partition_offsets
        from iotmon.lake import append_rows, table_version

        def kafka_high() -> dict[int, int]:
            return {partition: high for partition, (_, high) in partition_offsets(self.settings, timeout=5).items()}

        def version(table: str) -> int:
            return table_version(self.settings.table_path(table))

        due = ticks_due(self.observe(kafka_high, version), self.idle_after)
        if due:
            import pyarrow as pa

            # Typed by the table's own schema (``append_rows`` conforms the rows to it).
            rows = pa.table({EVENT_TIME: [t.astimezone(UTC) for t in due.values()], FOLLOWS: list(due)})
            append_rows(rows, self.settings.table_path(STREAM_CLOCK))
            self.ticks += len(due)

    def run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                self.tick_if_idle()
            except Exception as exc:  # a missed tick only delays finalisation; the next one catches up
                print(f"event clock: tick failed ({explain(exc)}); retrying", file=self.out, flush=True)
