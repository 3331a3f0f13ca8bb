"""The embedded broker is a real Kafka: it starts idempotently, refuses taken ports, keeps data across restarts."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest

from iotmon import broker
from iotmon.config import Settings
from iotmon.kafka import ensure_topic, make_producer, partition_offsets
from tests.support import with_own_broker

pytestmark = pytest.mark.integration


def test_start_is_idempotent(kafka: Settings) -> None:
    first = broker.status(kafka)
    again = broker.start(kafka)
    assert first.running and again.running
    assert again.pid == first.pid


def test_a_taken_port_gives_a_clear_error(kafka: Settings, tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        other = dataclasses.replace(kafka, home=tmp_path, kafka_bootstrap=f"127.0.0.1:{port}")
        with pytest.raises(broker.BrokerError, match=f"Port {port} .* IOTMON_KAFKA_BOOTSTRAP"):
            broker.start(other)


def test_remote_bootstrap_is_refused(tmp_path: Path) -> None:
    remote = Settings.from_env({}, home=tmp_path, kafka_bootstrap="kafka.example.com:9092")
    with pytest.raises(broker.BrokerError, match="not a loopback address"):
        broker.start(remote)


def test_data_survives_a_broker_restart(kafka: Settings, tmp_path: Path) -> None:
    """A second broker of its own, so stopping it does not disturb the shared one."""
    own = with_own_broker(kafka, tmp_path, topic="restart-check", topic_partitions=2)
    broker.start(own)
    try:
        assert ensure_topic(own) == 2
        producer = make_producer(own)
        for i in range(1000):
            producer.produce(own.topic, value=b"%d" % i, key=b"k%d" % (i % 7))
        assert producer.flush(30) == 0
        before = partition_offsets(own)
        assert sum(high - low for low, high in before.values()) == 1000
        assert broker.stop(own)
        assert not broker.status(own).running
        broker.start(own)
        assert partition_offsets(own) == before
    finally:
        broker.stop(own)
