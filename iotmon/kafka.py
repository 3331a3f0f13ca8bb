"""Kafka client helpers: one place for producer settings, topic creation and offset look-ups.

The Python side uses confluent-kafka (librdkafka): its producer reaches the simulator's backlog target
where a pure-Python client cannot. Spark reads Kafka through its own Java connector.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import Consumer, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from iotmon.config import Settings

ANSWER_TIMEOUT_SECONDS = 10.0
"""How long a first metadata request may take: a live broker answers in milliseconds, and a wrong
``IOTMON_KAFKA_BOOTSTRAP`` should be reported in seconds, not after retrying for minutes."""


class KafkaUnavailable(RuntimeError):
    """The configured brokers did not answer; the message says what to do."""


def _unavailable(settings: Settings, exc: KafkaException) -> KafkaUnavailable:
    return KafkaUnavailable(
        f"Kafka at {settings.kafka_bootstrap} did not answer ({exc.args[0].str() if exc.args else exc}). "
        "Start the embedded broker with `iotmon kafka start` or set IOTMON_KAFKA_BOOTSTRAP."
    )


def require_broker(settings: Settings, timeout: float = ANSWER_TIMEOUT_SECONDS) -> None:
    """Raise ``KafkaUnavailable`` unless a bootstrap server answers a metadata request within ``timeout``."""
    try:
        admin(settings).list_topics(timeout=timeout)
    except KafkaException as exc:
        raise _unavailable(settings, exc) from None


def _client_config(settings: Settings) -> dict[str, Any]:
    return {"bootstrap.servers": settings.kafka_bootstrap}


def producer_config(settings: Settings) -> dict[str, Any]:
    """Idempotent, batched producer: no duplicates from retries, per-partition order kept.

    ``murmur2_random`` is the Java client's partitioner, so a device lands on the same partition whichever
    client publishes it.
    """
    return {
        **_client_config(settings),
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 20,
        "batch.size": 1_000_000,
        "batch.num.messages": 100_000,
        "compression.type": "lz4",
        "queue.buffering.max.messages": 1_000_000,
        "queue.buffering.max.kbytes": 1_048_576,
        "message.max.bytes": 1_000_000,
        "partitioner": "murmur2_random",
    }


def make_producer(settings: Settings, **extra: Any) -> Producer:
    return Producer({**producer_config(settings), **extra})


def admin(settings: Settings) -> AdminClient:
    """Errors arrive as exceptions; librdkafka's own log lines (one per failed connect) would only repeat them."""
    return AdminClient({**_client_config(settings), "log_level": 0})


def ensure_topic(settings: Settings, timeout: float = 30.0) -> int:
    """Create the readings topic if it is missing; returns its partition count."""
    client = admin(settings)
    try:
        metadata = client.list_topics(timeout=min(timeout, ANSWER_TIMEOUT_SECONDS))
    except KafkaException as exc:
        raise _unavailable(settings, exc) from None
    existing = metadata.topics.get(settings.topic)
    if existing is not None and existing.error is None:
        return len(existing.partitions)
    futures = client.create_topics(
        [NewTopic(settings.topic, num_partitions=settings.topic_partitions, replication_factor=1)]
    )
    try:
        futures[settings.topic].result(timeout)
    except KafkaException as exc:
        if "TOPIC_ALREADY_EXISTS" not in str(exc):
            raise
    return settings.topic_partitions


def partition_offsets(settings: Settings, timeout: float = 30.0) -> dict[int, tuple[int, int]]:
    """Low and high watermark of every partition of the readings topic: the records Kafka holds."""
    consumer = Consumer({**_client_config(settings), "group.id": "iotmon-verify", "enable.auto.commit": False})
    try:
        metadata = consumer.list_topics(settings.topic, timeout=timeout)
        topic = metadata.topics.get(settings.topic)
        if topic is None or topic.error is not None:
            return {}
        result = {}
        for partition in sorted(topic.partitions):
            low, high = consumer.get_watermark_offsets(
                TopicPartition(settings.topic, partition), timeout=timeout, cached=False
            )
            result[partition] = (low, high)
        return result
    except KafkaException as exc:
        raise _unavailable(settings, exc) from None
    finally:
        consumer.close()
