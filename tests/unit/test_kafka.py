"""Kafka client helpers (``iotmon.kafka``) that need no broker."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from iotmon.config import Settings
from iotmon.kafka import event_time_of, plausible


def test_an_event_time_is_read_from_a_payload_or_not_at_all() -> None:
    read = event_time_of(b'{"event_time": "2026-11-25T14:00:30.250Z"}')
    assert read == datetime(2026, 11, 25, 14, 0, 30, 250000, UTC)
    assert event_time_of(b'{"event_time": "2026-11-25T14:00:30"}') == datetime(2026, 11, 25, 14, 0, 30, tzinfo=UTC)
    for payload in (b"{}", b"not json", b'{"event_time": 17}', b'{"event_time": "soon"}', b"[]", None):
        assert event_time_of(payload) is None


def test_an_event_time_the_archive_would_quarantine_is_not_plausible() -> None:
    settings = Settings.from_env({})
    earliest = datetime.fromisoformat(settings.min_event_time)
    sent = datetime(2026, 11, 25, 14, 0, 0, tzinfo=UTC)
    sent_ms = round(sent.timestamp() * 1000)
    skew = timedelta(seconds=settings.max_clock_skew_seconds)
    assert plausible(sent - timedelta(days=3), sent_ms, earliest, settings)  # late, as readings may be
    assert plausible(sent + skew, sent_ms, earliest, settings)
    assert not plausible(sent + skew + timedelta(seconds=1), sent_ms, earliest, settings)  # ahead of the clock
    assert not plausible(datetime(2999, 1, 1, tzinfo=UTC), sent_ms, earliest, settings)
    assert not plausible(earliest - timedelta(seconds=1), sent_ms, earliest, settings)  # before any sensor ran
    assert plausible(datetime(2999, 1, 1, tzinfo=UTC), -1, earliest, settings)  # no timestamp: one bound only
