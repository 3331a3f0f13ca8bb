"""Helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses
import socket
import uuid
from pathlib import Path
from typing import Any

from iotmon.config import Settings

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def with_own_broker(settings: Settings, home: Path, **overrides: Any) -> Settings:
    """Settings for a broker of a test's own (fresh ports, state under ``home``), to stop or restart freely."""
    return dataclasses.replace(
        settings,
        home=home,
        cache_dir=settings.cache,
        kafka_bootstrap=f"127.0.0.1:{free_port()}",
        kafka_controller_port=free_port(),
        **overrides,
    )


def isolated_settings(kafka: Settings, home: Path) -> Settings:
    """A topic, lake and checkpoints of their own under ``home``, on the shared broker."""
    return dataclasses.replace(
        kafka,
        topic=f"test-{uuid.uuid4().hex[:10]}",
        lake=str(home / "lake"),
        checkpoints=str(home / "checkpoints"),
        home=home,
        cache_dir=kafka.cache,
    )


def wait_for(condition, timeout: float, what: str, poll: float = 0.02):
    """Poll ``condition`` until it returns something truthy; fail the test with ``what`` on timeout."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
