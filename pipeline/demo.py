"""``iotmon demo``: the whole loop on one machine, each part a process of its own, as it would run in production.

The broker, a real-time fleet (``iotmon simulate``), the dashboard and the MLflow UI are child processes; the
stream runs in this one, with a periodic trainer in its Spark session (``pipeline.stream``: its warm JVM trains
the first model sooner than a cold one beside it). A fresh lake first gets the fleet's recent past, as much as
the first model needs, so that it trains at once rather than minutes later.

A stop (Ctrl-C, SIGTERM, or the end of ``DemoOptions.duration_s``) stops the fleet first, so that the stream can
drain what Kafka holds, and with it what else competes for the cores (the dashboard and the MLflow UI; the
stream cancels a training run in progress); then the lake is reconciled against Kafka and the fleet's ground
truth, and every process the demo started is stopped.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from iotmon.config import Settings
from iotmon.logs import say

if TYPE_CHECKING:
    from pipeline.verify import LakeCheck

CHILD_STOP_SECONDS = 30.0
"""How long a child process may take to stop on its signal before it is killed."""


@dataclass(frozen=True)
class DemoOptions:
    devices: int = 200
    rate: float = 500.0
    """Events a second, the whole fleet's."""
    duration_s: float | None = None
    """Seconds until the demo stops by itself; None runs until a signal."""
    retrain_every_s: float = 300.0


class ChildProcesses:
    """The processes a demo starts (``iotmon`` commands), each stopped with its own signal, waited for, and
    killed if it has not stopped within ``CHILD_STOP_SECONDS``."""

    def __init__(self) -> None:
        self.started: list[tuple[str, subprocess.Popen, signal.Signals]] = []

    def start(self, name: str, argv: Sequence[str], stop_with: signal.Signals) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", "iotmon.cli", *argv])
        self.started.append((name, process, stop_with))
        return process

    def stop(self, *names: str) -> None:
        chosen = [child for child in self.started if child[0] in names]
        for _, process, stop_with in chosen:
            if process.poll() is None:
                process.send_signal(stop_with)
        for name, process, _ in chosen:
            try:
                process.wait(CHILD_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                say(f"{name}: killed after {CHILD_STOP_SECONDS:g}s without stopping", sys.stderr)

    def stop_all(self) -> None:
        self.stop(*(name for name, *_ in self.started))


def run_demo(
    settings: Settings,
    options: DemoOptions,
    stop: threading.Event,
    progress: Callable[[str], None] = lambda _: None,
) -> LakeCheck:
    """Run the demo until ``stop`` is set (or ``options.duration_s`` has passed), drain, and return the lake's
    reconciliation (``progress`` hears what is being checked). The broker is stopped at the end unless it was
    running before."""
    from iotmon import broker
    from iotmon.spark import spark_session
    from ml.train import past_to_publish_s
    from pipeline.stream import run_stream
    from pipeline.verify import reconcile_lake

    broker_was_running = broker.status(settings).running
    say(broker.start(settings).report())
    children = ChildProcesses()
    try:
        truth = settings.truth_dir / f"demo-{datetime.now():%Y%m%d-%H%M%S}.parquet"
        past = past_to_publish_s(settings)
        fleet = ["--devices", str(options.devices), "--rate", f"{options.rate:g}", "--past", f"{past:g}"]
        duration = ["--duration", f"{options.duration_s:g}"] if options.duration_s else []
        simulator = children.start(
            "simulator", ["simulate", "--quiet", "--truth", str(truth), *fleet, *duration], signal.SIGINT
        )
        history = f", after their last {past:g}s of readings at once" if past else ""
        say(
            f"simulator: {options.devices} devices at {options.rate:g} events/s{history} (pid {simulator.pid}); "
            f"truth -> {truth}"
        )
        say(
            f"trainer: retrains every {options.retrain_every_s:g} s in the stream's Spark session, once silver has "
            "enough history"
        )
        for name in ("dashboard", "mlflow"):
            children.start(name, [name], signal.SIGTERM)
        say("dashboard, MLflow UI: their addresses follow; the first anomalies appear once the first model is trained")
        if options.duration_s:
            timer = threading.Timer(options.duration_s, stop.set)
            timer.daemon = True
            timer.start()
        drain = threading.Event()

        def wind_down() -> None:
            """At a stop, the stream drains as soon as nothing new is published; meanwhile what else competes
            for the cores stops too (the dashboard and the MLflow UI; the stream cancels a training run)."""
            stop.wait()
            children.stop("simulator")
            drain.set()
            say("stopped the fleet; the trainer stops, the stream drains, then the lake is reconciled")
            children.stop("dashboard", "mlflow")
            say("stopped the dashboard and the MLflow UI")

        threading.Thread(target=wind_down, name="iotmon-demo-wind-down", daemon=True).start()
        run_stream(settings, drain, drain_on_stop=True, train_every_s=options.retrain_every_s)
        every_truth = sorted(settings.truth_dir.glob("*.parquet"))
        return reconcile_lake(spark_session(settings, "iotmon-verify"), settings, every_truth, progress)
    finally:
        children.stop_all()
        if not broker_was_running:
            broker.stop(settings)
            say("stopped the kafka broker the demo started")
