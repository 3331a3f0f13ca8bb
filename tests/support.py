"""Helpers shared by tests (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import socket

from iotmon.config import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_env(settings: Settings) -> dict[str, str]:
    """Environment for running ``iotmon`` in a child process with these settings."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("IOTMON_")}
    env.update(settings.to_env())
    return env
