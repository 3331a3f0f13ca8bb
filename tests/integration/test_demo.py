"""The README's demo command, shortened: the whole loop end to end (fleet, stream, trainer, scorer), an
exact reconciliation, and nothing left running afterwards."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import deltalake
import pytest

from iotmon import broker
from iotmon.config import Settings
from iotmon.schema import ALERTS, ANOMALIES, SILVER
from ml import registry
from tests.support import cli_env, with_own_broker

pytestmark = pytest.mark.integration


def test_demo_runs_the_whole_loop_reconciles_and_stops_everything(base_settings: Settings, tmp_path: Path) -> None:
    # A short feature history lets the trainer start after 20 s of data instead of 4 minutes.
    settings = dataclasses.replace(with_own_broker(base_settings, tmp_path), feature_history="5 seconds")
    demo = subprocess.run(
        [
            *(sys.executable, "-m", "iotmon.cli", "demo", "--duration", "90"),
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

    # The loop closed: a model was trained and promoted, and the stream scored with it.
    champion = registry.champion(settings)
    assert champion is not None, output
    scored = deltalake.DeltaTable(settings.table_path(ANOMALIES)).to_pyarrow_table(columns=["model_version"])
    silver = deltalake.DeltaTable(settings.table_path(SILVER)).to_pyarrow_table(columns=["seq"])
    assert 0 < scored.num_rows == silver.num_rows, output
    assert set(scored.column("model_version").to_pylist()) <= set(range(1, champion.version + 1))
    assert deltalake.DeltaTable(settings.table_path(ALERTS)).version() >= 0
