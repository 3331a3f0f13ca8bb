"""The README's demo command, shortened: it runs end to end, reconciles exactly and cleans up after itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from iotmon import broker
from iotmon.config import Settings
from tests.support import cli_env, with_own_broker

pytestmark = pytest.mark.integration


def test_demo_runs_reconciles_and_stops_its_broker(base_settings: Settings, tmp_path: Path) -> None:
    settings = with_own_broker(base_settings, tmp_path)
    demo = subprocess.run(
        [sys.executable, "-m", "iotmon.cli", "demo", "--duration", "12", "--devices", "50", "--rate", "200"],
        env=cli_env(settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "RESULT: exact" in demo.stdout
    assert "delivered  " in demo.stdout  # the simulator's summary reached the user
    assert not broker.status(settings).running
    assert list((tmp_path / "truth").glob("demo-*.parquet"))
