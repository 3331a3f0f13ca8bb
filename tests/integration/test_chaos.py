"""``iotmon chaos``, short: a stream kill mid-batch in each stage from the archive to the alerts, a broker
restart and a trainer kill, then an exact reconciliation."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from bench.chaos import (
    BROKER_RESTART,
    DRIVER_ONLY,
    STREAM_KILL,
    TRAINER_KILL,
    WHOLE_GROUP,
    ChaosOptions,
    pipeline_queries,
    run_chaos,
)
from iotmon import broker
from iotmon.config import Settings
from iotmon.schema import ALERTS, ANOMALIES, BRONZE, DEVICE_STATUS, DEVICE_STATUS_CHANGES, INGEST, SILVER
from ml import registry
from tests.support import with_own_broker

pytestmark = pytest.mark.integration


@pytest.mark.timeout(1800)  # five stream runs, the first model trained under them, the drain and reconciliation
def test_chaos_run_injects_every_fault_and_reconciles_exactly(isolated: Settings, tmp_path: Path, spark) -> None:
    # A broker of the test's own, which chaos restarts; a 1-second trigger and a short feature history, so that
    # the trainer has its first model from silver's first batch (four histories: 20 s of readings). Batches are
    # not capped (the default): a run after a kill takes what Kafka holds in one batch, as `iotmon chaos`
    # does, where 2,000-record batches made the cold runs fall behind and the drain take 18 batches (200 s).
    own = with_own_broker(
        isolated,
        tmp_path / "home",
        trigger_interval="1 seconds",
        feature_history="5 seconds",
    )
    # One kill while a batch is in flight in each stage: bronze (and quarantine), silver (its deduplication
    # state), a stateful query (transformWithState with timers; the window aggregations share its
    # state store and checkpoint protocol), the alerts MERGE and the scorer. The alerts go before the scorer:
    # the scorer's first batch scores all of silver, and killed in it, the next run starts that batch over
    # before the alerts see a row (on a loaded machine that took more than 300 s); killed after the alerts,
    # it replays an ordinary batch. The seed decides which run has the broker restarted under it and which
    # kills take only the Python driver, orphaning its JVM. Then one more kill, drawn as `iotmon chaos` draws
    # them by default (query, moment and kind at random).
    kill_in = (INGEST, INGEST, DEVICE_STATUS, ALERTS, ANOMALIES)
    options = ChaosOptions(
        kills=len(kill_in) + 1,
        kill_in=kill_in,
        broker_restarts=1,
        trainer_kills=1,
        seed=4,
        devices=40,
        rate=80.0,
        max_delay_s=20.0,
    )
    out = io.StringIO()
    report = run_chaos(own, options, out)
    printed = out.getvalue()

    assert report.exact, printed
    assert "RESULT: exact" in printed
    # The faults really happened: a stream kill mid-batch in each stage, in order, both kinds of kill, one broker
    # restart under a running stream, and a trainer killed while its MLflow run was open.
    counts = report.counts()
    assert counts[STREAM_KILL] == len(kill_in) + 1 and counts[BROKER_RESTART] == 1, printed
    kills = [f.facts for f in report.faults if f.kind == STREAM_KILL]
    assert [k["query"] for k in kills[: len(kill_in)]] == list(kill_in), printed
    assert all(k["batch"] is not None for k in kills[: len(kill_in)]), printed  # each saw its batch in flight
    assert kills[-1]["query"] in (None, *pipeline_queries()), printed  # the random draw
    assert {k["scope"] for k in kills} == {WHOLE_GROUP, DRIVER_ONLY}, printed
    assert printed.count(f"/{len(kill_in) + 1}: SIGKILL stream (") == len(kill_in) + 1  # a line as each lands
    mid_write = [f for f in report.faults if f.kind == TRAINER_KILL and f.facts["mid_write"]]
    assert len(mid_write) == 1, printed
    facts = mid_write[0].facts
    assert facts["killed_runs"] and not facts["champion_problems"]
    # The champion after the kill is a complete version from a finished run, not the killed one.
    assert facts["champion_version"] is not None and facts["champion_run"] not in facts["killed_runs"]
    assert facts["champion_version"] not in facts["killed_versions"]
    champion, problems = registry.champion_problems(own)
    assert champion is not None and not problems

    # Every table was checked, against something non-empty.
    checked = report.checked
    assert checked[BRONZE] == checked["kafka records"] > 1_000
    assert checked["ground truth sends"] >= checked[BRONZE]  # a send may fail while the broker restarts
    assert 0 < checked[SILVER] <= checked[BRONZE] and checked[ANOMALIES] == checked[SILVER]
    # Device status and its changes were reconciled against their batch recomputation too.
    assert checked[DEVICE_STATUS] > 0 and checked[DEVICE_STATUS_CHANGES] > 0
    # The JSON report for the benchmark docs.
    (written,) = (own.home / "chaos").glob("chaos-*.json")
    assert json.loads(written.read_text())["exact"] is True

    # Nothing it started is left: no broker, no process of any child's group.
    assert not broker.status(own).running
    groups = [pid for pids in report.process_groups.values() for pid in pids]
    assert len(report.process_groups["stream"]) >= len(kill_in) and report.process_groups["trainer"]
    for pid in groups:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
