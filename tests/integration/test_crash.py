"""Exactly once under crashes: SIGKILL the streaming process mid-batch, each time in a different query.

Broker restarts under a running stream, and a trainer killed mid-write, are covered by test_chaos.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.chaos import batch_ids
from ingest.archive import ARCHIVE_QUERIES, ensure_archive_tables
from iotmon.config import Settings
from iotmon.queries import run_until_idle
from iotmon.schema import ALERTS, ANOMALIES, BRONZE, DEVICE_STATUS, SILVER
from ml.train import TrainOptions, train
from simulators.options import SimulationOptions
from simulators.publish import run_simulation
from streaming.jobs import ANALYTICS_QUERIES, ensure_analytics_tables
from streaming.silver import READING_KEY
from tests.support import cli_env, wait_for

pytestmark = pytest.mark.integration

IOTMON = [sys.executable, "-m", "iotmon.cli"]


def _stream(settings: Settings, log: Path) -> subprocess.Popen:
    """``iotmon stream`` in a process group of its own: the Python driver and its Spark JVM."""
    env = cli_env(settings)
    return subprocess.Popen(
        [*IOTMON, "stream"], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _run(settings: Settings, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*IOTMON, *args], env=cli_env(settings), capture_output=True, text=True, timeout=600)


def _batch_in_flight(checkpoint: str, after: int) -> int | None:
    """The first batch after ``after`` whose offsets are logged: the moment to crash. It is usually still
    running when seen (batches take seconds); if the test process was slow to look, the kill lands just
    after it, which must be survived exactly as well."""
    planned = {b for b in batch_ids(checkpoint, "offsets") if b > after}
    return min(planned) if planned else None


def _gone(groups: list[int]) -> None:
    """Kill what is left of earlier runs (the JVM a driver-only kill orphaned) and wait until it is gone."""

    def alive(group: int) -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True

    for group in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    wait_for(lambda: not any(alive(group) for group in groups), 60, "the killed runs' processes to exit")


def _simulate(settings: Settings, truth: Path, events: int, seed: int) -> None:
    """The seed fixes the registry too: later runs reuse it, so the fleet (and each device's site) stays put."""
    options = SimulationOptions(devices=100, seed=seed, events=events, truth_path=truth, progress=False)
    assert run_simulation(settings, options).failed == 0


def _reconciles_exactly(settings: Settings, *truth: Path) -> str:
    assert _run(settings, "stream", "--until-idle").returncode == 0
    verified = _run(settings, "verify", *[arg for path in truth for arg in ("--truth", str(path))])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "RESULT: exact" in verified.stdout
    return verified.stdout


def test_sigkill_mid_batch_repeatedly_then_resume(isolated: Settings, tmp_path: Path, spark) -> None:
    # Small batches, so every query is still busy when it is killed.
    # A short feature history lets the trainer work on the few minutes of readings simulated here.
    settings = dataclasses.replace(
        isolated, max_offsets_per_trigger=1_500, trigger_interval="1 seconds", feature_history="10 seconds"
    )
    first, second = tmp_path / "first.parquet", tmp_path / "second.parquet"
    _simulate(settings, first, events=15_000, seed=3)
    log = tmp_path / "stream.log"

    # Each kill lands while a batch of a different query is in flight, archive to alerts: the archive, the
    # deduplicating MERGE, a stateful query (transformWithState with timers; the window aggregations share
    # its state store and checkpoint protocol), the scorer and the alerts MERGE. Kill 1 takes only the
    # Python driver: its orphaned JVM shuts down on its own while the next run is already starting. The
    # others take the whole process tree at once, like a crashed machine.
    last_killed: dict[str, int] = {}
    groups = []
    for kill, query in enumerate((BRONZE, SILVER, DEVICE_STATUS, ANOMALIES, ALERTS)):
        if query == ANOMALIES:
            # The first model appears while the stream is down, trained on all of silver: the next run's
            # scorer starts with a backlog, and little else competes with it (everything else is drained).
            _gone(groups)  # no killed JVM may still write to the checkpoints the drain resumes
            ensure_archive_tables(spark, settings)
            ensure_analytics_tables(spark, settings)
            run_until_idle(spark, settings, (*ARCHIVE_QUERIES, *ANALYTICS_QUERIES))
            assert train(spark, settings, TrainOptions()).promoted
        checkpoint, after = settings.checkpoint_path(query), last_killed.get(query, -1)
        process = _stream(settings, log)
        groups.append(process.pid)
        try:
            # A tuple, so that batch 0 counts as found (wait_for waits for something truthy).
            (in_flight,) = wait_for(
                lambda cp=checkpoint, after=after: (b,) if (b := _batch_in_flight(cp, after)) is not None else None,
                240,
                f"{query} batch in flight",
            )
            if kill == 1:
                process.send_signal(signal.SIGKILL)
            else:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        last_killed[query] = in_flight
        if kill == 1:  # more data arrives while the stream is down
            _simulate(settings, second, events=5_000, seed=3)

    report = _reconciles_exactly(settings, first, second)
    for group in groups:  # the orphaned JVM is long gone by now; make sure nothing lingers
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    assert "20,000" in report  # 15,000 + 5,000 sends, each archived once
    assert "analytics    OK" in report  # silver and gold equal their batch recomputation, nothing twice
    # Every silver reading scored once, every incident once.
    silver = spark.read.format("delta").load(settings.table_path(SILVER)).select(*READING_KEY)
    scored = spark.read.format("delta").load(settings.table_path(ANOMALIES)).select(*READING_KEY)
    assert scored.count() == scored.distinct().count() == silver.count()
    assert silver.exceptAll(scored).isEmpty()
    alerts = spark.read.format("delta").load(settings.table_path(ALERTS))
    assert alerts.count() == alerts.select("alert_id").distinct().count() > 0
