"""Device status rules in plain Python, then the whole operator on small static frames (no timers fire there)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import DataFrame, SparkSession

from iotmon.config import Settings
from iotmon.schema import DEGRADED, DEVICE_ID, OFFLINE, ONLINE, SEQ
from streaming.device_status import (
    DEVICE_STATUS_CHANGES_SCHEMA,
    DEVICE_STATUS_SCHEMA,
    DeviceState,
    Reading,
    StatusRules,
    Update,
    advance,
    apply_readings,
    assess,
    change_rows,
    changes_of,
    go_offline,
    latest_status,
    latest_status_rows,
    next_watermark,
    reading_columns,
    significant_readings,
    silence_reason,
    silenced,
    status_updates,
)
from tests.readings import at, silver_frame, silver_row

RULES = StatusRules(offline_after_ms=60_000, low_battery=15.0, lateness_ms=5_000)


def reading(seconds: float, seq: int, battery: float | None = 90.0, out_of_range: str | None = None) -> Reading:
    return Reading(round(seconds * 1000), seq, battery, out_of_range, "pump", "site-1")


def state(status: str, since: float, last_seen: float, seq: int, reason: str, version: int) -> DeviceState:
    return DeviceState(status, round(since * 1000), round(last_seen * 1000), seq, reason, "pump", "site-1", version)


ONLINE_AT_0 = state(ONLINE, 0, 0, 1, "reporting", 1)


# -- assess: one reading's verdict ------------------------------------------------------------------------


def test_a_healthy_reading_is_online() -> None:
    assert assess(reading(0, 1), RULES) == (ONLINE, "reporting")


def test_low_battery_is_degraded_and_says_by_how_much() -> None:
    assert assess(reading(0, 1, battery=12.0), RULES) == (DEGRADED, "battery 12.0% < 15%")


def test_the_battery_threshold_itself_is_still_healthy() -> None:
    assert assess(reading(0, 1, battery=15.0), RULES) == (ONLINE, "reporting")
    assert assess(reading(0, 1, battery=None), RULES) == (ONLINE, "reporting")


def test_out_of_range_names_the_metrics() -> None:
    assert assess(reading(0, 1, out_of_range="temperature,humidity"), RULES) == (
        DEGRADED,
        "out of range: temperature, humidity",
    )


def test_both_problems_are_named() -> None:
    assert assess(reading(0, 1, battery=-3.0, out_of_range="battery"), RULES) == (
        DEGRADED,
        "out of range: battery; battery -3.0% < 15%",
    )


def test_silence_reason_in_seconds() -> None:
    assert silence_reason(60_000) == "silent for 60s"
    assert silence_reason(1_500) == "silent for 1.5s"


def test_rules_come_from_settings() -> None:
    settings = Settings.from_env({}, offline_after="2 minutes", low_battery=20.0, status_lateness="7 seconds")
    assert StatusRules.from_settings(settings) == StatusRules(
        offline_after_ms=120_000, low_battery=20.0, lateness_ms=7_000
    )


# -- advance: one batch of one device -------------------------------------------------------------------


def test_first_reading_is_a_change_from_nothing() -> None:
    assert advance(None, [reading(0, 1)], RULES) == [Update(ONLINE_AT_0, True, None)]


def test_every_transition_of_a_batch_is_emitted_in_arrival_order() -> None:
    arrived = [reading(0, 1), reading(10, 2, battery=12.0), reading(20, 3)]
    assert advance(None, arrived, RULES) == [
        Update(ONLINE_AT_0, True, None),
        Update(state(DEGRADED, 10, 10, 2, "battery 12.0% < 15%", 2), True, ONLINE),
        Update(state(ONLINE, 20, 20, 3, "reporting", 3), True, DEGRADED),
    ]


def test_a_reading_overtaken_on_its_way_changes_nothing_however_the_readings_are_batched() -> None:
    """Applied in arrival order, an overtaken reading is stale in one batch as in two: the changes a batch
    recomputation makes from silver are the stream's."""
    arrived = [reading(0, 1), reading(20, 3), reading(10, 2, battery=12.0)]
    together = advance(None, arrived, RULES)
    first = advance(None, arrived[:2], RULES)
    apart = first + advance(first[-1].state, arrived[2:], RULES)
    assert [u for u in together if u.changed] == [u for u in apart if u.changed] == [Update(ONLINE_AT_0, True, None)]
    assert together[-1].state.last_seen_ms == apart[-1].state.last_seen_ms == 20_000


def test_readings_without_a_change_end_in_one_snapshot() -> None:
    assert advance(ONLINE_AT_0, [reading(10, 2), reading(20, 3)], RULES) == [
        Update(state(ONLINE, 0, 20, 3, "reporting", 2), False, None)
    ]


def test_a_new_reason_for_the_same_status_keeps_since() -> None:
    battery = state(DEGRADED, 0, 0, 1, "battery 12.0% < 15%", 1)
    assert advance(battery, [reading(10, 2, out_of_range="vibration")], RULES) == [
        Update(state(DEGRADED, 0, 10, 2, "out of range: vibration", 2), False, None)
    ]


