"""Running streaming queries: until the input is drained, or continuously under supervision.

Each stage contributes ``QuerySpec``s; this module starts them with a trigger, restarts a failed one with
backoff, reports progress and stops them cleanly. Exactly-once does not depend on any of it: a query
restarted from its checkpoint replays uncommitted batches into idempotent sinks.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TextIO

from pyspark.errors import StreamingQueryException
from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery, StreamingQueryListener
from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
)

from iotmon.config import Settings
from iotmon.logs import say

Trigger = dict[str, Any]
"""Keyword arguments of ``DataStreamWriter.trigger``: ``{"availableNow": True}``, ``{"processingTime": ...}``."""

AVAILABLE_NOW: Trigger = {"availableNow": True}
SCHEDULER_POOL = "spark.scheduler.pool"
"""The local property naming a job's fair-scheduler pool; a query's jobs inherit it from the thread that
starts it, its ``foreachBatch`` writes included."""
READY_POLL_SECONDS = 10.0
"""How often a waiting query asks again whether it can run."""
RATE_BATCHES = 3
"""How many batches in a row must ask for another trigger before a query moves to it (``run_continuously``'s
``trigger_at``): a catch-up batch after a start, or a pause, does not move it alone."""
DRAIN_CHECK_SECONDS = 2.0
"""How often, at least, a draining run asks whether every query has read all its source holds; it also asks
whenever a query has finished a batch."""


@dataclass(frozen=True)
class QuerySpec:
    name: str
    start: Callable[[SparkSession, Settings, Trigger], StreamingQuery]
    ready: Callable[[SparkSession, Settings], str | None] | None = None
    """For a query that needs something besides its input (the scorer needs a model): None when it can
    run, else why not. A query that is not ready waits (and is not counted as failing) until it is."""
    state_variables: tuple[str, ...] = ()
    """The state variables of its ``transformWithState`` operator, which its checkpoint records: a checkpoint
    recording others holds state of an earlier version (``recorded_state_variables``)."""
    state_operators: tuple[str, ...] | None = None
    """Spark's names of its stateful operators (``()``: none), which its checkpoint records, for a query whose plan
    an earlier version built otherwise: a checkpoint recording others is that version's, which Spark cannot
    continue (``recorded_state_operators``). None: not checked."""

    def waiting_for(self, spark: SparkSession, settings: Settings) -> str | None:
        return self.ready(spark, settings) if self.ready is not None else None


def recorded_state_variables(checkpoint: Path) -> set[str] | None:
    """The state variables a query's local checkpoint recorded for its ``transformWithState`` operators
    (Spark's own timers left out), from the newest operator metadata; None without any."""
    names: set[str] | None = None
    for versions in checkpoint.glob("state/*/_metadata/v2"):
        written = [path for path in versions.iterdir() if path.name.isdigit()]
        if not written:
            continue
        newest = max(written, key=lambda path: int(path.name))
        try:
            _, metadata = newest.read_text().split("\n", 1)  # a version line ("v2"), then the JSON
            variables = json.loads(json.loads(metadata).get("operatorPropertiesJson") or "{}")["stateVariables"]
            recorded = {v["stateName"] for v in variables if not v["stateName"].startswith("$")}
        except (ValueError, KeyError, TypeError):
            continue  # not a transformWithState operator's, or not Spark 4's format: nothing to tell
        names = (names or set()) | recorded
    return names


def recorded_state_operators(checkpoint: Path) -> set[str] | None:
    """Spark's names of the stateful operators a query's local checkpoint recorded (``state/<n>/_metadata/metadata``:
    a version line, then the JSON; ``transformWithState`` writes its own format instead); None without any."""
    names: set[str] | None = None
    for path in checkpoint.glob("state/*/_metadata/metadata"):
        try:
            _, metadata = path.read_text().split("\n", 1)
            name = json.loads(metadata)["operatorInfo"]["operatorName"]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not Spark 4's format: nothing to tell
        names = (names or set()) | {str(name)}
    return names


def streamed_table_ids(checkpoint: Path) -> list[str]:
    """The ids of the Delta tables a query's local checkpoint streamed, from its newest offsets (a version line,
    the batch's metadata, then one offset per source; a Delta source's names its table's id); empty without."""
    logged = [path for path in (checkpoint / "offsets").glob("*") if path.name.isdigit()]
    if not logged:
        return []
    ids = []
    for line in max(logged, key=lambda path: int(path.name)).read_text().splitlines()[2:]:
        try:
            offset = json.loads(line)
        except ValueError:
            continue  # another source's offset, or a line being written
        if isinstance(offset, dict) and "reservoirId" in offset:
            ids.append(str(offset["reservoirId"]))
    return ids


_STARTS = threading.RLock()
"""Held while a query starts: a query copies the session's configuration when it is created, so a start must
not see another's temporary settings (``query_settings``)."""


@contextmanager
def query_settings(spark: SparkSession, conf: Mapping[str, str]) -> Iterator[None]:
    """Session configuration ``conf`` for the queries started inside only: each streaming query runs in a copy of
    the session made when it is created (Spark's ``sparkSessionForStream``), so the setting stays with it, and
    the session gets its own values back at the end. Starts are one at a time meanwhile (``start_query``)."""
    with _STARTS:
        before = {key: spark.conf.get(key, None) for key in conf}
        try:
            for key, value in conf.items():
                spark.conf.set(key, value)
            yield
        finally:
            for key, value in before.items():
                if value is None:
                    spark.conf.unset(key)
                else:
                    spark.conf.set(key, value)


def start_query(
    spec: QuerySpec, spark: SparkSession, settings: Settings, trigger: Trigger, out: TextIO
) -> StreamingQuery:
    """Start ``spec`` in a fair-scheduler pool of its own, after clearing what a crash in its first offset
    write may have left (see ``iotmon.lake.remove_unfinished_first_batch``).

    With the session's FAIR scheduler (``iotmon.spark``), a pool per query lets a small bronze batch take the
    next free core instead of queueing behind every task of a scorer batch, as one FIFO queue would have it.
    """
    from iotmon.lake import remove_unfinished_first_batch

    if removed := remove_unfinished_first_batch(spark, settings.checkpoint_path(spec.name)):
        say(f"{spec.name}: removed {', '.join(removed)}: the first batch's offsets, unfinished when a crash hit", out)
    context = spark.sparkContext
    context.setLocalProperty(SCHEDULER_POOL, spec.name)
    try:
        with _STARTS:
            return spec.start(spark, settings, trigger)
    finally:
        context.setLocalProperty(SCHEDULER_POOL, None)  # None removes it


def wrote_batch(progress: Mapping[str, Any] | None) -> bool:
    """Whether a progress report is of a batch that reached its sink (not of a trigger that found no data)."""
    return progress is not None and "addBatch" in progress["durationMs"]


class JsonEventListener(StreamingQueryListener):
    """A streaming query listener whose events are read from the JSON Spark renders them as.

    PySpark's own adapter copies a progress report into Python field by field, a py4j round trip each, and
    resolves a JVM class by name for every observed metric; on the listener bus's thread such a lookup
    searches every jar on the class path: 60-65 ms of that thread and 25-28 ms of the Python driver an event
    (docs/cost-model.md). Here each event costs one call (``json()``), about 1 ms, and the listener gets
    PySpark's own event classes, built with their ``fromJson``.
    """

    @property
    def _jlistener(self) -> Any:  # what ``StreamingQueryManager.addListener`` registers
        if not hasattr(self, "_json_jlistener"):
            from pyspark import SparkContext

            jvm = SparkContext._jvm
            assert jvm is not None, "listeners are installed on a running session"
            self._json_jlistener = jvm.PythonStreamingQueryListenerWrapper(_EventsFromJson(self))
        return self._json_jlistener


class _EventsFromJson:
    """The Java interface PySpark's listeners implement (``PythonStreamingQueryListener``), over JSON.

    A report's ``inputRowsPerSecond`` is its rows over the time since the start of the run's previous batch:
    Spark divides by the time since the previous trigger, which for a query that polls its source between
    batches (the ingest query's ``ingest.landing.early_batches``) is one poll, and would say 2,500 records a
    second at the demo's 500."""

    def __init__(self, listener: StreamingQueryListener) -> None:
        self.listener = listener
        self._batch_started: dict[str, datetime] = {}
        """Per run, when its last reported batch started."""

    def onQueryStarted(self, jevent: Any) -> None:
        self.listener.onQueryStarted(QueryStartedEvent.fromJson(json.loads(jevent.json())))

    def onQueryProgress(self, jevent: Any) -> None:
        event = json.loads(jevent.json())
        progress = event["progress"]
        started = datetime.fromisoformat(progress["timestamp"])
        previous = self._batch_started.get(progress["runId"])
        self._batch_started[progress["runId"]] = started
        if previous is not None and started > previous:
            progress["inputRowsPerSecond"] = progress["numInputRows"] / (started - previous).total_seconds()
        self.listener.onQueryProgress(QueryProgressEvent.fromJson(event))

    def onQueryIdle(self, jevent: Any) -> None:
        self.listener.onQueryIdle(QueryIdleEvent.fromJson(json.loads(jevent.json())))

    def onQueryTerminated(self, jevent: Any) -> None:
        self.listener.onQueryTerminated(QueryTerminatedEvent.fromJson(json.loads(jevent.json())))

    class Java:
        implements: ClassVar[list[str]] = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]


