"""Simulated fleet -> Kafka -> bronze -> silver -> gold, checked against a batch recomputation and the truth."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import threading
from pathlib import Path

import deltalake
import pyarrow.parquet as pq
import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from ingest.silver import READING_KEY
from iotmon.cli import main
from iotmon.config import Settings, interval_seconds
from iotmon.schema import (
    ANOMALIES,
    BRONZE,
    DEVICE_SESSIONS,
    DEVICE_STATUS,
    DEVICE_STATUS_CHANGES,
    DEVICE_WINDOWS,
    LIVE_WINDOWS,
    ON_TIME,
    QUARANTINE,
    SILVER,
    STREAM_CLOCK,
    TOO_LATE,
)
from pipeline.backfill import backfill
from pipeline.stream import drain_until_idle, run_stream
from pipeline.topology import ensure_tables
from pipeline.verify import reconcile_lake
from simulators.options import SimulationOptions
from simulators.publish import run_simulation
from streaming.verify import KEYS, compare_tables, final_watermarks, reconcile_analytics
from streaming.windows import FINAL_TABLES, WindowSpec, tumbling_device_windows
from tests.support import isolated_settings, wait_for

pytestmark = pytest.mark.integration

START = dt.datetime(2026, 11, 20, 8, 0, 0, tzinfo=dt.UTC)


def _simulate(
    settings: Settings,
    truth: Path,
    start: dt.datetime,
    seed: int,
    duration: float = 600,
    dropout_fraction: float = 0.01,
) -> None:
    options = SimulationOptions(
        dropout_fraction=dropout_fraction,
        devices=100,
        seed=seed,
        duration=duration,
        interval=2.0,
        start=start,
        late_fraction=0.03,
        very_late_fraction=0.01,
        duplicate_fraction=0.02,
        malformed_fraction=0.01,
        truth_path=truth,
        progress=False,
    )
    assert run_simulation(settings, options).failed == 0


def _drain(spark: SparkSession, settings: Settings) -> dict[str, int]:
    ensure_tables(spark, settings)
    return drain_until_idle(spark, settings)


@pytest.fixture(scope="module")
def fleet(kafka: Settings, spark: SparkSession, tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, Path]:
    """Fifteen minutes of a 100-device fleet with every injection, drained once; read by the tests below."""
    settings = isolated_settings(kafka, tmp_path_factory.mktemp("fleet"))
    truth = settings.home / "truth-1.parquet"
    _simulate(settings, truth, START, seed=41, duration=900, dropout_fraction=0.05)
    _drain(spark, settings)
    return settings, truth


def test_silver_and_gold_equal_a_batch_recomputation_and_the_truth(fleet: tuple[Settings, Path], spark: SparkSession):
    isolated, truth = fleet
    lake = reconcile_lake(spark, isolated, [truth])  # the archive against Kafka, beside silver and gold
    check = lake.analytics
    assert check is not None, lake.archive.report()
    assert lake.problems == [], lake.archive.report() + "\n" + check.report()
    assert lake.archive.truth is not None and lake.archive.truth.ok
    assert sum(p.bronze_rows for p in lake.archive.partitions) == lake.archive.truth.delivered > 0
    assert check.watermark is not None and all(check.rows_checked.values()), check.report()

    sends = pq.read_table(truth).to_pandas()
    valid = sends[sends.delivered & sends.malformed_kind.isna()]
    silver = spark.read.format("delta").load(isolated.table_path(SILVER))
    # Every injected duplicate collapsed into one reading; every far-late reading kept and flagged.
    assert valid.is_duplicate.sum() > 0
    assert silver.count() == len(valid.drop_duplicates(["device_id", "seq"]))
    very_late = valid[(valid.delay_s > 120) & ~valid.is_duplicate]
    assert len(very_late) > 0
    assert silver.where(F.col("lateness") == TOO_LATE).count() == len(very_late)

    # Far-late readings would have changed some final windows; the stream kept them out.
    spec = WindowSpec.from_settings(isolated)
    as_if_on_time = tumbling_device_windows(silver.withColumn("lateness", F.lit("on_time")), spec)
    final = spark.read.format("delta").load(isolated.table_path(DEVICE_WINDOWS)).where("window_kind = 'tumbling'")
    changed = final.join(as_if_on_time, ["window_start", "device_id"]).where(
        final["readings"] != as_if_on_time["readings"]
    )
    assert changed.count() > 0

    # Ops dashboards read every table without Spark: delta-rs sees the same rows and columns.
    for table in (SILVER, *FINAL_TABLES, LIVE_WINDOWS, DEVICE_STATUS, DEVICE_STATUS_CHANGES, STREAM_CLOCK):
        spark_frame = spark.read.format("delta").load(isolated.table_path(table))
        arrow = deltalake.DeltaTable(isolated.table_path(table)).to_pyarrow_table()
        assert arrow.num_rows == spark_frame.count(), table
        assert arrow.column_names == spark_frame.columns, table

    # Late readings within the watermark did reach the live table (they are in its counts).
    late = silver.where("lateness = 'late'").select("device_id", F.window("event_time", spec.window).start.alias("w"))
    live = spark.read.format("delta").load(isolated.table_path(LIVE_WINDOWS))
    assert late.count() > 0
    assert late.join(live, (late.device_id == live.device_id) & (late.w == live.window_start)).count() == late.count()


def test_dropouts_take_devices_offline_and_back(fleet: tuple[Settings, Path], spark: SparkSession):
    isolated, truth = fleet
    watermark, _ = final_watermarks(spark, isolated)
    offline_after = dt.timedelta(seconds=interval_seconds(isolated.offline_after))
    episodes = [
        (e["device_id"], dt.datetime.fromisoformat(e["start"]), dt.datetime.fromisoformat(e["end"]))
        for e in json.loads(truth.with_name(truth.name + ".summary.json").read_text())["dropouts"]
    ]
    # Silences wholly inside the run, which the watermark has passed far enough to see the return.
    checked = [
        (device, start, end)
        for device, start, end in episodes
        if start > START and end.replace(tzinfo=None) + offline_after < watermark
    ]
    assert checked, episodes
    changes = spark.read.format("delta").load(isolated.table_path(DEVICE_STATUS_CHANGES))
    silver = spark.read.format("delta").load(isolated.table_path(SILVER))
    for device, start, end in checked:
        start, end = start.replace(tzinfo=None), end.replace(tzinfo=None)
        mine = changes.where(F.col("device_id") == device)
        offline = mine.where((F.col("status") == "offline") & F.col("changed_at").between(start, end)).collect()
        assert len(offline) == 1, (device, start, end, mine.orderBy("changed_at").collect())
        assert start < offline[0].changed_at <= start + offline_after
        back = silver.where((F.col("device_id") == device) & (F.col("event_time") >= end)).agg(F.min("event_time"))
        returned = mine.where((F.col("previous_status") == "offline") & (F.col("changed_at") == back.first()[0]))
        assert returned.count() == 1, (device, back.first()[0], mine.orderBy("changed_at").collect())


def test_latency_reads_each_on_time_reading_back_from_every_table(
    fleet: tuple[Settings, Path], spark: SparkSession, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``iotmon latency`` as documented: one line per table, each on-time reading found in silver and in the
    live window version that first counted it (by its rank in Kafka order)."""
    isolated, _ = fleet
    for name, value in isolated.to_env().items():
        monkeypatch.setenv(name, value)
    on_time = (
        spark.read.format("delta")
        .load(isolated.table_path(SILVER))
        .where((F.col("lateness") == ON_TIME) & (F.col("event_time") >= F.lit(START)))
        .count()
    )

    assert main(["latency", "--since", START.strftime("%Y-%m-%dT%H:%M:%S")]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[2:]}

    assert set(rows) == {BRONZE, SILVER, ANOMALIES, LIVE_WINDOWS}
    assert on_time > 0
    assert int(rows[SILVER].replace(",", "")) == on_time
    assert int(rows[LIVE_WINDOWS].replace(",", "")) == on_time


