"""The local MLflow store is created whole or not at all, whoever else is starting or being killed."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from iotmon.config import Settings
from ml import registry
from tests.support import cli_env, wait_for

OPEN_REGISTRY = "from iotmon.config import Settings; from ml import registry; registry.tracking(Settings.from_env())"


def _settings(home: Path) -> Settings:
    return Settings.from_env({}, home=home)


def test_a_process_killed_while_creating_the_store_leaves_none_behind(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    creating = subprocess.Popen([sys.executable, "-c", OPEN_REGISTRY], env=cli_env(settings))
    try:
        # The store's folder gets its first file once the schema is being built: kill right then.
        wait_for(lambda: settings.mlflow_home.is_dir() and any(settings.mlflow_home.iterdir()), 120, "store creation")
        creating.send_signal(signal.SIGKILL)
    finally:
        creating.wait(30)
    # Whatever the kill left, the next process opens a complete store and can register models in it.
    client = registry.tracking(settings)
    assert client.search_registered_models() == []
    assert registry.champion(settings) is None
    assert [path.name for path in settings.mlflow_home.iterdir()] == ["mlflow.db"]


def test_processes_starting_together_share_one_store(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    openers = [subprocess.Popen([sys.executable, "-c", OPEN_REGISTRY], env=cli_env(settings)) for _ in range(3)]
    assert [opener.wait(180) for opener in openers] == [0, 0, 0]
    assert registry.tracking(settings).search_experiments()
    assert [path.name for path in settings.mlflow_home.iterdir()] == ["mlflow.db"]
