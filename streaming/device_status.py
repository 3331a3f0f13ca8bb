"""Per-device status (online / degraded / offline) from the silver readings, with event-time timers.

Rules, all in event time so that a replayed micro-batch writes exactly what it wrote before:

* A device is ``online`` when its latest reading is healthy and ``degraded`` when that reading has a metric
  out of range (``out_of_range`` not null) or ``battery < IOTMON_LOW_BATTERY``.
* It is ``offline`` once it has been silent for ``IOTMON_OFFLINE_AFTER``: when the watermark reaches
  ``last_seen + offline_after``, the device changes to offline with ``changed_at = last_seen + offline_after``,
  never a wall-clock time. The change is written by the batch whose readings take the watermark there (Spark
  moves the watermark only at the next batch, a trigger later), or, while no reading comes, by the batch whose
  watermark the clock's ticks moved (an event-time timer fires).
  A reading that arrives at or after that instant in the same micro-batch as the silence (Spark hands a
  batch's rows to the operator before it fires the batch's timers, and a backlog comes in one batch) is
  preceded by the same offline change, so readings in order give the same changes however they are batched.
* The next reading brings an offline device back (online or degraded) with ``changed_at`` = its event time.
* Status is about now: a reading counts only if it reached Kafka within ``IOTMON_STATUS_LATENESS`` of its
  event time (``arrival_delay_s``), which is also the query's watermark delay, so a silent device is
  declared offline that long after its deadline rather than a whole ``IOTMON_WATERMARK`` later. Later
  readings are in silver and the windows, not here.
* A device's readings are applied in the order they reached Kafka (``partition``, ``offset``) and every
  transition is emitted, so online -> degraded -> online within one batch gives two change rows. A device's
  first reading is a change from ``previous_status`` null. Only a change of *status* is a change; a degraded
  device whose reason changes (battery -> out of range) keeps its ``since`` and gets the new reason.
* A reading older than the device's latest one (out of order) changes nothing: it cannot move ``last_seen``
  backwards nor rewrite a past status. Applied in arrival order, readings give the same changes however
  they are batched, which is what lets ``iotmon verify`` recompute them from silver (``status_history``).

The operator emits *status updates*: each change, plus one snapshot row per device and batch whose last
reading changed nothing (so ``device_status.last_seen`` stays current). ``version`` counts a device's
updates and orders them within a batch (two changes can share an event time). Both sinks are written in
one ``foreachBatch``, exactly once: the changes appended, the current status MERGEd, each commit tagged with
the batch (``iotmon.lake.BatchLedger``). State (RocksDB) is kept for every device ever seen, by shard of the
fleet: the operator's key is a shard (``SHARDS``), whose state is its devices' states and one timer
(``DeviceStatusProcessor``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle, StreamingQuery
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType, TimestampType

from iotmon.config import Settings, interval_seconds
from iotmon.lake import BatchLedger, append_once, create_table, merge_once, newest_per_key
from iotmon.queries import QuerySpec, Trigger
from iotmon.schema import (
    DEGRADED,
    DEVICE_ID,
    DEVICE_STATUS,
    DEVICE_STATUS_CHANGES,
    EVENT_TIME,
    OFFLINE,
    ONLINE,
    SEQ,
)
from streaming.sources import ensure_clock_table, observe_arrivals, readings_and_ticks

DEVICE_STATUS_CHANGES_SCHEMA = StructType(
    [
        StructField(DEVICE_ID, StringType(), False),
        StructField("status", StringType(), False),
        StructField("previous_status", StringType()),
        StructField("changed_at", TimestampType(), False),
        StructField("reason", StringType(), False),
        StructField("last_seen", TimestampType(), False),
        StructField(SEQ, LongType()),
    ]
)
"""One row per status transition; ``changed_at`` is event time, ``seq`` the device's latest reading then."""

