"""The publisher, against a fake producer that behaves like librdkafka's: queued sends, delivery reports
served by ``poll``/``flush`` in produce order per partition, a bounded queue, broker errors."""

from __future__ import annotations

import io
import json
import random
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from iotmon.config import Settings, interval_seconds
from simulators.options import SimulationOptions
from simulators.partitioning import partition_for_key
from simulators.publish import DeliveryLedger, SimulationSummary, StopRequest, simulate
from simulators.truth import NOT_DELIVERED, OFFSET_UNKNOWN, TRUTH_SCHEMA

START = datetime(2026, 11, 22, 1, 0, tzinfo=UTC)
PARTITIONS = 4


class FakeError:
    def __init__(self, text: str) -> None:
        self.text = text

    def str(self) -> str:
        return self.text


class FakeMessage:
    def __init__(self, partition: int, offset: int | None) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._offset


class FakeProducer:
    """Keeps what it was given; reports deliveries in produce order per partition, partitions interleaved
    at random (as different brokers would answer); fails every ``fail_every``-th send. Offsets in ``hide``
    are reported as None (a broker acknowledging an idempotent duplicate); before an offset in ``gap_before``
    one offset is skipped, as if another producer wrote there."""

    def __init__(
        self,
        on_delivery: Callable[[Any, Any], None],
        queue_limit: int = 1_000_000,
        fail_every: int = 0,
        on_produce: Callable[[int], None] | None = None,
        hide: set[tuple[int, int]] = frozenset(),
        gap_before: set[tuple[int, int]] = frozenset(),
    ) -> None:
        self.on_delivery = on_delivery
        self.queue_limit = queue_limit
        self.fail_every = fail_every
        self.on_produce = on_produce
        self.hide, self.gap_before = hide, gap_before
        self.queued: list[list[tuple[bytes, bytes, int | None]]] = [[] for _ in range(PARTITIONS)]
        self.log: dict[tuple[int, int], tuple[bytes, bytes, int | None]] = {}
        self.next_offset = [0] * PARTITIONS
        self.produced = 0
        self.buffer_errors = 0
        self.shuffle = random.Random(1)

    def __len__(self) -> int:
        return sum(map(len, self.queued))

    def produce(self, topic: str, value: bytes, key: bytes, partition: int, timestamp: int | None = None) -> None:
        if len(self) >= self.queue_limit:
            self.buffer_errors += 1
            raise BufferError("Local: Queue full")
        self.queued[partition].append((value, key, timestamp))
        self.produced += 1
        if self.on_produce:
            self.on_produce(self.produced)

    def poll(self, timeout: float = 0) -> int:
        served = 0
        while len(self):
            partition = self.shuffle.choice([p for p in range(PARTITIONS) if self.queued[p]])
            take = self.shuffle.randint(1, 50)
            batch, self.queued[partition] = self.queued[partition][:take], self.queued[partition][take:]
            for value, key, timestamp in batch:
                served += 1
                if self.fail_every and (sum(self.next_offset) + served) % self.fail_every == 0:
                    self.on_delivery(FakeError("Broker: Request timed out"), FakeMessage(partition, -1001))
                    continue
                if (partition, self.next_offset[partition]) in self.gap_before:
                    self.next_offset[partition] += 1
                offset = self.next_offset[partition]
                self.next_offset[partition] += 1
                self.log[(partition, offset)] = (value, key, timestamp)
                reported = None if (partition, offset) in self.hide else offset
                self.on_delivery(None, FakeMessage(partition, reported))
        return served

    def flush(self, timeout: float = 0) -> int:
        self.poll()
        return len(self)


def run(
    tmp_path: Path,
    producer_kwargs: dict[str, Any] | None = None,
    stop: StopRequest | None = None,
    **options: Any,
) -> tuple[SimulationSummary, FakeProducer, Any]:
    settings = Settings(home=tmp_path)
    made: list[FakeProducer] = []

    def factory(on_delivery: Callable[[Any, Any], None]) -> FakeProducer:
        made.append(FakeProducer(on_delivery, **(producer_kwargs or {})))
        return made[0]

    opts = SimulationOptions(**{"start": START, "progress": True, **options})
    progress = io.StringIO()
    summary = simulate(settings, opts, factory, PARTITIONS, progress_stream=progress, stop=stop)
    truth = pq.read_table(summary.truth_path)
    return summary, made[0], truth


