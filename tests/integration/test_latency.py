"""Latency read back from a real Delta log: each row's commit time, matched through its data file."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from bench.latency import commit_times, percentiles, visibility_latency, with_data_file

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


def test_a_window_row_is_measured_from_the_window_end(spark: SparkSession, tmp_path: Path) -> None:
    from dataclasses import replace

    from bench.latency import window_latency
    from iotmon.config import Settings
    from iotmon.schema import LIVE_WINDOWS

    settings = replace(Settings(), lake=str(tmp_path))
    path = settings.table_path(LIVE_WINDOWS)
    ends = [T0 + dt.timedelta(minutes=m) for m in (1, 2, 3)]
    frame = spark.createDataFrame(
        [(end - dt.timedelta(minutes=1), end) for end in ends], "window_start timestamp, window_end timestamp"
    )
    frame.write.format("delta").save(path)
    committed = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").first()["timestamp"]

    measured = window_latency(spark, settings, LIVE_WINDOWS, since=ends[1])
    assert measured.rows == 2  # the window ending before `since` is left out
    assert measured.seconds[0] == pytest.approx((committed - ends[2]).total_seconds(), abs=1e-3)