DEVICE_STATUS_SCHEMA = StructType(
    [
        StructField(DEVICE_ID, StringType(), False),
        StructField("status", StringType(), False),
        StructField("since", TimestampType(), False),
        StructField("last_seen", TimestampType(), False),
        StructField("reason", StringType(), False),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
    ]
)
"""One row per device ever seen: its status now, since when, and its latest reading's event time."""

STATUS_UPDATE_SCHEMA = StructType(
    [
        StructField(DEVICE_ID, StringType()),
        StructField("version", LongType()),
        StructField("changed", BooleanType()),
        StructField("status", StringType()),
        StructField("previous_status", StringType()),
        StructField("since", TimestampType()),
        StructField("last_seen", TimestampType()),
        StructField(SEQ, LongType()),
        StructField("reason", StringType()),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
    ]
)
"""What ``status_updates`` returns: a change (``changed``) or a snapshot of a device after a batch."""

# The operator speaks epoch milliseconds (no timezone conversion between Arrow, pandas and the state store);
# status_updates turns them into timestamps.
_OPERATOR_OUTPUT = StructType(
    [
        StructField(DEVICE_ID, StringType()),
        StructField("version", LongType()),
        StructField("changed", BooleanType()),
        StructField("status", StringType()),
        StructField("previous_status", StringType()),
        StructField("since_ms", LongType()),
        StructField("last_seen_ms", LongType()),
        StructField(SEQ, LongType()),
        StructField("reason", StringType()),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
    ]
)

SHARDS = 16
"""The operator's keys: devices hashed into this many shards, each a key with one state holding all its devices.

Each key costs about 3 ms of CPU a batch, the JVM's and Python's (an input frame cut out for it, an output
frame converted to Arrow, state calls over a socket), and a batch reaches every device: with one key per
device that was most of the query's Python (docs/cost-model.md, "Devices in shards"). Fixed into the
checkpoint's state (``STATE_VARIABLES``): another value needs a new checkpoint (``iotmon backfill`` or
``iotmon reset``)."""

_DEVICE_STATE_SCHEMA = StructType(
    [
        StructField(DEVICE_ID, StringType()),
        StructField("status", StringType()),
        StructField("since_ms", LongType()),
        StructField("last_seen_ms", LongType()),
        StructField(SEQ, LongType()),
        StructField("reason", StringType()),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
        StructField("version", LongType()),
    ]
)
"""One element of a shard's list of devices (``STATE_VARIABLES``): a device's ``DeviceState``."""

_TIMER_SCHEMA = StructType([StructField("timer_ms", LongType())])
"""A shard's ``timer`` value state: the one event-time timer armed for it."""

STATE_VARIABLES = (f"devices_of_{SHARDS}_shards", "timer")
"""The operator's state variables, recorded in its checkpoint (``pipeline.topology.outdated_checkpoints``); the
first names the shard count, so a checkpoint of another count is refused rather than read with devices looked
for in the wrong shard."""

SHARD = "shard"

_INPUT_COLUMNS = (
    SHARD,
    DEVICE_ID,
    EVENT_TIME,
    "event_ms",
    SEQ,
    "battery",
    "out_of_range",
    "device_type",
    "site",
    "partition",
    "offset",
)
ARRIVAL_ORDER: tuple[str, ...] = ("partition", "offset")
"""The order readings reached Kafka in; a device's readings are all in one partition (keyed by device)."""


# -- The rules, plain Python ------------------------------------------------------------------------------


@dataclass(frozen=True)
class StatusRules:
    offline_after_ms: int
    low_battery: float
    lateness_ms: int
    """``IOTMON_STATUS_LATENESS``, the query's watermark delay."""

    @classmethod
    def from_settings(cls, settings: Settings) -> StatusRules:
        return cls(
            round(interval_seconds(settings.offline_after) * 1000),
            settings.low_battery,
            round(interval_seconds(settings.status_lateness) * 1000),
        )


