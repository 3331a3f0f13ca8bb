"""The deterministic stream of outgoing records, in send order. No I/O: the publisher does that.

Time advances in blocks of ticks; in one tick every device takes one reading at its own phase within the
tick interval. A block is computed with numpy for all its ticks and devices at once, then:

* readings of silent devices (dropouts) are removed, the rest numbered per device (``seq``);
* on-time readings are sent at their event time;
* late readings and second sends of duplicates wait in a heap until the clock reaches their due time,
  so they really arrive after readings with later event times;
* held records due before the next block starts are merged into this block in send order.

The clock is the simulated one in backlog mode and the (future) wall clock in real-time mode, where the
publisher waits for each record's send time. When the stream ends, everything still held is flushed in due
order, marked ``final``.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import orjson

from iotmon.schema import DEVICE_ID, EVENT_TIME, METRIC_NAMES, SEQ

from .faults import (
    NOT_MALFORMED,
    ON_TIME,
    CorruptionContext,
    DropoutSchedule,
    FaultDraws,
    corrupt,
    draw_faults,
    late_kind_for_delay,
)
from .fleet import Fleet, build_fleet
from .options import StreamPlan
from .seeding import Stream, stream_rng
from .signals import AnomalySchedule, draw_signal_params, normal_values
from .timefmt import format_timestamps

BLOCK_READINGS = 4096
"""About this many readings are computed per block: large enough for numpy, small enough for the cache."""
SLICE_SENDS = 8192
"""Most records per yielded batch, which bounds the Python lists built per step."""
PHASE_RANGE = (0.05, 0.95)
"""A device's reading time within its tick, as a fraction of the interval."""
JITTER = 0.02
"""Clock jitter, as a fraction of the interval; with the phase range it keeps readings inside their tick."""
DECIMALS = 2
PAYLOAD_FIELDS = (DEVICE_ID, SEQ, EVENT_TIME, *METRIC_NAMES)


@dataclass
class SendBatch:
    """Consecutive records of the stream, as columns in send order."""

    device: np.ndarray
    """Index into the fleet (int64)."""
    seq: np.ndarray
    event_ms: np.ndarray
    send_ms: np.ndarray
    late_kind: np.ndarray
    """int8 code into ``LATE_KINDS``; a duplicate keeps its reading's code."""
    duplicate: np.ndarray
    """True for the second send of a reading."""
    malformed: np.ndarray
    """int8 code into ``MALFORMED_KINDS`` or ``NOT_MALFORMED``."""
    anomaly_type: np.ndarray
    """int8 code into ``ANOMALY_TYPES`` or ``NO_ANOMALY``."""
    anomaly_metric: np.ndarray
    """int8 index into ``METRIC_NAMES`` or ``NO_ANOMALY``."""
    payloads: list[bytes]
    final: bool = False
    """Part of the end-of-stream flush of held records."""

    def __len__(self) -> int:
        return len(self.seq)

    def without_payloads(self) -> SendBatch:
        """The columns only: what truth rows need once the payloads are in the producer's hands."""
        return dataclasses.replace(self, payloads=[])

    def _columns(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("payloads", "final")}

    def select(self, index: np.ndarray) -> SendBatch:
        """The records at ``index`` (an integer array), in that order."""
        columns = {name: column[index] for name, column in self._columns().items()}
        payloads = self.payloads
        return SendBatch(**columns, payloads=[payloads[i] for i in index.tolist()], final=self.final)

    @classmethod
    def concat(cls, batches: list[SendBatch]) -> SendBatch:
        columns = {name: np.concatenate([b._columns()[name] for b in batches]) for name in batches[0]._columns()}
        payloads = [p for b in batches for p in b.payloads]
        return cls(**columns, payloads=payloads, final=all(b.final for b in batches))

    @classmethod
    def from_held(cls, items: list[Held]) -> SendBatch:
        columns = list(zip(*items, strict=True)) if items else [()] * len(Held._fields)
        held = Held(*columns)
        return cls(
            device=np.array(held.device, dtype=np.int64),
            seq=np.array(held.seq, dtype=np.int64),
            event_ms=np.array(held.event_ms, dtype=np.int64),
            send_ms=np.array(held.send_ms, dtype=np.int64),
            late_kind=np.array(held.late_kind, dtype=np.int8),
            duplicate=np.array(held.duplicate, dtype=bool),
            malformed=np.array(held.malformed, dtype=np.int8),
            anomaly_type=np.array(held.anomaly_type, dtype=np.int8),
            anomaly_metric=np.array(held.anomaly_metric, dtype=np.int8),
            payloads=list(held.payload),
        )


