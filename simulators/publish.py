"""The edge of the simulator: Kafka, the ground-truth file, the device registry, the terminal.

``run_simulation`` writes the registry, makes sure the topic exists, then sends the generator's records in
order with one idempotent producer. Each record is produced to an explicit partition (Kafka's own choice
for its key), so the per-partition order of delivery reports tells which send got which offset; truth
rows wait in a queue until their offsets are known and are then written out.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, TextIO

import numpy as np
import orjson
import pyarrow as pa
from deltalake import write_deltalake

from iotmon.config import Settings
from iotmon.kafka import ensure_topic, make_producer
from iotmon.schema import ANOMALY_TYPES, DEVICES, LATE_KINDS, MALFORMED_KINDS

from .faults import LATE, NOT_MALFORMED, VERY_LATE
from .fleet import build_fleet
from .generator import FleetStream, SendBatch
from .options import SimulationOptions, StreamPlan, plan_stream
from .partitioning import partition_for_key
from .signals import NO_ANOMALY
from .timefmt import format_timestamp
from .truth import NOT_DELIVERED, OFFSET_UNKNOWN, TruthWriter, payload_sizes, truth_table

__all__ = ["SimulationOptions", "SimulationSummary", "run_simulation", "write_device_registry"]

POLL_EVERY = 4096
"""Records produced between two ``poll(0)`` calls, which serve delivery reports."""
PACING_WINDOW_MS = 10
"""Real-time mode sends the records due within this window together (up to this much behind time)."""
FLUSH_STEP_S = 0.5
MAX_STAMP_AHEAD_MS = 15 * 60_000
"""Brokers reject record timestamps over an hour ahead (``log.message.timestamp.after.max.ms``), and the
whole batch with them; a backlog reaching into the future is stamped at most this far ahead."""


class ProducerLike(Protocol):
    """The part of ``confluent_kafka.Producer`` the publisher uses (tests substitute a fake)."""

    def produce(self, topic: str, value: bytes, key: bytes, partition: int, timestamp: int = 0) -> None: ...
    def poll(self, timeout: float) -> int: ...
    def flush(self, timeout: float) -> int: ...


def write_device_registry(settings: Settings, devices: int, seed: int) -> str:
    """Write the ``devices`` Delta table (overwriting it): static reference data, same seed, same rows."""
    path = settings.table_path(DEVICES)
    if "://" not in path:
        Path(path).mkdir(parents=True, exist_ok=True)
    write_deltalake(path, build_fleet(devices, seed).registry_table(), mode="overwrite", schema_mode="overwrite")
    return path


# ---------------------------------------------------------------------------------------------------------
# Summary


@dataclass
class SimulationSummary:
    """What a run did. Fault counts are per reading (first sends); ``duplicate`` counts second sends."""

    mode: str
    devices: int
    seed: int
    topic: str
    sent: int = 0
    delivered: int = 0
    failed: int = 0
    """Sends the broker rejected or that timed out (``delivered=False`` in the truth file)."""
    unconfirmed: int = 0
    """Sends without a delivery report when the run was aborted (also ``delivered=False``)."""
    offsets_inferred: int = 0
    """Delivered sends reported without an offset, whose offset the neighbouring reports pinned down."""
    offsets_unknown: int = 0
    """Delivered sends reported without an offset that stayed unknown (``OFFSET_UNKNOWN`` in the truth file;
    verification matches them to bronze by content)."""
    readings: int = 0
    late: int = 0
    very_late: int = 0
    duplicate: int = 0
    malformed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MALFORMED_KINDS, 0))
    anomaly: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ANOMALY_TYPES, 0))
    """Readings inside anomaly episodes, per type."""
    anomaly_episodes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ANOMALY_TYPES, 0))
    dropouts: int = 0
    """Dropout episodes (a device silent for minutes) that began before the run ended."""
    dropped_at_stop: int = 0
    """Records of readings not yet taken when a run was stopped early: generated, never sent."""
    delivery_errors: dict[str, int] = field(default_factory=dict)
    interrupted: bool = False
    first_event_time: str | None = None
    last_send_time: str | None = None
    """Clock (simulated in backlog mode) of the last send."""
    elapsed_s: float = 0.0
    events_per_s: float = 0.0
    truth_path: str | None = None
    summary_path: str | None = None
    registry_path: str | None = None

    def count(self, batch: SendBatch) -> None:
        """Add the records of a sent batch."""
        first = ~batch.duplicate
        self.sent += len(batch)
        self.readings += int(first.sum())
        self.duplicate += len(batch) - int(first.sum())
        late = np.bincount(batch.late_kind[first], minlength=len(LATE_KINDS))
        self.late += int(late[LATE])
        self.very_late += int(late[VERY_LATE])
        malformed = batch.malformed[first]
        for code, n in enumerate(np.bincount(malformed[malformed != NOT_MALFORMED], minlength=len(MALFORMED_KINDS))):
            self.malformed[MALFORMED_KINDS[code]] += int(n)
        anomaly = batch.anomaly_type[first]
        for code, n in enumerate(np.bincount(anomaly[anomaly != NO_ANOMALY], minlength=len(ANOMALY_TYPES))):
            self.anomaly[ANOMALY_TYPES[code]] += int(n)
        if len(batch):
            self.last_send_time = format_timestamp(int(batch.send_ms[-1]))

    def report(self) -> str:
        """A few aligned lines for the terminal."""

        def kinds(counts: dict[str, int]) -> str:
            return ", ".join(f"{name} {n:,}" for name, n in counts.items())

        rows = [
            (
                "mode",
                f"{self.mode}, {self.devices:,} devices, seed {self.seed}, topic {self.topic}"
                + (" (stopped early)" if self.interrupted else ""),
            ),
            ("sent", f"{self.sent:,} records in {self.elapsed_s:.1f} s ({self.events_per_s:,.0f} events/s)"),
            (
                "delivered",
                f"{self.delivered:,}, failed {self.failed:,}"
                + (f", unconfirmed {self.unconfirmed:,}" if self.unconfirmed else ""),
            ),
            *(
                [("offsets", f"{self.offsets_inferred:,} not reported but inferred, {self.offsets_unknown:,} unknown")]
                if self.offsets_inferred or self.offsets_unknown
                else []
            ),
            ("readings", f"{self.readings:,} first sends"),
            ("clock", f"{self.first_event_time} .. {self.last_send_time} (first reading .. last send)"),
            ("late", f"{self.late:,} within the watermark, {self.very_late:,} beyond it"),
            ("duplicates", f"{self.duplicate:,}"),
            ("malformed", f"{sum(self.malformed.values()):,}: {kinds(self.malformed)}"),
            ("anomalous", f"{sum(self.anomaly.values()):,} readings: {kinds(self.anomaly)}"),
            ("episodes", kinds(self.anomaly_episodes)),
            ("dropouts", f"{self.dropouts:,} silent episodes"),
        ]
        if self.dropped_at_stop:
            rows.append(("not sent", f"{self.dropped_at_stop:,} records of readings after the stop"))
        if self.delivery_errors:
            rows.append(("errors", kinds(self.delivery_errors)))
        rows += [("truth", str(self.truth_path)), ("registry", str(self.registry_path))]
        width = max(len(label) for label, _ in rows)
        return "\n".join(f"{label:>{width}}  {text}" for label, text in rows)


# ---------------------------------------------------------------------------------------------------------
# Delivery reports


class DeliveryLedger:
    """Offsets from delivery reports, per partition in produce order (what idempotence guarantees).

    A success without a valid offset (the broker acknowledging a retried batch it already had) is kept as
    ``OFFSET_UNKNOWN``. Offsets of one partition strictly increase in produce order and nothing else writes
    between our records, so a run of k unknowns between known offsets a and b with b - a - 1 == k is
    a + 1 .. a + k: filled in when b arrives. Until then the run is *open* and the reports in it are not
    ``settled``, so that their truth rows wait for b.
    """

    def __init__(self, partitions: int) -> None:
        self.reports: list[list[int]] = [[] for _ in range(partitions)]
        self._consumed = [0] * partitions
        self.failed = 0
        self.errors: Counter[str] = Counter()
        self.inferred = 0
        self._last_known: list[int | None] = [None] * partitions
        self._open_run: list[list[int]] = [[] for _ in range(partitions)]
        """Per partition, positions (counted from the first report) of the unknowns since the last known offset."""

    def on_delivery(self, err: Any, msg: Any) -> None:
        """The producer's ``on_delivery`` callback: one bound method for all messages."""
        partition = msg.partition()
        if err is not None:
            self.reports[partition].append(NOT_DELIVERED)
            self.failed += 1
            self.errors[err.str()] += 1
            return
        offset = msg.offset()
        if offset is None or offset < 0:
            self._open_run[partition].append(self._consumed[partition] + len(self.reports[partition]))
            self.reports[partition].append(OFFSET_UNKNOWN)
            return
        self._close_run(partition, offset)
        self.reports[partition].append(offset)

    def _close_run(self, partition: int, offset: int) -> None:
        """A known ``offset`` arrived: fill the open run of unknowns before it if the gap fits it exactly."""
        run, before = self._open_run[partition], self._last_known[partition]
        consumed, reports = self._consumed[partition], self.reports[partition]
        if run and before is not None and offset - before - 1 == len(run) and run[0] >= consumed:
            for i, position in enumerate(run, start=1):
                reports[position - consumed] = before + i
            self.inferred += len(run)
        self._open_run[partition] = []
        self._last_known[partition] = offset

    @property
    def reported(self) -> int:
        return sum(len(r) for r in self.reports) + sum(self._consumed)

    def available(self, partition: int) -> int:
        return len(self.reports[partition])

    def settled(self, partition: int, count: int) -> bool:
        """Whether the next ``count`` reports of ``partition`` are final (none in a run still open)."""
        run = self._open_run[partition]
        return not run or run[0] >= self._consumed[partition] + count

    def take(self, partition: int, count: int) -> list[int]:
        """The next ``count`` reports of ``partition`` (which must have arrived)."""
        reports = self.reports[partition]
        taken = reports[:count]
        del reports[:count]
        self._consumed[partition] += count
        return taken


