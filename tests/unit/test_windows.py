"""Gold's window functions on tiny frames, in batch: the same functions the stream runs incrementally."""

from __future__ import annotations

import datetime as dt
import math

import numpy as np
import pandas as pd
import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from iotmon.schema import SILVER_SCHEMA
from streaming.windows import (
    STAT_COLUMNS,
    WindowSpec,
    _windowed,
    device_sessions,
    device_windows,
    site_rollup_rows,
    site_rollups,
    site_windows,
    sliding_device_window_rows,
    sliding_device_windows,
    tumbling_device_windows,
    with_kind_rows,
    with_kinds,
)

T0 = dt.datetime(2026, 11, 22, 12, 0, 0)
SPEC = WindowSpec(window="1 minute", sliding_window="2 minutes", slide="1 minute", session_gap="1 minute")


def _silver(spark: SparkSession, rows: list[tuple[str, int, float, str]]) -> DataFrame:
    """Rows of (device_id, seconds after T0, temperature, lateness); other metrics constant."""
    site = {"dev-1": "site-a", "dev-2": "site-a", "dev-3": "site-b"}
    records = [
        (
            device,
            i,
            T0 + dt.timedelta(seconds=seconds),
            temperature,
            50.0,
            1.0,
            100.0,
            80.0,
            "pump",
            site[device],
            "P",
            None,
            0.0,
            lateness,
            0,
            i,
            T0,
        )
        for i, (device, seconds, temperature, lateness) in enumerate(rows)
    ]
    return spark.createDataFrame(records, SILVER_SCHEMA)


def _minute(n: int) -> dt.datetime:
    return T0 + dt.timedelta(minutes=n)


def test_tumbling_windows_aggregate_per_device_and_skip_too_late(spark: SparkSession) -> None:
    silver = _silver(
        spark,
        [
            ("dev-1", 10, 20.0, "on_time"),
            ("dev-1", 50, 24.0, "late"),
            ("dev-1", 55, 99.0, "too_late"),
            ("dev-1", 70, 30.0, "on_time"),
            ("dev-2", 5, 10.0, "on_time"),
        ],
    )
    got = [
        (r.window_start, r.window_end, r.device_id, r.site, r.readings, r.temperature_avg, r.temperature_min,
         r.temperature_max, None if r.temperature_stddev is None else round(r.temperature_stddev, 6))
        for r in tumbling_device_windows(silver, SPEC).orderBy("device_id", "window_start").collect()
    ]  # fmt: skip
    assert got == [
        (_minute(0), _minute(1), "dev-1", "site-a", 2, 22.0, 20.0, 24.0, round(2.0**1.5, 6)),
        (_minute(1), _minute(2), "dev-1", "site-a", 1, 30.0, 30.0, 30.0, None),
        (_minute(0), _minute(1), "dev-2", "site-a", 1, 10.0, 10.0, 10.0, None),
    ]


def test_device_windows_hold_tumbling_and_sliding_rows(spark: SparkSession) -> None:
    silver = _silver(spark, [("dev-1", 10, 20.0, "on_time"), ("dev-1", 70, 30.0, "on_time")])
    got = [
        (r.window_kind, r.window_start, r.window_end, r.readings, r.temperature_avg)
        for r in device_windows(silver, SPEC).orderBy("window_kind", "window_start").collect()
    ]
    assert got == [
        ("sliding", _minute(-1), _minute(1), 1, 20.0),
        ("sliding", _minute(0), _minute(2), 2, 25.0),
        ("sliding", _minute(1), _minute(3), 1, 30.0),
        ("tumbling", _minute(0), _minute(1), 1, 20.0),
        ("tumbling", _minute(1), _minute(2), 1, 30.0),
    ]


