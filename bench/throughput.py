"""Throughput: the ceilings of this machine, and the whole pipeline draining a backlog.

Ceilings first, so the pipeline's figure has something to be compared with: how fast a plain Kafka
consumer reads the topic (confluent-kafka, the client ``iotmon.kafka`` uses), and how fast Spark reads it
into a no-op sink with the archive's own Kafka options (the engine's ceiling: no parsing, no Delta).

The pipeline drains in three ways, each said in the report:

- in turn (``drain``): every query with the available-now trigger, one after the other, so each query's time
  and rate stand alone and their sum bounds the path's;
- by the topology (``drain_by_topology``): the same over a lake of its own, as ``iotmon stream --until-idle``
  drains: each query once those upstream of it have finished, the others beside it; the path's wall time;
- concurrently (``drain_concurrently``): every query at once with the processing-time trigger, as
  ``iotmon stream`` runs, until each has read everything its source holds (``behind``). Bronze is capped per
  batch, so event time moves through many batches and the state a stateful query keeps can be watched.
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from bench.progress import ProgressCollector
from bench.stats import rate
from bench.system import application_cpu
from ingest.landing import kafka_records
from iotmon.config import Settings
from iotmon.kafka import partition_offsets
from iotmon.queries import AVAILABLE_NOW, await_batches, run_until_idle
from pipeline.stream import drain_until_idle, run_topology
from pipeline.topology import (
    KAFKA,
    TOPOLOGY,
    ensure_tables,
    queries,
    triggers_line,
)
from simulators.options import SimulationOptions
from simulators.publish import run_simulation

Log = Callable[[str], None]
SOURCE_OF: dict[str, str] = {node.name: node.source for node in TOPOLOGY}
"""What each query streams from: it has caught up when it has read as many rows as its source holds."""
CONSUMER_BATCH = 10_000


def topic_records(settings: Settings) -> int:
    return sum(high - low for low, high in partition_offsets(settings).values())


def preload(settings: Settings, options: SimulationOptions) -> dict[str, Any]:
    """A backlog in the topic, published as fast as the simulator can (its rate is a figure too)."""
    summary = run_simulation(settings, options)
    return {
        "topic": settings.topic,
        "devices": options.devices,
        "sent": summary.sent,
        "records": topic_records(settings),
        "failed": summary.failed,
        "seconds": round(summary.elapsed_s, 3),
        "events_per_s": round(summary.events_per_s, 1),
    }


def consumer_ceiling(settings: Settings, expected: int, timeout: float = 300.0) -> dict[str, Any]:
    """A plain confluent-kafka consumer reading every record of the topic from the beginning, timed from the
    first record it receives (connecting and the first fetch's wait are not reading)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": settings.kafka_bootstrap,
            "group.id": f"iotmon-bench-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    partitions = sorted(partition_offsets(settings))
    count = payload_bytes = 0
    deadline = time.monotonic() + timeout
    started = None  # the clock starts at the first record: connecting is not reading
    try:
        consumer.assign([TopicPartition(settings.topic, p, OFFSET_BEGINNING) for p in partitions])
        while count < expected and time.monotonic() < deadline:
            messages = consumer.consume(num_messages=CONSUMER_BATCH, timeout=1.0)
            started = started or (time.monotonic() if messages else None)
            for message in messages:
                if message.error() is None:
                    count += 1
                    payload_bytes += len(message.value() or b"")
    finally:
        seconds = time.monotonic() - started if started else 0.0
        consumer.close()
    return {
        "records": count,
        "bytes": payload_bytes,
        "seconds": round(seconds, 3),
        "events_per_s": round(rate(count, seconds), 1),
    }


def spark_noop_ceiling(spark: SparkSession, settings: Settings, checkpoint: str) -> dict[str, Any]:
    """readStream kafka (the archive's options) -> writeStream noop, available-now: Spark's own ceiling, and the
    CPU it spent per event."""
    cpu = application_cpu(spark).start()
    started = time.monotonic()
    query = (
        kafka_records(spark, settings)
        .writeStream.format("noop")
        .queryName("bench_kafka_noop")
        .option("checkpointLocation", checkpoint)
        .trigger(**AVAILABLE_NOW)
        .start()
    )
    progress = await_batches(query, 10.0)
    seconds = time.monotonic() - started
    used = cpu.stop()
    rows = sum(p["numInputRows"] for p in progress)
    in_batches = sum(p["durationMs"].get("triggerExecution", 0) for p in progress) / 1000
    return {
        "records": rows,
        "seconds": round(seconds, 3),
        "batch_seconds": round(in_batches, 3),
        "events_per_s": round(rate(rows, seconds), 1),
        **cpu_figures(used, rows),
    }


def cpu_figures(used: Mapping[str, Any], events: int) -> dict[str, Any]:
    """What a ``CpuMeter`` measured over a drain of ``events``: CPU seconds, cores busy on average, and the
    microseconds of CPU per event, the figure the drain's rate is bound by (``bench.stats.cpu_bound``)."""
    return {
        "cpu_seconds": used["cpu_seconds"],
        "cores": used["cores"],
        "cpu_us_per_event": round(1e6 * rate(used["cpu_seconds"], events), 1),
    }


def drain(spark: SparkSession, settings: Settings, records: int, log: Log) -> dict[str, Any]:
    """Every query in turn with the available-now trigger; the path's time is the sum of theirs, and so is its
    CPU: each query's share of the path's cost."""
    ensure_tables(spark, settings)
    timed = []
    for spec in queries():
        cpu = application_cpu(spark).start()
        started = time.monotonic()
        rows = run_until_idle(spark, settings, [spec], out=sys.stderr)
        seconds = time.monotonic() - started
        used = cpu.stop()
        timed.append(
            {
                "name": spec.name,
                "rows": rows.get(spec.name),
                "seconds": round(seconds, 3),
                "rows_per_s": round(rate(rows.get(spec.name) or 0, seconds), 1),
                "skipped": spec.name not in rows,
                **cpu_figures(used, records),
            }
        )
    total = sum(q["seconds"] for q in timed)
    cpu_seconds = round(sum(q["cpu_seconds"] for q in timed), 3)
    log(f"drain: {records:,} events through {len(timed)} queries in {total:.1f}s, {cpu_seconds:.1f}s of CPU")
    return {
        "mode": "in turn (available-now, one query after the other)",
        "events": records,
        "seconds": round(total, 3),
        "events_per_s": round(rate(records, total), 1),
        **cpu_figures({"cpu_seconds": cpu_seconds, "cores": round(rate(cpu_seconds, total), 3)}, records),
        "queries": timed,
    }


def drain_by_topology(spark: SparkSession, settings: Settings, records: int, log: Log) -> dict[str, Any]:
    """Every query with the available-now trigger as ``iotmon stream --until-idle`` drains: each once the queries
    upstream of it have finished, the others beside it. The path's time is the wall time of the whole; its CPU,
    and where the cores went (``CpuMeter``'s parts), say how much of that time the cores were busy."""
    ensure_tables(spark, settings)
    cpu = application_cpu(spark).start()
    started = time.monotonic()
    rows = drain_until_idle(spark, settings)
    seconds = time.monotonic() - started
    used = cpu.stop()
    log(
        f"drain: {records:,} events through every query by the topology in {seconds:.1f}s, "
        f"{used['cpu_seconds']:.1f}s of CPU ({used['cores']:.2f} cores)"
    )
    return {
        "mode": "available-now, each query once the queries upstream of it have finished, the others beside it, "
        "as iotmon stream --until-idle drains",
        "events": records,
        "seconds": round(seconds, 3),
        "events_per_s": round(rate(records, seconds), 1),
        **cpu_figures(used, records),
        "cpu_parts": used["parts"],
        "rows": rows,
    }


def table_rows(settings: Settings, table: str) -> int:
    """Rows of a lake table from its Delta log (delta-rs, no Spark job competing with the queries)."""
    from deltalake import DeltaTable

    from iotmon.status import row_count

    return row_count(DeltaTable(settings.table_path(table)))


def behind(read: Mapping[str, int], held: Mapping[str, int]) -> list[str]:
    """Queries that have read fewer rows than their source holds (``SOURCE_OF``); pure."""
    return [name for name, source in SOURCE_OF.items() if read.get(name, 0) < held.get(source, 0)]


def source_rows(settings: Settings) -> dict[str, int]:

    tables = {s for s in SOURCE_OF.values() if s != KAFKA}
    return {KAFKA: topic_records(settings), **{table: table_rows(settings, table) for table in tables}}


def drain_concurrently(
    spark: SparkSession,
    settings: Settings,
    collector: ProgressCollector,
    timeout: float,
    log: Log,
    until: threading.Event | None = None,
) -> dict[str, Any]:
    """Every query at once (as ``iotmon stream``, its event clock beside them) until all have read what their
    sources hold, or ``timeout``.

    With ``until`` (a publisher still running), catching up only counts once it is set.
    """
    ensure_tables(spark, settings)
    mark = collector.mark()
    stop = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            run_topology(spark, settings, stop, report_every=30.0)
        except BaseException as exc:  # reported by the caller, after the queries stopped
            failure.append(exc)
            stop.set()

    runner = threading.Thread(target=run, name="iotmon-bench-stream", daemon=True)
    started = time.monotonic()
    runner.start()
    lagging: list[str] = list(SOURCE_OF)
    caught_up_at = None
    next_line = started + 15.0
    try:
        while not stop.wait(1.0):
            if until is not None and not until.is_set():
                continue
            lagging = behind(collector.input_rows(mark), source_rows(settings))
            if not lagging:
                caught_up_at = time.monotonic()
                break
            if time.monotonic() - started > timeout:
                break
            if time.monotonic() >= next_line:
                log(f"  waiting for {', '.join(lagging)} ({time.monotonic() - started:.0f}s)")
                next_line = time.monotonic() + 15.0
    finally:
        stop.set()
        runner.join()
        collector.settle()
    if failure:
        raise failure[0]
    seconds = (caught_up_at or time.monotonic()) - started
    return {
        "mode": f"concurrent (every query at once: {triggers_line(settings)})",
        "caught_up": caught_up_at is not None,
        "behind": lagging if caught_up_at is None else [],
        "seconds": round(seconds, 3),
        "mark": mark,
    }


def phase_settings(base: Settings, root: Path, name: str, run_id: str, **overrides: Any) -> Settings:
    """A phase's own topic, lake and checkpoints under the bench directory; the bench's own MLflow store."""
    return replace(
        base,
        topic=f"iotmon.bench.{run_id}.{name}",
        lake=str((root / name / "lake").absolute()),
        checkpoints=str((root / name / "checkpoints").absolute()),
        **overrides,
    )
