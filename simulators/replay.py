"""Recorded readings (CSV or Parquet) -> the readings topic, as the simulator's JSON events, in event-time order.

Choices, and why:

* **Order.** A first pass streams the file in chunks and reads only the device and time columns: it counts
  rows, learns each device's first reading (for the registry) and checks whether the file is already in
  event-time order. A sorted file is then published chunk by chunk (memory: one chunk). An unsorted one is
  loaded whole, only the mapped columns, and sorted stably (file order breaks ties): about 100 bytes a row,
  so ten million rows take about a gigabyte; split bigger unsorted files by time first.
* **Incomplete rows are published, not dropped.** A missing value leaves its field out of the event, an
  unparsable one is sent as its original text; bronze quarantines both with a reason
  (``missing_field:temperature``, ``mistyped_field:event_time``), so every row of the file is accounted for
  in the lake. Rows without a usable time have no place in event-time order: they are sent last.
* **Time.** ``event_time`` is the recorded time (shifted by one constant with ``restamp``); the Kafka
  timestamp is the send time. Silver measures lateness as Kafka time minus event time, so old history
  replayed as is arrives ``too_late`` for the windowed aggregates (it is still archived in bronze and
  silver). ``restamp`` shifts every event time so the first reading is "now": at the original pace each
  reading then arrives on time, as if live. Faster, event times run ahead of the wall clock by
  ``(1 - 1/speed)`` of the elapsed recording, which bronze tolerates up to ``IOTMON_MAX_CLOCK_SKEW_SECONDS``.
* **Registry.** Silver rejects readings of unknown devices, so devices missing from the ``devices`` table are
  appended to it (delta-rs, as the simulator writes it); existing rows are never changed.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from deltalake import DeltaTable, write_deltalake

from iotmon.config import Settings
from iotmon.kafka import ensure_topic, make_producer
from iotmon.schema import DEVICE_ID, DEVICES, DEVICES_SCHEMA, EVENT_TIME, METRIC_NAMES, SEQ

from .fleet import arrow_schema
from .publish import PACING_WINDOW_MS, POLL_EVERY, Progress, StopRequest, now_ms, stop_on_interrupt
from .timefmt import format_timestamp, format_timestamps, from_ms, to_ms

FORMATS: tuple[str, ...] = ("csv", "parquet")
TIME_UNITS: dict[str, int] = {"s": 1000, "ms": 1}
"""Milliseconds per unit of a numeric time column."""
DEFAULT_DEVICE_TYPE = "unknown"
DEFAULT_SITE = "replay"
DEFAULT_MODEL = "replay"
FLUSH_STEP_S = 0.5

# The parsed form of a chunk: one row per file row, each field as a typed value and, where the file's value
# could not be read as that type, the original text (published as is, so bronze names the field).
TIME_MS = "event_ms"
TEXT_SUFFIX = "_text"
DEVICE_TYPE = "device_type"
SITE = "site"


class ReplayError(ValueError):
    """A problem with the file or the options that the user can fix; the message names the flag."""


def metric_flag(metric: str) -> str:
    return f"--{metric}-col"


@dataclass(frozen=True)
class ColumnMapping:
    """Which column of the file holds each field of the event (and the optional registry attributes)."""

    device: str = DEVICE_ID
    time: str = EVENT_TIME
    seq: str | None = None
    """None: seq is assigned per device, 1, 2, 3 ... in event-time order."""
    metrics: tuple[tuple[str, str], ...] = tuple((name, name) for name in METRIC_NAMES)
    """(metric, column) for every metric of the contract."""
    device_type: str | None = None
    site: str | None = None

    def by_flag(self) -> dict[str, str]:
        """Command-line flag -> column, for every mapped column."""
        flags = {"--device-col": self.device, "--time-col": self.time}
        if self.seq is not None:
            flags["--seq-col"] = self.seq
        flags.update({metric_flag(metric): column for metric, column in self.metrics})
        if self.device_type is not None:
            flags["--device-type-col"] = self.device_type
        if self.site is not None:
            flags["--site-col"] = self.site
        return flags

    @property
    def columns(self) -> list[str]:
        """The file's columns to read, each once, in flag order."""
        return list(dict.fromkeys(self.by_flag().values()))

    def check(self, available: Sequence[str]) -> None:
        """Raise ``ReplayError`` naming every flag whose column the file lacks, and listing the file's columns."""
        missing = [f"{flag} {column!r}" for flag, column in self.by_flag().items() if column not in available]
        if missing:
            raise ReplayError(
                f"column not in the file: {', '.join(missing)}; the file has: {', '.join(available)}. "
                "Map each field to one of these with its flag."
            )