class Held(NamedTuple):
    """A record waiting for its send time; heap order is send time, then the order of holding."""

    send_ms: int
    order: int
    device: int
    seq: int
    event_ms: int
    late_kind: int
    duplicate: bool
    malformed: int
    anomaly_type: int
    anomaly_metric: int
    payload: bytes


@dataclass(frozen=True)
class PayloadSpec:
    """What payload building needs besides the readings."""

    device_ids: tuple[str, ...]
    max_payload_bytes: int
    max_message_bytes: int
    max_clock_skew_s: float


@dataclass
class ReadingBlock:
    """The readings of one block in event order, with their faults; payloads are built on demand."""

    device: np.ndarray
    seq: np.ndarray
    event_ms: np.ndarray
    values: np.ndarray
    """``(readings, metrics)``."""
    anomaly_type: np.ndarray
    anomaly_metric: np.ndarray
    faults: FaultDraws

    @property
    def first_send_ms(self) -> np.ndarray:
        return self.event_ms + self.faults.delay_ms

    def payloads(self, index: np.ndarray, spec: PayloadSpec) -> list[bytes]:
        """JSON payloads of the readings at ``index``; malformed ones are corrupted after their kind."""
        if len(index) == 0:
            return []
        dumps = orjson.dumps
        names = PAYLOAD_FIELDS
        ids = [spec.device_ids[d] for d in self.device[index].tolist()]
        seqs = self.seq[index].tolist()
        times = format_timestamps(self.event_ms[index])
        metrics = np.round(self.values[index], DECIMALS).T.tolist()
        payloads = [dumps(dict(zip(names, row, strict=True))) for row in zip(ids, seqs, times, *metrics, strict=True)]
        malformed = self.faults.malformed[index]
        for j in np.flatnonzero(malformed != NOT_MALFORMED).tolist():
            reading = dict(zip(names, (ids[j], seqs[j], times[j], *(column[j] for column in metrics)), strict=True))
            i = index[j]
            send_ms = int(self.event_ms[i] + self.faults.delay_ms[i])
            ctx = CorruptionContext(send_ms, spec.max_payload_bytes, spec.max_message_bytes, spec.max_clock_skew_s)
            payloads[j] = corrupt(int(malformed[j]), reading, ctx, int(self.faults.variant[i]))
        return payloads

    def to_batch(self, index: np.ndarray, spec: PayloadSpec) -> SendBatch:
        """First sends of the readings at ``index``."""
        return SendBatch(
            device=self.device[index],
            seq=self.seq[index],
            event_ms=self.event_ms[index],
            send_ms=self.first_send_ms[index],
            late_kind=self.faults.late_kind[index],
            duplicate=np.zeros(len(index), dtype=bool),
            malformed=self.faults.malformed[index],
            anomaly_type=self.anomaly_type[index],
            anomaly_metric=self.anomaly_metric[index],
            payloads=self.payloads(index, spec),
        )


@dataclass
class _PendingBlock:
    """A block being yielded: fresh on-time readings and due held records merged by ``order``."""

    block: ReadingBlock
    on_time: np.ndarray
    due: SendBatch
    order: np.ndarray
    position: int = 0
    """Entries of ``order`` yielded so far."""

    def records(self, part: np.ndarray, spec: PayloadSpec) -> SendBatch:
        """The records at positions ``part`` of the merged order, in that order."""
        from_block = part < len(self.on_time)
        fresh = self.block.to_batch(self.on_time[part[from_block]], spec)
        if from_block.all():
            return fresh
        held = self.due.select(part[~from_block] - len(self.on_time))
        positions = np.concatenate([np.flatnonzero(from_block), np.flatnonzero(~from_block)])
        return SendBatch.concat([fresh, held]).select(np.argsort(positions))


