"""Every streaming query's progress, kept: a Delta ops table for dashboards and a run file for ``iotmon status``.

Spark keeps only the last 100 progress reports of a query, in memory; a listener turns each one into a row
of the ``query_progress`` table instead, so throughput, lag, watermarks and state size can be charted over
days and compared across restarts.

The table is telemetry, and written like telemetry: rows are buffered and appended every ``flush_every``
seconds by a background thread (never from the listener callback, which runs on Spark's listener bus and
would delay every other listener). A process killed with SIGKILL loses the rows still buffered, at most
``flush_every`` seconds of progress. That is acceptable for telemetry and would not be for data, which is
why the pipeline's own tables never go through a buffer like this one.

Install it once in the stream process, after the session is built and before or after queries start::

    recorder = install_progress_recorder(spark, settings)
    try:
        run_continuously(...)
    finally:
        recorder.close()  # after the queries stopped: waits for their last events, flushes, marks the run file
"""

from __future__ import annotations

import functools
import json
import math
import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ParamSpec, TextIO

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.listener import (
    QueryIdleEvent,
    QueryProgressEvent,
    QueryStartedEvent,
    QueryTerminatedEvent,
)

from iotmon.config import Settings
from iotmon.lake import append_once, ledger_for
from iotmon.logs import say
from iotmon.queries import JsonEventListener, explain
from iotmon.schema import QUERY_PROGRESS, QUERY_PROGRESS_SCHEMA

P = ParamSpec("P")

# Spark reports the watermark of a query that has not seen an event yet as the epoch: no watermark at all.
_NO_WATERMARK = datetime(1970, 1, 1, tzinfo=UTC)
_KAFKA_SOURCE_PREFIXES = ("KafkaV2[", "KafkaSource[", "KafkaTable[")
PROGRESS_ARROW_SCHEMA = to_arrow_schema(QUERY_PROGRESS_SCHEMA, timezone="UTC")
SUMMARY_FIELDS: tuple[str, ...] = (
    "batch_id",
    "timestamp",
    "input_rows",
    "input_rows_per_second",
    "processed_rows_per_second",
    "batch_duration_ms",
    "watermark",
    "state_rows",
    "kafka_lag",
)
"""The columns of a progress row that the run file keeps as a query's last progress."""


# --- progress rows -----------------------------------------------------------------------------------------


def parse_time(text: str | None) -> datetime | None:
    """A Spark progress timestamp (``2026-11-22T03:24:02.123Z``) as an aware UTC datetime."""
    if not text:
        return None
    return datetime.fromisoformat(text).astimezone(UTC)


def _rate(value: Any) -> float | None:
    # Spark leaves NaN and infinite rates out of its JSON; a hand-built dict may still carry them.
    if value is None:
        return None
    rate = float(value)
    return rate if math.isfinite(rate) else None


def source_offsets(value: Any) -> dict[str, Any] | None:
    """Source offsets are JSON objects in ``progress.json`` but JSON strings in PySpark's progress objects."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def kafka_lag(sources: Iterable[Mapping[str, Any]]) -> int | None:
    """Records the Kafka sources had not read when the batch was planned: sum of latest - end per partition.

    None when the query reads no Kafka topic (or Kafka did not report a latest offset), so that a dashboard
    tells "no lag" from "not a Kafka query".
    """
    lag: int | None = None
    for source in sources:
        if not str(source.get("description", "")).startswith(_KAFKA_SOURCE_PREFIXES):
            continue
        end, latest = source_offsets(source.get("endOffset")), source_offsets(source.get("latestOffset"))
        if end is None or latest is None:
            continue
        lag = lag or 0
        for topic, partitions in latest.items():
            for partition, offset in partitions.items():
                lag += max(0, int(offset) - int(end.get(topic, {}).get(partition, offset)))
    return lag


def _state_sum(operators: list[Mapping[str, Any]], key: str) -> int | None:
    return sum(int(op.get(key) or 0) for op in operators) if operators else None


def progress_row(progress: Mapping[str, Any]) -> dict[str, Any]:
    """One ``query_progress`` row from a progress report parsed from its JSON (``json.loads(progress.json)``).

    Pure, so the mapping is tested on recorded reports without Spark. Columns that do not apply (state of
    a stateless query, Kafka lag of a Delta-sourced one, a watermark not yet set) are None, not zero.
    """
    event_time = progress.get("eventTime") or {}
    operators = list(progress.get("stateOperators") or [])
    observed = progress.get("observedMetrics")
    duration = progress.get("batchDuration")
    if duration is None:
        duration = (progress.get("durationMs") or {}).get("triggerExecution")
    watermark = parse_time(event_time.get("watermark"))
    return {
        "query_name": progress.get("name"),
        "query_id": str(progress["id"]),
        "run_id": str(progress["runId"]),
        "batch_id": int(progress["batchId"]),
        "timestamp": parse_time(progress["timestamp"]),
        "input_rows": progress.get("numInputRows"),
        "input_rows_per_second": _rate(progress.get("inputRowsPerSecond")),
        "processed_rows_per_second": _rate(progress.get("processedRowsPerSecond")),
        "batch_duration_ms": duration,
        "watermark": None if watermark == _NO_WATERMARK else watermark,
        "event_time_max": parse_time(event_time.get("max")),
        "state_rows": _state_sum(operators, "numRowsTotal"),
        "state_memory_bytes": _state_sum(operators, "memoryUsedBytes"),
        "rows_dropped_by_watermark": _state_sum(operators, "numRowsDroppedByWatermark"),
        "kafka_lag": kafka_lag(progress.get("sources") or []),
        "observed_metrics": json.dumps(observed, separators=(",", ":"), default=str) if observed else None,
        "sink_description": (progress.get("sink") or {}).get("description"),
        "progress_json": json.dumps(progress, separators=(",", ":"), default=str),
    }


def progress_summary(row: Mapping[str, Any]) -> dict[str, Any]:
    """The run file's "last progress" of a query: the headline columns of its row, JSON-ready."""
    return {key: row[key].isoformat() if isinstance(row[key], datetime) else row[key] for key in SUMMARY_FIELDS}


