"""The README's demo command, shortened: fleet, stream and periodic trainer together, an exact
reconciliation, and nothing left running afterwards."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import deltalake
import pytest

from iotmon import broker
from iotmon.config import Settings
from iotmon.schema import ALERTS, ANOMALIES
from tests.support import cli_env, with_own_broker

pytestmark = pytest.mark.integration


def test_demo_runs_fleet_stream_and_trainer_reconciles_and_stops_everything(
    base_settings: Settings, tmp_path: Path
) -> None:
    # A short feature history lets the trainer start after 20 s of data instead of 4 minutes.
    settings = dataclasses.replace(with_own_broker(base_settings, tmp_path), feature_history="5 seconds")
    demo = subprocess.run(
        [
            *(sys.executable, "-m", "iotmon.cli", "demo", "--duration", "45"),
            *("--devices", "50", "--rate", "200", "--retrain-every", "10 seconds"),
        ],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = demo.stdout[-4000:] + demo.stderr[-4000:]
    assert demo.returncode == 0, output
    assert "RESULT: exact" in demo.stdout
    assert "delivered  " in demo.stdout  # the simulator's summary reached the user
    assert not broker.status(settings).running
    assert list((tmp_path / "truth").glob("demo-*.parquet"))
    assert not list((tmp_path / "truth").glob("*.live"))  # the simulator's live truth is cleaned up

    # The periodic trainer ran beside the stream and was stopped with it.
    trainer = re.search(r"trainer: retrains every 10 seconds .*\(pid (\d+)\)", demo.stdout)
    assert trainer, output
    with pytest.raises(ProcessLookupError):
        os.kill(int(trainer.group(1)), 0)
    assert deltalake.DeltaTable(settings.table_path(ANOMALIES)).version() >= 0
    assert deltalake.DeltaTable(settings.table_path(ALERTS)).version() >= 0