class QueryEvents(JsonEventListener):
    """What a supervisor knows of its queries' runs, as Spark's listener bus tells it: each run's last progress
    report, the newest that read rows, whether a batch of it reached its sink, whether it has ended.

    Asking the queries instead (``isActive``, ``lastProgress``, ``recentProgress``) is a py4j round trip each,
    served by a JVM thread too: a supervisor asking seven queries twice a second held the Python driver's
    interpreter more than anything but the writes (docs/cost-model.md). The bus tells each report once, as its
    batch ends. Install it before the queries it follows start (``query_events``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, Mapping[str, Any]] = {}
        self._with_rows: dict[str, Mapping[str, Any]] = {}
        self._rates: dict[str, deque[float]] = {}
        self._wrote: set[str] = set()
        self._ended: set[str] = set()

    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        """A run's start is known to whoever started it."""

    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        self.progressed(json.loads(event.progress.json))

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        """Triggers that found nothing to do: Spark posts this every ``noDataProgressEventInterval`` instead of a
        report (and nothing for a run's first idle trigger), so ``last`` stays the last batch's report."""

    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        self.terminated(str(event.runId))

    def progressed(self, progress: Mapping[str, Any]) -> None:
        """A run's next progress report."""
        run = progress["runId"]
        with self._lock:
            self._last[run] = progress
            if progress["numInputRows"]:
                self._with_rows[run] = progress
                # A run's first batch has no trigger before it to measure a rate from (Spark reports 0).
                if (rate := progress.get("inputRowsPerSecond") or 0) > 0:
                    self._rates.setdefault(run, deque(maxlen=RATE_BATCHES)).append(rate)
            if wrote_batch(progress):
                self._wrote.add(run)

    def terminated(self, run: str) -> None:
        """A run has ended, failed or stopped."""
        with self._lock:
            self._ended.add(run)

    def last(self, run: str) -> Mapping[str, Any] | None:
        """The run's last progress report: None until it has finished a batch."""
        with self._lock:
            return self._last.get(run)

    def newest_with_rows(self, run: str) -> Mapping[str, Any] | None:
        """The run's newest report of a batch that read rows (a stateful query follows one with a batch
        without data to move its watermark on, which then is the last report)."""
        with self._lock:
            return self._with_rows.get(run)

    def rates(self, run: str) -> list[float]:
        """The input rates (rows a second since the trigger before) of the run's last ``RATE_BATCHES`` batches
        that read rows, oldest first."""
        with self._lock:
            return list(self._rates.get(run, ()))

    def wrote(self, run: str) -> bool:
        """Whether a batch of the run reached its sink."""
        with self._lock:
            return run in self._wrote

    def ended(self, run: str) -> bool:
        """Whether the run has ended, failed or stopped."""
        with self._lock:
            return run in self._ended


