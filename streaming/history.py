"""The scorer's memory between micro-batches: each device's recent silver readings, as far back as the features
of the next readings can reach.

A reading's features depend on its device's readings in the lookback before it (``ml.features``), three
feature histories and a bucket: at 500 events/s and a one-minute history, some 100,000 silver rows for a batch
of 1,000. Read from silver at every batch, that lookback cost the scorer seconds per batch whatever the batch's
size. So the scorer keeps it: ``DeviceHistory`` holds each device's readings (the columns the features use),
newest last, from the start of a whole bucket on, and drops what no reading still to come can need.

It is a cache of silver, never a source of truth. A reading's features depend only on on-time readings that
reached Kafka before it: same device, so same partition, so the same or an earlier silver commit. The scorer
gets silver's commits whole (each is one file, ``iotmon.lake.append_once``, and a Delta source splits its
batches between files), so all of them were in the cache or in the reading's own batch; features computed from
the cache equal those computed from silver, and from the whole archive. Whatever a batch needs that the cache
does not hold is read from silver first, in one read for the batch:

- a device the cache has not seen (the scorer's first batch after a start, a new device), from the lookback of
  its batch's readings to silver's end: a scorer restarted from its checkpoint has not had the readings its
  previous run scored, and a first batch holding only a reading far older than them (a late-arrivals commit)
  would otherwise leave the device's history without them;
- a *straggler*, a reading whose lookback starts before what the cache holds of its device (one Kafka delivered
  beyond the watermark, minutes behind the device's newest), from its lookback to itself only: its features are
  computed from that read, and neither the read nor the reading enters the cache, which goes on from where it
  was. Read to silver's end and merged into the cache, as the scorer did before, each such reading cost its
  device's readings of the 6 to 20 minutes since, trimmed again at the batch's end (docs/cost-model.md).

A replayed batch starts with an empty cache and reads silver: the same features.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from iotmon.schema import DEVICE_ID, EVENT_TIME, LATENESS, METRIC_NAMES, ON_TIME, SEQ
from ml.features import FEATURE_COLUMNS, FeatureSpec, Judgements, device_features

FEATURE_INPUTS: tuple[str, ...] = (DEVICE_ID, SEQ, EVENT_TIME, *METRIC_NAMES, LATENESS)
"""The silver columns a reading's features are computed from."""
SilverRanges = Mapping[str, tuple[int, int | None]]
"""Per device, the epoch microseconds from which (inclusive) and through which (inclusive; ``None``: to silver's
end, however new) its readings are wanted."""
SilverReader = Callable[[SilverRanges], pa.Table]
"""Reads silver's ``FEATURE_INPUTS`` rows of each given device in its range (at least those)."""


@dataclass
class _Readings:
    """One device's readings, sorted by (event time, seq), and from when on they are all there; with what is
    known of each reading's jump and suspicion (``ml.features.Judgements``), computed once per reading."""

    event_us: np.ndarray
    seq: np.ndarray
    values: np.ndarray
    on_time: np.ndarray
    judgements: Judgements
    complete_from_us: int
    newest_scored_us: int = -1
    """The newest reading of the device a batch has had: what decides what is still needed (readings read from
    silver ahead of it are kept, and need nothing)."""

    def merged(self, other: _Readings | None) -> _Readings:
        """These readings and ``other``'s, each once, sorted; complete from where these are (``other`` only
        adds readings). A reading both hold keeps these readings' judgements."""
        parts = [self] if other is None else [self, other]
        if other is not None and _before(self, other):  # the usual batch, newer than all held: nothing to sort
            return _Readings(
                np.concatenate([self.event_us, other.event_us]),
                np.concatenate([self.seq, other.seq]),
                np.concatenate([self.values, other.values]),
                np.concatenate([self.on_time, other.on_time]),
                Judgements.concatenated([self.judgements, other.judgements]),
                self.complete_from_us,
                max(self.newest_scored_us, other.newest_scored_us),
            )
        event_us = np.concatenate([p.event_us for p in parts])
        seq = np.concatenate([p.seq for p in parts])
        order = np.lexsort((seq, event_us))
        event_us, seq = event_us[order], seq[order]
        first = np.ones(len(event_us), dtype=bool)  # none for no readings at all
        first[1:] = (event_us[1:] != event_us[:-1]) | (seq[1:] != seq[:-1])
        keep = order[first]
        return _Readings(
            event_us[first],
            seq[first],
            np.concatenate([p.values for p in parts])[keep],
            np.concatenate([p.on_time for p in parts])[keep],
            Judgements.concatenated([p.judgements for p in parts]).take(keep),
            self.complete_from_us,
            max(p.newest_scored_us for p in parts),
        )

    def since(self, start_us: int) -> _Readings:
        """The readings from ``start_us`` on."""
        at = int(np.searchsorted(self.event_us, start_us, side="left"))
        return _Readings(
            self.event_us[at:],
            self.seq[at:],
            self.values[at:],
            self.on_time[at:],
            self.judgements.take(slice(at, None)),
            max(self.complete_from_us, start_us),
            self.newest_scored_us,
        )


