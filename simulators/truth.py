"""The ground truth of a run: one Parquet row per send, saying what the simulator did to that record.

Later stages are checked against it (was every very-late reading dropped, every duplicate removed, every
malformed payload quarantined, every anomaly found?), so a row names its Kafka coordinates as well.
Rows are written in row groups while the run goes on; the file appears under its final name only when
complete (a crashed run leaves ``<name>.partial``).

A real-time run also publishes its rows so far as live parts, which other processes (the periodic trainer)
read while the run goes on, and which vanish when it finishes. ``available_truth`` lists and ``read_truth``
reads through that: every reader of truth that another process may be writing goes through them.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from iotmon.schema import ANOMALY_TYPES, LATE_KINDS, MALFORMED_KINDS, METRIC_NAMES

from .generator import SendBatch

UTC_MS = pa.timestamp("ms", tz="UTC")
TRUTH_SCHEMA = pa.schema(
    [
        pa.field("send_index", pa.int64(), nullable=False),
        pa.field("device_id", pa.string(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("event_time", UTC_MS, nullable=False),
        pa.field("send_time", UTC_MS, nullable=False),
        pa.field("delay_s", pa.float64(), nullable=False),
        pa.field("late_kind", pa.string(), nullable=False),
        pa.field("is_duplicate", pa.bool_(), nullable=False),
        pa.field("malformed_kind", pa.string()),
        pa.field("anomaly_type", pa.string()),
        pa.field("anomaly_metric", pa.string()),
        pa.field("payload_bytes", pa.int32(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("delivered", pa.bool_(), nullable=False),
    ]
)
ROW_GROUP_ROWS = 256 * 1024
NOT_DELIVERED = -1
"""The offset of a send the broker did not acknowledge."""
OFFSET_UNKNOWN = -2
"""The offset of a send the broker acknowledged without saying where (librdkafka reports a retried batch the
broker already had, an idempotent duplicate, as delivered with an invalid offset) and that the neighbouring
offsets did not pin down. The send is in Kafka (``delivered``); verification finds it by its content."""

_LATE_NAMES = pa.array(LATE_KINDS)
_MALFORMED_NAMES = pa.array(MALFORMED_KINDS)
_ANOMALY_NAMES = pa.array(ANOMALY_TYPES)
_METRIC_NAMES = pa.array(METRIC_NAMES)


def _names(codes: np.ndarray, names: pa.Array) -> pa.Array:
    """Codes to names; a negative code is null."""
    return names.take(pa.array(codes, mask=codes < 0))


def payload_sizes(batch: SendBatch) -> np.ndarray:
    return np.fromiter(map(len, batch.payloads), dtype=np.int32, count=len(batch.payloads))


def truth_table(
    batch: SendBatch,
    payload_bytes: np.ndarray,
    first_index: int,
    device_ids: pa.Array,
    topic: str,
    partition: np.ndarray,
    offset: np.ndarray,
) -> pa.Table:
    """The truth rows of ``batch``, whose first record is send number ``first_index`` of the run.

    ``payload_bytes`` is passed apart so that the payloads themselves need not be kept until delivery.
    """
    n = len(batch)
    columns = [
        pa.array(np.arange(first_index, first_index + n, dtype=np.int64)),
        device_ids.take(pa.array(batch.device)),
        pa.array(batch.seq),
        pa.array(batch.event_ms, type=pa.int64()).cast(UTC_MS),
        pa.array(batch.send_ms, type=pa.int64()).cast(UTC_MS),
        pa.array((batch.send_ms - batch.event_ms) / 1000.0),
        _names(batch.late_kind, _LATE_NAMES),
        pa.array(batch.duplicate),
        _names(batch.malformed, _MALFORMED_NAMES),
        _names(batch.anomaly_type, _ANOMALY_NAMES),
        _names(batch.anomaly_metric, _METRIC_NAMES),
        pa.array(payload_bytes),
        pa.repeat(pa.scalar(topic), n) if n else pa.array([], pa.string()),
        pa.array(partition, type=pa.int32()),
        pa.array(offset, type=pa.int64()),
        pa.array(offset != NOT_DELIVERED),  # OFFSET_UNKNOWN is delivered
    ]
    return pa.Table.from_arrays(columns, schema=TRUTH_SCHEMA)


LIVE_SUFFIX = ".live"
READ_ATTEMPTS = 3
"""How often ``read_truth`` lists and reads again when a file it listed vanished while it read (a run finished)."""


def live_parts(path: Path) -> Path:
    """Where a running simulation publishes its truth so far (complete files), beside ``path``."""
    return path.with_name(path.name + LIVE_SUFFIX)


def _is_live_part(path: Path) -> bool:
    return path.parent.name.endswith(".parquet" + LIVE_SUFFIX)


def _listed_parts(folder: Path) -> list[Path]:
    """The complete parts in a live folder now; none once its run has removed it."""
    try:
        return sorted(part for part in folder.iterdir() if part.name.startswith("part-") and part.suffix == ".parquet")
    except FileNotFoundError:
        return []


def _run_truth(path: Path) -> list[Path]:
    """The truth of the run that finishes as ``path``, as it is now: its live parts until the finished file is in
    place, then that file alone (it holds every row of the parts, which ``TruthWriter.close`` removes only after).

    The parts are listed before the finished file is looked for, so a run that finishes in between is seen
    finished, never with neither. A finished file older than the parts is an earlier run of the same name, which
    this one replaces when it finishes: until then, both are its truth.
    """
    parts = _listed_parts(live_parts(path))
    try:
        finished = path.stat().st_mtime_ns
    except FileNotFoundError:
        return parts
    try:
        newest_part = max((part.stat().st_mtime_ns for part in parts), default=None)
    except FileNotFoundError:  # the parts are being removed: the run has finished
        return [path]
    return [path] if newest_part is None or finished >= newest_part else [path, *parts]


def available_truth(folder: Path) -> list[Path]:
    """Every finished truth file in ``folder``, plus the live parts of runs still going: each run once, as it is
    at the moment it is listed (a run that finishes meanwhile is listed by its finished file, not both)."""
    runs = {live.name.removesuffix(LIVE_SUFFIX) for live in folder.glob("*.parquet" + LIVE_SUFFIX)}
    runs |= {finished.name for finished in folder.glob("*.parquet")}
    return [path for run in sorted(runs) for path in _run_truth(folder / run)]


def current_truth(files: Iterable[Path]) -> list[Path]:
    """``files`` (finished truth files and live parts, as ``available_truth`` listed them a while ago) as they are
    now: a run's live parts listed again, or its finished file once the run has finished."""
    current: dict[Path, None] = {}
    for path in files:
        if _is_live_part(path):
            run = path.parent.with_name(path.parent.name.removesuffix(LIVE_SUFFIX))
            current.update(dict.fromkeys(_run_truth(run)))
        else:
            current[path] = None
    return list(current)


