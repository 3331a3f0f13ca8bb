"""``iotmon status``: is the stream running, how are its queries doing, and what does the lake hold.

No Spark here, so the answer comes in about a second: the stream process's run file (``iotmon.ops``) says
what runs now; the ``query_progress`` table, read with delta-rs, says what ran last when nothing runs; and
each table's row count comes from its Delta log's file statistics rather than from reading its data.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from iotmon.config import Settings
from iotmon.logs import say
from iotmon.ops import SUMMARY_FIELDS, process_start_ticks, read_run_file, run_file_path
from iotmon.schema import LAKE_TABLES, QUERY_PROGRESS, as_utc

EXIT_NOT_RUNNING = 3
STATUS_KAFKA_TIMEOUT_SECONDS = 3.0
"""How long status waits for Kafka's newest event: with no broker, the lake's part still answers at once."""
FROM_RUN_FILE = "run file"
FROM_TABLE = "query_progress table"

# The fallback reads only the progress rows of the last day before the newest one: a query silent for a
# day longer than every other query is not "the stream's last state" any more, and the table grows forever.
_FALLBACK_WINDOW = timedelta(days=1)


@dataclass
class QueryStatus:
    name: str
    id: str | None = None
    run_id: str | None = None
    active: bool = False
    last_progress: dict[str, Any] | None = None
    last_exception: str | None = None


@dataclass
class TableStatus:
    name: str
    path: str
    exists: bool = False
    rows: int | None = None
    counted_from: str | None = None
    """"file stats" (the log's num_records, no data read) or "scan" (some files have no statistics)."""
    version: int | None = None
    last_commit: str | None = None
    newest_event: str | None = None
    """The newest value of its event-time column (``FRESHNESS_COLUMNS``), by file statistics."""
    behind_kafka_s: float | None = None
    """Seconds from ``newest_event`` to the newest event in Kafka: how far the table is behind its source.
    A table can only be this fresh, and "Kafka lag 0" with a large figure here means a query downstream is
    behind, not that all is well."""
    error: str | None = None


@dataclass
class Status:
    running: bool
    run_file: str
    pid: int | None = None
    host: str | None = None
    checked: bool = True
    """False when the stream runs on another host (container): its pid cannot be checked from here, so
    "running" only means the run file was not marked stopped."""
    started_at: str | None = None
    stopped_at: str | None = None
    queries_from: str | None = None
    queries: list[QueryStatus] = field(default_factory=list)
    kafka_newest_event: str | None = None
    """The newest event time among the last records of the readings topic (None: Kafka did not answer)."""
    tables: list[TableStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether process ``pid`` exists, is not a zombie (killed, not yet reaped) and, when ``start_ticks``
    is known, is the process that wrote the run file rather than a later one that reused its pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    if stat.rpartition(")")[2].split()[:1] == ["Z"]:
        return False
    return start_ticks is None or process_start_ticks(pid) == start_ticks


def _iso_from_millis(millis: int | None) -> str | None:
    return None if millis is None else datetime.fromtimestamp(millis / 1000, UTC).isoformat()


def _json_ready(value: Any) -> Any:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).isoformat()
    return value


# --- tables ------------------------------------------------------------------------------------------------


def _row_count(table: Any) -> tuple[int, str]:
    """Rows from the add actions' ``num_records`` minus rows deleted by deletion vectors; a scan (of
    Parquet footers) only when some file has no statistics."""
    import pyarrow as pa
    import pyarrow.compute as pc

    actions = pa.table(table.get_add_actions(flatten=True))
    records = actions.column("num_records") if "num_records" in actions.column_names else None
    if records is not None and records.null_count == 0:
        rows = int(pc.sum(records).as_py() or 0)
        if "deletionVectors" in (table.protocol().reader_features or []):
            vectors = pa.table(table.deletion_vectors()).column("selection_vector")
            rows -= sum(keep.count(False) for keep in vectors.to_pylist())
        return rows, "file stats"
    return table.to_pyarrow_dataset().count_rows(), "scan"


def freshness(newest_event: datetime | None, kafka_newest: datetime | None) -> float | None:
    """Seconds a table's newest event is behind Kafka's newest (never below 0: a table cannot be ahead of its
    source, only Kafka's sample of last records can miss a late-sent newer one); pure."""
    if newest_event is None or kafka_newest is None:
        return None
    return max(0.0, (kafka_newest - as_utc(newest_event)).total_seconds())


def table_status(name: str, path: str, kafka_newest: datetime | None = None) -> TableStatus:
    from deltalake import DeltaTable

    from iotmon.schema import FRESHNESS_COLUMNS

    status = TableStatus(name, path)
    try:
        if not DeltaTable.is_deltatable(path):
            return status
        status.exists = True
        table = DeltaTable(path)
        status.version = table.version()
        history = table.history(1)
        status.last_commit = _iso_from_millis(history[0].get("timestamp")) if history else None
        status.rows, status.counted_from = _row_count(table)
        if name in FRESHNESS_COLUMNS and (latest := newest(table, FRESHNESS_COLUMNS[name])) is not None:
            status.newest_event = as_utc(latest).isoformat()
            status.behind_kafka_s = freshness(latest, kafka_newest)
    except Exception as exc:  # one unreadable table must not hide the others
        status.error = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return status


# --- queries -----------------------------------------------------------------------------------------------


def queries_from_run_file(document: Mapping[str, Any]) -> list[QueryStatus]:
    return [
        QueryStatus(
            name=name,
            id=entry.get("id"),
            run_id=entry.get("run_id"),
            active=bool(entry.get("active")),
            last_progress=entry.get("last_progress"),
            last_exception=entry.get("last_exception"),
        )
        for name, entry in sorted(document.get("queries", {}).items())
    ]


def _order(row: Mapping[str, Any]) -> tuple[datetime, int]:
    return row["timestamp"], row["batch_id"]


def _bound_scalar(table: Any, column: str, bound: str) -> Any:
    """``bound`` ("min" or "max") of ``column`` over the files' statistics, as a pyarrow scalar."""
    import pyarrow as pa
    import pyarrow.compute as pc

    actions = pa.table(table.get_add_actions(flatten=True))
    stat = f"{bound}.{column}"
    if actions.num_rows == 0 or stat not in actions.column_names or actions.column(stat).null_count:
        return None
    return pc.min(actions.column(stat)) if bound == "min" else pc.max(actions.column(stat))


def newest(table: Any, column: str) -> Any:
    """The largest value of ``column`` by the Delta log's file statistics, no data read; None when the table
    is empty or some file has no statistics for it (then nobody can say without a scan)."""
    latest = _bound_scalar(table, column, "max")
    return None if latest is None else latest.as_py()


def oldest(table: Any, column: str) -> Any:
    """The smallest value of ``column``, as ``newest`` finds the largest."""
    earliest = _bound_scalar(table, column, "min")
    return None if earliest is None else earliest.as_py()


def row_count(table: Any) -> int:
    return _row_count(table)[0]


def since_newest(table: Any, column: str, span: timedelta) -> Any:
    """A pyarrow filter keeping the rows within ``span`` of the table's newest ``column`` value (None: no
    filter). Relative to the data, not the wall clock, so a replayed or simulated past still shows; delta-rs
    gives each file its min/max as a guarantee, so files older than the span are not even opened."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    latest = _bound_scalar(table, column, "max")
    if latest is None:
        return None
    return ds.field(column) >= pa.scalar(latest.as_py() - span, latest.type)


def queries_from_table(path: str) -> list[QueryStatus]:
    """The latest row per query of ``query_progress`` (among the rows of its last day)."""
    from deltalake import DeltaTable

    if not DeltaTable.is_deltatable(path):
        return []
    table = DeltaTable(path)
    dataset = table.to_pyarrow_dataset()
    where = since_newest(table, "timestamp", _FALLBACK_WINDOW)
    rows = dataset.to_table(columns=["query_name", "query_id", "run_id", *SUMMARY_FIELDS], filter=where).to_pylist()
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = row["query_name"] or row["query_id"]
        if key not in latest or _order(row) > _order(latest[key]):
            latest[key] = row
    return [
        QueryStatus(
            name=key,
            id=row["query_id"],
            run_id=row["run_id"],
            last_progress={f: _json_ready(row[f]) for f in SUMMARY_FIELDS},
        )
        for key, row in sorted(latest.items())
    ]


# --- the report --------------------------------------------------------------------------------------------


def stream_process(settings: Settings) -> tuple[Status, dict[str, Any] | None]:
    """Whether a stream process is running, from its run file (no table is read); and the run file."""
    path = run_file_path(settings)
    document = read_run_file(path)
    status = Status(running=False, run_file=str(path))
    if document is not None:
        status.pid, status.host = document.get("pid"), document.get("host")
        status.started_at, status.stopped_at = document.get("started_at"), document.get("stopped_at")
        status.checked = status.host in (None, socket.gethostname())
        status.running = status.stopped_at is None and isinstance(status.pid, int)
        if status.running and status.checked:
            status.running = pid_alive(status.pid, document.get("pid_start"))
    return status, document


def collect(settings: Settings) -> Status:
    status, document = stream_process(settings)
    if status.running and document is not None:
        status.queries_from, status.queries = FROM_RUN_FILE, queries_from_run_file(document)
    else:
        try:
            status.queries = queries_from_table(settings.table_path(QUERY_PROGRESS))
        except Exception as exc:  # the table counts below will say more about an unreadable table
            status.queries = []
            say(f"iotmon status: could not read {QUERY_PROGRESS}: {exc}", sys.stderr)
        status.queries_from = FROM_TABLE if status.queries else None
        # The table has no exceptions; after a crash the run file still knows the last one of each query.
        known = {query.name: query for query in queries_from_run_file(document or {})}
        for query in status.queries:
            if query.name in known:
                query.last_exception = known[query.name].last_exception
        recorded = {query.name for query in status.queries}
        status.queries += [query for name, query in known.items() if name not in recorded]
        for query in status.queries:
            query.active = False
    kafka_newest = kafka_newest_event(settings)
    status.kafka_newest_event = kafka_newest.isoformat() if kafka_newest else None
    status.tables = [table_status(name, settings.table_path(name), kafka_newest) for name in LAKE_TABLES]
    return status


def kafka_newest_event(settings: Settings) -> datetime | None:
    """The newest event time in the readings topic, or None when Kafka does not answer within seconds."""
    from iotmon.kafka import KafkaUnavailable, newest_event_time

    try:
        return newest_event_time(settings, timeout=STATUS_KAFKA_TIMEOUT_SECONDS)
    except KafkaUnavailable:  # status still answers about the lake; freshness then shows as unknown
        return None


def _number(value: Any, suffix: str = "", digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}{suffix}"


def _rate(value: float | None) -> str:
    """Whole rows per second, but a trickle (a few rows a second) keeps one decimal rather than reading 0/s."""
    return _number(value, "/s", 1 if value is not None and value < 10 else 0)


def _when(text: str | None) -> str:
    if not text:
        return "-"
    return datetime.fromisoformat(text).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def render(status: Status) -> str:
    lines = []
    if status.running and not status.checked:
        lines.append(
            f"stream: running by its run file (pid {status.pid} on host {status.host}, cannot be checked from here; "
            f"since {_when(status.started_at)})"
        )
    elif status.running:
        lines.append(f"stream: running (pid {status.pid}, since {_when(status.started_at)})")
    elif status.pid is None:
        lines.append(f"stream: not running (no run file at {status.run_file})")
    elif status.stopped_at:
        lines.append(f"stream: not running (pid {status.pid} stopped at {_when(status.stopped_at)})")
    else:
        started = _when(status.started_at)
        lines.append(f"stream: not running (pid {status.pid}, started {started}, ended without a clean stop)")
    if status.queries:
        lines.append(f"queries (from the {status.queries_from or FROM_RUN_FILE}):")
    for query in status.queries:
        state = "active" if query.active else "stopped"
        p = query.last_progress
        if p is None:
            lines.append(f"  {query.name:<22} {state:<8} no progress yet")
        else:
            duration = None if p.get("batch_duration_ms") is None else p["batch_duration_ms"] / 1000
            lines.append(f"  {query.name:<22} {state:<8} batch {p.get('batch_id')} at {_when(p.get('timestamp'))}")
            lines.append(
                f"      in {_rate(p.get('input_rows_per_second'))}  "
                f"done {_rate(p.get('processed_rows_per_second'))}  took {_number(duration, 's', 2)}  "
                f"watermark {_when(p.get('watermark'))}  state rows {_number(p.get('state_rows'))}  "
                f"kafka behind {_number(p.get('kafka_lag'))}"
            )
        if query.last_exception:
            first, *rest = query.last_exception.splitlines()
            lines.append(f"      last error: {first}")
            lines.extend(f"      {line}" for line in rest)
    if not status.queries:
        lines.append("queries: none recorded yet")
    kafka = _when(status.kafka_newest_event) if status.kafka_newest_event else "unknown (Kafka did not answer)"
    lines.append(f"tables (newest event in Kafka: {kafka}):")
    for table in status.tables:
        if table.error:
            detail = f"unreadable: {table.error}"
        elif not table.exists:
            detail = "not created yet"
        else:
            rows = _number(table.rows)
            detail = f"{rows:>12} rows  version {table.version:<6} last commit {_when(table.last_commit)}"
            if table.newest_event:
                detail += f"  newest event {_when(table.newest_event)}"
                detail += (
                    f", {_number(table.behind_kafka_s, 's', 1)} behind Kafka"
                    if table.behind_kafka_s is not None
                    else ""
                )
        lines.append(f"  {table.name:<22} {detail}")
    return "\n".join(lines)


def report(settings: Settings, as_json: bool, out: TextIO) -> int:
    """Print the status (text or JSON); 0 if the stream runs, 3 if not (like ``iotmon kafka status``)."""
    status = collect(settings)
    say(json.dumps(status.to_dict(), indent=2) if as_json else render(status), out)
    return 0 if status.running else EXIT_NOT_RUNNING
