"""The ground truth of a run: one Parquet row per send, saying what the simulator did to that record.

Later stages are checked against it (was every very-late reading dropped, every duplicate removed, every
malformed payload quarantined, every anomaly found?), so a row names its Kafka coordinates as well.
Rows are written in row groups while the run goes on; the file appears under its final name only when
complete (a crashed run leaves ``<name>.partial``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
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


def live_parts(path: Path) -> Path:
    """Where a running simulation publishes its truth so far (complete files), beside ``path``."""
    return path.with_name(path.name + ".live")


def available_truth(folder: Path) -> list[Path]:
    """Every finished truth file in ``folder``, plus the live parts of runs still going."""
    finished = sorted(folder.glob("*.parquet"))
    return finished + sorted(folder.glob("*.parquet.live/part-*.parquet"))


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
        """Write what is buffered, close the file and give it its final name."""
        self._flush()
        self._writer.close()
        os.replace(self.partial, self.path)
        shutil.rmtree(live_parts(self.path), ignore_errors=True)
        return self.path
