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
from simulators.publish import SimulationSummary, StopRequest, simulate
from simulators.truth import TRUTH_SCHEMA

START = datetime(2026, 11, 22, 1, 0, tzinfo=UTC)
PARTITIONS = 4


class FakeError:
    def __init__(self, text: str) -> None:
        self.text = text

    def str(self) -> str:
        return self.text


class FakeMessage:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class FakeProducer:
    """Keeps what it was given; reports deliveries in produce order per partition, partitions interleaved
    at random (as different brokers would answer); fails every ``fail_every``-th send."""

    def __init__(
        self,
        on_delivery: Callable[[Any, Any], None],
        queue_limit: int = 1_000_000,
        fail_every: int = 0,
        on_produce: Callable[[int], None] | None = None,
    ) -> None:
        self.on_delivery = on_delivery
        self.queue_limit = queue_limit
        self.fail_every = fail_every
        self.on_produce = on_produce
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
                offset = self.next_offset[partition]
                self.next_offset[partition] += 1
                self.log[(partition, offset)] = (value, key, timestamp)
                self.on_delivery(None, FakeMessage(partition, offset))
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


def test_backlog_needs_a_limit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backlog mode needs events or duration"):
        run(tmp_path, devices=5)
