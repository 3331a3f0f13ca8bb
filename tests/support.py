"""Helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import socket
import uuid
from pathlib import Path
from typing import Any

from iotmon.config import Settings

PROJECT_ROOT = Path(__file__).resolve().parents[1]


PORT_BLOCK = 1_000
FIRST_PORT = 20_000
"""Ports for the servers tests start come from below Linux's ephemeral range (32768-60999 by default), one
block of ``PORT_BLOCK`` per pytest-xdist worker."""


def _worker_ports() -> itertools.cycle[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw0", "gw1", ...; gw0 outside xdist too
    first = FIRST_PORT + int(worker.removeprefix("gw") or 0) * PORT_BLOCK
    ports = list(range(first, first + PORT_BLOCK))
    start = random.randrange(PORT_BLOCK)  # two runs at once on one machine rarely start on the same port
    return itertools.cycle(ports[start:] + ports[:start])


_ports = _worker_ports()


def free_port() -> int:
    """A loopback port no one listens on now, for a server a test is about to start.

    Not one the kernel picks (``bind(0)``): those come from the ephemeral range, which every client
    connection's local port comes from too, so between the pick and the server's start another process (the
    other worker's broker or Spark) could take it; that happened, and a session broker failed to start. A
    worker's own block, each port handed out once per cycle, and none of the range the kernel hands out.
    """
    for _ in range(PORT_BLOCK):
        port = next(_ports)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block ({PORT_BLOCK} ports from {FIRST_PORT})")


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
