"""Steady state: a real-time fleet at a fixed rate into the running pipeline, and its end-to-end latency.

The simulator runs as a process of its own (as in production, and so its producer does not share this
process's interpreter with the Spark driver), publishing with event time = wall clock. The pipeline runs
every query at once, as ``iotmon stream`` does. The first ``warmup`` seconds are not measured: every query's
first batches plan, generate and JIT-compile their code and start Python workers, all at once on two cores,
which is a start-up figure, not a steady one. Once the fleet has stopped and every query has read what its
source holds, latency is read back from the Delta logs (``bench.latency``) for the events after the warm-up:
event -> bronze, silver, anomaly and live-window rows, and window end -> final window row; the stream's CPU
and each query's batches are those after the warm-up too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from bench.latency import measure, window_latency
from bench.progress import ProgressCollector
from bench.system import CpuMeter
from bench.throughput import Log, drain_concurrently, topic_records
from iotmon.config import Settings
from iotmon.kafka import ensure_topic
from iotmon.schema import DEVICE_WINDOWS
from simulators.publish import write_device_registry

CATCH_UP_MIN_S = 300.0


def spark_counters(jvm: Any) -> dict[str, Callable[[], float]]:
    """Cumulative figures of the stream's JVM for a ``CpuMeter``: the classes Spark generated and compiled with
    Janino (``CodegenMetrics``). A plan whose code holds a value that changes every batch (a timestamp or
    integer literal is written into the generated source) misses Spark's cache of generated classes each batch,
    and each new class is compiled by Janino, run interpreted, then JIT-compiled again."""
    codegen = getattr(getattr(jvm.org.apache.spark.metrics.source, "CodegenMetrics$"), "MODULE$")
    return {"generated_classes": lambda: codegen.METRIC_COMPILATION_TIME().getCount()}


def simulator_command(
    settings: Settings, rate: float, seconds: float, devices: int, seed: int, truth: Path
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "iotmon.cli",
        "simulate",
        "--rate",
        f"{rate:g}",
        "--duration",
        f"{seconds:g}",
        "--devices",
        str(devices),
        "--seed",
        str(seed),
        "--truth",
        str(truth),
        "--quiet",
    ]


def steady_state(
    spark: SparkSession,
    settings: Settings,
    collector: ProgressCollector,
    rate: float,
    seconds: float,
    devices: int,
    seed: int,
    log: Log,
    warmup: float = 0.0,
) -> dict[str, Any]:
    ensure_topic(settings)
    # The registry first: silver joins it from its first batch (the simulator rewrites the same rows).
    write_device_registry(settings, devices, seed)
    truth = settings.home / "truth" / f"steady-{settings.topic}.parquet"
    command = simulator_command(settings, rate, warmup + seconds, devices, seed, truth)
    published = threading.Event()
    outcome: dict[str, Any] = {}
    measured = {"since": datetime.now(UTC).replace(tzinfo=None), "mark": collector.mark()}

    # The stream's CPU while the fleet publishes at the rate: Spark's JVM, its Python workers and this process,
    # where the foreachBatch functions run (the simulator is a process of its own).
    jvm = spark.sparkContext._jvm
    cpu = CpuMeter(int(jvm.java.lang.ProcessHandle.current().pid()), os.getpid(), spark_counters(jvm))

    def publish() -> None:
        try:
            started = time.monotonic()
            fleet = subprocess.Popen(command, env=settings.child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                fleet.wait(timeout=warmup)  # returns early only if the fleet stopped (it failed)
            except subprocess.TimeoutExpired:
                log(f"steady: warm-up over after {warmup:g}s; measuring from now")
            measured.update(since=datetime.now(UTC).replace(tzinfo=None), mark=collector.mark())
            cpu.start()
            stdout, stderr = (text.decode(errors="replace") for text in fleet.communicate())
            done = subprocess.CompletedProcess(command, fleet.returncode, stdout, stderr)
            outcome.update(cpu=cpu.stop())
            outcome.update(returncode=done.returncode, seconds=time.monotonic() - started, output=done.stdout[-2000:])
            if done.returncode != 0:
                log(f"steady: the simulator failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        finally:
            published.set()

    publisher = threading.Thread(target=publish, name="iotmon-bench-fleet", daemon=True)
    publisher.start()
    catch_up = max(CATCH_UP_MIN_S, 2 * seconds)
    run = drain_concurrently(spark, settings, collector, seconds + catch_up, log, until=published)
    publisher.join()
    until = datetime.now(UTC).replace(tzinfo=None)
    records = topic_records(settings)
    since = measured["since"]
    latencies = [*measure(spark, settings, since, until)]
    latencies.append(window_latency(spark, settings, DEVICE_WINDOWS, since, until))
    return {
        "mode": run["mode"],
        "rate": round(rate, 1),
        "seconds": seconds,
        "warmup_seconds": warmup,
        "devices": devices,
        "records": records,
        "published_events_per_s": round(records / outcome["seconds"], 1) if outcome.get("seconds") else None,
        "simulator_exit": outcome.get("returncode"),
        "stream_cpu": outcome.get("cpu"),
        "queries": collector.batch_costs(measured["mark"]),
        "caught_up": run["caught_up"],
        "behind": run["behind"],
        "latency": [latency.to_dict() for latency in latencies],
    }
