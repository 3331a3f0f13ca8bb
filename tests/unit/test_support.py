"""The tests' own helpers: ports for the servers tests start."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.support import PORT_BLOCK, free_port


def test_free_ports_are_distinct_free_and_never_ones_the_kernel_hands_out() -> None:
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(port < ephemeral_low for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: raises if someone listened there


def test_a_port_someone_holds_is_passed_over() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        held = squatter.getsockname()[1]
        # The next cycle through the block would reach the held port again: it is skipped.
        assert held not in {free_port() for _ in range(PORT_BLOCK)}