@dataclass(frozen=True)
class Reading:
    event_ms: int
    seq: int | None
    battery: float | None
    out_of_range: str | None
    device_type: str | None = None
    site: str | None = None
    follows_ms: int | None = None
    """The event time of the device's reading just before this one when readings in between were left out
    (``significant_readings``); else the state's ``last_seen`` is that reading."""


@dataclass(frozen=True)
class DeviceState:
    status: str
    since_ms: int
    last_seen_ms: int
    seq: int | None
    reason: str
    device_type: str | None
    site: str | None
    version: int
    """How many updates of this device have been emitted; the last one carries this number."""


@dataclass(frozen=True)
class Update:
    """One output row: the device's state after an event, and whether its status changed there."""

    state: DeviceState
    changed: bool
    previous_status: str | None


def _number(value: float) -> str:
    return f"{value:g}"


def assess(reading: Reading, rules: StatusRules) -> tuple[str, str]:
    """Status and reason a reading alone implies; both degradations are named when both apply."""
    problems = []
    if reading.out_of_range:
        names = [name.strip() for name in reading.out_of_range.split(",") if name.strip()]
        problems.append("out of range: " + ", ".join(names))
    if reading.battery is not None and not math.isnan(reading.battery) and reading.battery < rules.low_battery:
        problems.append(f"battery {reading.battery:.1f}% < {_number(rules.low_battery)}%")
    if problems:
        return DEGRADED, "; ".join(problems)
    return ONLINE, "reporting"


def silence_reason(silent_ms: int) -> str:
    return f"silent for {_number(silent_ms / 1000)}s"


def go_offline(state: DeviceState, at_ms: int) -> Update:
    """The offline change of a device silent since ``state.last_seen_ms``, dated ``at_ms`` (its deadline)."""
    offline = replace(
        state,
        status=OFFLINE,
        since_ms=at_ms,
        reason=silence_reason(at_ms - state.last_seen_ms),
        version=state.version + 1,
    )
    return Update(offline, True, state.status)


def is_stale(state: DeviceState | None, reading: Reading) -> bool:
    """Not newer than the device's latest reading: it must not move ``last_seen`` back nor rewrite history."""
    return state is not None and _order(reading) <= (state.last_seen_ms, state.seq if state.seq is not None else -1)


def advance(state: DeviceState | None, readings: Iterable[Reading], rules: StatusRules) -> list[Update]:
    """Apply one batch of a device's readings, in the order they reached Kafka; return the updates to emit,
    the last one being the new state.

    Every status change is an update; if readings after the last change moved ``last_seen`` on, a final
    snapshot (``changed=False``) carries them. An empty list means the state is unchanged.
    """
    updates: list[Update] = []
    pending = False  # the state moved on since the last update
    for reading in readings:
        if is_stale(state, reading):
            continue
        if state is not None and state.status != OFFLINE:
            follows = reading.follows_ms if reading.follows_ms is not None else state.last_seen_ms
            deadline = follows + rules.offline_after_ms
            if reading.event_ms >= deadline:
                updates.append(go_offline(state, deadline))
                state = updates[-1].state
        status, reason = assess(reading, rules)
        previous = state.status if state is not None else None
        changed = previous != status
        state = DeviceState(
            status=status,
            since_ms=reading.event_ms if changed or state is None else state.since_ms,
            last_seen_ms=reading.event_ms,
            seq=reading.seq,
            reason=reason,
            device_type=reading.device_type if reading.device_type is not None else _kept(state, "device_type"),
            site=reading.site if reading.site is not None else _kept(state, "site"),
            version=(state.version if state is not None else 0) + (1 if changed else 0),
        )
        pending = not changed
        if changed:
            updates.append(Update(state, True, previous))
    if pending and state is not None:
        updates.append(Update(replace(state, version=state.version + 1), False, None))
    return updates


def _order(reading: Reading) -> tuple[int, int]:
    return reading.event_ms, reading.seq if reading.seq is not None else -1