@dataclass
class _AwaitingOffsets:
    """Sent records whose truth rows wait for their delivery reports."""

    batch: SendBatch
    """Without payloads: librdkafka holds its own copy until delivery."""
    payload_bytes: np.ndarray
    first_index: int
    partition: np.ndarray
    counts: np.ndarray
    """Records per partition."""


# ---------------------------------------------------------------------------------------------------------
# Terminal progress


class Progress:
    """One updating line on a terminal, a line every few seconds in a log."""

    def __init__(
        self,
        enabled: bool,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        label: str = "simulate",
    ):
        self.stream = stream or sys.stderr
        self.label = label
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self.every = 0.25 if self.tty else 5.0
        self.clock = clock
        self.started = clock()
        self._last = self.started
        self._printed = False

    def update(self, sent: int, delivered: int, sim_ms: int | None, force: bool = False) -> None:
        now = self.clock()
        if not self.enabled or (not force and now - self._last < self.every):
            return
        self._last = now
        rate = sent / max(now - self.started, 1e-9)
        sim = format_timestamp(sim_ms)[:19] + "Z" if sim_ms is not None else "-"
        line = f"sent {sent:,} ({rate:,.0f} events/s), delivered {delivered:,}, clock {sim}"
        if self.tty:
            self.stream.write(f"\r{line}\x1b[K")
        else:
            self.stream.write(f"{time.strftime('%H:%M:%S')} {self.label}: {line}\n")
        self.stream.flush()
        self._printed = True

    def close(self) -> None:
        if self.enabled and self.tty and self._printed:
            self.stream.write("\n")
            self.stream.flush()


