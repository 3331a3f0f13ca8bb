"""The dashboard's data shaping on tiny frames: what an operator reads must be right, and empty tables must
give empty results rather than errors."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pandas as pd
import pytest

from dashboard import shaping
from dashboard.shaping import NOT_REPORTED, TOTAL, ModelVersion
from iotmon.schema import CLEARED, DEGRADED, LATE, OFFLINE, ON_TIME, ONLINE, OPEN, TOO_LATE

T0 = datetime(2026, 11, 22, 8, 0, tzinfo=UTC)


def at(seconds: float) -> pd.Timestamp:
    return pd.Timestamp(T0 + timedelta(seconds=seconds))


def registry(*rows: tuple[str, str, str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["device_id", "device_type", "site"])


def status(*rows: tuple[str, str, str, str]) -> pd.DataFrame:
    """(device_id, status, device_type, site) rows of ``device_status``."""
    frame = pd.DataFrame(rows, columns=["device_id", "status", "device_type", "site"])
    frame["since"] = frame["last_seen"] = at(0)
    frame["reason"] = "reading"
    return frame


def test_fleet_counts_every_registry_device_once_and_those_not_reporting_yet() -> None:
    devices = registry(("a", "pump", "s1"), ("b", "pump", "s1"), ("c", "motor", "s2"), ("d", "motor", "s2"))
    current = status(("a", ONLINE, "pump", "s1"), ("b", DEGRADED, "pump", "s1"), ("c", OFFLINE, "motor", "s2"))
    fleet = shaping.fleet(current, devices)
    assert shaping.fleet_counts(fleet) == {ONLINE: 1, DEGRADED: 1, OFFLINE: 1, NOT_REPORTED: 1, TOTAL: 4}

    by_site = shaping.fleet_breakdown(fleet, "site")
    assert by_site.to_dict("records") == [
        {"site": "s2", ONLINE: 0, DEGRADED: 0, OFFLINE: 1, NOT_REPORTED: 1, TOTAL: 2},  # offline first
        {"site": "s1", ONLINE: 1, DEGRADED: 1, OFFLINE: 0, NOT_REPORTED: 0, TOTAL: 2},
    ]
    assert set(shaping.fleet_breakdown(fleet, "device_type")["device_type"]) == {"pump", "motor"}


def test_a_reporting_device_missing_from_the_registry_still_counts_with_its_own_site() -> None:
    fleet = shaping.fleet(status(("x", ONLINE, "chiller", "s9")), registry())
    assert fleet[["device_id", "site", "device_type", "status"]].values.tolist() == [["x", "s9", "chiller", ONLINE]]


def test_empty_tables_give_zero_counts_and_empty_breakdowns() -> None:
    fleet = shaping.fleet(pd.DataFrame(), pd.DataFrame())
    assert shaping.fleet_counts(fleet) == dict.fromkeys((*shaping.FLEET_STATES, TOTAL), 0)
    assert shaping.fleet_breakdown(fleet, "site").empty
    assert shaping.device_choices(fleet, pd.DataFrame()) == ([], None)
    assert shaping.latest_anomalies(pd.DataFrame(), 10).empty
    assert shaping.alert_board(pd.DataFrame(), 10).empty
    assert shaping.open_alert_count(pd.DataFrame()) == 0
    assert shaping.latest_per_query(shaping.progress_series(pd.DataFrame())).empty
    assert shaping.quarantine_reasons(pd.DataFrame()).empty
    assert shaping.lateness_counts(pd.Series(dtype="int64")) == {ON_TIME: 0, LATE: 0, TOO_LATE: 0}
    series = shaping.device_series(pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), pd.DataFrame(), "temperature")
    assert series.empty and series.anomalies.empty
    assert shaping.model_history([], None).versions.empty


def test_the_first_device_shown_is_the_one_with_the_latest_anomaly_and_a_pick_is_kept() -> None:
    fleet = shaping.fleet(status(("a", ONLINE, "pump", "s1"), ("b", OFFLINE, "pump", "s1")), registry())
    anomalies = pd.DataFrame({"device_id": ["a", "c"], "event_time": [at(20), at(10)]})
    assert shaping.device_choices(fleet, anomalies) == (["a", "b", "c"], "a")
    assert shaping.device_choices(fleet, anomalies.iloc[:0]) == (["a", "b"], "b")  # offline beats online
    assert shaping.keep_choice(["a", "b"], "b", "a") == "b"
    assert shaping.keep_choice(["a", "b"], "gone", "a") == "a"


def test_device_series_places_anomalies_on_their_readings() -> None:
    readings = pd.DataFrame(
        {"seq": [2, 1, 3], "event_time": [at(10), at(0), at(20)], "temperature": [21.0, 20.0, 35.0]}
    )
    live = pd.DataFrame({"window_start": [at(0)], "window_end": [at(60)], "temperature_avg": [25.3]})
    anomalies = pd.DataFrame(
        {
            "seq": [3, 2, 99],
            "is_anomaly": [True, False, True],  # seq 99: not among the readings read, nowhere to plot it
            "score": [4.0, 0.2, 9.0],
            "threshold": [2.0, 2.0, 2.0],
            "top_metric": ["temperature", "humidity", "battery"],
            "model_version": [3, 3, 3],
        }
    )
    series = shaping.device_series(readings, live, live.iloc[:0], anomalies, "temperature")
    assert series.readings["value"].tolist() == [20.0, 21.0, 35.0]  # oldest first
    assert series.tumbling["value"].tolist() == [25.3] and series.sliding.empty
    assert series.anomalies[["event_time", "value", "score", "model_version"]].values.tolist() == [
        [at(20), 35.0, 4.0, 3]
    ]


def test_latest_anomalies_are_the_flagged_ones_newest_first_and_capped() -> None:
    anomalies = pd.DataFrame(
        {
            "device_id": ["a", "b", "c", "d"],
            "seq": [1, 1, 1, 1],
            "event_time": [at(0), at(30), at(10), at(20)],
            "is_anomaly": [True, True, False, True],
            "score": [3.0, 5.0, 0.1, 4.0],
            "model_version": [1, 2, 2, 2],
        }
    )
    latest = shaping.latest_anomalies(anomalies, 2)
    assert latest[["device_id", "model_version"]].values.tolist() == [["b", 2], ["d", 2]]
    assert list(latest.columns) == list(shaping.ANOMALY_COLUMNS)


def test_alert_board_lists_open_alerts_before_cleared_ones() -> None:
    alerts = pd.DataFrame(
        {
            "device_id": ["a", "b", "c"],
            "status": [CLEARED, OPEN, OPEN],
            "last_anomaly_at": [at(50), at(10), at(20)],
            "model_version": [1, 2, 2],
        }
    )
    board = shaping.alert_board(alerts, 10)
    assert board[["device_id", "status"]].values.tolist() == [["c", OPEN], ["b", OPEN], ["a", CLEARED]]
    assert shaping.open_alert_count(alerts) == 2
    assert len(shaping.alert_board(alerts, 1)) == 1


def test_pipeline_health_takes_each_querys_latest_batch_and_sums_dropped_rows() -> None:
    progress = pd.DataFrame(
        {
            "query_name": ["silver", "silver", "bronze", None],
            "query_id": ["q1", "q1", "q2", "q3"],
            "batch_id": [1, 2, 7, 0],
            "timestamp": [at(5), at(10), at(10), at(10)],
            "input_rows_per_second": [100.0, 50.0, 80.0, None],
            "processed_rows_per_second": [200.0, 400.0, 90.0, None],
            "batch_duration_ms": [1500, 250, 900, 10],
            "kafka_lag": [None, None, 12, None],
            "watermark": [at(-120), at(-100), None, None],
            "state_rows": [10, 12, None, None],
            "rows_dropped_by_watermark": [3, 2, None, None],
        }
    )
    latest = shaping.latest_per_query(shaping.progress_series(progress))
    assert latest["query_name"].tolist() == ["bronze", "q3", "silver"]  # an unnamed query goes by its id
    silver = latest.set_index("query_name").loc["silver"]
    assert (silver["batch_id"], silver["batch_duration_s"], silver["watermark_delay_s"]) == (2, 0.25, 110.0)
    assert silver["rows_dropped_by_watermark"] == 5
    bronze = latest.set_index("query_name").loc["bronze"]
    assert bronze["kafka_lag"] == 12 and pd.isna(bronze["watermark_delay_s"])  # no watermark: no delay


def test_late_and_quarantined_records_are_counted() -> None:
    assert shaping.lateness_counts({ON_TIME: 3, TOO_LATE: 1}) == {ON_TIME: 3, LATE: 0, TOO_LATE: 1}
    quarantine = pd.DataFrame({"stage": ["bronze", "bronze", "silver"], "reason": ["invalid_json", "x", "x"]})
    assert shaping.quarantine_reasons(quarantine).values.tolist() == [
        ["bronze", "invalid_json", 1],
        ["bronze", "x", 1],
        ["silver", "x", 1],
    ]


def _version(number: int, promoted_minute: int | None, f1: float = 0.8) -> ModelVersion:
    promoted = None if promoted_minute is None else T0 + timedelta(minutes=promoted_minute)
    return ModelVersion(number, T0 + timedelta(minutes=number), "why", promoted, {"f1": f1, "threshold": 2.0})


def test_model_history_names_the_champion_and_since_when() -> None:
    versions = [_version(1, 1), _version(2, None, f1=0.5), _version(3, 3, f1=0.9)]
    history = shaping.model_history(versions, champion=3)
    assert history.versions["version"].tolist() == [3, 2, 1]
    assert history.versions["champion"].tolist() == [True, False, False]
    assert history.versions["f1"].tolist() == [0.9, 0.5, 0.8]
    assert history.champion_since == T0 + timedelta(minutes=3)


@pytest.mark.parametrize(
    ("champion", "reason"),
    [(1, "moved back by hand after v3's promotion"), (2, "never promoted by the trainer")],
)
def test_champion_since_is_unknown_when_the_alias_was_moved_by_hand(champion: int, reason: str) -> None:
    versions = [_version(1, 1), _version(2, None), _version(3, 3)]
    assert shaping.model_history(versions, champion).champion_since is None, reason


def test_freshness_puts_the_table_furthest_behind_kafka_first_and_unknown_ones_last() -> None:
    kafka = datetime(2026, 11, 25, 14, 0, tzinfo=UTC)
    newest = {"bronze": kafka - timedelta(seconds=2), "anomalies": None, "silver": kafka - timedelta(seconds=75)}
    frame = shaping.freshness(newest, kafka)
    assert frame["table"].tolist() == ["silver", "bronze", "anomalies"]
    assert frame["behind_kafka_s"].tolist()[:2] == [75.0, 2.0]
    assert shaping.freshness(newest, None)["behind_kafka_s"].isna().all()  # Kafka did not answer