def parse_speed(text: str) -> float | None:
    """``max`` (None: no waiting) or a positive factor of the original pace (``60``: an hour per minute)."""
    if text.strip().lower() == "max":
        return None
    try:
        speed = float(text)
    except ValueError:
        raise ValueError(f"speed must be a positive number or 'max', not {text!r}") from None
    if not (speed > 0 and math.isfinite(speed)):
        raise ValueError(f"speed must be a positive number or 'max', not {text!r}")
    return speed


def file_format(path: Path, given: str | None = None) -> str:
    """``given``, or the format the file name says (``.csv``, ``.csv.gz``, ``.parquet``, ``.pq``)."""
    if given is not None:
        return given
    suffixes = [s.lower() for s in path.suffixes]
    if ".csv" in suffixes or ".tsv" in suffixes:
        return "csv"
    if suffixes and suffixes[-1] in {".parquet", ".pq"}:
        return "parquet"
    raise ReplayError(f"cannot tell the format of {path.name} from its name; pass --format csv|parquet")


# ---------------------------------------------------------------------------------------------------------
# Parsing values (pure)


def _text_or_null(values: Sequence[str | None], failed: Sequence[bool]) -> pa.Array:
    return pa.array([v if bad else None for v, bad in zip(values, failed, strict=True)], pa.string())


def _numbers_from_text(values: pa.Array, integral: bool) -> tuple[pa.Array, pa.Array]:
    """Strings -> (numbers, original text where a value is not a number). ``nan``/``inf`` count as missing."""
    kind = pa.int64() if integral else pa.float64()
    numbers: list[Any] = []
    failed: list[bool] = []
    texts = values.to_pylist()
    for text in texts:
        number, bad = None, False
        if text is not None and text.strip():
            try:
                number = float(text)
            except ValueError:
                bad = True
            else:
                if not math.isfinite(number):
                    number = None
                elif integral:
                    number, bad = (int(number), False) if number.is_integer() else (None, True)
        numbers.append(number)
        failed.append(bad)
    return pa.array(numbers, kind), _text_or_null(texts, failed)


def parse_numbers(values: pa.Array, integral: bool = False) -> tuple[pa.Array, pa.Array]:
    """A column -> (float64 or int64 values, null where missing; original text where unparsable).

    Non-finite numbers count as missing: JSON has no NaN, and a gap is what such a value means.
    """
    kind = pa.int64() if integral else pa.float64()
    no_text = pa.nulls(len(values), pa.string())
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return _numbers_from_text(values.cast(pa.string()), integral)
    if pa.types.is_integer(values.type):
        return values.cast(kind), no_text
    floats = values.cast(pa.float64())
    finite = pc.is_finite(floats)
    floats = pc.if_else(finite, floats, pa.scalar(None, pa.float64()))
    if not integral:
        return floats, no_text
    whole = pc.equal(pc.floor(floats), floats)
    fractional = pc.fill_null(pc.invert(whole), False)
    ints = pc.if_else(whole, floats, pa.scalar(None, pa.float64())).cast(pa.int64())
    text = pc.if_else(fractional, floats.cast(pa.string()), pa.scalar(None, pa.string()))
    return ints, text