def test_backfill_rebuilds_what_the_stream_produced_and_a_second_run_extends_it(
    isolated: Settings, spark: SparkSession
):
    truth = isolated.home / "truth-1.parquet"
    _simulate(isolated, truth, START, seed=31, duration=300)
    _drain(spark, isolated)
    watermark_after_first, _ = final_watermarks(spark, isolated)
    streamed = {
        table: spark.read.format("delta").load(isolated.table_path(table)).localCheckpoint()
        for table in (SILVER, QUARANTINE, *FINAL_TABLES, LIVE_WINDOWS)
    }

    result = backfill(spark, isolated)
    assert result.final_through is not None

    keys = {SILVER: READING_KEY, QUARANTINE: ("stage", "topic", "partition", "offset"), **KEYS}
    for table, before in streamed.items():
        after = spark.read.format("delta").load(isolated.table_path(table)).select(*before.columns)
        rows, problems = compare_tables(before, after, keys[table], table)
        assert problems == [], (table, problems)
        assert rows > 0 or table == DEVICE_SESSIONS, table  # no session of this short run has ended yet

    # A second run resumes on the rebuilt tables: new data flows in, every table grows exactly, nothing twice.
    later = isolated.home / "truth-2.parquet"
    _simulate(isolated, later, START + dt.timedelta(seconds=300), seed=31, duration=120)
    _drain(spark, isolated)
    check = reconcile_analytics(spark, isolated, [truth, later])
    assert check.problems == [], check.report()
    assert watermark_after_first is not None and result.final_through is not None
    assert check.watermark is not None and check.watermark > max(watermark_after_first, result.final_through)