def test_truth_rows_match_what_kafka_holds(tmp_path: Path) -> None:
    summary, producer, truth = run(tmp_path, devices=60, events=30_000)
    assert truth.schema.equals(TRUTH_SCHEMA)
    assert summary.sent == summary.delivered == truth.num_rows == 30_000
    assert truth.column("send_index").to_pylist() == list(range(30_000))
    assert pc.all(truth.column("delivered")).as_py()
    rows = truth.select(["device_id", "partition", "offset", "payload_bytes", "send_time"]).to_pylist()
    for row in rows:
        value, key, timestamp = producer.log[(row["partition"], row["offset"])]
        assert key == row["device_id"].encode()
        assert len(value) == row["payload_bytes"]
        assert timestamp == int(row["send_time"].timestamp() * 1000), "backlog: Kafka timestamp = send time"
        assert row["partition"] == partition_for_key(key, PARTITIONS)
    for row in truth.filter(pc.is_null(truth.column("malformed_kind"))).slice(0, 2_000).to_pylist():
        value, _, _ = producer.log[(row["partition"], row["offset"])]
        assert json.loads(value)["seq"] == row["seq"]
    malformed_readings = pc.and_(pc.is_valid(truth.column("malformed_kind")), pc.invert(truth.column("is_duplicate")))
    assert sum(summary.malformed.values()) == pc.sum(malformed_readings).as_py() > 0


def test_failed_deliveries_are_recorded_not_dropped(tmp_path: Path) -> None:
    summary, _, truth = run(tmp_path, {"fail_every": 97}, devices=20, events=10_000)
    failed = truth.filter(pc.invert(truth.column("delivered")))
    assert summary.failed == failed.num_rows > 50
    assert summary.delivered + summary.failed == summary.sent == truth.num_rows
    assert set(failed.column("offset").to_pylist()) == {-1}
    assert summary.delivery_errors == {"Broker: Request timed out": summary.failed}
    delivered = truth.filter(truth.column("delivered"))
    for partition in range(PARTITIONS):
        offsets = delivered.filter(pc.equal(delivered.column("partition"), partition)).column("offset")
        assert offsets.to_pylist() == list(range(len(offsets))), "offsets follow send order per partition"


def test_ledger_infers_offsets_the_broker_did_not_report() -> None:
    ledger = DeliveryLedger(1)
    reports: list[tuple[FakeError | None, int | None]] = [
        (None, 10),
        (None, None),  # run of two between 10 and 13: 11, 12
        (None, None),
        (FakeError("Broker: Request timed out"), -1001),  # a failure takes no offset
        (None, 13),
        (None, None),  # between 13 and 16 but alone: the gap does not fit, stays unknown
        (None, 16),
        (None, None),  # at the end: no next offset yet
    ]
    for err, offset in reports:
        ledger.on_delivery(err, FakeMessage(0, offset))
    assert ledger.settled(0, 7) and not ledger.settled(0, 8), "the open run at the end waits"
    assert ledger.take(0, 7) == [10, 11, 12, NOT_DELIVERED, 13, OFFSET_UNKNOWN, 16]
    assert ledger.inferred == 2
    ledger.on_delivery(None, FakeMessage(0, 18))
    assert ledger.take(0, 2) == [17, 18], "closed by the next report of the partition"
    ledger.on_delivery(None, FakeMessage(0, None))
    ledger.take(0, 1)  # given up on (written as unknown) before the next report came
    ledger.on_delivery(None, FakeMessage(0, 20))
    assert ledger.take(0, 1) == [20] and ledger.inferred == 3
    assert ledger.reported == 11 and ledger.failed == 1


