"""The record stream of the simulator: determinism, fault injection, payload validity, ordering."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from iotmon.config import Settings, interval_seconds
from iotmon.schema import LATE_KINDS, MALFORMED_KINDS, METRIC_NAMES, METRICS, REQUIRED_FIELDS
from simulators.faults import LATE, NOT_MALFORMED, ON_TIME, VERY_LATE
from simulators.generator import FleetStream, SendBatch
from simulators.options import SimulationOptions, expected_span_s, plan_stream
from simulators.signals import NO_ANOMALY
from simulators.timefmt import format_timestamp, to_ms

START = datetime(2026, 11, 22, 1, 0, tzinfo=UTC)
SETTINGS = Settings()
WATERMARK_S = interval_seconds(SETTINGS.watermark)


@dataclass
class Run:
    stream: FleetStream
    sends: SendBatch
    flushed_from: int
    """Index of the first record of the end-of-stream flush."""

    @property
    def first(self) -> np.ndarray:
        return ~self.sends.duplicate


def run(**overrides: object) -> Run:
    options = SimulationOptions(**{"start": START, "progress": False, **overrides})  # type: ignore[arg-type]
    stream = FleetStream(plan_stream(SETTINGS, options, now_ms=to_ms(START)))
    batches = list(stream)
    flushed_from = sum(len(b) for b in batches if not b.final)
    return Run(stream, SendBatch.concat(batches), flushed_from)


@pytest.fixture(scope="module")
def default_run() -> Run:
    """About 50k sends with the default fault fractions."""
    return run(devices=50, events=50_000, interval=4.0)


@pytest.fixture(scope="module")
def busy_run() -> Run:
    """Raised fractions, so that every malformed kind and anomaly type shows up many times."""
    return run(
        devices=200,
        events=120_000,
        interval=5.0,
        malformed_fraction=0.05,
        anomaly_fraction=0.05,
        dropout_fraction=0.05,
    )


def test_same_seed_same_bytes_and_truth() -> None:
    a, b = run(devices=30, events=8_000), run(devices=30, events=8_000)
    assert a.sends.payloads == b.sends.payloads
    for name in (
        "device",
        "seq",
        "event_ms",
        "send_ms",
        "late_kind",
        "duplicate",
        "malformed",
        "anomaly_type",
    ):
        assert np.array_equal(getattr(a.sends, name), getattr(b.sends, name)), name
    other = run(devices=30, events=8_000, seed=43)
    assert other.sends.payloads != a.sends.payloads
    assert len(set(other.sends.payloads) & set(a.sends.payloads)) < 10


def test_fault_knobs_do_not_change_the_signals() -> None:
    """Each concern has its own random stream: more duplicates must not reshuffle the readings."""
    a = run(devices=20, events=3_000, duplicate_fraction=0.0, late_fraction=0.0, very_late_fraction=0.0)
    b = run(devices=20, events=3_000, duplicate_fraction=0.2, late_fraction=0.0, very_late_fraction=0.0)
    first_b = [p for p, dup in zip(b.sends.payloads, b.sends.duplicate.tolist(), strict=True) if not dup]
    n = min(len(a.sends), len(first_b))
    assert a.sends.payloads[: n // 2] == first_b[: n // 2]


def test_event_limit_is_exact(default_run: Run) -> None:
    assert len(default_run.sends) == 50_000
    assert len(run(devices=7, events=1_001).sends) == 1_001


def test_duration_bounds_event_times() -> None:
    r = run(devices=50, duration=90.0, interval=1.0)
    start = to_ms(START)
    assert r.sends.event_ms.min() >= start
    assert r.sends.event_ms.max() < start + 90_000
    readings = int(r.first.sum())
    assert 0.9 * 50 * 90 < readings <= 50 * 90


def test_send_times_never_go_backwards(default_run: Run) -> None:
    assert (np.diff(default_run.sends.send_ms) >= 0).all()


def test_injection_rates_follow_the_flags(default_run: Run) -> None:
    s, first = default_run.sends, default_run.first
    readings = first.sum()
    late = np.bincount(s.late_kind[first], minlength=len(LATE_KINDS)) / readings
    assert late[LATE] == pytest.approx(0.02, rel=0.2)
    assert late[VERY_LATE] == pytest.approx(0.005, rel=0.3)
    assert s.duplicate.sum() / readings == pytest.approx(0.01, rel=0.2)
    assert (s.malformed[first] != NOT_MALFORMED).mean() == pytest.approx(0.005, rel=0.3)


def test_anomaly_and_dropout_fractions(busy_run: Run) -> None:
    s, first = busy_run.sends, busy_run.first
    assert (s.anomaly_type[first] != NO_ANOMALY).mean() == pytest.approx(0.05, rel=0.3)
    plan = busy_run.stream.plan
    ticks = (s.event_ms[first].max() - plan.start_ms) // round(plan.interval_s * 1000) + 1
    possible = plan.devices * ticks
    silent = 1 - first.sum() / possible
    assert silent == pytest.approx(0.05, rel=0.4)
    assert busy_run.stream.dropouts.episodes


def test_dropouts_silence_their_device(busy_run: Run) -> None:
    s, first = busy_run.sends, busy_run.first
    for episode in busy_run.stream.dropouts.episodes[:50]:
        assert 120_000 <= episode.end_ms - episode.start_ms <= 600_000
        mine = first & (s.device == episode.device)
        inside = (s.event_ms[mine] >= episode.start_ms) & (s.event_ms[mine] < episode.end_ms)
        assert not inside.any()


def test_seq_counts_readings_per_device(default_run: Run) -> None:
    s, first = default_run.sends, default_run.first
    for device in range(default_run.stream.plan.devices):
        mine = first & (s.device == device)
        order = np.argsort(s.event_ms[mine], kind="stable")
        seqs = s.seq[mine][order]
        assert np.array_equal(seqs, np.arange(len(seqs))), device


def test_late_records_arrive_after_later_event_times(default_run: Run) -> None:
    s, first = default_run.sends, default_run.first
    before_flush = np.arange(len(s)) < default_run.flushed_from
    newest_before = np.maximum.accumulate(s.event_ms)
    delay_s = (s.send_ms - s.event_ms) / 1000.0
    late = first & (s.late_kind == LATE) & before_flush
    very_late = first & (s.late_kind == VERY_LATE) & before_flush
    on_time = first & (s.late_kind == ON_TIME) & before_flush
    assert late.sum() > 500 and very_late.sum() > 100
    assert (delay_s[on_time] == 0).all()
    assert delay_s[late].min() >= 1.0 and delay_s[late].max() <= 0.75 * WATERMARK_S
    assert delay_s[very_late].min() >= 3 * WATERMARK_S and delay_s[very_late].max() <= 10 * WATERMARK_S
    # what the stream had already seen when a late record arrived: readings newer than it
    assert (newest_before[late] > s.event_ms[late]).all()
    assert ((newest_before[very_late] - s.event_ms[very_late]) / 1000.0 > 2.5 * WATERMARK_S).all()


def test_flushed_records_are_as_late_as_the_pipeline_sees_them() -> None:
    """At the end no newer readings come: lateness is the gap to the newest event time sent before."""
    r = run(devices=200, events=100_000, interval=1.0)
    s = r.sends
    flushed = np.arange(len(s)) >= r.flushed_from
    assert flushed.sum() > 500 and not s.duplicate[flushed].all()
    newest_before = np.maximum.accumulate(np.concatenate([[0], s.event_ms]))[:-1]
    gap_s = (newest_before - s.event_ms) / 1000.0
    late = flushed & (s.late_kind == LATE)
    very_late = flushed & (s.late_kind == VERY_LATE)
    assert late.any() and very_late.any()
    assert (gap_s[late] < WATERMARK_S).all() and (gap_s[very_late] >= WATERMARK_S).all()


def test_duplicates_resend_identical_bytes(default_run: Run) -> None:
    s = default_run.sends
    first_send = {}
    for i in np.flatnonzero(~s.duplicate).tolist():
        first_send[(int(s.device[i]), int(s.seq[i]))] = i
    duplicates = np.flatnonzero(s.duplicate).tolist()
    assert duplicates
    for i in duplicates:
        original = first_send[(int(s.device[i]), int(s.seq[i]))]
        assert original < i
        assert s.payloads[original] == s.payloads[i]
        assert 0 <= s.send_ms[i] - s.send_ms[original] <= 5_000
    assert len(first_send) == (~s.duplicate).sum(), "each (device, seq) is sent once before duplicates"


def _payload_time_ms(text: str) -> int:
    assert text.endswith("Z") and len(text) == 24, text
    return to_ms(datetime.fromisoformat(text))


def test_well_formed_payloads_follow_the_contract(default_run: Run) -> None:
    s = default_run.sends
    ids = default_run.stream.fleet.device_ids
    low = {m.name: m.low for m in METRICS}
    high = {m.name: m.high for m in METRICS}
    checked = 0
    for i in np.flatnonzero(s.malformed == NOT_MALFORMED).tolist():
        record = json.loads(s.payloads[i])
        assert list(record) == list(REQUIRED_FIELDS)
        assert record["device_id"] == ids[s.device[i]]
        assert record["seq"] == s.seq[i] and isinstance(record["seq"], int)
        assert _payload_time_ms(record["event_time"]) == s.event_ms[i]
        for name in METRIC_NAMES:
            value = record[name]
            assert isinstance(value, float) and math.isfinite(value)
            if s.anomaly_type[i] == NO_ANOMALY:
                assert low[name] <= value <= high[name], (name, value)
        checked += 1
    assert checked > 45_000


def _bare_token(payload: bytes) -> bool:
    text = payload.decode()
    return any(f":{token}" in text for token in ("NaN", "Infinity", "-Infinity"))


def test_every_malformed_kind_is_broken_its_way(busy_run: Run) -> None:
    s = busy_run.sends
    max_bytes = SETTINGS.max_payload_bytes
    seen = dict.fromkeys(MALFORMED_KINDS, 0)
    for i in np.flatnonzero(s.malformed != NOT_MALFORMED).tolist():
        kind = MALFORMED_KINDS[s.malformed[i]]
        payload = s.payloads[i]
        seen[kind] += 1
        if kind == "invalid_json":
            try:
                parsed = json.loads(payload)
            except ValueError:
                continue
            assert not isinstance(parsed, dict), payload
            continue
        record = json.loads(payload)
        assert isinstance(record, dict)
        if kind == "missing_field":
            assert len(set(REQUIRED_FIELDS) - set(record)) == 1
        elif kind == "mistyped_field":
            assert set(record) == set(REQUIRED_FIELDS)
            wrong = [
                not isinstance(record["seq"], int),
                not isinstance(record["event_time"], str),
                *[not isinstance(record[name], float) for name in METRIC_NAMES],
            ]
            assert sum(wrong) == 1, payload
        elif kind == "non_finite":
            assert _bare_token(payload), payload
            assert any(not math.isfinite(record[name]) for name in METRIC_NAMES)
        elif kind == "absurd_timestamp":
            moment = datetime.fromisoformat(record["event_time"])
            sent = datetime.fromtimestamp(s.send_ms[i] / 1000, tz=UTC)
            skew = max(timedelta(days=30), timedelta(seconds=SETTINGS.max_clock_skew_seconds))
            ahead = moment - sent  # a duplicate goes up to 5 s after the send the time was based on
            assert moment.year in (1970, 2999) or ahead >= skew - timedelta(seconds=5), record["event_time"]
        elif kind == "oversized":
            assert max_bytes < len(payload) <= 2 * max_bytes < 1_000_000
    assert all(n >= 20 for n in seen.values()), seen


def test_invalid_json_variants_all_occur(busy_run: Run) -> None:
    s = busy_run.sends
    code = MALFORMED_KINDS.index("invalid_json")
    payloads = [s.payloads[i] for i in np.flatnonzero(s.malformed == code).tolist()]
    not_utf8 = [p for p in payloads if not _decodes(p)]
    arrays = [p for p in payloads if p.startswith(b"[")]
    truncated = [p for p in payloads if _decodes(p) and p.startswith(b"{")]
    assert not_utf8 and arrays and truncated


def _decodes(payload: bytes) -> bool:
    try:
        payload.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_drain_sends_what_taken_readings_still_owe() -> None:
    """A run stopped mid-batch: drained records belong to readings taken by the cutoff, in due order."""
    options = SimulationOptions(devices=40, events=20_000, start=START, progress=False)
    stream = FleetStream(plan_stream(SETTINGS, options, now_ms=to_ms(START)))
    batches = iter(stream)
    sent = [next(batches) for _ in range(3)]
    half = len(sent[-1]) // 2
    unsent = sent[-1].select(np.arange(half, len(sent[-1])))
    sent[-1] = sent[-1].select(np.arange(half))
    cutoff = int(sent[-1].send_ms[-1])
    drained, dropped = stream.drain(cutoff, unsent=unsent)
    assert drained.final and len(drained) > 0 and dropped > 0
    assert (drained.event_ms <= cutoff).all()
    assert (np.diff(drained.send_ms) >= 0).all() and drained.send_ms[0] >= cutoff
    everything = SendBatch.concat([*sent, drained])
    firsts = set(
        zip(
            everything.device[~everything.duplicate].tolist(),
            everything.seq[~everything.duplicate].tolist(),
            strict=True,
        )
    )
    duplicates = zip(
        everything.device[everything.duplicate].tolist(),
        everything.seq[everything.duplicate].tolist(),
        strict=True,
    )
    assert all(pair in firsts for pair in duplicates)
    assert list(batches) == []


def test_default_start_ends_the_backlog_now() -> None:
    now = to_ms(datetime(2026, 11, 22, 12, 0, 0, 789_000, tzinfo=UTC))
    options = SimulationOptions(devices=100, events=360_000, progress=False)
    plan = plan_stream(SETTINGS, options, now_ms=now)
    assert plan.start_ms % 1000 == 0
    span_s = expected_span_s(options) + 10 * WATERMARK_S
    assert plan.start_ms <= now - span_s * 1000 < plan.start_ms + 1000
    assert 3000 < expected_span_s(options) < 4000
    last_send = max(int(b.send_ms.max()) for b in FleetStream(plan))
    assert now - 15 * 60_000 < last_send <= now, "a default backlog ends by now, with no future send times"


def test_timestamp_format() -> None:
    assert format_timestamp(to_ms(datetime(2026, 11, 22, 1, 2, 3, 456_000, tzinfo=UTC))) == "2026-11-22T01:02:03.456Z"


def test_oversized_payloads_need_room_under_the_kafka_limit() -> None:
    options = SimulationOptions(devices=5, events=10, start=START)
    with pytest.raises(ValueError, match="IOTMON_MAX_PAYLOAD_BYTES"):
        plan_stream(Settings(max_payload_bytes=999_000), options, now_ms=0)
    plan = plan_stream(Settings(max_payload_bytes=999_000), replace(options, malformed_fraction=0.0), 0)
    assert plan.max_payload_bytes == 999_000


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (SimulationOptions(), "backlog mode needs events or duration"),
        (SimulationOptions(events=10, late_fraction=1.5), "late fraction"),
        (SimulationOptions(events=10, devices=0), "devices"),
        (SimulationOptions(rate=100.0, start=START), "start applies to backlog mode"),
        (SimulationOptions(rate=-1.0), "rate must be"),
    ],
)
def test_invalid_options_are_refused(options: SimulationOptions, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        options.validate()