# --- run file ----------------------------------------------------------------------------------------------


def run_file_path(settings: Settings) -> Path:
    return settings.home / "run" / "stream.json"


def write_json_atomically(path: Path, document: Mapping[str, Any]) -> None:
    """Write via a temporary file and ``os.replace``, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    temporary.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(temporary, path)


def read_run_file(path: Path) -> dict[str, Any] | None:
    """The run file, or None when there is none (or it is unreadable: status then falls back to the table)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _now() -> str:
    return datetime.now(UTC).isoformat()


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux ``/proc``; None elsewhere or if gone).

    Stored next to the pid so that ``iotmon status`` does not take a new process that reused the pid of a
    killed stream for the stream itself.
    """
    try:
        fields_after_name = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        return int(fields_after_name[19])  # field 22 of proc(5); the name (field 2) may contain spaces
    except (OSError, ValueError, IndexError):
        return None


class RunFile:
    """What the stream process is doing now, for ``iotmon status``: one entry per query name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.document: dict[str, Any] = {
            "pid": os.getpid(),
            "pid_start": process_start_ticks(os.getpid()),
            "host": socket.gethostname(),
            "started_at": _now(),
            "stopped_at": None,
            "queries": {},
        }

    def _query(self, key: str, query_id: str, run_id: str) -> dict[str, Any]:
        entry = self.document["queries"].setdefault(
            key, {"id": query_id, "run_id": run_id, "active": True, "last_progress": None, "last_exception": None}
        )
        # A restarted query keeps its last progress and last exception: "active" with an error says it recovered.
        entry.update(id=query_id, run_id=run_id)
        entry["active"] = True
        return entry

    def started(self, key: str, query_id: str, run_id: str) -> None:
        self._query(key, query_id, run_id)

    def progressed(self, key: str, row: Mapping[str, Any]) -> None:
        self._query(key, row["query_id"], row["run_id"])["last_progress"] = progress_summary(row)

    def terminated(self, key: str, query_id: str, run_id: str, exception: str | None) -> None:
        entry = self._query(key, query_id, run_id)
        entry.update(active=False, last_exception=exception)

    def stopped(self) -> None:
        self.document["stopped_at"] = _now()
        for entry in self.document["queries"].values():
            entry["active"] = False

    def write(self) -> None:
        self.document["updated_at"] = _now()
        write_json_atomically(self.path, self.document)


# --- the recorder ------------------------------------------------------------------------------------------


def _reported(method: Callable[P, None]) -> Callable[P, None]:
    """Listener callbacks must never raise: an exception would only be logged by the JVM, far from its cause."""

    @functools.wraps(method)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            method(*args, **kwargs)
        except Exception as exc:
            say(f"iotmon ops: {method.__name__} failed: {exc!r}", sys.stderr)

    return wrapper


def _query_key(name: str | None, query_id: Any) -> str:
    return name or str(query_id)