def test_deliveries_without_offset_are_delivered_and_inferred(tmp_path: Path) -> None:
    _, plain, _ = run(tmp_path / "plain", devices=30, events=12_000)
    unfit = {(0, 1_001)}  # after offset 1000, which someone else took: the gap is one wider than the run
    last = {(p, plain.next_offset[p] - (p != 0)) for p in range(PARTITIONS)}  # partition 0 one later (the gap)
    middle = {(p, o) for p in range(PARTITIONS) for o in (0, 500, 501, 502, 1_500)}
    assert min(plain.next_offset) > 1_502
    summary, producer, truth = run(
        tmp_path / "hidden",
        {"hide": middle | last | unfit, "gap_before": {(0, 1_000)}},
        devices=30,
        events=12_000,
    )
    assert summary.sent == summary.delivered == truth.num_rows == 12_000
    assert pc.all(truth.column("delivered")).as_py(), "acknowledged without offset is still delivered"
    unknown = truth.filter(pc.equal(truth.column("offset"), OFFSET_UNKNOWN))
    # offset 0 has no known offset before it, the last ones none after it, the unfit one an ambiguous gap
    expected_unknown = {(p, 0) for p in range(PARTITIONS)} | last | unfit
    assert summary.offsets_unknown == unknown.num_rows == len(expected_unknown)
    assert summary.offsets_inferred == len(middle) - PARTITIONS
    by_send = {(r["partition"], r["offset"]): r for r in truth.to_pylist()}
    for (partition, offset), (value, key, _) in producer.log.items():
        if (partition, offset) in expected_unknown:
            continue
        row = by_send[(partition, offset)]
        assert key == row["device_id"].encode() and len(value) == row["payload_bytes"]
    for row in unknown.to_pylist():  # each unknown is the send Kafka holds at the hidden offset
        candidates = [
            o
            for (p, o) in expected_unknown
            if p == row["partition"] and producer.log[(p, o)][1].decode() == row["device_id"]
        ]
        assert candidates, row


def test_third_ctrl_c_still_writes_every_send(tmp_path: Path) -> None:
    def interrupt(produced: int) -> None:
        if produced == 6_000:
            for _ in range(3):
                signal.raise_signal(signal.SIGINT)

    made: list[FakeProducer] = []

    def factory(on_delivery: Callable[[Any, Any], None]) -> FakeProducer:
        made.append(FakeProducer(on_delivery, on_produce=interrupt))
        return made[0]

    settings = Settings(home=tmp_path)
    opts = SimulationOptions(start=START, devices=40, events=50_000)
    with pytest.raises(KeyboardInterrupt):
        simulate(settings, opts, factory, PARTITIONS, progress_stream=io.StringIO())
    truth = pq.read_table(opts.truth_file(settings))
    producer = made[0]
    assert truth.num_rows == producer.produced == 6_000, "every produced record has its truth row"
    companion = json.loads(
        opts.truth_file(settings).with_name(opts.truth_file(settings).name + ".summary.json").read_text()
    )
    counts = companion["summary"]
    assert counts["sent"] == 6_000 == counts["delivered"] + counts["unconfirmed"]
    delivered = truth.filter(truth.column("delivered"))
    assert delivered.num_rows == counts["delivered"] == len(producer.log)
    for row in delivered.to_pylist():
        assert producer.log[(row["partition"], row["offset"])][1] == row["device_id"].encode()
    assert truth.num_rows - delivered.num_rows == counts["unconfirmed"] > 0


def test_a_full_queue_is_waited_for(tmp_path: Path) -> None:
    summary, producer, truth = run(tmp_path, {"queue_limit": 500}, devices=30, events=8_000)
    assert producer.buffer_errors > 0
    assert summary.sent == summary.delivered == truth.num_rows == 8_000


def test_ctrl_c_stops_cleanly_with_consistent_truth(tmp_path: Path) -> None:
    def interrupt(produced: int) -> None:
        if produced == 6_000:
            signal.raise_signal(signal.SIGINT)

    previous = signal.getsignal(signal.SIGINT)
    summary, producer, truth = run(tmp_path, {"on_produce": interrupt}, devices=40, events=50_000)
    assert signal.getsignal(signal.SIGINT) is previous, "the handler is restored"
    assert summary.interrupted
    assert 6_000 <= summary.sent < 50_000
    assert summary.sent == summary.delivered == truth.num_rows == producer.produced
    assert summary.dropped_at_stop > 0
    firsts = truth.filter(pc.invert(truth.column("is_duplicate")))
    pairs = set(zip(firsts.column("device_id").to_pylist(), firsts.column("seq").to_pylist(), strict=True))
    assert len(pairs) == firsts.num_rows
    duplicates = truth.filter(truth.column("is_duplicate"))
    assert all(
        pair in pairs
        for pair in zip(duplicates.column("device_id").to_pylist(), duplicates.column("seq").to_pylist(), strict=True)
    )
    companion = json.loads(Path(summary.summary_path).read_text())
    assert companion["summary"]["interrupted"] is True