@dataclass(frozen=True)
class _Columns:
    """What features are computed from, as arrays of a whole table: a device's rows are then picked by index,
    not taken out of the table device by device (an Arrow ``take`` of every column, about 0.7 ms a device)."""

    event_us: np.ndarray
    seq: np.ndarray
    values: np.ndarray
    on_time: np.ndarray

    @classmethod
    def of(cls, table: pa.Table) -> _Columns:
        return cls(
            table.column(EVENT_TIME).cast(pa.timestamp("us")).to_numpy().astype(np.int64),
            table.column(SEQ).to_numpy().astype(np.int64),
            np.column_stack([table.column(m).to_numpy() for m in METRIC_NAMES]).astype(np.float64),
            pc.equal(table.column(LATENESS), ON_TIME).to_numpy(zero_copy_only=False),
        )

    def readings(self, rows: np.ndarray, complete_from_us: int) -> _Readings:
        """The readings at ``rows``, complete from ``complete_from_us`` on."""
        picked = _Readings(
            self.event_us[rows],
            self.seq[rows],
            self.values[rows],
            self.on_time[rows],
            Judgements.none(len(rows), self.values.shape[1]),
            complete_from_us,
        )
        return picked.merged(None)


class DeviceHistory:
    """Each device's recent readings (see the module docstring). A device's readings are kept from a bucket
    boundary a lookback and a bucket behind its newest reading, and ``late_s`` more: a reading that arrives
    that late (the watermark) still finds its lookback here."""

    def __init__(self, late_s: float) -> None:
        self.late_us = round(late_s * 1_000_000)
        self.devices: dict[str, _Readings] = {}
        self.silver_reads = 0
        """How many batches had to read silver: a cold cache, or readings older than it keeps."""

    def featured(self, batch: pa.Table, spec: FeatureSpec, read_silver: SilverReader) -> pa.Table:
        """``batch`` (silver rows, ``FEATURE_INPUTS`` at least) with a ``f_<metric>`` struct of features each;
        then the batch is remembered and what no reading still to come can need is forgotten."""
        devices, columns = batch.column(DEVICE_ID).to_numpy(zero_copy_only=False), _Columns.of(batch)
        event_us, seq = columns.event_us, columns.seq
        names, inverse = np.unique(devices, return_inverse=True)
        # The batch's rows device by device, each device's in (event time, seq) order.
        order = np.lexsort((seq, event_us, inverse))
        bounds = np.r_[0, np.cumsum(np.bincount(inverse, minlength=len(names)))]
        # A reading of a device the history holds whose lookback starts before what it holds is a straggler.
        held_from = np.array([self._held_from(str(d)) for d in names], dtype=np.int64)
        stragglers = spec.lookback_start_us(event_us) < held_from[inverse]
        # Each device's stragglers and its other readings.
        parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for i, name in enumerate(names):
            rows = order[bounds[i] : bounds[i + 1]]
            parts[str(name)] = (rows[stragglers[rows]], rows[~stragglers[rows]])
        wanted: dict[str, tuple[int, int | None]] = {}
        for device, (late, rows) in parts.items():
            if len(late):  # from the oldest one's lookback to the newest one
                wanted[device] = (spec.lookback_start_us(int(event_us[late[0]])), int(event_us[late[-1]]))
            elif device not in self.devices:  # from the batch's lookback to silver's end
                wanted[device] = (spec.lookback_start_us(int(event_us[rows[0]])), None)
        read = _Silver.of(read_silver(wanted)) if wanted else None
        if read is not None:
            self.silver_reads += 1
            for device, (start, _) in wanted.items():
                if device not in self.devices:
                    self.devices[device] = read.readings(device, start)
        features = np.empty((batch.num_rows, len(METRIC_NAMES), len(FEATURE_COLUMNS)))
        for device, (late, rows) in parts.items():
            if len(late) and read is not None:
                start, through = wanted[device]
                straggling = columns.readings(late, start)
                features[late] = _features(read.readings(device, start, through).merged(straggling), straggling, spec)
            if len(rows) == 0:
                continue
            mine = columns.readings(rows, spec.lookback_start_us(int(event_us[rows[0]])))
            mine.newest_scored_us = int(mine.event_us[-1])
            known = self.devices[device].merged(mine)
            features[rows] = _features(known, mine, spec)
            self.devices[device] = known.since(self._horizon(known, spec))
        for m, metric in enumerate(METRIC_NAMES):
            fields = [pa.array(features[:, m, k]) for k in range(len(FEATURE_COLUMNS))]
            batch = batch.append_column(f"f_{metric}", pa.StructArray.from_arrays(fields, names=list(FEATURE_COLUMNS)))
        return batch

    def _held_from(self, device: str) -> int:
        """From when on the history holds all of ``device``'s readings (nothing held: from any time on)."""
        held = self.devices.get(device)
        return held.complete_from_us if held is not None else np.iinfo(np.int64).min

    def _horizon(self, readings: _Readings, spec: FeatureSpec) -> int:
        """Where a device's kept readings start (a bucket boundary): what the lookback of a reading as late as
        ``late_s`` behind the newest one scored reaches."""
        return spec.lookback_start_us(readings.newest_scored_us - self.late_us)