def _kept(state: DeviceState | None, attribute: str) -> str | None:
    return getattr(state, attribute) if state is not None else None


# -- The operator ---------------------------------------------------------------------------------------


def shard_of(device_id: Column) -> Column:
    """The operator's key of a device: its shard, one of ``SHARDS``."""
    return F.pmod(F.hash(device_id), F.lit(SHARDS))


def _state_row(device_id: str, state: DeviceState) -> tuple:
    """A device's element of its shard's list state (``_DEVICE_STATE_SCHEMA``): the id, then ``DeviceState``'s
    fields in order, as ``DeviceStatusProcessor._states`` reads them back."""
    return (device_id, *(getattr(state, field.name) for field in fields(DeviceState)))


def _frame(changed: Iterable[tuple[str, list[Update]]]) -> pd.DataFrame:
    """Operator output rows: each device's updates, in order."""
    rows = [(device_id, update) for device_id, updates in changed for update in updates]
    states = [update.state for _, update in rows]
    columns = {
        DEVICE_ID: [device_id for device_id, _ in rows],
        "version": [s.version for s in states],
        "changed": [u.changed for _, u in rows],
        "status": [s.status for s in states],
        "previous_status": [u.previous_status for _, u in rows],
        "since_ms": [s.since_ms for s in states],
        "last_seen_ms": [s.last_seen_ms for s in states],
        # object dtype keeps a null seq null instead of turning the column into floats
        SEQ: np.array([s.seq for s in states], dtype=object),
        "reason": [s.reason for s in states],
        "device_type": [s.device_type for s in states],
        "site": [s.site for s in states],
    }
    return pd.DataFrame(columns, columns=_OPERATOR_OUTPUT.fieldNames())


def _optional(value: object) -> object:
    return None if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)) else value


