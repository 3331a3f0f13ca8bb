"""Alert rules in plain Python, then the whole operator on a small static frame (no timers fire there)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from iotmon.config import Settings
from iotmon.schema import ALERTS_SCHEMA, CLEARED, OPEN
from streaming.alerts import (
    ALERT_UPDATE_SCHEMA,
    AlertRules,
    Anomaly,
    Incident,
    advance,
    alert_id,
    alert_updates,
    clear,
    latest_alert_rows,
    latest_alerts,
)
from tests.readings import at, scored_frame, scored_row
from tests.support import PROJECT_ROOT

RULES = AlertRules(clear_after_ms=60_000)
DEVICE = "dev-a"


def anomaly(seconds: float, seq: int, score: float = 2.0, metric: str = "temperature", model: int = 1) -> Anomaly:
    return Anomaly(round(seconds * 1000), seq, score, metric, model, "pump", "site-1")


def incident(
    opened: float,
    last: float,
    count: int,
    score: float,
    metric: str = "temperature",
    *,
    cleared: float | None = None,
    model: int = 1,
    version: int = 1,
) -> Incident:
    return Incident(
        alert_id=alert_id(DEVICE, round(opened * 1000)),
        device_type="pump",
        site="site-1",
        status=OPEN if cleared is None else CLEARED,
        opened_ms=round(opened * 1000),
        last_anomaly_ms=round(last * 1000),
        cleared_ms=None if cleared is None else round(cleared * 1000),
        anomalies=count,
        max_score=score,
        top_metric=metric,
        model_version=model,
        version=version,
    )


def one_by_one(anomalies: list[Anomaly]) -> dict[str, Incident]:
    """Each reading in its own batch, in order: every incident's final state by id, versions aside."""
    latest, final = None, {}
    for reading in anomalies:
        for changed in advance(DEVICE, latest, [reading], RULES):
            final[changed.alert_id] = dataclasses.replace(changed, version=0)
            latest = changed
    return final


# -- the rules ------------------------------------------------------------------------------------------


def test_alert_id_is_the_device_at_its_opening_in_utc_with_milliseconds() -> None:
    assert alert_id("dev-000042", 1_795_309_323_456) == "dev-000042@2026-11-22T01:02:03.456Z"
    assert alert_id("dev-1", 0) == "dev-1@1970-01-01T00:00:00.000Z"


def test_rules_come_from_settings() -> None:
    settings = Settings.from_env({}, alert_clear_after="90 seconds")
    assert AlertRules.from_settings(settings) == AlertRules(clear_after_ms=90_000)


def test_a_first_anomaly_opens_an_incident() -> None:
    assert advance(DEVICE, None, [anomaly(5, 1, score=3.0, model=7)], RULES) == [incident(5, 5, 1, 3.0, model=7)]


def test_no_anomalies_change_nothing() -> None:
    assert advance(DEVICE, None, [], RULES) == []
    assert advance(DEVICE, incident(0, 0, 1, 2.0), [], RULES) == []


def test_further_anomalies_extend_the_open_incident() -> None:
    opened = incident(0, 0, 1, 2.0)
    readings = [anomaly(30, 3, score=1.5, metric="humidity"), anomaly(10, 2, score=4.0, metric="vibration")]
    assert advance(DEVICE, opened, readings, RULES) == [incident(0, 30, 3, 4.0, "vibration", version=2)]


def test_the_opening_readings_model_version_stays_and_equal_scores_keep_the_first_metric() -> None:
    readings = [anomaly(0, 1, score=2.0, model=1), anomaly(10, 2, score=2.0, metric="pressure", model=2)]
    assert advance(DEVICE, None, readings, RULES) == [incident(0, 10, 2, 2.0, model=1)]


def test_the_timer_clears_at_the_deadline_in_event_time() -> None:
    cleared = clear(incident(0, 30, 2, 2.0, version=4), RULES)
    assert cleared == incident(0, 30, 2, 2.0, cleared=90, version=5)


def test_an_anomaly_just_inside_the_deadline_extends() -> None:
    assert advance(DEVICE, incident(0, 0, 1, 2.0), [anomaly(59.999, 2)], RULES) == [
        incident(0, 59.999, 2, 2.0, version=2)
    ]


def test_an_anomaly_at_the_deadline_clears_the_incident_and_opens_the_next() -> None:
    changed = advance(DEVICE, incident(0, 0, 1, 2.0), [anomaly(60, 2, score=5.0)], RULES)
    assert changed == [incident(0, 0, 1, 2.0, cleared=60, version=2), incident(60, 60, 1, 5.0, version=3)]
    assert changed[1].alert_id == "dev-a@1970-01-01T00:01:00.000Z"


def test_after_a_cleared_incident_the_next_anomaly_opens_a_new_one() -> None:
    cleared = incident(0, 0, 1, 2.0, cleared=60, version=2)
    assert advance(DEVICE, cleared, [anomaly(200, 9)], RULES) == [incident(200, 200, 1, 2.0, version=3)]