# ---------------------------------------------------------------------------------------------------------
# Stopping on Ctrl-C


@dataclass
class StopRequest:
    """Set by Ctrl-C and checked between chunks, so a stop never lands in the middle of bookkeeping."""

    requested: bool = False
    """Stop generating, send what readings already taken still owe, flush."""
    aborted: bool = False
    """Stop waiting for delivery reports too; unconfirmed sends are written as undelivered."""


@contextmanager
def stop_on_interrupt(stop: StopRequest) -> Iterator[None]:
    """The first Ctrl-C stops the run cleanly, the second stops waiting for the broker, the third raises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if stop.aborted:
            raise KeyboardInterrupt
        if stop.requested:
            stop.aborted = True
        stop.requested = True

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ---------------------------------------------------------------------------------------------------------
# Publishing


LIVE_TRUTH_EVERY_S = 30.0
"""How often a real-time run publishes its truth so far, for a trainer evaluating while it runs."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Publisher:
    """Produces batches in order, keeps the truth rows in step with delivery reports."""

    def __init__(
        self,
        producer: ProducerLike,
        ledger: DeliveryLedger,
        truth: TruthWriter,
        topic: str,
        partitions: int,
        device_keys: list[bytes],
        summary: SimulationSummary,
        progress: Progress,
        stop: StopRequest,
    ) -> None:
        self.producer = producer
        self.ledger = ledger
        self.truth = truth
        self.topic = topic
        self.partitions = partitions
        self.device_keys = device_keys
        self.device_partition = np.array([partition_for_key(key, partitions) for key in device_keys], dtype=np.int32)
        self.device_ids = pa.array([key.decode() for key in device_keys])
        self.summary = summary
        self.progress = progress
        self.stop = stop
        self.sent = 0
        self.last_send_ms: int | None = None
        self._awaiting: deque[_AwaitingOffsets] = deque()

    def send(self, batch: SendBatch, paced: bool) -> int:
        """Produce ``batch`` in order; paced, each record waits for its send time on the wall clock.

        A record's Kafka timestamp is its simulated send time, in every mode: a backlog's, a real-time run's
        past, and a live record's due time even when publishing runs behind. Lateness (Kafka time minus event
        time) and clock-skew checks then see the simulated world, which the ground truth records.

        Returns how many records were produced: all of them, unless a stop was requested first.
        """
        produce, topic, keys = self.producer.produce, self.topic, self.device_keys
        partitions = self.device_partition[batch.device]
        payloads, n = batch.payloads, len(batch)
        lo = attempted = 0
        try:
            while lo < n:
                if paced:  # send a window of records together once its last one is due, never early
                    hi = self._window_end(batch, lo)
                    if not self._wait_until(int(batch.send_ms[hi - 1])):
                        break
                else:
                    hi = min(n, lo + POLL_EVERY)
                devices, parts = batch.device[lo:hi].tolist(), partitions[lo:hi].tolist()
                stamps = np.minimum(batch.send_ms[lo:hi], now_ms() + MAX_STAMP_AHEAD_MS)
                for attempted, value, device, partition, stamp in zip(  # noqa: B007 (read on interrupt)
                    range(lo + 1, hi + 1), payloads[lo:hi], devices, parts, stamps.tolist(), strict=True
                ):
                    try:
                        produce(topic, value, keys[device], partition, timestamp=stamp)
                    except BufferError:
                        self._produce_when_room(value, keys[device], partition, stamp)
                lo = hi
                self.producer.poll(0)
                self._collect()
                self.progress.update(self.sent + lo, self.delivered, int(batch.send_ms[lo - 1]))
                if self.stop.requested and not batch.final:
                    break
        except KeyboardInterrupt:
            # The third Ctrl-C: every record that may have been produced still gets a truth row. One that
            # was being produced when the signal came counts as sent; without a report it is undelivered.
            self._record(batch, partitions, max(lo, attempted))
            raise
        self._record(batch, partitions, lo)
        return lo

    @staticmethod
    def _window_end(batch: SendBatch, lo: int) -> int:
        """End of the records due within ``PACING_WINDOW_MS`` of record ``lo`` (at most ``POLL_EVERY``)."""
        end = int(np.searchsorted(batch.send_ms, batch.send_ms[lo] + PACING_WINDOW_MS, side="left"))
        return max(lo + 1, min(end, lo + POLL_EVERY))

    def _wait_until(self, due_ms: int) -> bool:
        """Sleep until the wall clock reaches ``due_ms``; False if a stop was requested meanwhile."""
        while not self.stop.requested:
            ahead = due_ms - now_ms()
            if ahead <= 0:
                return True
            self.producer.poll(min(ahead / 1000.0, 0.1))
            self._collect()
        return False

    def _produce_when_room(self, value: bytes, key: bytes, partition: int, stamp: int) -> None:
        """The local queue is full: serve delivery reports until the record fits."""
        while True:
            self.producer.poll(0.05)
            self._collect()
            try:
                self.producer.produce(self.topic, value, key, partition, timestamp=stamp)
                return
            except BufferError:
                continue

    def _record(self, batch: SendBatch, partitions: np.ndarray, count: int) -> None:
        if count == 0:
            return
        sent = batch if count == len(batch) else batch.select(np.arange(count))
        partition = partitions[:count]
        counts = np.bincount(partition, minlength=self.partitions)
        self._awaiting.append(
            _AwaitingOffsets(sent.without_payloads(), payload_sizes(sent), self.sent, partition, counts)
        )
        self.sent += count
        self.last_send_ms = int(sent.send_ms[-1])
        self.summary.count(sent)
        self._collect()

    @property
    def delivered(self) -> int:
        return self.ledger.reported - self.ledger.failed

    def _collect(self, give_up: bool = False) -> None:
        """Write the truth rows of every leading batch whose delivery reports are all in.

        A batch also waits while a report of it is in an open run of unknown offsets (see ``DeliveryLedger``).
        With ``give_up``, batches still missing reports are written too, the missing sends as undelivered,
        offsets still unknown as ``OFFSET_UNKNOWN``.
        """
        ledger = self.ledger
        while self._awaiting:
            waiting = self._awaiting[0]
            complete = all(
                ledger.available(p) >= n and ledger.settled(p, n) for p, n in enumerate(waiting.counts.tolist())
            )
            if not complete and not give_up:
                return
            self._awaiting.popleft()
            offset = np.empty(len(waiting.batch), dtype=np.int64)
            for p, n in enumerate(waiting.counts.tolist()):
                if n:
                    got = ledger.take(p, min(n, ledger.available(p)))
                    missing = n - len(got)
                    self.summary.unconfirmed += missing
                    offset[waiting.partition == p] = np.array(got + [NOT_DELIVERED] * missing, dtype=np.int64)
            self.summary.offsets_unknown += int(np.count_nonzero(offset == OFFSET_UNKNOWN))
            table = truth_table(
                waiting.batch,
                waiting.payload_bytes,
                waiting.first_index,
                self.device_ids,
                self.topic,
                waiting.partition,
                offset,
            )
            self.truth.write(table)

    def flush(self) -> None:
        """Wait for every delivery report; if the stop is aborted, write what is known and stop waiting."""
        try:
            while not self.stop.aborted:
                remaining = self.producer.flush(FLUSH_STEP_S)
                self._collect()
                self.progress.update(self.sent, self.delivered, self.last_send_ms)
                if remaining == 0:
                    break
        finally:  # also when the third Ctrl-C interrupts the wait: what is known is written
            self._collect(give_up=True)


