"""The event-time clock: event time moves on without readings only when the source has nothing unread.

Event time only moves with data, so when the whole fleet falls silent the last windows, offline timers and
alert clearings would wait for the next reading. The clock ticks instead: it appends rows of event time to
the ``stream_clock`` table, which the stateful queries read with their source (``streaming.sources``).

Whether the fleet is silent is decided at the source, never downstream: a query that saw no readings for a
while may only be behind (a stalled scorer, a broker restart), and ticking then would move its watermark
past readings still on their way, which it would drop. So a tick that follows a table is written only
when Kafka holds nothing the ingest query has not read, that table holds everything read, and nothing new
has arrived for ``IOTMON_IDLE_TICK_AFTER``. Its time is the newest event time seen plus the wall time since
the last record arrived (or the clock started): event time advancing at the wall clock's pace, as a live
fleet's does. A stalled or restarted upstream therefore delays windows, and never drops readings from them.

A restarted stream resumes the clock where event time stood (the newest of silver's readings and of the ticks,
``resumed_event_time``): otherwise, restarted while its fleet is silent, it would wait for a reading that may
not come, and the fleet's last windows and offline devices with it.

Ticks are data in a Delta table, so a replayed batch sees the same ones.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from pyspark.sql.streaming.listener import QueryIdleEvent, QueryProgressEvent, QueryStartedEvent, QueryTerminatedEvent

from iotmon.config import Settings, interval_seconds
from iotmon.logs import say
from iotmon.ops import source_offsets
from iotmon.queries import JsonEventListener, explain
from iotmon.schema import ANOMALIES, EVENT_TIME, INGEST, SILVER, STREAM_CLOCK, as_utc
from streaming.sources import FOLLOWS

TICKED: dict[str, tuple[str, str | None]] = {SILVER: (INGEST, None), ANOMALIES: (ANOMALIES, SILVER)}
"""Each table ticks follow, with the query writing it and the table that query reads (None: Kafka, which a
tick already requires the ingest query to have read whole)."""
FOLLOWED = frozenset(query for query, _ in TICKED.values())
"""The queries whose progress the clock reads."""


@dataclass(frozen=True)
class Observed:
    """What the clock reads of the pipeline in one round."""

    kafka_unread: int | None
    """Records Kafka holds that the ingest query has not read; None when Kafka cannot be asked, or was not (the
    source not idle long enough for a tick)."""
    newest_event: datetime | None
    """The newest event time silver has seen."""
    idle_s: float
    """Wall seconds since the ingest query last read a record."""
    complete: Mapping[str, bool]
    """Per ticked table: whether it holds everything its query's source holds (empty when not asked)."""


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


def resumed_event_time(settings: Settings) -> datetime | None:
    """Where event time stood when the stream last stopped: the newest of silver's readings and of the ticks, by
    the Delta logs' file statistics (no data read); None on a new lake."""
    from deltalake import DeltaTable

    from iotmon.status import newest

    seen = []
    for table in (SILVER, STREAM_CLOCK):
        path = settings.table_path(table)
        if DeltaTable.is_deltatable(path) and (latest := newest(DeltaTable(path), EVENT_TIME)) is not None:
            seen.append(as_utc(latest))
    return max(seen, default=None)


