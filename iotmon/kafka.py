"""Kafka client helpers: one place for connection and producer settings, topic creation and offset look-ups.

The Python side uses confluent-kafka (librdkafka): its producer reaches the simulator's backlog target
where a pure-Python client cannot. Spark reads Kafka through its own Java connector. Both get their
connection and security settings here (``client_config``, ``spark_kafka_options``), from the same typed
settings, so a secured cluster is configured once for every client.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from iotmon.config import ConfigError, Settings
from iotmon.schema import as_utc

# The JAAS login module of each SASL mechanism, for the Java client's ``sasl.jaas.config``.
JAAS_LOGIN_MODULES = {
    "PLAIN": "org.apache.kafka.common.security.plain.PlainLoginModule",
    "SCRAM-SHA-256": "org.apache.kafka.common.security.scram.ScramLoginModule",
    "SCRAM-SHA-512": "org.apache.kafka.common.security.scram.ScramLoginModule",
}

ANSWER_TIMEOUT_SECONDS = 10.0
"""How long a first metadata request may take: a live broker answers in milliseconds, and a wrong
``IOTMON_KAFKA_BOOTSTRAP`` should be reported in seconds, not after retrying for minutes."""


class KafkaUnavailable(RuntimeError):
    """The configured brokers did not answer; the message says what to do."""


def _uses_sasl(settings: Settings) -> bool:
    return settings.kafka_security_protocol.startswith("SASL_")


def _uses_ssl(settings: Settings) -> bool:
    return settings.kafka_security_protocol in ("SSL", "SASL_SSL")


def sasl_credentials(settings: Settings) -> tuple[str, str]:
    """User name and password of a SASL protocol; a clear error (without the password) if one is missing."""
    if not settings.kafka_sasl_username or settings.kafka_sasl_password is None:
        raise ConfigError(
            f"IOTMON_KAFKA_SECURITY_PROTOCOL={settings.kafka_security_protocol} needs IOTMON_KAFKA_SASL_USERNAME "
            "and IOTMON_KAFKA_SASL_PASSWORD"
        )
    return settings.kafka_sasl_username, settings.kafka_sasl_password.reveal()


def jaas_quote(value: str) -> str:
    """A JAAS option value: double-quoted, with backslashes and quotes escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def jaas_config(module: str, username: str, password: str) -> str:
    """A one-line JAAS configuration, the Java client's ``sasl.jaas.config``."""
    return f"{module} required username={jaas_quote(username)} password={jaas_quote(password)};"


def client_config(settings: Settings) -> dict[str, Any]:
    """Connection and security settings of every confluent-kafka (librdkafka) client of the project."""
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "security.protocol": settings.kafka_security_protocol.lower(),
    }
    if _uses_sasl(settings):
        username, password = sasl_credentials(settings)
        config.update(
            {"sasl.mechanisms": settings.kafka_sasl_mechanism, "sasl.username": username, "sasl.password": password}
        )
    if _uses_ssl(settings) and settings.kafka_ssl_ca_location:
        config["ssl.ca.location"] = settings.kafka_ssl_ca_location
    return config


def spark_kafka_options(settings: Settings) -> dict[str, str]:
    """The same connection as ``client_config``, as options of Spark's Kafka source (Java client, ``kafka.``).

    The JAAS line carries the password; Spark masks it in plans and UIs through
    ``spark.sql.redaction.options.regex`` (set in ``iotmon.spark``).
    """
    options = {
        "kafka.bootstrap.servers": settings.kafka_bootstrap,
        "kafka.security.protocol": settings.kafka_security_protocol,
    }
    if _uses_sasl(settings):
        username, password = sasl_credentials(settings)
        options["kafka.sasl.mechanism"] = settings.kafka_sasl_mechanism
        options["kafka.sasl.jaas.config"] = jaas_config(
            JAAS_LOGIN_MODULES[settings.kafka_sasl_mechanism], username, password
        )
    if _uses_ssl(settings) and settings.kafka_ssl_ca_location:
        options["kafka.ssl.truststore.type"] = "PEM"
        options["kafka.ssl.truststore.location"] = settings.kafka_ssl_ca_location
    return options


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