def _iso_ms(text: str) -> int | None:
    """Unix ms of an ISO-8601 date or date-time (``Z`` or an offset; none means UTC); None if it is not one."""
    try:
        return to_ms(datetime.fromisoformat(text.strip()))
    except ValueError:
        return None


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_event_times(values: pa.Array, unit: str | None) -> tuple[pa.Array, pa.Array]:
    """The time column -> (Unix ms, null where missing or unparsable; original text where unparsable).

    Timestamps (naive ones are UTC) and dates are taken as they are, strings as ISO-8601, numbers as epoch
    seconds or milliseconds, which ``unit`` (``s``/``ms``) must say: guessing would be off by 1000 silently.
    """
    kind = values.type
    no_text = pa.nulls(len(values), pa.string())
    if pa.types.is_timestamp(kind):
        return values.cast(pa.timestamp("ms", kind.tz), safe=False).cast(pa.int64()), no_text
    if pa.types.is_date(kind):
        days = values.cast(pa.date32()).cast(pa.int32()).cast(pa.int64())
        return pc.multiply(days, 86_400_000), no_text
    is_text = pa.types.is_string(kind) or pa.types.is_large_string(kind)
    if not is_text and not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        raise ReplayError(f"--time-col holds {kind}; expected ISO-8601 text, timestamps or epoch numbers")
    if unit is not None:
        if unit not in TIME_UNITS:
            raise ReplayError(f"--time-unit must be one of {', '.join(TIME_UNITS)}, not {unit!r}")
        numbers, text = parse_numbers(values)
        ms = pc.round(pc.multiply(numbers, float(TIME_UNITS[unit]))).cast(pa.int64())
        return ms, text
    if not is_text:
        raise ReplayError(
            "--time-col holds numbers: say whether they are epoch seconds or milliseconds with --time-unit s|ms"
        )
    texts = values.cast(pa.string()).to_pylist()
    ms = [None if t is None or not t.strip() else _iso_ms(t) for t in texts]
    failed = [t is not None and bool(t.strip()) and m is None for t, m in zip(texts, ms, strict=True)]
    parsed_none = all(m is None for m in ms)
    if any(failed) and parsed_none and all(_looks_numeric(t) for t, bad in zip(texts, failed, strict=True) if bad):
        raise ReplayError(
            "--time-col holds numbers: say whether they are epoch seconds or milliseconds with --time-unit s|ms"
        )
    return pa.array(ms, pa.int64()), _text_or_null(texts, failed)


def parse_device_ids(values: pa.Array) -> pa.Array:
    """Device ids as text; empty ones are missing. Numeric ids become their decimal text (17 -> "17")."""
    text = values.cast(pa.string())
    return pc.if_else(pc.equal(pc.utf8_trim_whitespace(text), ""), pa.scalar(None, pa.string()), text)


def parse_chunk(raw: pa.Table | pa.RecordBatch, mapping: ColumnMapping, unit: str | None) -> pa.Table:
    """File columns -> the parsed form: ``device_id``, ``event_ms``, ``seq``, metrics, registry attributes,
    each with a ``*_text`` column holding the original value where it could not be parsed."""
    columns: dict[str, pa.Array] = {DEVICE_ID: parse_device_ids(_array(raw, mapping.device))}
    columns[TIME_MS], columns[EVENT_TIME + TEXT_SUFFIX] = parse_event_times(_array(raw, mapping.time), unit)
    if mapping.seq is not None:
        columns[SEQ], columns[SEQ + TEXT_SUFFIX] = parse_numbers(_array(raw, mapping.seq), integral=True)
    for metric, column in mapping.metrics:
        columns[metric], columns[metric + TEXT_SUFFIX] = parse_numbers(_array(raw, column))
    for name, column in ((DEVICE_TYPE, mapping.device_type), (SITE, mapping.site)):
        if column is not None:
            columns[name] = parse_device_ids(_array(raw, column))  # same rule: text, empty is missing
    return pa.table(columns)


def _array(raw: pa.Table | pa.RecordBatch, column: str) -> pa.Array:
    values = raw.column(column)
    return values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values


def incomplete_fields(parsed: pa.Table) -> Counter[str]:
    """``missing:<field>`` and ``unparsable:<field>`` counts: what bronze will quarantine, and why."""
    counts: Counter[str] = Counter()
    fields = [(DEVICE_ID, DEVICE_ID, None), (EVENT_TIME, TIME_MS, EVENT_TIME + TEXT_SUFFIX)]
    if SEQ in parsed.column_names:
        fields.append((SEQ, SEQ, SEQ + TEXT_SUFFIX))
    fields += [(m, m, m + TEXT_SUFFIX) for m in METRIC_NAMES]
    for name, value, text in fields:
        unparsable = 0 if text is None else len(parsed) - parsed.column(text).null_count
        missing = parsed.column(value).null_count - unparsable
        if missing:
            counts[f"missing:{name}"] += missing
        if unparsable:
            counts[f"unparsable:{name}"] += unparsable
    return counts


