"""The local MLflow store is created whole or not at all, whoever else is starting or being killed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from iotmon.config import Settings
from ml import registry
from tests.support import PROJECT_ROOT, wait_for

QUIET_PRINTS = """
import sys
from iotmon.config import Settings
from ml import registry
from mlflow.utils.logging_utils import eprint
assert "mlflow.types.responses" not in sys.modules, "imported already: its import would not switch prints back on"
with registry.quiet(Settings.from_env()):
    import mlflow.types.responses  # ends one of MLflow's own quiet blocks, as a first log_model does
    eprint("Created version inside")
eprint("Created version after")
"""
OPEN_REGISTRY = "from iotmon.config import Settings; from ml import registry; registry.tracking(Settings.from_env())"
CONCURRENT_IMPORTS = """
import sys, threading
from ml.registry import MLFLOW_MODULES, import_mlflow
assert not [name for name in sys.modules if name.partition(".")[0] == "mlflow"], "MLflow imported already"
import_mlflow()
assert set(MLFLOW_MODULES) <= set(sys.modules)
# What the project's threads do first, each twice, all at once (the chaos run's trainer and stream threads).
statements = [
    "from mlflow.exceptions import MlflowException",
    "from mlflow import MlflowClient",
    "import mlflow.spark",
    "import mlflow; mlflow.set_tracking_uri",
] * 2
start = threading.Barrier(len(statements))
failures = []

def run(statement):
    start.wait()
    try:
        exec(statement, {})
    except BaseException as exc:
        failures.append(f"{statement}: {exc!r}")

threads = [threading.Thread(target=run, args=(statement,)) for statement in statements]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("\\n".join(failures))
sys.exit(1 if failures else 0)
"""


def _settings(home: Path) -> Settings:
    return Settings.from_env({}, home=home)


def test_a_process_killed_while_creating_the_store_leaves_none_behind(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    creating = subprocess.Popen([sys.executable, "-c", OPEN_REGISTRY], env=settings.child_env())
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
    openers = [subprocess.Popen([sys.executable, "-c", OPEN_REGISTRY], env=settings.child_env()) for _ in range(3)]
    assert [opener.wait(180) for opener in openers] == [0, 0, 0]
    assert registry.tracking(settings).search_experiments()
    assert [path.name for path in settings.mlflow_home.iterdir()] == ["mlflow.db"]


def test_threads_importing_mlflow_at_once_succeed_after_the_early_import() -> None:
    """In a process of its own, so that the threads' imports would be the first ones without ``import_mlflow``."""
    run = subprocess.run(
        [sys.executable, "-c", CONCURRENT_IMPORTS], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("log_level", ["", "INFO"])
def test_mlflow_prints_stay_quiet_in_the_block_unless_library_lines_are_asked_for(log_level: str) -> None:
    """In a process of its own, where MLflow's lazy import inside the block is a first one, as in ``iotmon train``."""
    env = {**os.environ, "IOTMON_LOG_LEVEL": log_level}
    run = subprocess.run(
        [sys.executable, "-c", QUIET_PRINTS], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    printed = [line for line in run.stderr.splitlines() if line.startswith("Created version")]
    assert printed == (["Created version inside", "Created version after"] if log_level else ["Created version after"])


def test_the_early_import_covers_every_mlflow_module_the_code_imports() -> None:
    imports = re.compile(r"^\s*(?:from\s+(mlflow[\w.]*)\s+import|import\s+(mlflow[\w.]*))", re.M)
    used = set()
    for package in PROJECT_ROOT.glob("*/__init__.py"):
        if package.parent.name != "tests":
            for source in package.parent.rglob("*.py"):
                used |= {module or imported for module, imported in imports.findall(source.read_text())}
    assert used == set(registry.MLFLOW_MODULES)
