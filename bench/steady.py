"""Steady state: a real-time fleet at a fixed rate into the running pipeline, its end-to-end latency and CPU.

Issue 17 states its steady-state targets with everything a deployment runs on the same 2 cores: the stream, a
trainer retraining every 5 minutes, the dashboard and the broker. So the phase runs them all: the simulator as a
process of its own (as in production, and so its producer does not share this process's interpreter with the Spark
driver), publishing with event time = wall clock; every query at once, as ``iotmon stream`` runs them, in this
process; ``iotmon train --every`` as a process of its own (on what the stream leaves once a champion exists, as
ever); and a dashboard page left open (``bench.viewer``: the page's reads at every refresh), which also records each
table's freshness as the page showed it. The first ``warmup`` seconds are not measured: every query's first batches
plan, generate and JIT-compile their code and start Python workers, all at once on two cores, which is a start-up
figure, not a steady one. Once the fleet has stopped and every query has read what its source holds, latency is read
back from the Delta logs (``bench.latency``) for the events after the warm-up: event -> bronze, silver, anomaly and
live-window rows, window end -> final window row, and a silent device's last reading -> its offline row; the
stream's CPU and each query's batches are those after the warm-up too, the trainer's and the viewer's CPU beside it,
and each table's freshness trend over the measured window.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from bench.latency import measure, offline_latency, window_latency
from bench.progress import ProgressCollector
from bench.system import application_cpu, process_tree_cpu_seconds
from bench.throughput import Log, drain_concurrently, topic_records
from bench.viewer import fastest_growth, freshness_trend, read_samples
from iotmon.config import Settings
from iotmon.kafka import ensure_topic
from iotmon.schema import DEVICE_WINDOWS
from simulators.publish import write_device_registry

CATCH_UP_MIN_S = 300.0
STOP_PATIENCE_S = 60.0
"""How long the trainer and the viewer get to stop on a signal before they are killed."""


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
    retrain_every_s: float | None = None,
    viewer: bool = False,
    name: str = "steady",
) -> dict[str, Any]:
    """The fleet at ``rate`` for ``warmup`` then ``seconds``, every query running, and beside them (if asked) a
    trainer retraining every ``retrain_every_s`` and a dashboard ``viewer``; the figures of the measured window."""
    ensure_topic(settings)
    # The registry first: silver joins it from its first batch (the simulator rewrites the same rows).
    write_device_registry(settings, devices, seed)
    truth = settings.home / "truth" / f"steady-{settings.topic}.parquet"
    command = simulator_command(settings, rate, warmup + seconds, devices, seed, truth)
    published = threading.Event()
    outcome: dict[str, Any] = {}
    measured = {"since": datetime.now(UTC).replace(tzinfo=None), "mark": collector.mark()}
    samples = settings.home / f"viewer-{settings.topic}.jsonl"
    beside = _Beside(settings, retrain_every_s, samples if viewer else None)

    # The stream's CPU while the fleet publishes at the rate: Spark's JVM, its Python workers and this process,
    # where the foreachBatch functions run (the simulator, the trainer and the viewer are processes of their own).
    cpu = application_cpu(spark, spark_counters(spark.sparkContext._jvm))

    def publish() -> None:
        try:
            started = time.monotonic()
            fleet = subprocess.Popen(command, env=settings.child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                fleet.wait(timeout=warmup)  # returns early only if the fleet stopped (it failed)
            except subprocess.TimeoutExpired:
                log(f"{name}: warm-up over after {warmup:g}s; measuring from now")
            measured.update(since=datetime.now(UTC).replace(tzinfo=None), mark=collector.mark(), at=time.time())
            cpu.start()
            beside.measure()
            stdout, stderr = (text.decode(errors="replace") for text in fleet.communicate())
            done = subprocess.CompletedProcess(command, fleet.returncode, stdout, stderr)
            outcome.update(cpu=cpu.stop(), beside_cpu=beside.stop())
            measured.update(fleet_end=datetime.now(UTC).replace(tzinfo=None), end_at=time.time())
            outcome.update(returncode=done.returncode, seconds=time.monotonic() - started, output=done.stdout[-2000:])
            if done.returncode != 0:
                log(f"{name}: the simulator failed ({done.returncode}): {done.stderr.strip()[-500:]}")
        finally:
            beside.stop()
            published.set()

    beside.start()
    if beside.started:
        log(f"{name}: beside the stream: {', '.join(beside.started)}")
    publisher = threading.Thread(target=publish, name="iotmon-bench-fleet", daemon=True)
    publisher.start()
    catch_up = max(CATCH_UP_MIN_S, 2 * seconds)
    try:
        run = drain_concurrently(spark, settings, collector, seconds + catch_up, log, until=published)
        publisher.join()
    finally:
        beside.stop()
    until = datetime.now(UTC).replace(tzinfo=None)
    records = topic_records(settings)
    since = measured["since"]
    latencies = [*measure(spark, settings, since, until)]
    latencies.append(window_latency(spark, settings, DEVICE_WINDOWS, since, until))
    fleet_end = measured.get("fleet_end", until)
    offline = offline_latency(spark, settings, truth, since, fleet_end, until)
    trend = freshness_trend(read_samples(samples), measured.get("at", 0.0), measured.get("end_at", time.time()))
    growth = fastest_growth(trend)
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
        "beside": {"retrain_every_s": retrain_every_s, "viewer": viewer, "cpu_cores": outcome.get("beside_cpu")},
        "queries": collector.batch_costs(measured["mark"]),
        "caught_up": run["caught_up"],
        "behind": run["behind"],
        "latency": [latency.to_dict() for latency in latencies],
        "offline": offline,
        "freshness": trend,
        "fastest_growth": None if growth is None else {"table": growth[0], "s_per_min": growth[1]},
    }


class _Beside:
    """The processes that share the machine with the stream in the steady state: ``iotmon train --every`` and a
    dashboard viewer (``bench.viewer``); their CPU over the measured window; stopped with the fleet."""

    def __init__(self, settings: Settings, retrain_every_s: float | None, samples: Path | None) -> None:
        self.commands: dict[str, list[str]] = {}
        if retrain_every_s:
            every = f"{retrain_every_s:g} seconds"
            self.commands["trainer"] = [sys.executable, "-m", "iotmon.cli", "train", "--every", every]
        if samples is not None:
            self.commands["viewer"] = [sys.executable, "-m", "bench.viewer", str(samples)]
        self.settings = settings
        self.processes: dict[str, subprocess.Popen] = {}
        self._cpu_at_start: dict[str, float] = {}
        self._started_at = 0.0
        self._measured: dict[str, float] | None = None
        self._lock = threading.Lock()

    @property
    def started(self) -> list[str]:
        return list(self.processes)

    def start(self) -> None:
        for name, command in self.commands.items():
            out = self.settings.home / f"{name}-{self.settings.topic}.log"
            with out.open("ab") as log:
                self.processes[name] = subprocess.Popen(
                    command, env=self.settings.child_env(), stdout=log, stderr=subprocess.STDOUT
                )

    def measure(self) -> None:
        """The measured window starts: each process's CPU so far (its tree: the trainer's JVM is its child)."""
        self._cpu_at_start = {name: process_tree_cpu_seconds(p.pid) for name, p in self.processes.items()}
        self._started_at = time.monotonic()

    def stop(self) -> dict[str, float] | None:
        """Cores each used since ``measure`` (None if it was never called), then each is stopped; idempotent."""
        with self._lock:
            if self._measured is None and self._cpu_at_start:
                wall = time.monotonic() - self._started_at
                self._measured = {
                    name: round((process_tree_cpu_seconds(p.pid) - self._cpu_at_start[name]) / wall, 3)
                    for name, p in self.processes.items()
                }
            for process in self.processes.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGINT)
            for process in self.processes.values():
                try:
                    process.wait(STOP_PATIENCE_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            return self._measured