BACKLOG = [
    anomaly(0, 1, score=2.0),
    anomaly(20, 3, score=6.0, metric="vibration"),
    anomaly(100, 8, score=1.5, metric="battery"),  # 80 s after the last one: the first incident cleared at 80
    anomaly(130, 10, score=1.2),
    anomaly(300, 20, score=3.0, model=2),
    anomaly(310, 21, score=3.0),
]


def test_a_backlog_in_one_batch_gives_the_incidents_of_one_by_one() -> None:
    expected = [
        incident(0, 20, 2, 6.0, "vibration", cleared=80, version=1),
        incident(100, 130, 2, 1.5, "battery", cleared=190, version=2),
        incident(300, 310, 2, 3.0, model=2, version=3),
    ]
    assert advance(DEVICE, None, BACKLOG, RULES) == expected
    assert one_by_one(BACKLOG) == {i.alert_id: dataclasses.replace(i, version=0) for i in expected}


def test_a_backlog_after_state_numbers_its_updates_on() -> None:
    changed = advance(DEVICE, incident(-100, -90, 4, 9.0, version=6), BACKLOG[:3], RULES)
    assert [(c.opened_ms, c.status, c.version) for c in changed] == [
        (-100_000, CLEARED, 7),
        (0, CLEARED, 8),
        (100_000, OPEN, 9),
    ]
    assert changed[0].cleared_ms == -30_000


def test_a_late_anomaly_older_than_the_opening_is_counted_into_the_open_incident() -> None:
    opened = incident(100, 120, 2, 2.0)
    assert advance(DEVICE, opened, [anomaly(90, 1, score=8.0, metric="humidity")], RULES) == [
        incident(100, 120, 3, 8.0, "humidity", version=2)
    ]


def test_a_late_anomaly_does_not_move_a_cleared_incidents_times() -> None:
    cleared = incident(0, 20, 2, 2.0, cleared=80, version=2)
    assert advance(DEVICE, cleared, [anomaly(50, 5, score=3.0)], RULES) == [
        incident(0, 20, 3, 3.0, cleared=80, version=3)
    ]


# -- the operator on a static frame ---------------------------------------------------------------------


def test_alert_updates_on_a_static_frame(spark: SparkSession, base_settings: Settings) -> None:
    settings = dataclasses.replace(base_settings, alert_clear_after="1 minute")
    scored = scored_frame(
        spark,
        [
            scored_row("dev-a", 1, 0),  # normal readings open nothing
            scored_row("dev-a", 3, 20, score=4.0, top_metric="vibration"),
            scored_row("dev-a", 2, 10, score=2.0, model_version=3),
            scored_row("dev-a", 4, 30),
            scored_row("dev-a", 5, 90, score=1.5),  # 70 s after the last anomaly: a new incident
            scored_row("dev-b", 1, 0),
            scored_row("dev-b", 2, 40, score=1.1, device_type="motor", site="site-2"),
            scored_row("dev-c", 1, 5),
        ],
    )
    updates = alert_updates(scored, settings).cache()
    assert updates.schema.fieldNames() == ALERT_UPDATE_SCHEMA.fieldNames()
    current = latest_alerts(updates)
    assert current.schema.fieldNames() == ALERTS_SCHEMA.fieldNames()

    def ms(seconds: float) -> int:
        return round(at(seconds).timestamp() * 1000)

    rows: list[tuple[Any, ...]] = sorted((tuple(row) for row in current.collect()), key=repr)
    assert rows == sorted(
        [
            (alert_id("dev-a", ms(10)), "dev-a", "pump", "site-1", CLEARED, at(10), at(20), at(80), 2, 4.0,
             "vibration", 3),
            (alert_id("dev-a", ms(90)), "dev-a", "pump", "site-1", OPEN, at(90), at(90), None, 1, 1.5,
             "temperature", 1),
            (alert_id("dev-b", ms(40)), "dev-b", "motor", "site-2", OPEN, at(40), at(40), None, 1, 1.1,
             "temperature", 1),
        ],
        key=repr,
    )  # fmt: skip
    # The writer picks them from the batch's Arrow rows on the driver: the same rows, columns and types, also
    # where an incident has several updates (an earlier version of each, with another status, is added).
    on_driver = updates.toArrow()
    earlier = on_driver.set_column(
        on_driver.schema.get_field_index("version"), "version", pc.subtract(on_driver.column("version"), 1)
    ).set_column(on_driver.schema.get_field_index("status"), "status", pa.array(["stale"] * on_driver.num_rows))
    expected, picked = current.toArrow(), latest_alert_rows(pa.concat_tables([earlier, on_driver]))
    assert [(f.name, f.type) for f in picked.schema] == [(f.name, f.type) for f in expected.schema]
    assert sorted(picked.to_pylist(), key=repr) == sorted(expected.to_pylist(), key=repr)
    updates.unpersist()


def test_the_alerts_module_leaves_the_models_libraries_unimported() -> None:
    """Each Python worker of the alerts' operator imports this module: the scorer's libraries would cost
    every one of them a few tenths of a second, for nothing it runs."""
    heavy = ("pyspark.ml", "mlflow", "scipy")
    code = f"import sys, streaming.alerts; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PROJECT_ROOT)
    assert done.stdout.strip() == "[]"