@contextmanager
def query_events(spark: SparkSession) -> Iterator[QueryEvents]:
    """The events of ``spark``'s queries while the block runs."""
    events = QueryEvents()
    spark.streams.addListener(events)
    try:
        yield events
    finally:
        spark.streams.removeListener(events)


class QueryFailed(RuntimeError):
    """A query failed more often in a row than ``IOTMON_QUERY_RESTARTS`` allows."""


_HINTS = {
    "data may have been missed": (
        "The topic holds fewer records than the checkpoint has already read: Kafka's data was reset while "
        "the lake and checkpoints were kept. Wipe both together (`iotmon reset`) or restore the broker's data."
    ),
    "UnknownTopicOrPartition": (
        "The topic is gone from the broker (deleted while the stream ran?); `iotmon stream` creates it at start."
    ),
}


_PYTHON_ERROR_LINE = re.compile(r"^\w[\w.]*(Error|Exception|Exit|Interrupt)\b")


def explain(error: BaseException | str) -> str:
    """The telling line of a query error, with a hint when the cause is a known operator mistake.

    Usually that is the first line; for a Python error raised inside a batch, Spark's first line only says
    a traceback follows, so the traceback's last ``SomeError: message`` line is used instead.
    """
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    summary = lines[0] if lines else repr(error)
    if "Traceback (most recent call last)" in text:
        causes = [line for line in lines if _PYTHON_ERROR_LINE.match(line)]
        summary = causes[-1] if causes else summary
    hints = [hint for needle, hint in _HINTS.items() if needle in text]
    return summary + ("\n  hint: " + hints[0] if hints else "")