def test_a_reading_not_newer_than_the_last_changes_nothing() -> None:
    latest = state(ONLINE, 0, 50, 5, "reporting", 3)
    assert advance(latest, [reading(40, 4, battery=1.0), reading(50, 5, battery=1.0)], RULES) == []


def test_an_older_reading_among_newer_ones_is_skipped() -> None:
    latest = state(ONLINE, 0, 50, 5, "reporting", 3)
    updates = advance(latest, [reading(40, 4, battery=1.0), reading(55, 6)], RULES)
    assert updates == [Update(state(ONLINE, 0, 55, 6, "reporting", 4), False, None)]


def test_a_gap_of_offline_after_within_a_batch_is_an_offline_spell() -> None:
    assert advance(ONLINE_AT_0, [reading(70, 2, battery=5.0)], RULES) == [
        Update(state(OFFLINE, 60, 0, 1, "silent for 60s", 2), True, ONLINE),
        Update(state(DEGRADED, 70, 70, 2, "battery 5.0% < 15%", 3), True, OFFLINE),
    ]


def test_a_reading_exactly_at_the_deadline_comes_after_the_offline_change() -> None:
    updates = advance(ONLINE_AT_0, [reading(60, 2)], RULES)
    assert [(u.state.status, u.state.since_ms, u.state.version) for u in updates] == [
        (OFFLINE, 60_000, 2),
        (ONLINE, 60_000, 3),
    ]


def test_a_reading_just_inside_the_deadline_keeps_the_device_online() -> None:
    assert advance(ONLINE_AT_0, [reading(59.999, 2)], RULES) == [
        Update(state(ONLINE, 0, 59.999, 2, "reporting", 2), False, None)
    ]


def test_an_offline_device_comes_back_with_its_reading() -> None:
    offline = go_offline(ONLINE_AT_0, 60_000).state
    assert offline == state(OFFLINE, 60, 0, 1, "silent for 60s", 2)
    assert advance(offline, [reading(300, 2)], RULES) == [
        Update(state(ONLINE, 300, 300, 2, "reporting", 3), True, OFFLINE)
    ]


def test_registry_columns_are_kept_when_a_reading_lacks_them() -> None:
    [update] = advance(ONLINE_AT_0, [Reading(10_000, 2, 90.0, None, None, None)], RULES)
    assert (update.state.device_type, update.state.site) == ("pump", "site-1")


# -- which readings of a batch the rules need ---------------------------------------------------------------


def _frame(readings: list[Reading], devices: list[str] | None = None) -> pd.DataFrame:
    return pd.DataFrame(
        {
            DEVICE_ID: devices if devices is not None else ["dev-a"] * len(readings),
            "event_ms": [r.event_ms for r in readings],
            SEQ: pd.array([r.seq for r in readings], dtype="Int64"),
            "battery": [r.battery for r in readings],
            "out_of_range": [r.out_of_range for r in readings],
            "device_type": [r.device_type for r in readings],
            "site": [r.site for r in readings],
            "partition": [0] * len(readings),
            "offset": list(range(len(readings))),  # the list's order is the order they arrived in
        }
    )


_READING = st.builds(
    Reading,
    event_ms=st.integers(0, 400_000),
    seq=st.one_of(st.none(), st.integers(1, 30)),
    battery=st.one_of(st.none(), st.sampled_from([5.0, 14.9, 15.0, 90.0])),
    out_of_range=st.sampled_from([None, "", "temperature", "vibration,battery"]),
    device_type=st.sampled_from([None, "pump", "motor"]),
    site=st.sampled_from([None, "site-1", "site-2"]),
)
_READINGS = st.lists(_READING, max_size=25)
_STATES = st.one_of(
    st.none(),
    st.builds(
        DeviceState,
        status=st.sampled_from([ONLINE, DEGRADED, OFFLINE]),
        since_ms=st.integers(0, 100_000),
        last_seen_ms=st.integers(0, 200_000),
        seq=st.one_of(st.none(), st.integers(1, 30)),
        reason=st.just("reporting"),
        device_type=st.sampled_from([None, "pump"]),
        site=st.sampled_from([None, "site-1"]),
        version=st.integers(1, 5),
    ),
)


@settings(max_examples=300, deadline=None)
@given(state=_STATES, readings=_READINGS)
def test_the_significant_readings_give_the_same_updates_as_all_of_them(
    state: DeviceState | None, readings: list[Reading]
) -> None:
    """The operator hands the rules only some readings of a batch; what they emit must not change."""
    chosen = significant_readings(state, reading_columns(_frame(readings)), RULES)
    assert advance(state, chosen, RULES) == advance(state, readings, RULES)
    assert len(chosen) <= len(readings)


def test_steady_readings_are_not_handed_over_one_by_one() -> None:
    steady = [reading(i, i + 1) for i in range(1, 50)]
    assert [r.seq for r in significant_readings(ONLINE_AT_0, reading_columns(_frame(steady)), RULES)] == [2, 50]