def _sent_now(batch: SendBatch) -> None:
    """Real time, sent at shutdown without waiting for the due time: the send time is now."""
    batch.send_ms = np.full(len(batch), now_ms(), dtype=np.int64)


def publish_stream(
    stream: FleetStream,
    publisher: Publisher,
    realtime: bool,
    stop: StopRequest,
) -> None:
    """Send the whole stream, or until a stop is requested; then hand over what was held back."""
    plan = stream.plan
    for batch in stream:
        if realtime and batch.final:
            _sent_now(batch)
        sent = publisher.send(batch, paced=realtime and not batch.final)
        if stop.requested and not batch.final:
            cutoff = now_ms() if realtime else (publisher.last_send_ms or plan.start_ms)
            unsent = batch.select(np.arange(sent, len(batch)))
            rest, dropped = stream.drain(cutoff, unsent=unsent)
            if realtime:
                _sent_now(rest)
            publisher.send(rest, paced=False)
            publisher.summary.dropped_at_stop = dropped
            publisher.summary.interrupted = True
            return


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def write_companion(
    path: Path, options: SimulationOptions, plan: StreamPlan, summary: SimulationSummary, stream: FleetStream
) -> None:
    """``<truth>.summary.json``: the options, the counts and every dropout episode."""
    dropouts = [
        {
            "device_id": stream.fleet.device_ids[e.device],
            "start": format_timestamp(e.start_ms),
            "end": format_timestamp(e.end_ms),
        }
        for e in stream.dropouts.episodes
    ]
    document = {
        "options": {k: _jsonable(v) for k, v in dataclasses.asdict(options).items()},
        "plan": {
            "start": format_timestamp(plan.start_ms),
            "end": None if plan.end_ms is None else format_timestamp(plan.end_ms),
            "interval_s": plan.interval_s,
            "watermark_s": plan.watermark_s,
            "max_payload_bytes": plan.max_payload_bytes,
        },
        "summary": dataclasses.asdict(summary),
        "dropouts": dropouts,
    }
    path.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))