def progress_line(name: str, progress: Mapping[str, Any] | None) -> str:
    """One line about query ``name``: a batch's ``progress``, or (None) that it is starting."""
    if not progress:
        return f"{name:<12} starting"
    from iotmon.ops import kafka_lag  # ops builds on this module

    lag = kafka_lag(progress.get("sources", [])) or 0
    return (
        f"{name:<12} batch {progress['batchId']:>5}  rows {progress['numInputRows']:>9,}  "
        f"in {progress.get('inputRowsPerSecond', 0):>10,.0f}/s  "
        f"done {progress.get('processedRowsPerSecond', 0):>10,.0f}/s  "
        f"batch {progress['durationMs'].get('triggerExecution', 0) / 1000:>6.2f}s  kafka lag {lag:,}"
    )


class ProgressReport:
    """What the console hears about running queries: each query once as it starts, then its newest batch that
    read rows, once. A query's last report stays the same until its next batch, and is often of a batch without
    data (the one a stateful query runs after a batch to move its watermark): repeating those would bury the
    news, and showing only the last report would hide the batch before it."""

    def __init__(self, events: QueryEvents) -> None:
        self._events = events
        self._checked: dict[str, tuple[str, int | None]] = {}
        """Per query, the run and batch id of the last report looked at."""
        self._shown: dict[str, tuple[str, int]] = {}
        """Per query, the run and batch id of the last batch reported."""

    def lines(self, runs: Mapping[str, str]) -> list[str]:
        """The lines due about the queries ``runs`` names, each by its run id."""
        lines = []
        for name, run in runs.items():
            last = self._events.last(run)
            checked = (run, last["batchId"] if last else None)
            if self._checked.get(name) == checked:
                continue
            self._checked[name] = checked
            if not last:
                lines.append(progress_line(name, None))
                continue
            shown_run, shown_batch = self._shown.get(name, (None, -1))
            after = shown_batch if shown_run == run else -1
            newest = self._events.newest_with_rows(run)
            if newest is None or newest["batchId"] <= after:
                continue
            self._shown[name] = (run, newest["batchId"])
            lines.append(progress_line(name, newest))
        return lines

    def show(self, runs: Mapping[str, str], out: TextIO) -> None:
        for line in self.lines(runs):
            say(line, out)


