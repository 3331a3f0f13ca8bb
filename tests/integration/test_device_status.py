"""The device status query on a real silver Delta table: transitions, offline in event time, replay.

The silver table is fed by hand, one append per step, and the query (processing-time trigger) is drained
after each with ``processAllAvailable``, which also waits for the no-data batches that advance the
watermark and fire timers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from iotmon.config import Settings
from iotmon.lake import create_table
from iotmon.queries import AVAILABLE_NOW, recorded_state_variables
from iotmon.schema import DEGRADED, DEVICE_STATUS, DEVICE_STATUS_CHANGES, OFFLINE, ONLINE, SILVER, SILVER_SCHEMA
from streaming.device_status import DEVICE_STATUS_QUERY, STATE_VARIABLES, shard_of, start_device_status
from tests.readings import at, silver_frame, silver_row

pytestmark = pytest.mark.integration

TRIGGER = {"processingTime": "500 milliseconds"}


@pytest.fixture
def settings(base_settings: Settings, tmp_path: Path) -> Settings:
    return dataclasses.replace(
        base_settings,
        home=tmp_path,
        cache_dir=base_settings.cache,
        lake=str(tmp_path / "lake"),
        checkpoints=str(tmp_path / "checkpoints"),
        status_lateness="10 seconds",
        offline_after="1 minute",
        low_battery=15.0,
    )


def _append(spark: SparkSession, settings: Settings, query: StreamingQuery, rows: list[dict[str, Any]]) -> None:
    silver_frame(spark, rows).write.format("delta").mode("append").save(settings.table_path(SILVER))
    query.processAllAvailable()


def _rows(spark: SparkSession, settings: Settings, table: str) -> list[tuple[Any, ...]]:
    frame = spark.read.format("delta").load(settings.table_path(table))
    return sorted((tuple(row) for row in frame.collect()), key=repr)


def _shards(spark: SparkSession, *devices: str) -> list[int]:
    frame = spark.createDataFrame([(d,) for d in devices], "device_id string")
    return [row[0] for row in frame.select(shard_of(F.col("device_id"))).collect()]


def _current(spark: SparkSession, settings: Settings) -> dict[str, tuple[Any, ...]]:
    """device_id -> (status, since, last_seen, reason)."""
    return {row[0]: row[1:5] for row in _rows(spark, settings, DEVICE_STATUS)}


def _last_commit(settings: Settings, table: str) -> tuple[int, list[dict[str, Any]]]:
    """The table's latest version and the batch its commit is tagged with (``iotmon.lake.commit_tag``)."""
    log = Path(settings.table_path(table)) / "_delta_log"
    latest = max(log.glob("*.json"), key=lambda path: int(path.stem))
    actions = [json.loads(line) for line in latest.read_text().splitlines() if line.strip()]
    tags = [json.loads(a["commitInfo"]["userMetadata"]) for a in actions if a.get("commitInfo", {}).get("userMetadata")]
    return int(latest.stem), [{"version": tag["batch"]} for tag in tags]


EXPECTED_CHANGES = sorted(
    [
        ("dev-a", ONLINE, None, at(0), "reporting", at(0), 1),
        ("dev-a", DEGRADED, ONLINE, at(10), "battery 12.0% < 15%", at(10), 2),
        ("dev-a", ONLINE, DEGRADED, at(20), "reporting", at(20), 3),
        ("dev-a", OFFLINE, ONLINE, at(80), "silent for 60s", at(20), 3),
        ("dev-a", ONLINE, OFFLINE, at(100), "reporting", at(100), 4),
        ("dev-b", ONLINE, None, at(0), "reporting", at(0), 1),
        ("dev-b", DEGRADED, ONLINE, at(5), "battery 10.0% < 15%", at(5), 2),
        ("dev-b", ONLINE, DEGRADED, at(10), "reporting", at(10), 3),
        ("dev-b", DEGRADED, ONLINE, at(100), "out of range: temperature", at(100), 8),
        ("dev-c", ONLINE, None, at(95), "reporting", at(95), 1),
        ("dev-q", ONLINE, None, at(0), "reporting", at(0), 1),
    ],
    key=repr,
)
EXPECTED_STATUS = sorted(
    [
        ("dev-a", ONLINE, at(100), at(100), "reporting", "pump", "site-1"),
        ("dev-b", DEGRADED, at(100), at(100), "out of range: temperature", "motor", "site-2"),
        ("dev-c", ONLINE, at(95), at(95), "reporting", "pump", "site-3"),
        ("dev-q", ONLINE, at(0), at(100), "reporting", "pump", "site-1"),
    ],
    key=repr,
)


