"""The alerts query on a real anomalies Delta table: incidents open, extend and clear in event time; replay.

The anomalies table (the scorer's output, this query's input contract) and the stream clock are fed by
hand, and the query is run with the available-now trigger after each step, as ``iotmon stream --until-idle``
runs it; each run ends with the no-data batch that fires the timers its watermark passed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession

from iotmon.config import Settings
from iotmon.queries import AVAILABLE_NOW
from iotmon.schema import ALERTS, ANOMALIES, CLEARED, OPEN, STREAM_CLOCK
from streaming.alerts import ALERTS_QUERY, alert_id, start_alerts
from streaming.sources import CLOCK_SCHEMA
from tests.readings import at, scored_frame, scored_row

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(base_settings: Settings, tmp_path: Path) -> Settings:
    """A lake and checkpoints of this test's own; no broker, the input is a Delta table."""
    return dataclasses.replace(
        base_settings,
        home=tmp_path,
        cache_dir=base_settings.cache,
        lake=str(tmp_path / "lake"),
        checkpoints=str(tmp_path / "checkpoints"),
        watermark="10 seconds",
        alert_clear_after="1 minute",
    )


def _run(spark: SparkSession, settings: Settings) -> list[dict[str, Any]]:
    """Run the query until its input is drained; return its batches' progress."""
    query = start_alerts(spark, settings, AVAILABLE_NOW)
    query.awaitTermination()
    assert query.exception() is None
    return query.recentProgress


def _score(spark: SparkSession, settings: Settings, rows: list[dict[str, Any]]) -> None:
    scored_frame(spark, rows).write.format("delta").mode("append").save(settings.table_path(ANOMALIES))


def _tick(spark: SparkSession, settings: Settings, seconds: float) -> None:
    clock = spark.createDataFrame([(at(seconds), ANOMALIES)], CLOCK_SCHEMA)  # a tick following the scores
    clock.write.format("delta").mode("append").save(settings.table_path(STREAM_CLOCK))


def _alerts(spark: SparkSession, settings: Settings) -> list[tuple[Any, ...]]:
    frame = spark.read.format("delta").load(settings.table_path(ALERTS))
    return sorted((tuple(row) for row in frame.collect()), key=repr)


def _last_commit(settings: Settings) -> tuple[int, list[dict[str, Any]]]:
    """The alerts table's latest version and the batch its commit is tagged with (``iotmon.lake.commit_tag``)."""
    log = Path(settings.table_path(ALERTS)) / "_delta_log"
    latest = max(log.glob("*.json"), key=lambda path: int(path.stem))
    actions = [json.loads(line) for line in latest.read_text().splitlines() if line.strip()]
    tags = [json.loads(a["commitInfo"]["userMetadata"]) for a in actions if a.get("commitInfo", {}).get("userMetadata")]
    return int(latest.stem), [{"version": tag["batch"]} for tag in tags]


def _id(device_id: str, seconds: float) -> str:
    return alert_id(device_id, round(at(seconds).timestamp() * 1000))


def _alert(device: str, status: str, opened: float, last: float, cleared: float | None, *rest: Any) -> tuple:
    """An alerts row (dev-b is a motor at site-2, the others pumps at site-1); ``rest`` is
    (anomalies, max_score, top_metric, model_version)."""
    site = ("motor", "site-2") if device == "dev-b" else ("pump", "site-1")
    return (
        _id(device, opened),
        device,
        *site,
        status,
        at(opened),
        at(last),
        None if cleared is None else at(cleared),
        *rest,
    )


def test_incidents_open_extend_clear_and_replay(spark: SparkSession, settings: Settings) -> None:
    assert ALERTS_QUERY.name == ALERTS

    def b(seq: int, seconds: float, **values: Any) -> dict[str, Any]:
        return scored_row("dev-b", seq, seconds, device_type="motor", site="site-2", **values)

    _score(
        spark,
        settings,
        [
            scored_row("dev-a", 1, 0),
            scored_row("dev-a", 3, 20, score=5.0, top_metric="vibration"),
            scored_row("dev-a", 2, 10, score=2.0, model_version=2),
            scored_row("dev-a", 4, 30),
            b(1, 0, score=1.5),
            b(2, 40),
            # Normal readings only: no alert, but they move the watermark to 75 s, so dev-b's timer (60 s)
            # fires, dated at its deadline. dev-a's deadline (80 s) is not behind the watermark yet.
            scored_row("dev-c", 1, 85),
        ],
    )
    _run(spark, settings)
    expected = [
        _alert("dev-a", OPEN, 10, 20, None, 2, 5.0, "vibration", 2),
        _alert("dev-b", CLEARED, 0, 0, 60, 1, 1.5, "temperature", 1),
    ]
    assert _alerts(spark, settings) == sorted(expected, key=repr)

    # A second run: 78 s extends dev-a's incident (deadline now 138 s); 150 s, in the same batch, is past
    # that deadline, so the incident clears at 138 s and the next opens. Then only the clock's tick (the fleet
    # fell silent) moves the watermark past the new incident's deadline (210 s).
    _score(
        spark,
        settings,
        [
            scored_row("dev-a", 9, 150, score=3.0, top_metric="pressure", model_version=3),
            scored_row("dev-a", 7, 78, score=1.1),
            b(3, 120),
        ],
    )
    _tick(spark, settings, 300)
    _run(spark, settings)
    expected = [
        _alert("dev-a", CLEARED, 10, 78, 138, 3, 5.0, "vibration", 2),
        _alert("dev-a", CLEARED, 150, 150, 210, 1, 3.0, "pressure", 3),
        _alert("dev-b", CLEARED, 0, 0, 60, 1, 1.5, "temperature", 1),
    ]
    assert _alerts(spark, settings) == sorted(expected, key=repr)

    # Crash between the MERGE's commit and the checkpoint's: the last batch is run again on restart.
    commits = Path(settings.checkpoint_path(ALERTS)) / "commits"
    last_batch = max(int(path.name) for path in commits.iterdir() if path.name.isdigit())
    before = _last_commit(settings)
    assert [txn["version"] for txn in before[1]] == [last_batch], "alerts was not written by the last batch"
    (commits / str(last_batch)).unlink()
    (commits / f".{last_batch}.crc").unlink(missing_ok=True)

    replayed = [p for p in _run(spark, settings) if p["batchId"] == last_batch]
    assert replayed, "the last batch was not replayed"
    assert _last_commit(settings) == before, "a replayed batch was written"
    assert _alerts(spark, settings) == sorted(expected, key=repr)