@settings(max_examples=200, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.sampled_from(["dev-a", "dev-b", "dev-c"]), _READING), max_size=40),
    known=st.fixed_dictionaries({"dev-a": _STATES, "dev-c": _STATES}),
)
def test_a_shard_applies_each_device_s_readings_as_if_it_were_alone(
    arrivals: list[tuple[str, Reading]], known: dict[str, DeviceState | None]
) -> None:
    """The operator's key is a shard of devices: their readings arrive interleaved, each device's apply to it."""
    states = {device: state for device, state in known.items() if state is not None}
    alone = {
        device: advance(states.get(device), [r for d, r in arrivals if d == device], RULES)
        for device in sorted({d for d, _ in arrivals})
    }
    frame = _frame([r for _, r in arrivals], [d for d, _ in arrivals])
    changed = apply_readings(states, frame, RULES)
    assert changed == [(device, updates) for device, updates in alone.items() if updates]
    for device, updates in changed:
        assert states[device] == updates[-1].state


def test_the_devices_a_watermark_has_passed_go_offline_at_their_deadlines() -> None:
    states = {
        "dev-a": state(ONLINE, 0, 20, 3, "reporting", 3),  # deadline 80 s
        "dev-b": state(DEGRADED, 5, 30, 4, "battery 9.0% < 15%", 4),  # deadline 90 s
        "dev-c": state(OFFLINE, 70, 10, 2, "silent for 60s", 3),  # offline already: no deadline
    }
    gone = silenced(states, watermark_ms=80_000, rules=RULES)
    assert gone == [("dev-a", [go_offline(state(ONLINE, 0, 20, 3, "reporting", 3), 80_000)])]
    assert states["dev-a"] == gone[0][1][0].state and states["dev-a"].since_ms == 80_000
    assert silenced(states, watermark_ms=89_999, rules=RULES) == []  # dev-b's deadline is not reached yet
    assert [device for device, _ in silenced(states, watermark_ms=90_000, rules=RULES)] == ["dev-b"]


def test_a_batch_s_readings_say_where_the_next_watermark_is_at_least() -> None:
    """Spark's next watermark is the newest event time of every batch so far, less the lateness."""
    frame = _frame([reading(95, 7), reading(50, 5), reading(92, 6)])
    assert next_watermark(frame, RULES) == 95_000 - RULES.lateness_ms


# -- the operator on a static frame ---------------------------------------------------------------------


def _rows(frame: DataFrame) -> list[tuple[Any, ...]]:
    return sorted((tuple(row) for row in frame.collect()), key=repr)


def _sorted(rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    return sorted(rows, key=repr)


def test_status_updates_on_a_static_frame(spark: SparkSession, base_settings: Settings) -> None:
    settings = dataclasses.replace(base_settings, offline_after="1 minute", low_battery=15.0)
    readings = silver_frame(
        spark,
        [
            silver_row("dev-a", 3, 20),
            silver_row("dev-a", 1, 0),
            silver_row("dev-a", 2, 10, battery=12.0),
            silver_row("dev-a", 4, 100, out_of_range="temperature"),
            silver_row("dev-b", 1, 5, device_type="motor", site="site-2"),
            silver_row("dev-b", 2, 30),
        ],
    )
    updates = status_updates(readings, settings).cache()
    changes, current = changes_of(updates), latest_status(updates)

    assert changes.schema.fieldNames() == DEVICE_STATUS_CHANGES_SCHEMA.fieldNames()
    assert _rows(changes) == _sorted(
        [
            ("dev-a", ONLINE, None, at(0), "reporting", at(0), 1),
            ("dev-a", DEGRADED, ONLINE, at(10), "battery 12.0% < 15%", at(10), 2),
            ("dev-a", ONLINE, DEGRADED, at(20), "reporting", at(20), 3),
            ("dev-a", OFFLINE, ONLINE, at(80), "silent for 60s", at(20), 3),
            ("dev-a", DEGRADED, OFFLINE, at(100), "out of range: temperature", at(100), 4),
            ("dev-b", ONLINE, None, at(5), "reporting", at(5), 1),
        ]
    )
    assert current.schema.fieldNames() == DEVICE_STATUS_SCHEMA.fieldNames()
    # dev-b's second reading changed no status, only last_seen and the registry columns.
    assert _rows(current) == _sorted(
        [
            ("dev-a", DEGRADED, at(100), at(100), "out of range: temperature", "pump", "site-1"),
            ("dev-b", ONLINE, at(5), at(30), "reporting", "pump", "site-1"),
        ]
    )
    # The writer picks both from the batch's Arrow rows on the driver: the same rows, columns and types.
    on_driver = updates.toArrow()
    for in_spark, in_arrow in ((changes, change_rows(on_driver)), (current, latest_status_rows(on_driver))):
        expected = in_spark.toArrow()
        assert [(f.name, f.type) for f in in_arrow.schema] == [(f.name, f.type) for f in expected.schema]
        assert sorted(in_arrow.to_pylist(), key=repr) == sorted(expected.to_pylist(), key=repr)
    updates.unpersist()