@dataclass(frozen=True)
class _Silver:
    """What one silver read returned, device by device."""

    columns: _Columns
    rows: Mapping[str, np.ndarray]

    @classmethod
    def of(cls, table: pa.Table) -> _Silver:
        devices = table.column(DEVICE_ID).to_numpy(zero_copy_only=False)
        order = np.argsort(devices, kind="stable")
        names, firsts = np.unique(devices[order], return_index=True)
        ends = [*firsts[1:].tolist(), len(order)][: len(names)]  # none at all for an empty table
        rows = {name: order[first:end] for name, first, end in zip(names.tolist(), firsts.tolist(), ends, strict=True)}
        return cls(_Columns.of(table), rows)

    def readings(self, device: str, start_us: int, through_us: int | None = None) -> _Readings:
        """``device``'s readings from ``start_us`` (through ``through_us``), complete from ``start_us`` on: a
        reader may return more than it was asked for."""
        rows = self.rows.get(device, np.empty(0, dtype=np.int64))
        event_us = self.columns.event_us[rows]
        within = event_us >= start_us if through_us is None else (event_us >= start_us) & (event_us <= through_us)
        return self.columns.readings(rows[within], start_us)


def _before(earlier: _Readings, later: _Readings) -> bool:
    """Whether every reading of ``later`` comes after every reading of ``earlier``, in (event time, seq) order."""
    if len(earlier.event_us) == 0 or len(later.event_us) == 0:
        return True
    return (int(later.event_us[0]), int(later.seq[0])) > (int(earlier.event_us[-1]), int(earlier.seq[-1]))


def _features(known: _Readings, mine: _Readings, spec: FeatureSpec) -> np.ndarray:
    """The features of ``mine``'s readings, all of which ``known`` holds with their lookback; the judgements
    computed on the way stay in ``known``.

    Only ``known``'s readings from the lookback of ``mine``'s oldest on are passed (views, so the judgements
    land in ``known``): no feature of ``mine`` depends on an older one (``ml.features``), and ``known`` keeps
    a watermark more for the readings that arrive late. Every array operation of the features is then over a
    lookback, not over all that is kept (docs/cost-model.md, "The ingest batch's fixed CPU; the scorer's features
    by lookback")."""
    lookback = known.since(spec.lookback_start_us(int(mine.event_us[0])))
    wanted = _positions(lookback, mine.event_us, mine.seq)
    return device_features(lookback.event_us, lookback.values, lookback.on_time, spec, wanted, lookback.judgements)


def _positions(readings: _Readings, event_us: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Where each (event time, seq) of ``readings``' own rows sits in ``readings`` (all are there)."""
    at = np.searchsorted(readings.event_us, event_us, side="left")
    # Equal event times are ordered by seq: step to the matching one.
    for i in np.flatnonzero(readings.seq[np.minimum(at, len(readings.seq) - 1)] != seq):
        while readings.seq[at[i]] != seq[i]:
            at[i] += 1
    return at