def test_status_transitions_offline_timer_and_replay(spark: SparkSession, settings: Settings) -> None:
    assert DEVICE_STATUS_QUERY.name == DEVICE_STATUS
    # dev-q shares dev-a's shard and keeps reporting while dev-a falls silent: the shard's one timer must
    # still take dev-a offline at its own deadline, in the batch whose watermark reaches it.
    assert _shards(spark, "dev-a", "dev-q", "dev-b") == [8, 8, 10]
    create_table(spark, settings.table_path(SILVER), SILVER_SCHEMA, "silver, fed by the test")

    def b(seq: int, seconds: float, **values: Any) -> dict[str, Any]:
        return silver_row("dev-b", seq, seconds, device_type="motor", site="site-2", **values)

    def q(seq: int, seconds: float) -> dict[str, Any]:
        return silver_row("dev-q", seq, seconds)

    query = start_device_status(spark, settings, TRIGGER)
    try:
        _append(spark, settings, query, [silver_row("dev-a", 1, 0), b(1, 0), q(1, 0)])
        assert _current(spark, settings) == {
            "dev-a": (ONLINE, at(0), at(0), "reporting"),
            "dev-b": (ONLINE, at(0), at(0), "reporting"),
            "dev-q": (ONLINE, at(0), at(0), "reporting"),
        }

        # dev-b dips and recovers within one batch: both transitions are recorded.
        _append(spark, settings, query, [silver_row("dev-a", 2, 10, battery=12.0), b(3, 10), b(2, 5, battery=10.0)])
        assert _current(spark, settings) == {
            "dev-a": (DEGRADED, at(10), at(10), "battery 12.0% < 15%"),
            "dev-b": (ONLINE, at(10), at(10), "reporting"),
            "dev-q": (ONLINE, at(0), at(0), "reporting"),
        }

        # A reading without a change still moves last_seen on.
        _append(spark, settings, query, [silver_row("dev-a", 3, 20), b(4, 20), q(2, 20)])
        assert _current(spark, settings)["dev-b"] == (ONLINE, at(10), at(20), "reporting")

        # dev-a falls silent. Its deadline (80 s) is not behind the watermark (50 - 10 s) yet: still online.
        _append(spark, settings, query, [b(5, 50), q(3, 50)])
        assert _current(spark, settings)["dev-a"] == (ONLINE, at(20), at(20), "reporting")

        # Readings of 95 s take the next watermark to 85 s: dev-a goes offline, dated at its deadline, not at
        # 85 s, and in the batch that read them (dev-q's, in its shard), not in the next one, which Spark runs
        # to move the watermark there.
        _append(spark, settings, query, [b(7, 95), q(4, 95)])
        assert _current(spark, settings)["dev-a"] == (OFFLINE, at(80), at(20), "silent for 60s")
        assert _current(spark, settings)["dev-q"] == (ONLINE, at(0), at(95), "reporting")
        read_them = max(p["batchId"] for p in query.recentProgress if p["numInputRows"] > 0)
        assert _last_commit(settings, DEVICE_STATUS_CHANGES)[1] == [{"version": read_them}]

        _append(spark, settings, query, [silver_row("dev-a", 4, 100), b(8, 100, out_of_range="temperature"), q(5, 100)])
        assert _current(spark, settings)["dev-a"] == (ONLINE, at(100), at(100), "reporting")

        # Behind dev-b's last reading yet ahead of the watermark (90 s): changes nothing. A new device joins.
        # Nothing here moves the watermark, so this data batch is the query's last.
        _append(spark, settings, query, [b(6, 92, battery=5.0), silver_row("dev-c", 1, 95, site="site-3")])
    finally:
        query.stop()

    assert _rows(spark, settings, DEVICE_STATUS_CHANGES) == EXPECTED_CHANGES
    # What the checkpoint records is what a later version is checked against (pipeline.topology).
    assert recorded_state_variables(Path(settings.checkpoint_path(DEVICE_STATUS))) == set(STATE_VARIABLES)
    assert _rows(spark, settings, DEVICE_STATUS) == EXPECTED_STATUS

    # Crash between the sinks' commits and the checkpoint's: the last batch is run again on restart.
    commits = Path(settings.checkpoint_path(DEVICE_STATUS)) / "commits"
    last_batch = max(int(path.name) for path in commits.iterdir() if path.name.isdigit())
    before = {table: _last_commit(settings, table) for table in (DEVICE_STATUS_CHANGES, DEVICE_STATUS)}
    for table, (_, txns) in before.items():
        assert [txn["version"] for txn in txns] == [last_batch], f"{table} was not written by the last batch"
    (commits / str(last_batch)).unlink()
    (commits / f".{last_batch}.crc").unlink(missing_ok=True)

    replay = start_device_status(spark, settings, AVAILABLE_NOW)
    replay.awaitTermination()
    assert replay.exception() is None
    replayed = [p for p in replay.recentProgress if p["batchId"] == last_batch]
    assert replayed and replayed[0]["numInputRows"] == 2, "the last batch was not replayed"

    assert {table: _last_commit(settings, table) for table in before} == before, "a replayed batch was written"
    assert _rows(spark, settings, DEVICE_STATUS_CHANGES) == EXPECTED_CHANGES
    assert _rows(spark, settings, DEVICE_STATUS) == EXPECTED_STATUS