def incomplete_rows(parsed: pa.Table) -> int:
    """Rows with at least one missing or unparsable field."""
    values = [DEVICE_ID, TIME_MS, *METRIC_NAMES] + ([SEQ] if SEQ in parsed.column_names else [])
    bad = pc.is_null(parsed.column(values[0]))
    for name in values[1:]:
        bad = pc.or_(bad, pc.is_null(parsed.column(name)))
    return pc.sum(bad.cast(pa.int64())).as_py() or 0


# ---------------------------------------------------------------------------------------------------------
# Order, seq, time (pure)


def publish_order(event_ms: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Row indices in event-time order; ties keep file order, rows without a time go last."""
    ms = pc.fill_null(event_ms, np.iinfo(np.int64).max).to_numpy()
    return np.argsort(ms, kind="stable")


def in_event_time_order(event_ms: pa.Array | pa.ChunkedArray, after_ms: int | None) -> tuple[bool, int | None]:
    """Whether the timed rows are non-decreasing (and not before ``after_ms``); and the last time seen."""
    ms = pc.drop_null(event_ms).to_numpy()
    if len(ms) == 0:
        return True, after_ms
    ordered = bool(np.all(ms[1:] >= ms[:-1])) and (after_ms is None or ms[0] >= after_ms)
    return ordered, int(ms[-1])


class SeqCounter:
    """Assigns seq 1, 2, 3 ... per device in the order rows are published (the file has none)."""

    def __init__(self) -> None:
        self.last: dict[str | None, int] = {}

    def assign(self, devices: Sequence[str | None]) -> list[int]:
        last = self.last
        seqs = []
        for device in devices:
            n = last.get(device, 0) + 1
            last[device] = n
            seqs.append(n)
        return seqs


def restamp_shift_ms(first_ms: int | None, start_ms: int, restamp: bool) -> int:
    """The constant added to every event time: with ``restamp``, the first reading happens at ``start_ms``."""
    return start_ms - first_ms if restamp and first_ms is not None else 0


def restamp_lead_s(first_ms: int, last_ms: int, speed: float | None) -> float:
    """How far the last restamped event time runs ahead of its send time: ``(1 - 1/speed)`` of the span."""
    span_s = (last_ms - first_ms) / 1000
    return span_s if speed is None else span_s * max(0.0, 1 - 1 / speed)


def due_wall_ms(event_ms: np.ndarray, first_ms: int, wall_start_ms: int, speed: float) -> np.ndarray:
    """When each reading is sent on the wall clock: its offset from the first reading, divided by ``speed``."""
    return wall_start_ms + np.round((event_ms - first_ms) / speed).astype(np.int64)


def event_payloads(parsed: pa.Table, seqs: Sequence[int] | None, shift_ms: int) -> list[bytes]:
    """The JSON events of parsed rows, fields in contract order; missing fields are left out, unparsable
    ones carry the file's text. ``seqs`` replaces the seq column when the file has none."""
    n = len(parsed)
    ms = parsed.column(TIME_MS)
    timed = pc.is_valid(ms).to_numpy(zero_copy_only=False)
    times: list[str | None] = [None] * n
    if timed.any():
        shifted = pc.drop_null(ms).to_numpy() + shift_ms
        for i, text in zip(np.flatnonzero(timed).tolist(), format_timestamps(shifted), strict=True):
            times[i] = text
    time_text = parsed.column(EVENT_TIME + TEXT_SUFFIX).to_pylist()
    columns: list[tuple[str, list[Any]]] = [
        (DEVICE_ID, parsed.column(DEVICE_ID).to_pylist()),
        (SEQ, list(seqs) if seqs is not None else _value_or_text(parsed, SEQ)),
        (EVENT_TIME, [t if t is not None else raw for t, raw in zip(times, time_text, strict=True)]),
        *[(metric, _value_or_text(parsed, metric)) for metric in METRIC_NAMES],
    ]
    names = [name for name, _ in columns]
    dumps = orjson.dumps
    return [
        dumps({k: v for k, v in zip(names, row, strict=True) if v is not None})
        for row in zip(*(values for _, values in columns), strict=True)
    ]


def _value_or_text(parsed: pa.Table, name: str) -> list[Any]:
    values, texts = parsed.column(name).to_pylist(), parsed.column(name + TEXT_SUFFIX).to_pylist()
    return [v if v is not None else t for v, t in zip(values, texts, strict=True)]


# ---------------------------------------------------------------------------------------------------------
# Registry (pure part)


@dataclass
class DeviceSeen:
    """What the file says about a device: its first reading, and the first type and site given for it."""

    first_ms: int | None = None
    device_type: str | None = None
    site: str | None = None


def note_devices(seen: dict[str, DeviceSeen], parsed: pa.Table) -> None:
    """Fold a parsed chunk into ``seen`` (first non-empty type and site in file order win)."""
    attributes = [(name, "first") for name in (DEVICE_TYPE, SITE) if name in parsed.column_names]
    grouped = (
        parsed.filter(pc.is_valid(parsed.column(DEVICE_ID)))
        .group_by(DEVICE_ID, use_threads=False)
        .aggregate([(TIME_MS, "min"), *attributes])
    )
    types = (
        grouped.column(f"{DEVICE_TYPE}_first").to_pylist() if f"{DEVICE_TYPE}_first" in grouped.column_names else None
    )
    sites = grouped.column(f"{SITE}_first").to_pylist() if f"{SITE}_first" in grouped.column_names else None
    for i, (device, first) in enumerate(
        zip(grouped.column(DEVICE_ID).to_pylist(), grouped.column(f"{TIME_MS}_min").to_pylist(), strict=True)
    ):
        entry = seen.setdefault(device, DeviceSeen())
        if first is not None and (entry.first_ms is None or first < entry.first_ms):
            entry.first_ms = first
        if entry.device_type is None and types is not None:
            entry.device_type = types[i]
        if entry.site is None and sites is not None:
            entry.site = sites[i]


def registry_rows(seen: dict[str, DeviceSeen], known: set[str], shift_ms: int, today: date) -> pa.Table:
    """``devices`` rows for the devices not in ``known``: type ``unknown``, site ``replay``, model ``replay``
    unless the file says otherwise; installed on the date of their first (published) reading."""
    new = sorted(set(seen) - known)
    rows = [
        (
            device,
            seen[device].device_type or DEFAULT_DEVICE_TYPE,
            seen[device].site or DEFAULT_SITE,
            DEFAULT_MODEL,
            from_ms(seen[device].first_ms + shift_ms).date() if seen[device].first_ms is not None else today,
        )
        for device in new
    ]
    return pa.Table.from_pylist(
        [dict(zip(DEVICES_SCHEMA.fieldNames(), row, strict=True)) for row in rows], schema=arrow_schema(DEVICES_SCHEMA)
    )


# ---------------------------------------------------------------------------------------------------------
# Reading the file


@dataclass(frozen=True)
class ReplayOptions:
    """What ``iotmon replay`` was asked to do."""

    path: Path
    mapping: ColumnMapping = field(default_factory=ColumnMapping)
    file_format: str | None = None
    """``csv`` or ``parquet``; None: from the file name."""
    time_unit: str | None = None
    """``s`` or ``ms`` for a numeric time column."""
    speed: float | None = 1.0
    """Factor of the original pace; None publishes as fast as possible."""
    restamp: bool = False
    progress: bool = True
    chunk_rows: int = 65_536
    """Parquet rows per chunk."""
    csv_block_bytes: int = 4 << 20
    """CSV bytes per chunk."""

    def validate(self) -> None:
        if not self.path.is_file():
            raise ReplayError(f"no such file: {self.path}")
        if self.time_unit is not None and self.time_unit not in TIME_UNITS:
            raise ReplayError(f"--time-unit must be one of {', '.join(TIME_UNITS)}, not {self.time_unit!r}")
        if self.speed is not None and not (self.speed > 0 and math.isfinite(self.speed)):
            raise ReplayError(f"--speed must be a positive number or 'max', not {self.speed}")


def file_columns(path: Path, fmt: str) -> list[str]:
    if fmt == "parquet":
        return pq.ParquetFile(path).schema_arrow.names
    with pa_csv.open_csv(path) as reader:  # closed, or its read-ahead thread outlives the interpreter
        return reader.schema.names


def read_chunks(options: ReplayOptions, fmt: str, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The mapped columns in file order, a chunk at a time. CSV values are read as text and parsed here, so
    one odd value deep in a file is reported for its row instead of failing the type inferred from the top."""
    if fmt == "parquet":
        yield from pq.ParquetFile(options.path).iter_batches(batch_size=options.chunk_rows, columns=columns)
        return
    convert = pa_csv.ConvertOptions(
        include_columns=columns, column_types=dict.fromkeys(columns, pa.string()), strings_can_be_null=True
    )
    read = pa_csv.ReadOptions(block_size=options.csv_block_bytes)
    with pa_csv.open_csv(options.path, read_options=read, convert_options=convert) as reader:
        yield from reader


@dataclass
class FileSurvey:
    """The first pass: how many rows, their time range, whether they are in order, which devices."""

    rows: int = 0
    timed_rows: int = 0
    in_order: bool = True
    first_ms: int | None = None
    last_ms: int | None = None
    devices: dict[str, DeviceSeen] = field(default_factory=dict)


def survey_file(options: ReplayOptions, fmt: str) -> FileSurvey:
    """Read only the device, time and registry columns, chunk by chunk."""
    mapping = options.mapping
    light = ColumnMapping(
        device=mapping.device, time=mapping.time, metrics=(), device_type=mapping.device_type, site=mapping.site
    )
    survey = FileSurvey()
    previous: int | None = None
    for chunk in read_chunks(options, fmt, light.columns):
        parsed = parse_chunk(chunk, light, options.time_unit)
        ms = parsed.column(TIME_MS)
        ordered, previous = in_event_time_order(ms, previous)
        survey.in_order = survey.in_order and ordered
        survey.rows += len(parsed)
        survey.timed_rows += len(parsed) - ms.null_count
        low, high = pc.min_max(ms).values()
        if low.is_valid:
            survey.first_ms = low.as_py() if survey.first_ms is None else min(survey.first_ms, low.as_py())
            survey.last_ms = high.as_py() if survey.last_ms is None else max(survey.last_ms, high.as_py())
        note_devices(survey.devices, parsed)
    return survey


def chunks_in_event_time_order(options: ReplayOptions, fmt: str, survey: FileSurvey) -> Iterator[pa.Table]:
    """Parsed chunks in publish order: timed rows by event time, then the rows without a usable time."""
    chunks = (
        parse_chunk(raw, options.mapping, options.time_unit)
        for raw in read_chunks(options, fmt, options.mapping.columns)
    )
    if not survey.in_order:  # the documented memory bound: the whole file, parsed
        chunks = iter([_sorted(pa.concat_tables(list(chunks)))])
    untimed: list[pa.Table] = []
    for parsed in chunks:
        timed = pc.is_valid(parsed.column(TIME_MS))
        untimed.append(parsed.filter(pc.invert(timed)))
        yield parsed.filter(timed)
    yield pa.concat_tables(untimed) if untimed else pa.table({})


def _sorted(parsed: pa.Table) -> pa.Table:
    return parsed.take(pa.array(publish_order(parsed.column(TIME_MS))))


# ---------------------------------------------------------------------------------------------------------
# Registry (delta-rs)


def register_devices(
    settings: Settings, seen: dict[str, DeviceSeen], shift_ms: int, today: date
) -> tuple[int, int, str]:
    """Append the devices the ``devices`` table lacks; returns (registered, already known, table path)."""
    path = settings.table_path(DEVICES)
    known: set[str] = set()
    if DeltaTable.is_deltatable(path):
        known = set(DeltaTable(path).to_pyarrow_table(columns=[DEVICE_ID]).column(DEVICE_ID).to_pylist())
    rows = registry_rows(seen, known, shift_ms, today)
    if len(rows):
        if "://" not in path:
            Path(path).mkdir(parents=True, exist_ok=True)
        write_deltalake(path, rows, mode="append")
    return len(rows), len(set(seen) & known), path


# ---------------------------------------------------------------------------------------------------------
# Publishing


class ProducerLike(Protocol):
    """The part of ``confluent_kafka.Producer`` the replay uses (tests substitute a fake)."""

    def produce(self, topic: str, value: bytes, key: bytes | None) -> None: ...
    def poll(self, timeout: float) -> int: ...
    def flush(self, timeout: float) -> int: ...


@dataclass
class ReplaySummary:
    """What a replay did."""

    file: str
    topic: str
    rows: int = 0
    sent: int = 0
    delivered: int = 0
    failed: int = 0
    """Sends the broker rejected or that timed out."""
    unconfirmed: int = 0
    """Sends without a delivery report when the run was aborted."""
    delivery_errors: dict[str, int] = field(default_factory=dict)
    incomplete_rows: int = 0
    incomplete: dict[str, int] = field(default_factory=dict)
    in_order: bool = True
    devices_registered: int = 0
    devices_known: int = 0
    registry_path: str | None = None
    first_event_ms: int | None = None
    last_event_ms: int | None = None
    shift_ms: int = 0
    speed: float | None = 1.0
    elapsed_s: float = 0.0
    interrupted: bool = False

    def on_delivery(self, err: Any, msg: Any) -> None:
        """The producer's ``on_delivery`` callback."""
        if err is None:
            self.delivered += 1
        else:
            self.failed += 1
            self.delivery_errors[err.str()] = self.delivery_errors.get(err.str(), 0) + 1

    def report(self) -> str:
        """A few aligned lines for the terminal."""

        def span(shift: int) -> str:
            if self.first_event_ms is None or self.last_event_ms is None:
                return "no readable event time"
            return f"{format_timestamp(self.first_event_ms + shift)} .. {format_timestamp(self.last_event_ms + shift)}"

        pace = "as fast as possible" if self.speed is None else f"{self.speed:g}x the original pace"
        rows = [
            ("file", f"{self.file} ({self.rows:,} rows, {'in' if self.in_order else 'not in'} event-time order)"),
            (
                "published",
                f"{self.sent:,} records to {self.topic} in {self.elapsed_s:.1f} s, {pace}"
                + (" (stopped early)" if self.interrupted else ""),
            ),
            (
                "delivered",
                f"{self.delivered:,}, failed {self.failed:,}"
                + (f", unconfirmed {self.unconfirmed:,}" if self.unconfirmed else ""),
            ),
            ("recorded", span(0)),
        ]
        if self.shift_ms:
            rows.append(("restamped", f"{span(self.shift_ms)} (shifted by {self.shift_ms / 1000:+,.0f} s)"))
        if self.incomplete_rows:
            detail = ", ".join(f"{name} {n:,}" for name, n in sorted(self.incomplete.items()))
            rows.append(("incomplete", f"{self.incomplete_rows:,} rows, published for bronze to quarantine: {detail}"))
        rows.append(
            (
                "devices",
                f"{self.devices_registered:,} registered, {self.devices_known:,} already known ({self.registry_path})",
            )
        )
        if self.delivery_errors:
            rows.append(("errors", ", ".join(f"{name} {n:,}" for name, n in self.delivery_errors.items())))
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:>{width}}  {text}" for label, text in rows)


class Replayer:
    """Sends parsed chunks in order, each record at its due wall time unless the speed is ``max``."""

    def __init__(
        self,
        producer: ProducerLike,
        summary: ReplaySummary,
        assign_seq: bool,
        first_ms: int,
        wall_start_ms: int,
        progress: Progress,
        stop: StopRequest,
    ) -> None:
        self.producer = producer
        self.summary = summary
        self.seqs = SeqCounter() if assign_seq else None
        self.first_ms = first_ms
        self.wall_start_ms = wall_start_ms
        self.progress = progress
        self.stop = stop

    def send(self, parsed: pa.Table) -> bool:
        """Produce ``parsed`` (timed rows in order, or untimed rows, sent at once); False once stopped."""
        summary = self.summary
        summary.incomplete_rows += incomplete_rows(parsed)
        for name, n in incomplete_fields(parsed).items():
            summary.incomplete[name] = summary.incomplete.get(name, 0) + n
        devices = parsed.column(DEVICE_ID).to_pylist()
        payloads = event_payloads(parsed, self.seqs.assign(devices) if self.seqs else None, summary.shift_ms)
        keys = [None if d is None else d.encode() for d in devices]
        ms = parsed.column(TIME_MS)
        paced = summary.speed is not None and ms.null_count == 0
        event_ms = ms.to_numpy() if ms.null_count == 0 else None
        due = due_wall_ms(event_ms, self.first_ms, self.wall_start_ms, summary.speed) if paced else None
        n, lo = len(parsed), 0
        while lo < n:
            if due is not None:
                end = int(np.searchsorted(due, due[lo] + PACING_WINDOW_MS, side="left"))
                hi = max(lo + 1, min(end, lo + POLL_EVERY))
                if not self._wait_until(int(due[hi - 1])):
                    return False
            else:
                hi = min(n, lo + POLL_EVERY)
            for value, key in zip(payloads[lo:hi], keys[lo:hi], strict=True):
                self._produce(value, key)
            summary.sent += hi - lo
            lo = hi
            self.producer.poll(0)
            clock = int(event_ms[lo - 1]) + summary.shift_ms if event_ms is not None else None
            self.progress.update(summary.sent, summary.delivered, clock)
            if self.stop.requested:
                return False
        return True

    def _produce(self, value: bytes, key: bytes | None) -> None:
        while True:
            try:
                self.producer.produce(self.summary.topic, value, key)
                return
            except BufferError:  # the local queue is full: serve delivery reports until there is room
                self.producer.poll(0.05)

    def _wait_until(self, due_ms: int) -> bool:
        while not self.stop.requested:
            ahead = due_ms - now_ms()
            if ahead <= 0:
                return True
            self.producer.poll(min(ahead / 1000.0, 0.1))
        return False

    def flush(self) -> None:
        """Wait for every delivery report, unless a second Ctrl-C gives up on them."""
        while not self.stop.aborted:
            remaining = self.producer.flush(FLUSH_STEP_S)
            self.progress.update(self.summary.sent, self.summary.delivered, None)
            if remaining == 0:
                break
        self.summary.unconfirmed = self.summary.sent - self.summary.delivered - self.summary.failed


def replay(
    settings: Settings,
    options: ReplayOptions,
    producer_factory: Callable[[Callable[[Any, Any], None]], ProducerLike],
    progress_stream: TextIO | None = None,
    stop: StopRequest | None = None,
) -> ReplaySummary:
    """The run behind ``run_replay``, with the producer injected (tests pass a fake one)."""
    options.validate()
    fmt = file_format(options.path, options.file_format)
    options.mapping.check(file_columns(options.path, fmt))
    survey = survey_file(options, fmt)
    start_ms = now_ms()
    summary = ReplaySummary(
        file=str(options.path),
        topic=settings.topic,
        rows=survey.rows,
        in_order=survey.in_order,
        first_event_ms=survey.first_ms,
        last_event_ms=survey.last_ms,
        shift_ms=restamp_shift_ms(survey.first_ms, start_ms, options.restamp),
        speed=options.speed,
    )
    if options.restamp and survey.first_ms is not None and survey.last_ms is not None:
        lead = restamp_lead_s(survey.first_ms, survey.last_ms, options.speed)
        if lead > settings.max_clock_skew_seconds:
            raise ReplayError(
                f"with --restamp at this speed the last readings would be stamped {lead:,.0f} s ahead of the "
                f"time they are sent, beyond IOTMON_MAX_CLOCK_SKEW_SECONDS={settings.max_clock_skew_seconds}, "
                "and bronze would quarantine them as absurd_event_time; lower --speed or replay without --restamp"
            )
    summary.devices_registered, summary.devices_known, summary.registry_path = register_devices(
        settings, survey.devices, summary.shift_ms, from_ms(start_ms).date()
    )
    stop = stop or StopRequest()
    progress = Progress(options.progress, progress_stream, label="replay")
    producer = producer_factory(summary.on_delivery)
    replayer = Replayer(
        producer,
        summary,
        assign_seq=options.mapping.seq is None,
        first_ms=survey.first_ms if survey.first_ms is not None else 0,
        wall_start_ms=now_ms(),
        progress=progress,
        stop=stop,
    )
    started = time.monotonic()
    try:
        with stop_on_interrupt(stop):
            try:
                for parsed in chunks_in_event_time_order(options, fmt, survey):
                    if len(parsed) and not replayer.send(parsed):
                        break
            finally:
                replayer.flush()
    finally:
        progress.close()
        summary.elapsed_s = time.monotonic() - started
        summary.interrupted = stop.requested
    return summary


def run_replay(settings: Settings, options: ReplayOptions) -> ReplaySummary:
    """Publish a recorded file's readings to ``settings.topic``; see the module docstring for the choices."""
    options.validate()  # the file's mistakes first, Kafka's after
    options.mapping.check(file_columns(options.path, file_format(options.path, options.file_format)))
    ensure_topic(settings)
    return replay(settings, options, lambda on_delivery: make_producer(settings, on_delivery=on_delivery))