def read_truth(
    files: Sequence[Path], columns: Sequence[str] | None = None, where: pc.Expression | None = None
) -> pa.Table:
    """The rows of ``files`` (``current_truth``), read now and whole, so no later step reads a file that is gone.

    A running simulation removes its live parts when it finishes, possibly between the listing and the read:
    then the files are listed again (the finished file is in place by then) and read again. Only rows matching
    ``where`` (a ``pyarrow.compute`` expression) are kept, with ``columns`` (all when None).
    """
    schema = TRUTH_SCHEMA if columns is None else pa.schema([TRUTH_SCHEMA.field(name) for name in columns])
    attempt = 0
    while True:
        attempt += 1
        listed = current_truth(files)
        try:
            tables = [pq.read_table(path, columns=columns, filters=where) for path in listed]
        except OSError:
            if attempt >= READ_ATTEMPTS or all(path.exists() for path in listed):
                raise
            continue
        return pa.concat_tables(tables).select(schema.names) if tables else schema.empty_table()


class TruthWriter:
    """Appends truth tables to a Parquet file in row groups of about ``ROW_GROUP_ROWS``.

    With ``live_every_s`` (real-time runs, which may go on for hours), the rows are also published every
    so often as complete Parquet files under ``live_parts(path)``, so the trainer can evaluate against the
    truth while the run goes on; they are removed when the final file is in place.
    """

    def __init__(self, path: Path, row_group_rows: int = ROW_GROUP_ROWS, live_every_s: float | None = None) -> None:
        self.path = path
        self.partial = path.with_name(path.name + ".partial")
        path.parent.mkdir(parents=True, exist_ok=True)
        # Parts an earlier run of this name left (it crashed) would be read as this run's: they are numbered alike.
        shutil.rmtree(live_parts(path), ignore_errors=True)
        self._writer = pq.ParquetWriter(self.partial, TRUTH_SCHEMA, compression="zstd")
        self._buffer: list[pa.Table] = []
        self._buffered = 0
        self._row_group_rows = row_group_rows
        self.rows = 0
        self._live_every_s = live_every_s
        self._live: list[pa.Table] = []
        self._live_parts = 0
        self._live_at = time.monotonic()

    def write(self, table: pa.Table) -> None:
        self._buffer.append(table)
        self._buffered += table.num_rows
        self.rows += table.num_rows
        if self._buffered >= self._row_group_rows:
            self._flush()
        if self._live_every_s is not None:
            self._live.append(table)
            if time.monotonic() - self._live_at >= self._live_every_s:
                self._publish_live()

    def _publish_live(self) -> None:
        if self._live:
            folder = live_parts(self.path)
            folder.mkdir(exist_ok=True)
            part = folder / f"part-{self._live_parts:05d}.parquet"
            pq.write_table(pa.concat_tables(self._live), part.with_suffix(".tmp"), compression="zstd")
            os.replace(part.with_suffix(".tmp"), part)
            self._live_parts += 1
        self._live, self._live_at = [], time.monotonic()

    def _flush(self) -> None:
        if self._buffered:
            self._writer.write_table(pa.concat_tables(self._buffer), row_group_size=self._buffered)
        self._buffer, self._buffered = [], 0

    def close(self) -> Path:
        """Write what is buffered, close the file and give it its final name, then remove the live parts: in this
        order, a reader always finds every row in one or the other (see ``available_truth``)."""
        self._flush()
        self._writer.close()
        os.replace(self.partial, self.path)
        shutil.rmtree(live_parts(self.path), ignore_errors=True)
        return self.path