def producer_config(settings: Settings) -> dict[str, Any]:
    """Idempotent, batched producer: no duplicates from retries, per-partition order kept.

    ``murmur2_random`` is the Java client's partitioner, so a device lands on the same partition whichever
    client publishes it.
    """
    return {
        **client_config(settings),
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
    # librdkafka's own lines (retries while a new broker elects its coordinator) go to the log, not the console.
    return Producer({**producer_config(settings), "logger": logging.getLogger("rdkafka"), **extra})


def admin(settings: Settings) -> AdminClient:
    """Errors arrive as exceptions; librdkafka's own log lines (one per failed connect) would only repeat them."""
    return AdminClient({**client_config(settings), "log_level": 0})


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


def _reader(settings: Settings, group: str) -> Consumer:
    return Consumer({**client_config(settings), "group.id": group, "enable.auto.commit": False, "log_level": 0})


def partition_offsets(
    settings: Settings, timeout: float = 30.0, consumer: Consumer | None = None
) -> dict[int, tuple[int, int]]:
    """Low and high watermark of every partition of the readings topic: the records Kafka holds (asked with
    ``consumer``, or a client of its own)."""
    if consumer is None:
        own = _reader(settings, "iotmon-verify")
        try:
            return partition_offsets(settings, timeout, own)
        finally:
            own.close()
    try:
        metadata = consumer.list_topics(settings.topic, timeout=timeout)
        topic = metadata.topics.get(settings.topic)
        if topic is None or topic.error is not None:
            return {}
        deadline = time.monotonic() + timeout
        return {
            partition: _watermarks(consumer, settings.topic, partition, deadline)
            for partition in sorted(topic.partitions)
        }
    except KafkaException as exc:
        raise _unavailable(settings, exc) from None


LEADERLESS = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE)
"""What a broker answers for a partition whose leadership it has not taken up yet, as just after it (re)started."""
LEADER_WAIT_S = 0.2


def _watermarks(consumer: Consumer, topic: str, partition: int, deadline: float) -> tuple[int, int]:
    """A partition's low and high watermark, asked again while its leader is being elected (until ``deadline``)."""
    while True:
        try:
            timeout = max(0.1, deadline - time.monotonic())
            return consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout, cached=False)
        except KafkaException as exc:
            if exc.args[0].code() not in LEADERLESS or time.monotonic() + LEADER_WAIT_S > deadline:
                raise
            time.sleep(LEADER_WAIT_S)


def newest_event_time(settings: Settings, per_partition: int = 20, timeout: float = 10.0) -> datetime | None:
    """The newest event time among the last ``per_partition`` records of each partition of the readings
    topic: what every table's freshness is measured against. Records without a readable event time (the
    malformed ones) are passed over, and so are those whose event time the archive would quarantine as absurd
    (``plausible``): one reading stamped a century ahead would otherwise put every table centuries behind; None
    when the topic holds no readable reading."""
    earliest = as_utc(datetime.fromisoformat(settings.min_event_time))
    consumer = _reader(settings, "iotmon-status")
    try:
        wanted, remaining = [], 0
        for partition, (low, high) in partition_offsets(settings, timeout, consumer).items():
            start = max(low, high - per_partition)
            if high > start:
                wanted.append(TopicPartition(settings.topic, partition, start))
                remaining += high - start
        if not wanted:
            return None
        consumer.assign(wanted)
        newest: datetime | None = None
        deadline = time.monotonic() + timeout
        while remaining > 0 and time.monotonic() < deadline:
            records = consumer.consume(remaining, timeout=max(0.1, deadline - time.monotonic()))
            remaining -= len(records)
            for record in records:
                moment = event_time_of(record.value()) if record.error() is None else None
                if moment is None or not plausible(moment, record.timestamp()[1], earliest, settings):
                    continue
                if newest is None or moment > newest:
                    newest = moment
        return newest
    except KafkaException as exc:
        raise _unavailable(settings, exc) from None
    finally:
        consumer.close()


def plausible(moment: datetime, sent_ms: int, earliest: datetime, settings: Settings) -> bool:
    """Whether an event time passes the archive's check (``ingest.bronze``'s ``absurd_event_time``): not before
    ``IOTMON_MIN_EVENT_TIME``, nor more than ``IOTMON_MAX_CLOCK_SKEW_SECONDS`` after the record reached Kafka
    (``sent_ms``, the record's timestamp; a record without one is judged on the first bound only). Pure."""
    if moment < earliest:
        return False
    if sent_ms <= 0:
        return True
    return moment.timestamp() <= sent_ms / 1000 + settings.max_clock_skew_seconds


def event_time_of(payload: bytes | None) -> datetime | None:
    """The event time of a reading's JSON payload, in UTC; None when it has no readable one."""
    try:
        value = json.loads(payload or b"")["event_time"]
        moment = datetime.fromisoformat(value)
    except (ValueError, KeyError, TypeError):
        return None
    return as_utc(moment)