class FleetStream:
    """Iterate to get the run's records as ``SendBatch`` es in send order; see the module docstring."""

    def __init__(self, plan: StreamPlan) -> None:
        self.plan = plan
        self.fleet: Fleet = build_fleet(plan.devices, plan.seed)
        self.spec = PayloadSpec(
            self.fleet.device_ids, plan.max_payload_bytes, plan.max_message_bytes, plan.max_clock_skew_s
        )
        self.params = draw_signal_params(self.fleet.type_codes, stream_rng(plan.seed, Stream.SIGNAL_PARAMS))
        self._noise_rng = stream_rng(plan.seed, Stream.NOISE)
        self._fault_rng = stream_rng(plan.seed, Stream.FAULTS)
        self._clock_rng = stream_rng(plan.seed, Stream.CLOCK)
        n = plan.devices
        self._interval_ms = plan.interval_s * 1000.0
        self._phase = self._clock_rng.uniform(*PHASE_RANGE, n)
        self.dropouts = DropoutSchedule(n, plan.rates.dropout, plan.start_ms, stream_rng(plan.seed, Stream.DROPOUTS))
        self.anomalies = AnomalySchedule(self.params, plan.anomaly_fraction, stream_rng(plan.seed, Stream.ANOMALIES))
        self.ticks_per_block = max(1, BLOCK_READINGS // n)
        self._next_seq = np.zeros(n, dtype=np.int64)
        self._tick = 0
        self._held: list[Held] = []
        self._held_order = 0
        self.committed_sends = 0
        """Sends decided so far: everything yielded plus everything held."""
        self._pending: _PendingBlock | None = None
        self.newest_event_ms = plan.start_ms
        """Newest event time yielded so far."""
        self.readings = 0
        self.generating = True

    # -- clock -------------------------------------------------------------------------------------------
    def tick_start_ms(self, tick: int) -> int:
        return self.plan.start_ms + round(tick * self._interval_ms)

    def _out_of_time(self) -> bool:
        end = self.plan.end_ms
        return end is not None and self.tick_start_ms(self._tick) >= end

    def _out_of_sends(self) -> bool:
        limit = self.plan.max_sends
        return limit is not None and self.committed_sends >= limit

    # -- iteration ---------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[SendBatch]:
        while self.generating:
            if self._out_of_time() or self._out_of_sends():
                self.generating = False
                break
            yield from self._next_block()
        yield from self._slices(self._settle_lateness(self._pop_held(None), self.newest_event_ms))

    def drain(self, cutoff_ms: int, unsent: SendBatch | None = None) -> tuple[SendBatch, int]:
        """Stop generating and hand over everything not yet sent, for a run stopped early at ``cutoff_ms``.

        ``unsent`` is the rest of the batch the publisher was sending. Records of readings taken by the
        cutoff (event time <= cutoff) are returned in due order, marked final; the others belong to readings
        the fleet had not taken yet when the run stopped, and are only counted (second return value).
        """
        self.generating = False
        parts = [] if unsent is None else [unsent]
        if self._pending is not None:
            pending, self._pending = self._pending, None
            rest = pending.order[pending.position :]
            parts.append(pending.records(rest, self.spec))
        parts.append(self._pop_held(None))
        everything = SendBatch.concat(parts)
        keep = np.flatnonzero(everything.event_ms <= cutoff_ms)
        drained = everything.select(keep[np.argsort(everything.send_ms[keep], kind="stable")])
        return self._settle_lateness(drained, cutoff_ms), len(everything) - len(keep)

    def _pop_held(self, before_ms: int | None) -> SendBatch:
        items = []
        held = self._held
        while held and (before_ms is None or held[0].send_ms < before_ms):
            items.append(heapq.heappop(held))
        return SendBatch.from_held(items)

    def _hold(
        self,
        send_ms: np.ndarray,
        block: ReadingBlock,
        index: np.ndarray,
        duplicate: bool,
        payloads: list[bytes],
    ) -> None:
        rows = zip(
            send_ms.tolist(),
            block.device[index].tolist(),
            block.seq[index].tolist(),
            block.event_ms[index].tolist(),
            block.faults.late_kind[index].tolist(),
            block.faults.malformed[index].tolist(),
            block.anomaly_type[index].tolist(),
            block.anomaly_metric[index].tolist(),
            payloads,
            strict=True,
        )
        for send, device, seq, event, late, malformed, a_type, a_metric, payload in rows:
            held = Held(
                send,
                self._held_order,
                device,
                seq,
                event,
                late,
                duplicate,
                malformed,
                a_type,
                a_metric,
                payload,
            )
            heapq.heappush(self._held, held)
            self._held_order += 1

    def _readings(self) -> ReadingBlock:
        """Compute the next block of ticks for all devices and keep the readings that are taken."""
        plan = self.plan
        n = plan.devices
        ticks = self._tick + np.arange(self.ticks_per_block)
        jitter = self._clock_rng.uniform(-JITTER, JITTER, (len(ticks), n))
        event_ms = plan.start_ms + np.rint((ticks[:, None] + self._phase + jitter) * self._interval_ms).astype(np.int64)
        noise = self._noise_rng.standard_normal((len(ticks), n, len(METRIC_NAMES)))
        values = normal_values(self.params, event_ms / 1000.0, noise)
        anomaly_type, anomaly_metric = self.anomalies.apply(values, self._tick)
        taken = ~self.dropouts.silent(event_ms)
        if plan.end_ms is not None:
            taken &= event_ms < plan.end_ms
        seq = self._next_seq + np.cumsum(taken, axis=0) - 1
        self._next_seq += taken.sum(axis=0)
        self._tick += len(ticks)

        flat = np.flatnonzero(taken.ravel())
        order = flat[np.argsort(event_ms.ravel()[flat], kind="stable")]
        faults = draw_faults(len(order), plan.rates, plan.watermark_s, self._fault_rng)
        return ReadingBlock(
            device=order % n,
            seq=seq.ravel()[order],
            event_ms=event_ms.ravel()[order],
            values=values.reshape(-1, len(METRIC_NAMES))[order],
            anomaly_type=anomaly_type.ravel()[order],
            anomaly_metric=anomaly_metric.ravel()[order],
            faults=faults,
        )

    def _limit_sends(self, block: ReadingBlock) -> int:
        """How many of the block's readings fit under ``max_sends``; trims the last duplicate if needed."""
        limit = self.plan.max_sends
        n = len(block.event_ms)
        if limit is None:
            return n
        sends = np.cumsum(1 + block.faults.duplicate)
        room = limit - self.committed_sends
        kept = int(np.searchsorted(sends, room, side="right"))
        if kept < n and (kept == 0 or sends[kept - 1] < room):
            block.faults.duplicate[kept] = False  # the reading fits, its second send does not
            kept += 1
        return kept

    def _next_block(self) -> Iterator[SendBatch]:
        block = self._readings()
        kept = self._limit_sends(block)
        readings = np.arange(kept)
        faults = block.faults
        late = readings[faults.late_kind[:kept] != ON_TIME]
        duplicated = readings[faults.duplicate[:kept]]
        held_payload_index = np.union1d(late, duplicated)
        held_payloads = dict(
            zip(held_payload_index.tolist(), block.payloads(held_payload_index, self.spec), strict=True)
        )
        first_send = block.first_send_ms
        self._hold(first_send[late], block, late, False, [held_payloads[i] for i in late.tolist()])
        second_send = first_send[duplicated] + faults.duplicate_delay_ms[duplicated]
        self._hold(second_send, block, duplicated, True, [held_payloads[i] for i in duplicated.tolist()])
        self.readings += kept
        self.committed_sends += kept + len(duplicated)

        on_time = readings[faults.late_kind[:kept] == ON_TIME]
        if self._out_of_time() or self._out_of_sends():
            # the last block: what falls due after its newest reading belongs to the final flush
            newest = int(block.event_ms[:kept].max(initial=self.newest_event_ms))
            due = self._pop_held(newest + 1)
        else:
            due = self._pop_held(self.tick_start_ms(self._tick))
        order = np.argsort(np.concatenate([block.event_ms[on_time], due.send_ms]), kind="stable")
        pending = self._pending = _PendingBlock(block, on_time, due, order)
        while self._pending is pending and pending.position < len(order):
            part = order[pending.position : pending.position + SLICE_SENDS]
            pending.position += len(part)
            records = pending.records(part, self.spec)
            if len(records):
                self.newest_event_ms = max(self.newest_event_ms, int(records.event_ms.max()))
            yield records
        self._pending = None

    def _settle_lateness(self, batch: SendBatch, newest_ms: int) -> SendBatch:
        """Mark ``batch`` final and say how late its delayed records really are.

        After the stream stops, no newer readings push the watermark on, so a record planned as very late
        may arrive only a little behind the newest reading. Its late kind is then what the pipeline sees:
        the gap to the newest event time sent before it.
        """
        newest_before = np.maximum.accumulate(np.concatenate([[newest_ms], batch.event_ms]))[:-1]
        lateness_s = (newest_before - batch.event_ms) / 1000.0
        actual = late_kind_for_delay(lateness_s, self.plan.watermark_s)
        batch.late_kind = np.where(batch.late_kind != ON_TIME, actual, batch.late_kind).astype(np.int8)
        batch.final = True
        return batch

    def _slices(self, batch: SendBatch) -> Iterator[SendBatch]:
        for lo in range(0, len(batch), SLICE_SENDS):
            yield batch.select(np.arange(lo, min(lo + SLICE_SENDS, len(batch))))