class EventClock(threading.Thread):
    """Ticks event time forward while the source is idle (see the module docstring).

    What the queries have done it learns from Spark's listener bus, which hands it each progress report once
    (``progressed``); Kafka and the tables' versions it asks only once no record has arrived for
    ``IOTMON_IDLE_TICK_AFTER``, the only time a tick can be due. A clock that asked the queries, Kafka and the
    Delta log every trigger interval paid a py4j round trip per query, a Kafka client and a read of silver's log
    every 5 s of a live fleet, to learn that readings were still arriving (docs/cost-model.md)."""

    def __init__(self, spark: Any, settings: Settings, stop: threading.Event, out: TextIO = sys.stderr) -> None:
        super().__init__(name="iotmon-event-clock", daemon=True)
        self.spark, self.settings, self.stop, self.out = spark, settings, stop, out
        self.idle_after = interval_seconds(settings.idle_tick_after)
        self.every = interval_seconds(settings.trigger_interval)
        self._lock = threading.Lock()
        self.last_record_at = time.monotonic()
        self.newest_event: datetime | None = None
        """The newest event time the ingest query has reported (a batch without readings, which Spark runs to
        move the watermark on, reports none), or where it stood at the start (``start``)."""
        self.last_report: dict[str, Mapping[str, Any]] = {}
        """The last progress report of each query the ticks follow (``TICKED``)."""
        self.ticks = 0
        self.listener = _ProgressOf(self)

    def progressed(self, report: Mapping[str, Any]) -> None:
        """A query's next progress report (the listener bus hands over every one, in order)."""
        name = report.get("name")
        if name not in FOLLOWED:
            return
        with self._lock:
            self.last_report[name] = report
            if name != INGEST:
                return
            if report.get("numInputRows"):
                self.last_record_at = time.monotonic()
            if newest := (report.get("eventTime") or {}).get("max"):
                reported = datetime.fromisoformat(newest.replace("Z", "+00:00"))
                self.newest_event = max(self.newest_event or reported, reported)

    def observe(self, kafka_high: Callable[[], Mapping[int, int]], table_version: Callable[[str], int]) -> Observed:
        """What the reports say, with Kafka and the tables asked only if the source has been idle long enough
        for a tick: until then whether Kafka holds unread records is not asked (None), and no tick is due."""
        with self._lock:
            newest, idle_s, reports = self.newest_event, time.monotonic() - self.last_record_at, dict(self.last_report)
        if newest is None or idle_s < self.idle_after:
            return Observed(kafka_unread=None, newest_event=newest, idle_s=idle_s, complete={})
        for name in FOLLOWED - reports.keys():
            # No report since this clock started: a stream restarted on a source with nothing new runs no batch.
            # The query itself still knows where it stands (its last progress, idle triggers included).
            if (asked := self._asked(name)) is not None:
                reports[name] = asked
        ingest = reports.get(INGEST)
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
            end = delta_end(reports.get(query))
            complete[table] = end is not None and end > table_version(source)
        return Observed(kafka_unread=unread, newest_event=newest, idle_s=idle_s, complete=complete)

    def _asked(self, name: str) -> Mapping[str, Any] | None:
        query = next((q for q in self.spark.streams.active if q.name == name), None)
        return query.lastProgress if query is not None else None

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

    def start(self) -> None:
        """Resume where event time stood and listen, before the queries start; then tick on a thread of its own
        until ``stop``."""
        try:
            self.newest_event = resumed_event_time(self.settings)  # not listening yet: no report has come
        except Exception as exc:  # an unreadable log must not stop the stream: the clock waits for a reading
            say(
                f"event clock: cannot tell where event time stood ({explain(exc)}); it moves on with the next reading",
                self.out,
            )
        self.spark.streams.addListener(self.listener)
        super().start()

    def run(self) -> None:
        try:
            while not self.stop.wait(self.every):
                try:
                    self.tick_if_idle()
                except Exception as exc:  # a missed tick only delays finalisation; the next one catches up
                    say(f"event clock: tick failed ({explain(exc)}); retrying", self.out)
        finally:
            self.spark.streams.removeListener(self.listener)


class _ProgressOf(JsonEventListener):
    """Hands an event clock each progress report of the session's queries."""

    def __init__(self, clock: EventClock) -> None:
        self.clock = clock

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        """A start says nothing about what was read."""

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        self.clock.progressed(json.loads(event.progress.json))

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        """An idle trigger read nothing: the last report still holds."""

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        """A run's end leaves what it wrote, which its last report says."""