class ProgressRecorder(JsonEventListener):
    """Buffers a row per progress event and appends the buffer to ``query_progress`` from its own thread.

    Sees the queries of the session it is installed on (each session has its own listener bus). Flushes
    are idempotent (a Delta transaction id per flush), so a flush that failed after committing is not
    written twice; a failed flush is reported to ``out`` and retried on the next one, never raised.
    Rows still buffered when the process is SIGKILLed are lost (at most ``flush_every`` seconds of them):
    fine for telemetry, which is why no data table is ever written this way.
    """

    def __init__(
        self,
        spark: SparkSession,
        settings: Settings,
        flush_every: float = 10.0,
        out: TextIO | None = None,
        max_buffered: int = 10_000,
    ) -> None:
        self._session = spark
        self._table = settings.table_path(QUERY_PROGRESS)
        self._flush_every = flush_every
        self._out = out
        self._max_buffered = max_buffered
        self._ledger = ledger_for(f"iotmon-progress-{uuid.uuid4()}")
        self._lock = threading.Condition()
        self._flush_lock = threading.Lock()
        self._buffer: list[dict[str, Any]] = []
        self._pending: tuple[int, list[dict[str, Any]]] | None = None
        self._next_flush = 0
        self._dropped = 0
        self._names: dict[str, str] = {}  # run id -> run-file key
        self._terminated: set[str] = set()
        self._run = RunFile(run_file_path(settings))
        self._stop = threading.Event()
        self._flusher = threading.Thread(target=self._flush_loop, name="iotmon-progress-flusher", daemon=True)
        self._closed = False

    # Listener callbacks: called by Spark (onQueryStarted on the thread starting the query, the others on
    # the listener bus thread), so they only touch memory and the small run file.

    @_reported
    def onQueryStarted(self, event: QueryStartedEvent) -> None:
        key = _query_key(event.name, event.id)
        with self._lock:
            self._names[str(event.runId)] = key
            self._run.started(key, str(event.id), str(event.runId))
            self._run.write()

    @_reported
    def onQueryProgress(self, event: QueryProgressEvent) -> None:
        progress = json.loads(event.progress.json)
        row = progress_row(progress)
        key = _query_key(row["query_name"], row["query_id"])
        with self._lock:
            self._names.setdefault(row["run_id"], key)
            self._buffer.append(row)
            if len(self._buffer) > self._max_buffered:
                del self._buffer[0]
                self._dropped += 1
            self._run.progressed(key, row)
            self._run.write()
            self._lock.notify_all()

    def onQueryIdle(self, event: QueryIdleEvent) -> None:
        """Idle triggers produce no progress row: the table records executed batches only."""

    @_reported
    def onQueryTerminated(self, event: QueryTerminatedEvent) -> None:
        run_id = str(event.runId)
        exception = explain(event.exception) if event.exception else None
        with self._lock:
            key = self._names.setdefault(run_id, str(event.id))
            self._run.terminated(key, str(event.id), run_id, exception)
            self._run.write()
            self._terminated.add(run_id)
            self._lock.notify_all()

    # Recording.

    def start(self) -> None:
        with self._lock:
            self._run.write()
        self._session.streams.addListener(self)
        self._flusher.start()

    def _report(self, message: str) -> None:
        say(f"iotmon ops: {message}", self._out or sys.stderr)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self._flush_every):
            self.flush()

    def flush(self) -> bool:
        """Append what is buffered now; False (and a line on ``out``) if it failed and will be retried."""
        with self._flush_lock:
            while True:
                with self._lock:
                    if self._dropped:
                        self._report(f"progress buffer full: dropped the {self._dropped} oldest rows")
                        self._dropped = 0
                    if self._pending is None and self._buffer:
                        self._pending = (self._next_flush, self._buffer)
                        self._buffer = []
                    pending = self._pending
                if pending is None:
                    return True
                sequence, rows = pending
                try:
                    table = pa.Table.from_pylist(rows, schema=PROGRESS_ARROW_SCHEMA)  # naive times: UTC
                    append_once(table, self._table, self._ledger, sequence, self._session)
                except Exception as exc:
                    self._report(f"could not append {len(rows)} rows to {self._table}, will retry: {explain(exc)}")
                    return False
                with self._lock:
                    self._pending = None
                    self._next_flush = sequence + 1

    def last_batch(self, query_name: str) -> int | None:
        """The latest batch id of ``query_name`` whose progress reached this recorder: events arrive
        asynchronously, so this is what to wait for before expecting a batch in the next flush."""
        with self._lock:
            entry = self._run.document["queries"].get(query_name) or {}
            return (entry.get("last_progress") or {}).get("batch_id")

    def _await_terminations(self, timeout: float) -> None:
        """Stopped queries' last events may still be queued on the listener bus: wait until they arrive."""
        try:
            active = {str(query.runId) for query in self._session.streams.active}
        except Exception:
            return
        with self._lock:
            self._lock.wait_for(lambda: set(self._names) - active <= self._terminated, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Flush, stop listening and mark the run file stopped. Call it after the queries have stopped."""
        if self._closed:
            return
        self._closed = True
        self._await_terminations(timeout)
        try:
            self._session.streams.removeListener(self)
        except Exception as exc:
            self._report(f"could not remove the progress listener: {exc!r}")
        self._stop.set()
        if self._flusher.is_alive():
            self._flusher.join()
        self.flush()
        with self._lock:
            self._run.stopped()
            self._run.write()

    def __enter__(self) -> ProgressRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def install_progress_recorder(spark: SparkSession, settings: Settings, flush_every: float = 10.0) -> ProgressRecorder:
    """Create ``query_progress`` if missing, then record every query of ``spark`` into it until ``close()``."""
    from iotmon.lake import create_table

    create_table(
        spark,
        settings.table_path(QUERY_PROGRESS),
        QUERY_PROGRESS_SCHEMA,
        "One row per micro-batch of every streaming query (iotmon.ops): telemetry for dashboards.",
        append_only=True,
    )
    recorder = ProgressRecorder(spark, settings, flush_every)
    recorder.start()
    return recorder
