"""Latency read back from a real Delta log: each row's commit time, matched through its data file."""

from __future__ import annotations

import datetime as dt
from dataclasses import replace
from pathlib import Path

import pytest
from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from bench.latency import (
    commit_times,
    live_window_latency,
    percentiles,
    row_versions,
    visibility_latency,
    window_latency,
    with_data_file,
)
from iotmon.config import Settings
from iotmon.schema import DEVICE_WINDOWS, LATE, LIVE_WINDOWS, ON_TIME, SILVER, TOO_LATE

pytestmark = pytest.mark.integration

T0 = dt.datetime(2026, 11, 22, 12, 0, 0)


def test_rows_take_the_time_of_the_commit_that_added_them(spark: SparkSession, tmp_path: Path) -> None:
    path = str(tmp_path / "table")
    for commit, seconds in enumerate(((0, 1), (2, 3, 4))):
        rows = [(commit, T0 + dt.timedelta(seconds=s)) for s in seconds]
        spark.createDataFrame(rows, "commit int, reference timestamp").write.format("delta").mode("append").save(path)
    history = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
    committed = {row["version"]: row["timestamp"] for row in history}

    table = with_data_file(spark.read.format("delta").load(path))
    latencies = visibility_latency(table, commit_times(spark, path), "reference")
    measured = sorted(latencies.collect(), key=lambda r: r.latency_s)
    expected = sorted(
        (committed[commit] - (T0 + dt.timedelta(seconds=s))).total_seconds()
        for commit, seconds in enumerate(((0, 1), (2, 3, 4)))
        for s in seconds
    )

    assert [r.latency_s for r in measured] == pytest.approx(expected, abs=1e-3)
    summary = percentiles(latencies, "table")
    assert summary.rows == 5
    assert summary.seconds[0] == pytest.approx(sorted(expected)[2], abs=1e-3)


def test_a_final_window_row_is_measured_from_the_window_end(spark: SparkSession, tmp_path: Path) -> None:
    settings = replace(Settings(), lake=str(tmp_path))
    path = settings.table_path(DEVICE_WINDOWS)
    ends = [T0 + dt.timedelta(minutes=m) for m in (1, 2, 3)]
    frame = spark.createDataFrame(
        [(end - dt.timedelta(minutes=1), end) for end in ends], "window_start timestamp, window_end timestamp"
    )
    frame.write.format("delta").save(path)
    committed = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").first()["timestamp"]

    measured = window_latency(spark, settings, DEVICE_WINDOWS, since=ends[1])
    assert measured.rows == 2  # the window ending before `since` is left out
    assert measured.seconds[0] == pytest.approx((committed - ends[2]).total_seconds(), abs=1e-3)


def test_a_reading_reaches_its_live_window_with_the_first_commit_that_counts_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The MERGE that updates dev-a rewrites the file dev-b's unchanged row is in: dev-b's reading still dates
    from the commit that first counted it, and dev-a's third on-time reading (its window's fourth by offset)
    from the MERGE."""
    settings = replace(Settings(), lake=str(tmp_path))
    at = [T0 + dt.timedelta(seconds=s) for s in (1, 2, 3, 4, 5, 6)]
    silver = [  # device, seq, event time, lateness, partition, offset
        ("dev-a", 1, at[0], ON_TIME, 0, 10),
        ("dev-a", 2, at[1], ON_TIME, 0, 11),
        ("dev-a", 3, at[4], ON_TIME, 0, 14),
        ("dev-a", 4, at[3], TOO_LATE, 0, 12),  # not counted by the window: does not move the ranks
        ("dev-a", 5, at[2], LATE, 0, 13),  # counted, and by offset the third: not measured (not on time)
        ("dev-b", 1, at[5], ON_TIME, 1, 20),
        ("dev-b", 2, T0 - dt.timedelta(seconds=1), ON_TIME, 1, 21),  # before `since`
    ]
    spark.createDataFrame(
        silver, "device_id string, seq long, event_time timestamp, lateness string, partition int, offset long"
    ).write.format("delta").save(settings.table_path(SILVER))
    live_path = settings.table_path(LIVE_WINDOWS)
    live_schema = "device_id string, window_start timestamp, readings long"
    spark.createDataFrame([("dev-a", T0, 2), ("dev-b", T0, 1)], live_schema).coalesce(1).write.format("delta").save(
        live_path
    )
    update = spark.createDataFrame([("dev-a", T0, 4)], live_schema)
    condition = "t.device_id = s.device_id AND t.window_start = s.window_start"
    DeltaTable.forPath(spark, live_path).alias("t").merge(update.alias("s"), condition).whenMatchedUpdateAll().execute()
    history = spark.sql(f"DESCRIBE HISTORY delta.`{live_path}`").collect()
    committed = {row["version"]: row["timestamp"] for row in history}
    rewritten = spark.read.format("delta").load(live_path).select(F.input_file_name()).distinct().count()
    assert rewritten == 1  # both rows now in the MERGE's file: its time is not dev-b's latency

    files = sorted(commit_times(spark, live_path).collect(), key=lambda r: r["committed_at"])
    versions = row_versions(spark, live_path).groupBy("data_file").count().collect()
    assert sorted((r["data_file"], r["count"]) for r in versions) == sorted((f["data_file"], 2) for f in files)
    merged = row_versions(spark, live_path, since=files[-1]["committed_at"])
    assert {r["data_file"] for r in merged.collect()} == {files[-1]["data_file"]}  # the MERGE's file only

    measured = live_window_latency(spark, settings, since=T0)

    expected = sorted(
        [
            (committed[0] - at[0]).total_seconds(),
            (committed[0] - at[1]).total_seconds(),
            (committed[1] - at[4]).total_seconds(),  # the window's fourth reading by offset
            (committed[0] - at[5]).total_seconds(),
        ]
    )
    assert measured.table == LIVE_WINDOWS
    assert measured.rows == 4
    assert measured.seconds[0] == pytest.approx(expected[1], abs=1e-3)  # p50 of four: the second
    assert measured.seconds[-1] == pytest.approx(expected[-1], abs=1e-3)