def _scaled_down(settings: Settings) -> Settings:
    """Windows, watermark, offline time and the clock's idle time in seconds, so a silent fleet's end shows soon."""
    return dataclasses.replace(
        settings,
        window="10 seconds",
        sliding_window="20 seconds",
        slide="10 seconds",
        session_gap="10 seconds",
        watermark="5 seconds",
        offline_after="10 seconds",
        idle_tick_after="2 seconds",
        trigger_interval="1 second",
        final_trigger_interval="5 seconds",  # the final windows' budget, scaled down like the windows themselves
    )


def _everything_final(settings: Settings, devices: int = 100) -> bool:
    """The window holding silver's newest reading is final, and every device offline."""
    silver_path, windows_path = settings.table_path(SILVER), settings.table_path(DEVICE_WINDOWS)
    status_path = settings.table_path(DEVICE_STATUS)
    if not all(deltalake.DeltaTable.is_deltatable(p) for p in (silver_path, windows_path, status_path)):
        return False
    newest = deltalake.DeltaTable(silver_path).to_pandas(columns=["event_time"]).event_time.max()
    windows = deltalake.DeltaTable(windows_path).to_pandas(columns=["window_end"])
    status = deltalake.DeltaTable(status_path).to_pandas(columns=["status"])
    return (
        not windows.empty
        and windows.window_end.max() > newest
        and len(status) == devices
        and (status.status == "offline").all()
    )


def _stream_until_final(settings: Settings) -> None:
    """``iotmon stream`` until the silent fleet's last windows are final and every device offline, then stopped."""
    stop = threading.Event()
    stream = threading.Thread(target=run_stream, args=(settings, stop), daemon=True)
    stream.start()
    try:
        closed = "the last windows to close and every device to go offline"
        wait_for(lambda: _everything_final(settings), 240, closed, poll=1.0)
    finally:
        stop.set()
        stream.join(120)
    assert not stream.is_alive()


def test_a_silent_fleet_still_finalises_its_last_windows_and_goes_offline(isolated: Settings, spark: SparkSession):
    """The event-time clock: once readings stop, ticks move the watermark, so nothing waits for more data."""
    fast = _scaled_down(isolated)
    _simulate(fast, fast.home / "truth.parquet", START, seed=51, duration=60, dropout_fraction=0.0)
    _stream_until_final(fast)
    assert deltalake.DeltaTable(fast.table_path(STREAM_CLOCK)).to_pandas().shape[0] > 0
    check = reconcile_analytics(spark, fast)
    assert check.problems == [], check.report()

    # A device's rows lost from two tables: the comparisons, run at once, each report theirs, in the list's order.
    device = F.col("device_id") == "dev-000007"
    for table in (LIVE_WINDOWS, DEVICE_STATUS):
        DeltaTable.forPath(spark, fast.table_path(table)).delete(device)
    damaged = reconcile_analytics(spark, fast)
    assert [problem.split(":")[0] for problem in damaged.problems] == [LIVE_WINDOWS, DEVICE_STATUS], damaged.report()
    assert "rows of the batch recomputation are missing" in damaged.problems[1]
    assert damaged.rows_checked == check.rows_checked


def test_a_stream_restarted_while_its_fleet_is_silent_resumes_its_clock(isolated: Settings, spark: SparkSession):
    """A stream stopped before its fleet's silence was noticed, and started again while it lasts: its clock
    resumes where event time stood, so the last windows close and the devices go offline without a reading."""
    fast = _scaled_down(isolated)
    _simulate(fast, fast.home / "truth.parquet", START, seed=53, duration=30, dropout_fraction=0.0)
    run_stream(fast, None)  # every reading into every table, then stopped: no clock ran
    assert not _everything_final(fast)
    _stream_until_final(fast)  # not one reading arrives: only ticks can close the windows
    check = reconcile_analytics(spark, fast)
    assert check.problems == [], check.report()