def await_batches(
    query: StreamingQuery, poll_every: float, on_poll: Callable[[], None] = lambda: None
) -> list[dict[str, Any]]:
    """Wait until ``query`` ends (an available-now query); the progress report of each of its batches.

    Gathered as it runs, every ``poll_every`` seconds (then ``on_poll()``): Spark keeps only a query's last 99
    reports, so a drain of more batches would otherwise count the last ones only."""
    reports: dict[int, dict[str, Any]] = {}
    while not query.awaitTermination(poll_every):
        reports |= {p["batchId"]: p for p in query.recentProgress}
        on_poll()
    reports |= {p["batchId"]: p for p in query.recentProgress}
    return [reports[batch] for batch in sorted(reports)]


def run_until_idle(
    spark: SparkSession,
    settings: Settings,
    specs: Sequence[QuerySpec],
    out: TextIO = sys.stderr,
    report_every: float = 10.0,
    upstream: Callable[[str], Collection[str]] | None = None,
) -> dict[str, int]:
    """Run each query with the available-now trigger once the queries it reads from have finished, so each
    sees all its upstream wrote; the rows each read.

    ``specs`` come upstream first. By default each query waits for every one before it: one at a time, in
    order. With ``upstream`` (the queries that write what a query reads, by name), every query whose upstream
    has finished runs at once, beside the others, each in its own pool: queries that read the same table
    share the cores instead of queueing, and a cold JVM's single-threaded work (planning, compiling) of one
    overlaps another's tasks. Once a query has failed no other starts; its failure is raised when those running
    have ended."""
    names = [spec.name for spec in specs]
    finished = {name: threading.Event() for name in names}
    rows: dict[str, int] = {}
    failures: list[BaseException] = []

    def waits_for(position: int, name: str) -> list[str]:
        return names[:position] if upstream is None else [n for n in upstream(name) if n in finished]

    def drain(position: int, spec: QuerySpec) -> None:
        try:
            for name in waits_for(position, spec.name):
                finished[name].wait()
            if not failures and (read := _drain_one(spark, settings, spec, events, out, report_every)) is not None:
                rows[spec.name] = read
        except BaseException as exc:  # raised by the caller's thread, below
            failures.append(exc)
        finally:
            finished[spec.name].set()

    threads = [
        threading.Thread(target=drain, args=(position, spec), name=f"iotmon-drain-{spec.name}", daemon=True)
        for position, spec in enumerate(specs)
    ]
    with query_events(spark) as events:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return {name: rows[name] for name in names if name in rows}


def _drain_one(
    spark: SparkSession, settings: Settings, spec: QuerySpec, events: QueryEvents, out: TextIO, report_every: float
) -> int | None:
    """Run one query with the available-now trigger until it ends; the rows it read, None if it cannot run."""
    waiting = spec.waiting_for(spark, settings)
    if waiting is not None:
        say(f"{spec.name:<12} skipped: {waiting}", out)
        return None
    started = time.monotonic()
    query = start_query(spec, spark, settings, AVAILABLE_NOW, out)
    show = partial(ProgressReport(events).show, {spec.name: str(query.runId)}, out)
    try:
        batches = await_batches(query, report_every, show)
    except StreamingQueryException as exc:
        raise QueryFailed(f"query {spec.name} failed: {settings.redact(explain(exc))}") from exc
    rows = sum(p["numInputRows"] for p in batches)
    say(f"{spec.name:<12} drained {rows:,} rows in {time.monotonic() - started:.1f}s", out)
    return rows