def test_site_windows_roll_up_devices(spark: SparkSession) -> None:
    silver = _silver(
        spark,
        [("dev-1", 10, 20.0, "on_time"), ("dev-2", 20, 30.0, "on_time"), ("dev-2", 30, 40.0, "late"),
         ("dev-3", 40, 50.0, "on_time")],
    )  # fmt: skip
    got = [
        (r.site, r.device_type, r.window_start, r.devices, r.readings, r.temperature_avg)
        for r in site_windows(silver, SPEC).orderBy("site").collect()
    ]
    assert got == [("site-a", "pump", _minute(0), 2, 3, 30.0), ("site-b", "pump", _minute(0), 1, 1, 50.0)]


def test_sessions_split_at_gaps_longer_than_the_session_gap(spark: SparkSession) -> None:
    silver = _silver(
        spark,
        [("dev-1", 0, 1.0, "on_time"), ("dev-1", 50, 2.0, "on_time"), ("dev-1", 200, 3.0, "on_time"),
         ("dev-1", 90, 9.0, "too_late")],
    )  # fmt: skip
    got = [
        (r.session_start, r.session_end, r.readings)
        for r in device_sessions(silver, SPEC).orderBy("session_start").collect()
    ]
    assert got == [
        (T0, T0 + dt.timedelta(seconds=110), 2),
        (T0 + dt.timedelta(seconds=200), T0 + dt.timedelta(seconds=260), 1),
    ]