def reading_columns(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """The operator's input rows as arrays, converted once for all the devices they hold: ``seq`` as
    ``int | None`` objects, ``battery`` as floats with NaN for null."""
    seq = [None if _optional(value) is None else int(value) for value in frame[SEQ].to_numpy(dtype=object)]
    return {
        DEVICE_ID: frame[DEVICE_ID].to_numpy(dtype=object),
        "event_ms": frame["event_ms"].to_numpy(dtype=np.int64),
        SEQ: np.array(seq, dtype=object),
        "battery": frame["battery"].to_numpy(dtype="float64", na_value=np.nan),
        **{name: frame[name].to_numpy(dtype=object) for name in ("out_of_range", "device_type", "site")},
        **{name: frame[name].to_numpy() for name in ARRIVAL_ORDER},
    }


def by_device(columns: Mapping[str, np.ndarray]) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """Each device's rows of ``columns`` (``reading_columns``), in device order."""
    devices = columns[DEVICE_ID]
    if len(devices) == 0:
        return
    order = np.argsort(devices, kind="stable")
    sorted_ids = devices[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    for start, end in zip(starts, [*starts[1:], len(order)], strict=True):
        rows = order[start:end]
        yield sorted_ids[start], {name: values[rows] for name, values in columns.items()}


def significant_readings(
    state: DeviceState | None, columns: Mapping[str, np.ndarray], rules: StatusRules
) -> list[Reading]:
    """The readings of a batch that ``advance`` needs to emit what all of them would, in arrival order: the
    first and the last of the newer ones, each whose status differs from the one before, and both sides of
    every silence of ``offline_after``. Chosen with array operations on one device's ``columns``
    (``reading_columns``), so that a batch's steady readings never become Python objects: they would only
    have moved ``last_seen`` on, which the last reading does too."""
    if len(columns["event_ms"]) == 0:
        return []
    arrival = np.lexsort([columns[column] for column in reversed(ARRIVAL_ORDER)])  # lexsort: last key primary
    event_ms = columns["event_ms"][arrival]
    seqs = list(columns[SEQ][arrival])
    seq = np.array([-1 if value is None else value for value in seqs], dtype=np.int64)
    # Newer than every reading before it (in arrival order) and than the state: compared by rank of
    # (event time, seq), so that a running maximum says it.
    by_key = np.lexsort((seq, event_ms))
    distinct = np.ones(len(arrival), dtype=bool)
    distinct[1:] = (np.diff(event_ms[by_key]) != 0) | (np.diff(seq[by_key]) != 0)
    rank = np.empty(len(arrival), dtype=np.int64)
    rank[by_key] = np.cumsum(distinct)  # equal readings, equal rank
    newer = np.ones(len(arrival), dtype=bool)
    newer[1:] = rank[1:] > np.maximum.accumulate(rank)[:-1]
    if state is not None:
        last = (state.last_seen_ms, state.seq if state.seq is not None else -1)
        newer &= (event_ms > last[0]) | ((event_ms == last[0]) & (seq > last[1]))
    rows = arrival[newer]
    if len(rows) == 0:
        return []
    event_ms = event_ms[newer]
    seqs = [value for value, kept in zip(seqs, newer, strict=True) if kept]
    battery = columns["battery"][rows]
    out_of_range = columns["out_of_range"][rows]
    flagged = np.array([isinstance(value, str) and value != "" for value in out_of_range], dtype=bool)
    degraded = flagged | (battery < rules.low_battery)  # NaN compares False: no battery, no degradation
    chosen = np.zeros(len(rows), dtype=bool)
    chosen[0] = chosen[-1] = True
    chosen[1:] |= degraded[1:] != degraded[:-1]
    silence = np.zeros(len(rows), dtype=bool)
    silence[1:] = event_ms[1:] >= event_ms[:-1] + rules.offline_after_ms
    chosen |= silence
    chosen[:-1] |= silence[1:]
    device_type = _filled_forward(columns["device_type"][rows])
    site = _filled_forward(columns["site"][rows])
    return [
        Reading(
            event_ms=int(event_ms[i]),
            seq=seqs[i],
            battery=None if np.isnan(battery[i]) else float(battery[i]),
            out_of_range=_optional(out_of_range[i]),
            device_type=device_type[i],
            site=site[i],
            follows_ms=int(event_ms[i - 1]) if i > 0 else None,
        )
        for i in np.flatnonzero(chosen)
    ]


def _filled_forward(values: np.ndarray) -> list[object]:
    """Each null replaced by the last value before it (None before the first)."""
    filled, last = [], None
    for value in values:
        if _optional(value) is not None:
            last = value
        filled.append(last)
    return filled


def apply_readings(
    states: dict[str, DeviceState], frame: pd.DataFrame, rules: StatusRules
) -> list[tuple[str, list[Update]]]:
    """A batch's readings of several devices applied to their ``states`` (updated in place): each changed
    device's updates (``advance``), in device order."""
    changed = []
    for device_id, columns in by_device(reading_columns(frame)):
        state = states.get(device_id)
        updates = advance(state, significant_readings(state, columns, rules), rules)
        if updates:
            states[device_id] = updates[-1].state
            changed.append((device_id, updates))
    return changed


def deadline_of(state: DeviceState, rules: StatusRules) -> int | None:
    """When the device goes offline if it stays silent; None once it is offline."""
    return None if state.status == OFFLINE else state.last_seen_ms + rules.offline_after_ms


def silenced(states: dict[str, DeviceState], watermark_ms: int, rules: StatusRules) -> list[tuple[str, list[Update]]]:
    """Every device whose deadline ``watermark_ms`` has reached goes offline at its deadline (``states`` updated
    in place); their updates, in device order."""
    changed = []
    for device_id, state in states.items():
        deadline = deadline_of(state, rules)
        if deadline is not None and deadline <= watermark_ms:
            update = go_offline(state, deadline)
            states[device_id] = update.state
            changed.append((device_id, [update]))
    return changed


def next_watermark(frame: pd.DataFrame, rules: StatusRules) -> int:
    """A floor of the watermark the batch after this one starts with: Spark's is the newest event time of the
    batches so far, less the lateness, and these readings are among them."""
    return int(frame["event_ms"].max()) - rules.lateness_ms


def _joined(
    first: list[tuple[str, list[Update]]], then: list[tuple[str, list[Update]]]
) -> list[tuple[str, list[Update]]]:
    """Each device's updates of ``first`` followed by its updates of ``then``."""
    updates = dict(first)
    for device_id, more in then:
        updates[device_id] = [*updates.get(device_id, []), *more]
    return list(updates.items())


class DeviceStatusProcessor(StatefulProcessor):
    """Keeps, per shard of the fleet (``SHARDS``), each device's ``DeviceState`` and one event-time timer.

    The timer is armed at or before the earliest deadline of the shard's reporting devices, and not moved
    on when readings move deadlines later (that would be two state calls per device and batch): when it
    fires, every device whose deadline the watermark has reached goes offline at its deadline, and it is
    armed again at the earliest deadline left. A device therefore goes offline in the batch whose
    watermark reaches its deadline, as a timer of its own would have it, or, where the shard's readings
    already show that the next batch's watermark will reach it, in their batch (``next_watermark``).

    Spark calls ``handleExpiredTimer`` with keyword arguments, so its parameter names are part of the API.
    """

    def __init__(self, rules: StatusRules) -> None:
        self._rules = rules

    def init(self, handle: StatefulProcessorHandle) -> None:
        self._handle = handle
        self._devices = handle.getListState(STATE_VARIABLES[0], _DEVICE_STATE_SCHEMA)
        self._timer = handle.getValueState(STATE_VARIABLES[1], _TIMER_SCHEMA)

    def handleInputRows(
        self, key: tuple[int], rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        frames = list(rows)
        batch = frames[0] if len(frames) == 1 else pd.concat(frames)  # one frame unless a shard's rows are many
        states = self._states()
        changed = apply_readings(states, batch, self._rules)
        if not changed:
            return
        # What the next batch's watermark is sure to reach goes offline now, not a trigger later: the same
        # changes at the same instants, written one batch sooner (docs/cost-model.md, "Offline a trigger sooner").
        changed = _joined(changed, silenced(states, next_watermark(batch, self._rules), self._rules))
        self._store(states)
        earliest = self._earliest(states)
        armed = self._armed()
        if earliest is not None and (armed is None or earliest < armed):
            if armed is not None:
                self._handle.deleteTimer(armed)
            self._arm(earliest)
        yield _frame(changed)

    def handleExpiredTimer(
        self, key: tuple[int], timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[pd.DataFrame]:
        if self._armed() != expiredTimerInfo.getExpiryTimeInMs():
            return  # a timer this state no longer armed; Spark deletes it after this call
        # Timers fire up to the watermark, so every deadline up to it has passed.
        states = self._states()
        changed = silenced(states, timerValues.getCurrentWatermarkInMs(), self._rules)
        if changed:
            self._store(states)
        earliest = self._earliest(states)
        if earliest is None:
            self._timer.clear()
        else:
            self._arm(earliest)
        if changed:
            yield _frame(changed)

    def _states(self) -> dict[str, DeviceState]:
        return {row[0]: DeviceState(*row[1:]) for row in self._devices.get()}

    def _store(self, states: dict[str, DeviceState]) -> None:
        self._devices.put([_state_row(device_id, state) for device_id, state in states.items()])

    def _earliest(self, states: dict[str, DeviceState]) -> int | None:
        deadlines = [d for d in (deadline_of(s, self._rules) for s in states.values()) if d is not None]
        return min(deadlines, default=None)

    def _armed(self) -> int | None:
        stored = self._timer.get()
        return stored[0] if stored is not None else None

    def _arm(self, at_ms: int) -> None:
        self._handle.registerTimer(at_ms)
        self._timer.update((at_ms,))

    def close(self) -> None:
        pass


def status_updates(readings: DataFrame, settings: Settings) -> DataFrame:
    """Silver-shaped readings -> status updates (``STATUS_UPDATE_SCHEMA``); pure, no I/O.

    Works on a streaming frame (state and timers across batches) and on a static one (one pass, no timers
    fire, for tests). Spark creates the state store coordinator only with the streaming query manager, so a
    static frame touches ``spark.streams`` first or its state store fails to load.
    """
    if not readings.isStreaming:
        _ = readings.sparkSession.streams
    rules = StatusRules.from_settings(settings)
    operator_input = (
        observe_arrivals(readings.withWatermark(EVENT_TIME, settings.status_lateness))
        .where(F.col(DEVICE_ID).isNotNull())  # the event-time clock's ticks only move the watermark
        .where(F.col("arrival_delay_s") <= interval_seconds(settings.status_lateness))
        .withColumn("event_ms", F.unix_millis(EVENT_TIME))
        .withColumn(SHARD, shard_of(F.col(DEVICE_ID)))
        .select(*_INPUT_COLUMNS)
    )
    updates = operator_input.groupBy(SHARD).transformWithStateInPandas(
        statefulProcessor=DeviceStatusProcessor(rules),
        outputStructType=_OPERATOR_OUTPUT,
        outputMode="Update",
        timeMode="EventTime",
    )
    return _with_timestamps(updates)


def _with_timestamps(updates: DataFrame, *kept: str) -> DataFrame:
    """Operator rows (epoch milliseconds) as ``STATUS_UPDATE_SCHEMA`` rows."""
    return updates.select(
        *[
            F.timestamp_millis(f"{f.name}_ms").alias(f.name) if f.name in ("since", "last_seen") else F.col(f.name)
            for f in STATUS_UPDATE_SCHEMA.fields
        ],
        *kept,
    )


def _epoch_ms(moment: datetime | None) -> int | None:
    """A naive UTC time (as Spark returns them) in epoch milliseconds."""
    return round(moment.replace(tzinfo=UTC).timestamp() * 1000) if moment is not None else None


OFFLINE_UNSETTLED = "unsettled"
"""Column of ``status_history``: the update is an offline change the stream may or may not have made yet."""


def status_history(
    readings: DataFrame, settings: Settings, settled: datetime | None, reached: datetime | None
) -> DataFrame:
    """What the status query emits over all of ``readings`` (silver, a batch frame), computed in one pass.

    The same rules on the same readings in the same (arrival) order, so the changes are those of the stream
    however it was batched. A device's last silence is closed by its offline change only where the
    stream's watermark reached the deadline: surely by ``settled`` (the watermark its last batch started
    with), perhaps by ``reached`` (the one it ended with; ``OFFLINE_UNSETTLED`` marks those).
    """
    rules = StatusRules.from_settings(settings)
    settled_ms, reached_ms = (
        round(t.replace(tzinfo=UTC).timestamp() * 1000) if t else None for t in (settled, reached)
    )
    schema = StructType([*_OPERATOR_OUTPUT.fields, StructField(OFFLINE_UNSETTLED, BooleanType())])

    def shard(frame: pd.DataFrame) -> pd.DataFrame:
        devices, unsettled = [], []
        for device_id, updates in apply_readings({}, frame, rules):
            deadline, closed = deadline_of(updates[-1].state, rules), False
            if deadline is not None and reached_ms is not None and deadline <= reached_ms:
                updates = [*updates, go_offline(updates[-1].state, deadline)]
                closed = settled_ms is None or deadline > settled_ms
            devices.append((device_id, updates))
            unsettled += [False] * (len(updates) - 1) + [closed]
        return _frame(devices).assign(**{OFFLINE_UNSETTLED: unsettled})

    counted = readings.where(F.col("arrival_delay_s") <= interval_seconds(settings.status_lateness))
    history = (
        counted.withColumn("event_ms", F.unix_millis(EVENT_TIME))
        .withColumn(SHARD, shard_of(F.col(DEVICE_ID)))
        .select(*_INPUT_COLUMNS)
        .groupBy(SHARD)
        .applyInPandas(shard, schema)
    )
    return _with_timestamps(history, OFFLINE_UNSETTLED)


def changes_of(updates: DataFrame, *kept: str) -> DataFrame:
    """The status transitions among ``updates``, shaped as ``DEVICE_STATUS_CHANGES_SCHEMA`` (and ``kept``)."""
    return updates.where(F.col("changed")).select(
        DEVICE_ID, "status", "previous_status", F.col("since").alias("changed_at"), "reason", "last_seen", SEQ, *kept
    )


def latest_status(updates: DataFrame) -> DataFrame:
    """Each device's last update among ``updates``, shaped as ``DEVICE_STATUS_SCHEMA``."""
    newest_first = Window.partitionBy(DEVICE_ID).orderBy(F.col("version").desc())
    return (
        updates.withColumn("_rank", F.row_number().over(newest_first))
        .where(F.col("_rank") == 1)
        .select(*DEVICE_STATUS_SCHEMA.fieldNames())
    )


def change_rows(updates: pa.Table) -> pa.Table:
    """``changes_of`` over Arrow rows: the writer picks a batch's changes on the driver (tested equal)."""
    changed = updates.filter(updates.column("changed"))
    columns = [DEVICE_ID, "status", "previous_status", "since", "reason", "last_seen", SEQ]
    return changed.select(columns).rename_columns(DEVICE_STATUS_CHANGES_SCHEMA.fieldNames())


def latest_status_rows(updates: pa.Table) -> pa.Table:
    """``latest_status`` over Arrow rows: each device's update of the highest version (tested equal)."""
    return newest_per_key(updates, DEVICE_ID, "version").select(DEVICE_STATUS_SCHEMA.fieldNames())


# -- The query ------------------------------------------------------------------------------------------


def ensure_device_status_tables(spark: SparkSession, settings: Settings) -> None:
    """Create both tables up front, so readers find them before the first status change."""
    create_table(
        spark,
        settings.table_path(DEVICE_STATUS_CHANGES),
        DEVICE_STATUS_CHANGES_SCHEMA,
        "Every device status transition (online/degraded/offline), dated in event time.",
    )
    create_table(
        spark,
        settings.table_path(DEVICE_STATUS),
        DEVICE_STATUS_SCHEMA,
        "Each device's current status, since when, and when it last reported (event time).",
    )


def status_batch_writer(settings: Settings) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function: both sinks, each skipping a batch id it already holds."""
    checkpoint = settings.checkpoint_path(DEVICE_STATUS)
    changes_path = settings.table_path(DEVICE_STATUS_CHANGES)
    status_path = settings.table_path(DEVICE_STATUS)
    ledger = BatchLedger(checkpoint)

    def write(batch: DataFrame, batch_id: int) -> None:
        updates = batch.toArrow()  # one Spark job: the batch is read once, so it need not be held
        if updates.num_rows == 0:
            return  # no reading and no timer: nothing to record
        append_once(change_rows(updates), changes_path, ledger, batch_id, batch.sparkSession)
        merge_once(latest_status_rows(updates), status_path, (DEVICE_ID,), ledger, batch_id, batch.sparkSession)

    return write


def start_device_status(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    ensure_device_status_tables(spark, settings)
    ensure_clock_table(spark, settings)
    return (
        status_updates(readings_and_ticks(spark, settings), settings)
        .writeStream.queryName(DEVICE_STATUS)
        .outputMode("update")
        .option("checkpointLocation", settings.checkpoint_path(DEVICE_STATUS))
        .foreachBatch(status_batch_writer(settings))
        .trigger(**trigger)
        .start()
    )


DEVICE_STATUS_QUERY = QuerySpec(DEVICE_STATUS, start_device_status, state_variables=STATE_VARIABLES)
