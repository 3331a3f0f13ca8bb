"""Session-scoped real infrastructure: one Kafka broker and one Spark session for the whole run (for each
worker, under `make test`'s two pytest-xdist workers).

Each test gets its own topic, lake and checkpoints (``isolated``), so tests share the expensive parts
without sharing data. Jars are cached in the project's ``var/cache`` and resolved once per machine.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from iotmon.config import Settings
from tests.support import PROJECT_ROOT, free_port, isolated_settings

WHOLE_MACHINE = ("tests/integration/test_chaos.py", "tests/integration/test_demo.py")
"""The modules whose tests take both cores for minutes in real time: the chaos run and the demo."""

if os.environ.get("PYTEST_XDIST_WORKER") and not hasattr(sys.modules["__main__"], "__file__"):
    # A pytest-xdist worker's `__main__` has neither a file nor a spec, which PySpark takes for its own doctest
    # runner: importing `pyspark.ml.connect` (MLflow does, to tell a Spark Connect model) then exits the worker
    # (`pyspark.sql.connect.utils.check_dependencies`) instead of raising the ImportError MLflow expects.
    sys.modules["__main__"].__file__ = "<pytest-xdist worker>"


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The whole-machine tests last: under `make test` they then run with the other worker done or nearly."""
    items.sort(key=lambda item: _module(item.nodeid) in WHOLE_MACHINE)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """How `make test` shares its two workers: a module's tests stay on one worker, so its fixtures are built
    once, and the whole-machine tests run last, one after the other on one worker. Beside other tests they took
    twice as long and did more work (their fleets publish in real time, so a slower run reads and checks more),
    and two of them at once likewise; on a machine of their own they run as fast as they can.
    (xdist's own ``loadgroup`` would say this with marks, but its group names do not reach the scheduler with
    pytest 9's node ids: pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module(nodeid)
            return "whole machine" if module in WHOLE_MACHINE else module

    return ModuleScheduling(config, log)


def _docker_engine_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def base_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("iotmon-home")
    return Settings.from_env(
        {},
        home=home,
        cache_dir=Path(os.environ.get("IOTMON_CACHE_DIR", PROJECT_ROOT / "var" / "cache")),
        kafka_bootstrap=f"127.0.0.1:{free_port()}",
        kafka_controller_port=free_port(),
        kafka_heap="384m",
        spark_driver_memory="2g",
        spark_ui=False,
        trigger_interval="1 seconds",
    )


@pytest.fixture(scope="session")
def kafka(base_settings: Settings) -> Iterator[Settings]:
    """A real broker: testcontainers' Kafka where a Docker engine runs, else the embedded KRaft broker."""
    if os.environ.get("IOTMON_TEST_KAFKA") == "testcontainers" and _docker_engine_available():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer() as container:
            yield dataclasses.replace(base_settings, kafka_bootstrap=container.get_bootstrap_server())
        return
    from iotmon import broker

    broker.start(base_settings)
    try:
        yield base_settings
    finally:
        broker.stop(base_settings)


@pytest.fixture(scope="session")
def spark(base_settings: Settings):
    from iotmon.spark import spark_session

    session = spark_session(base_settings, "iotmon-tests")
    yield session
    session.stop()


@pytest.fixture
def isolated(kafka: Settings, tmp_path: Path) -> Settings:
    """Settings with a topic, lake and checkpoints of this test's own, on the shared broker."""
    return isolated_settings(kafka, tmp_path)


@pytest.fixture
def browser() -> Iterator[Any]:
    """Debian's headless Chromium, driven by selenium (see ``tests/browser.py``)."""
    from tests.browser import chromium

    yield from chromium()