def simulate(
    settings: Settings,
    options: SimulationOptions,
    producer_factory: Callable[[Callable[[Any, Any], None]], ProducerLike],
    partitions: int,
    progress_stream: TextIO | None = None,
    stop: StopRequest | None = None,
) -> SimulationSummary:
    """The run behind ``run_simulation``, with the producer injected (tests pass a fake one)."""
    plan = plan_stream(settings, options, now_ms())
    stream = FleetStream(plan)
    summary = SimulationSummary(
        mode="real-time" if options.realtime else "backlog",
        devices=options.devices,
        seed=options.seed,
        topic=settings.topic,
        first_event_time=format_timestamp(plan.start_ms),
    )
    truth_path = options.truth_file(settings)
    ledger = DeliveryLedger(partitions)
    producer = producer_factory(ledger.on_delivery)
    stop = stop or StopRequest()
    progress = Progress(options.progress, progress_stream)
    truth = TruthWriter(truth_path, live_every_s=LIVE_TRUTH_EVERY_S if options.realtime else None)
    publisher = Publisher(
        producer,
        ledger,
        truth,
        settings.topic,
        partitions,
        stream.fleet.keys,
        summary,
        progress,
        stop,
    )
    started = time.monotonic()
    try:
        with stop_on_interrupt(stop):
            try:
                publish_stream(stream, publisher, options.realtime, stop)
            finally:
                publisher.flush()
    finally:
        progress.close()
        summary.elapsed_s = time.monotonic() - started
        summary.events_per_s = summary.sent / max(summary.elapsed_s, 1e-9)
        summary.delivered = publisher.delivered
        summary.failed = ledger.failed
        summary.offsets_inferred = ledger.inferred
        summary.delivery_errors = dict(ledger.errors)
        summary.interrupted = summary.interrupted or stop.requested
        summary.dropouts = len(stream.dropouts.episodes)
        summary.anomaly_episodes = dict(zip(ANOMALY_TYPES, stream.anomalies.episodes_started.tolist(), strict=True))
        summary.truth_path = str(truth.close())
        companion = truth_path.with_name(truth_path.name + ".summary.json")
        summary.summary_path = str(companion)
        write_companion(companion, options, plan, summary, stream)
    return summary


def run_simulation(settings: Settings, options: SimulationOptions) -> SimulationSummary:
    """Publish a simulated fleet's readings to ``settings.topic``; see ``SimulationOptions`` for the modes."""
    options.validate()
    registry = write_device_registry(settings, options.devices, options.seed)
    partitions = ensure_topic(settings)
    summary = simulate(
        settings,
        options,
        lambda on_delivery: make_producer(settings, on_delivery=on_delivery),
        partitions,
    )
    summary.registry_path = registry
    return summary