def test_companion_summary_and_report(tmp_path: Path) -> None:
    summary, _, truth = run(tmp_path, devices=50, events=20_000, dropout_fraction=0.2, seed=11)
    companion = json.loads(Path(summary.summary_path).read_text())
    assert Path(summary.summary_path).name == Path(summary.truth_path).name + ".summary.json"
    assert companion["options"]["seed"] == 11 and companion["options"]["events"] == 20_000
    assert companion["summary"]["sent"] == truth.num_rows
    assert len(companion["dropouts"]) == summary.dropouts > 0
    assert {"device_id", "start", "end"} == set(companion["dropouts"][0])
    report = summary.report()
    for word in ("sent", "delivered", "late", "duplicates", "malformed", "anomalous", "dropouts", "truth"):
        assert word in report
    assert f"{summary.sent:,}" in report
    assert not Path(summary.truth_path + ".partial").exists()


def test_same_seed_same_truth(tmp_path: Path) -> None:
    _, first_producer, first = run(tmp_path / "a", devices=25, events=5_000)
    _, second_producer, second = run(tmp_path / "b", devices=25, events=5_000)
    assert first.equals(second)
    assert first_producer.log == second_producer.log


def test_real_time_paces_on_the_wall_clock(tmp_path: Path) -> None:
    began = datetime.now(UTC)
    summary, _, truth = run(tmp_path, devices=50, rate=5_000.0, duration=0.4, start=None)
    ended = datetime.now(UTC)
    assert summary.mode == "real-time"
    assert 1_500 <= summary.sent <= 2_500, summary.sent
    event = truth.column("event_time").to_pylist()
    began_ms = began - timedelta(milliseconds=1)  # event times have millisecond precision
    assert began_ms <= min(event) and max(event) <= ended, "event times are the wall clock of the run"
    watermark = interval_seconds(Settings().watermark)
    late = truth.filter(pc.equal(truth.column("late_kind"), "late"))
    assert (np.array(late.column("delay_s").to_pylist()) < watermark).all()
    assert truth.filter(pc.equal(truth.column("late_kind"), "very_late")).num_rows == 0, "no reading is 2 min old"


def test_real_time_past_is_sent_at_once_with_its_own_send_times(tmp_path: Path) -> None:
    began = datetime.now(UTC)
    summary, producer, truth = run(tmp_path, devices=50, rate=500.0, past=20.0, duration=1.0, start=None)
    ended = datetime.now(UTC)
    assert (ended - began).total_seconds() < 10, "20 s of past are not paced on the wall clock"
    event = np.array([t.timestamp() for t in truth.column("event_time").to_pylist()])
    assert event.min() < began.timestamp() - 19 and event.max() <= ended.timestamp()
    assert 9_500 <= summary.sent <= 12_000, summary.sent  # 21 s at 500 events/s
    stamps = [producer.log[(r["partition"], r["offset"])][2] for r in truth.to_pylist() if r["delivered"]]
    sends = [int(r["send_time"].timestamp() * 1000) for r in truth.to_pylist() if r["delivered"]]
    assert stamps == sends, "every record carries its simulated send time, past and live alike"
    assert sum(send < began.timestamp() * 1000 - 50 for send in sends) > 8_000, "the past: sent at once"
    late = truth.filter(pc.equal(truth.column("late_kind"), "late"))
    assert late.num_rows > 0, "the past has its late readings, as the live part does"


def test_past_is_for_real_time_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="past applies to real-time mode only"):
        run(tmp_path, devices=5, events=100, past=10.0)


def test_backlog_needs_a_limit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backlog mode needs events or duration"):
        run(tmp_path, devices=5)