def test_streamed_sessions_are_merged_in_each_partition_before_the_shuffle(
    spark: SparkSession, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The stream's sessions: each partition merges its readings into sessions before the shuffle (the
    session's setting), so a row per session crosses it, not a row per reading; the sessions stay the batch's."""
    rows = [(f"dev-{d}", float(s), 20.0 + s / 100, "on_time") for d in (1, 2) for s in [*range(0, 100, 5), 300, 310]]
    silver = _silver(spark, rows)
    silver.repartition(3).write.parquet(str(tmp_path / "silver"))
    stream = (
        spark.readStream.schema(silver.schema).parquet(str(tmp_path / "silver")).withWatermark("event_time", "1 minute")
    )
    streamed: list[pd.DataFrame] = []
    query = (
        device_sessions(stream, SPEC)
        .writeStream.outputMode("append")
        .foreachBatch(lambda batch, _: streamed.append(batch.toPandas()))
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    capsys.readouterr()
    query.explain()  # the last batch's physical plan
    plan = capsys.readouterr().out
    assert plan.count("MergingSessions") == 2, plan  # merged in each partition, then after the shuffle
    got = {(r.device_id, r.session_start, r.readings) for frame in streamed for r in frame.itertuples()}
    batch = {(r.device_id, r.session_start, r.readings) for r in device_sessions(silver, SPEC).collect()}
    assert got == {k for k in batch if k[1] < T0 + dt.timedelta(seconds=300)}  # the last ones are still open
    assert len(got) == 2


@pytest.mark.parametrize("compute", [tumbling_device_windows, device_windows, site_windows, device_sessions])
def test_an_empty_input_gives_an_empty_table(spark: SparkSession, compute) -> None:
    assert compute(spark.createDataFrame([], SILVER_SCHEMA), SPEC).count() == 0


def test_windows_combined_from_tumbling_ones_equal_the_readings_aggregated_directly(spark: SparkSession) -> None:
    """Sliding windows and site roll-ups are combined from tumbling windows' statistics: the same numbers as
    aggregating the readings themselves, to rounding (pressure is large and its spread tiny: cancellation)."""
    rng = np.random.default_rng(3)
    rows = [
        (f"dev-{d}", float(s), float(20 + rng.normal(0, 0.5)), "on_time") for d in (1, 2, 3) for s in range(0, 600, 7)
    ]
    silver = _silver(spark, rows).withColumn("pressure", F.lit(1999.5) + F.rand(7) * 0.001).cache()
    spec = WindowSpec(window="1 minute", sliding_window="5 minutes", slide="1 minute")
    direct = {
        "sliding": _windowed(silver, F.window("event_time", spec.sliding_window, spec.slide), ("device_id",)),
        "site": _windowed(silver, F.window("event_time", spec.window), ("site", "device_type")),
    }
    tumbling = tumbling_device_windows(silver, spec)
    derived = {"sliding": sliding_device_windows(tumbling, spec), "site": site_rollups(tumbling, spec)}
    for kind, keys in (("sliding", ("window_start", "device_id")), ("site", ("window_start", "site"))):
        expected = {tuple(r[k] for k in keys): r for r in direct[kind].collect()}
        actual = {tuple(r[k] for k in keys): r for r in derived[kind].collect()}
        assert actual.keys() == expected.keys() and len(actual) >= 20
        for key, row in expected.items():
            for column in STAT_COLUMNS:
                e, a = row[column], actual[key][column]
                assert (e is None and a is None) or math.isclose(a, e, rel_tol=1e-9, abs_tol=1e-12), (kind, key, column)
    devices = {r.window_start: r.devices for r in derived["site"].where("site = 'site-a'").collect()}
    assert set(devices.values()) == {2}  # dev-1 and dev-2 report in every minute


@pytest.mark.parametrize("sliding, slide", [("5 minutes", "1 minute"), ("3 minutes", "2 minutes")])
def test_the_combinations_over_arrow_rows_are_the_dataframe_ones(spark: SparkSession, sliding: str, slide: str) -> None:
    """The final windows' writer combines tumbling windows on the driver (``combined_rows``): the same rows, in
    the same columns and types, as ``combined`` in Spark, to the last bits of the floats' summation order.
    Null means (a metric no reading of a window had) and single readings (a null spread) included."""
    rng = np.random.default_rng(5)
    rows = [
        (f"dev-{d}", float(s), float(20 + rng.normal(0, 0.5)), "on_time")
        for d, readings in ((1, 80), (2, 100), (3, 6))  # dev-3's windows hold one reading each, mostly
        for s in sorted(rng.choice(900, readings, replace=False))
    ]
    silent = (F.col("device_id") == "dev-2") & (F.col("event_time") < F.lit(_minute(3)))
    silver = _silver(spark, rows).withColumn("humidity", F.when(silent, None).otherwise(F.col("humidity")))
    spec = WindowSpec(window="1 minute", sliding_window=sliding, slide=slide)
    tumbling = tumbling_device_windows(silver, spec).cache()
    on_driver = tumbling.toArrow()
    sliding_rows = sliding_device_window_rows(on_driver, spec)
    pairs = {
        ("window_start", "device_id"): (sliding_device_windows(tumbling, spec), sliding_rows),
        ("window_start", "site", "device_type"): (site_rollups(tumbling, spec), site_rollup_rows(on_driver, spec)),
        ("window_kind", "window_start", "device_id"): (
            with_kinds(tumbling, sliding_device_windows(tumbling, spec)),
            with_kind_rows(on_driver, sliding_rows),
        ),
    }
    for keys, (in_spark, in_arrow) in pairs.items():
        expected = in_spark.toArrow()
        assert in_arrow.schema.names == expected.schema.names
        assert [f.type for f in in_arrow.schema] == [f.type for f in expected.schema]
        want = {tuple(r[k] for k in keys): r for r in expected.to_pylist()}
        got = {tuple(r[k] for k in keys): r for r in in_arrow.to_pylist()}
        assert got.keys() == want.keys() and len(got) >= 20
        nulls = 0
        for key, row in want.items():
            for column, value in row.items():
                actual = got[key][column]
                nulls += value is None
                if isinstance(value, float):
                    assert actual is not None and math.isclose(actual, value, rel_tol=1e-12, abs_tol=1e-12), (
                        key,
                        column,
                    )
                else:
                    assert actual == value, (key, column)
        assert nulls  # the null means and spreads were compared too


def test_sliding_windows_must_be_made_of_whole_tumbling_windows() -> None:
    with pytest.raises(ValueError, match="whole multiples"):
        WindowSpec(window="1 minute", sliding_window="90 seconds", slide="1 minute")
