"""Kafka client helpers (``iotmon.kafka``) that need no broker."""

from __future__ import annotations

from datetime import UTC, datetime

from iotmon.kafka import event_time_of


def test_an_event_time_is_read_from_a_payload_or_not_at_all() -> None:
    read = event_time_of(b'{"event_time": "2026-11-25T14:00:30.250Z"}')
    assert read == datetime(2026, 11, 25, 14, 0, 30, 250000, UTC)
    assert event_time_of(b'{"event_time": "2026-11-25T14:00:30"}') == datetime(2026, 11, 25, 14, 0, 30, tzinfo=UTC)
    for payload in (b"{}", b"not json", b'{"event_time": 17}', b'{"event_time": "soon"}', b"[]", None):
        assert event_time_of(payload) is None