def run_continuously(
    spark: SparkSession,
    settings: Settings,
    specs: Sequence[QuerySpec],
    stop: threading.Event,
    out: TextIO = sys.stderr,
    report_every: float = 10.0,
    trigger_of: Callable[[QuerySpec], Trigger] | None = None,
    unread: Callable[[], Sequence[str]] | None = None,
    lead: Collection[str] = (),
    hold: Callable[[], str | None] | None = None,
    upstream: Callable[[str], Collection[str]] | None = None,
    trigger_at: Callable[[QuerySpec, float], Trigger] | None = None,
) -> None:
    """Run the queries until ``stop`` is set, restarting a failed query with exponential backoff; a query that
    fails more than ``IOTMON_QUERY_RESTARTS`` times in a row (without a batch written in between) ends the
    run. A stream runs for days: failures that each follow a working batch (a write conflict, a broker
    restart) are not a broken query.

    Each query runs with ``trigger_of(spec)``; by default every ``IOTMON_TRIGGER_INTERVAL``. With ``trigger_at``
    (the processing-time trigger for a query whose input arrives at so many rows a second), a query whose last
    ``RATE_BATCHES`` batches each ask it for another trigger moves to it: stopped between two batches and started
    again on it, from its checkpoint. A calm input's budget is the CPU, a busy one's its latency
    (docs/cost-model.md, "Triggers that follow the rate"). With ``unread`` (the running queries that have input they
    have not read), a stop drains first: the queries, warm, keep running until ``unread()`` is empty, which spares a
    drain the start of every query and its state. A drain has no budget left to keep: the queries with a slower
    trigger are restarted on the default one, so the drain does not wait for their next trigger. Each is stopped
    between two batches and started again once every query ``upstream(name)`` names (by default the lead queries)
    has read all its source holds: the lead queries, which everything else reads, finish alone, and each query then
    reads what is left in one batch, once, instead of a batch for what its upstream has written so far and another
    for the rest.

    The queries named in ``lead`` start first, the others once each of those has finished its first trigger
    (or a stop begins the drain): in a cold JVM, queries starting together share two cores while the JIT
    warms up, and the first batch of the queries everything else reads took half as long alone. A lead query
    waiting to be ready does not hold the others back, unless ``hold()`` gives a reason to wait for it: then
    the others start once ``hold()`` gives none and the lead queries it made ready have finished a trigger.

    What the loop knows of the queries (a batch finished, written, the query ended) the listener bus tells it
    (``QueryEvents``); each query is asked itself only once a report, in case the bus dropped an event.
    """
    every: Trigger = {"processingTime": settings.trigger_interval}
    budget = trigger_of or (lambda spec: every)
    draining = threading.Event()
    """Set once ``stop`` is: from then on only ``unread()`` ends the run, and waits do not end early."""

    def trigger(spec: QuerySpec) -> Trigger:
        return every if draining.is_set() else budget(spec)

    queries: dict[str, StreamingQuery] = {}
    waiting: dict[str, float] = {}
    """Queries that are not ready, and when to ask again."""
    specs_by_name = {spec.name: spec for spec in specs}
    lead = {name for name in lead if name in specs_by_name}
    upstream_of = upstream or (lambda name: lead)
    following = {spec.name: spec for spec in specs if lead and spec.name not in lead}
    """Queries that start once every lead query has finished a trigger."""

    runs: dict[str, str] = {}
    """Each running query's run id: what the loop looks up in ``events``, the listener bus's record (below)."""
    running_on: dict[str, Trigger] = {}
    """Each running query's trigger."""

    def launch(spec: QuerySpec, on: Trigger) -> None:
        """Start ``spec`` and say so now: the periodic report comes up to ``report_every`` later, and a start
        announced then reads as a start that took that long."""
        queries[spec.name] = start_query(spec, spark, settings, on, out)
        runs[spec.name] = str(queries[spec.name].runId)
        running_on[spec.name] = on
        report.show({spec.name: runs[spec.name]}, out)

    def rate_trigger(spec: QuerySpec) -> Trigger | None:
        """The trigger each of the query's last ``RATE_BATCHES`` batches asks for by its input's rate, when that
        is not the one it runs on (None while draining: a drain has a trigger of its own)."""
        if trigger_at is None or draining.is_set():
            return None
        rates = events.rates(runs[spec.name])
        if len(rates) < RATE_BATCHES:
            return None
        asked = [trigger_at(spec, rate) for rate in rates]
        if any(ask != asked[0] for ask in asked) or asked[0] == running_on[spec.name]:
            return None
        return asked[0]

    def start_when_ready(spec: QuerySpec, ended: str | None = None) -> None:
        reason = spec.waiting_for(spark, settings)
        if reason is None:
            waiting.pop(spec.name, None)
            launch(spec, trigger(spec))
            return
        if spec.name not in waiting:
            say(f"{spec.name}: {ended + '; ' if ended else ''}waiting: {reason}", out)
        waiting[spec.name] = time.monotonic() + READY_POLL_SECONDS

    def leads_done() -> bool:
        """Each lead query has finished a trigger in this run (or waits to be ready, so nothing follows it).
        Asked of the query itself: a trigger that found no data gives the bus nothing to tell at first (Spark
        posts no event for a run's first idle trigger), and this is asked only until the others have started."""
        return all(name in waiting or (name in queries and queries[name].lastProgress) for name in lead)

    held: str | None = None
    """The reason ``hold`` last gave (printed once)."""

    def may_follow() -> bool:
        """The lead queries have done their part: each has finished a trigger, and nothing ``hold`` waits for
        is pending. When the hold ends, a lead query it made ready starts at once, and the others follow it."""
        nonlocal held
        if not leads_done():
            return False
        if hold is not None:
            if (reason := hold()) is not None:
                if reason != held:
                    say(f"the other queries wait: {reason}", out)
                    held = reason
                return False
            for name in [name for name in lead if name in waiting]:
                start_when_ready(specs_by_name[name])
        return leads_done()

    def start_following(why: str) -> None:
        say(f"starting the other queries: {why}", out)
        for spec in following.values():
            start_when_ready(spec)
        following.clear()

    failures: Counter[str] = Counter()
    """Failures in a row per query: a failure after a run that wrote a batch is the first again."""
    next_report = time.monotonic() + report_every
    slower: set[str] = set()
    """Draining queries still on a slower trigger than the default: stopped between two batches..."""
    parked: set[str] = set()
    """... and started again on it once every query upstream of them has read all its source holds."""

    def pause(seconds: float) -> bool:
        """Wait; True when the run should end now."""
        if draining.is_set():
            time.sleep(seconds)
            return False
        if not stop.wait(seconds):
            return False
        if unread is None:
            return True
        draining.set()
        say("draining: the queries run on until each has read all its source holds", out)
        slower.update(name for name in queries if running_on[name] != every)
        if slower:
            say(f"draining: {', '.join(sorted(slower))} move to the default trigger ({settings.trigger_interval})", out)
        if following:
            start_following("a stop drains every query")
        return False

    next_check = 0.0
    checked_after: dict[str, int] = {}
    """Each query's last batch when the drain last asked."""

    def last_batches() -> dict[str, int]:
        return {name: progress["batchId"] for name in queries if (progress := events.last(runs[name]))}

    def drained() -> bool:
        """Whether every query has read all its sources hold. The same answer tells which parked queries may
        start again (every query upstream of them has read all its source holds): then they do, and the
        drain goes on.

        Asked as soon as a query has finished a batch, the only event after which the answer can change once
        nothing is published, and at least every ``DRAIN_CHECK_SECONDS``: each hop of a drain (ingest, then
        the late arrivals, the silver readers, the alerts) then starts within a poll of the last one's end,
        not within a clock's tick of 2 s."""
        nonlocal next_check, checked_after
        if unread is None or not draining.is_set():
            return False
        batches = last_batches()
        if batches == checked_after and time.monotonic() < next_check:
            return False
        checked_after = batches
        next_check = time.monotonic() + DRAIN_CHECK_SECONDS  # each check asks Kafka and reads Delta logs
        behind = unread()  # a query waiting to be ready (or parked) is not running: it is not in the answer
        if behind and time.monotonic() >= next_report:
            say(f"draining: {', '.join(behind)} still reading", out)
        pending = {*behind, *parked}
        if due := [spec for spec in specs if spec.name in parked and pending.isdisjoint(upstream_of(spec.name))]:
            for spec in due:
                launch(spec, every)
                parked.discard(spec.name)
            return False
        return not behind and not parked

    with query_events(spark) as events:  # what the loop knows of the queries, not asked of the JVM
        report = ProgressReport(events)
        try:
            for spec in specs:
                if spec.name not in following:
                    start_when_ready(spec)
            while not pause(0.5) and not drained():
                confirming = time.monotonic() >= next_report
                if following and may_follow():
                    started = sorted(name for name in lead if name in queries)
                    its = "its" if len(started) == 1 else "their"
                    start_following(f"{' and '.join(started)} finished {its} first trigger")
                for spec in specs:
                    if spec.name in following:
                        continue
                    if spec.name in waiting:
                        if time.monotonic() >= waiting[spec.name]:
                            start_when_ready(spec)
                        continue
                    if spec.name in parked:
                        continue
                    query, run = queries[spec.name], runs[spec.name]
                    # The bus drops events when its queue overflows (Spark logs that): so each query is also asked
                    # itself, once a report.
                    if not (events.ended(run) or (confirming and not query.isActive)):
                        if spec.name in slower and not query.status["isTriggerActive"]:
                            slower.discard(spec.name)
                            query.stop()
                            parked.add(spec.name)
                        elif (moved := rate_trigger(spec)) is not None and not query.status["isTriggerActive"]:
                            rates = ", ".join(f"{rate:,.0f}" for rate in events.rates(run))
                            query.stop()
                            interval = moved["processingTime"]
                            say(f"{spec.name}: its last batches read {rates} rows/s: every {interval} from now", out)
                            launch(spec, moved)
                        continue
                    error = query.exception()
                    reason = settings.redact(explain(error)) if error is not None else "stopped"
                    if spec.waiting_for(spark, settings) is not None:
                        del queries[spec.name], runs[spec.name]
                        start_when_ready(spec, ended=f"query ended ({reason})")
                        continue
                    if events.wrote(run):
                        failures[spec.name] = 0
                    failures[spec.name] += 1
                    if failures[spec.name] > settings.query_restarts:
                        raise QueryFailed(
                            f"query {spec.name} failed {failures[spec.name]} times in a row; last error: {reason}\n"
                            "Fix the cause and run `iotmon stream` again: it resumes from its checkpoint."
                        )
                    backoff = min(30.0, 2.0 ** failures[spec.name])
                    say(f"{spec.name}: query ended ({reason}); restarting in {backoff:.0f}s", out)
                    if pause(backoff):
                        break
                    slower.discard(spec.name)  # restarted on the trigger of the moment
                    launch(spec, trigger(spec))
                if confirming:
                    report.show(runs, out)
                    next_report = time.monotonic() + report_every
        finally:
            for query in queries.values():
                if query.isActive:
                    query.stop()
            say("stopped all queries", out)
