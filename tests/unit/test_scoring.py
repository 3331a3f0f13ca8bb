"""The scorer's rows from Arrow are the rows Spark's recomputation makes of the same scores."""

from __future__ import annotations

import datetime as dt
import math

import pyarrow as pa
from pyspark.sql import SparkSession

from iotmon.schema import ANOMALIES_SCHEMA
from ml.registry import ModelRef
from streaming.scoring import anomaly_rows, as_anomalies


def _plain(column: pa.ChunkedArray) -> list[object]:
    """A column's values, NaN as a string: NaN equals nothing, not even itself."""
    return ["NaN" if isinstance(v, float) and math.isnan(v) else v for v in column.to_pylist()]


REF = ModelRef(name="iotmon-anomaly", version=3, threshold=1.0, feature_history_s=60.0)


def test_the_scorers_arrow_rows_equal_sparks_for_the_same_scores(spark: SparkSession) -> None:
    at = dt.datetime(2026, 11, 22, 12, 0, 0)
    scores = [0.2, 1.0, 1.5, float("nan"), None]  # below, at, above the threshold, NaN, none
    table = pa.table(
        {
            "device_id": [f"dev-{i}" for i in range(len(scores))],
            "seq": pa.array(range(len(scores)), pa.int64()),
            "event_time": pa.array([at + dt.timedelta(seconds=i) for i in range(len(scores))], pa.timestamp("us")),
            "device_type": ["pump"] * len(scores),
            "site": ["site-1"] * len(scores),
            "partition": pa.array([0] * len(scores), pa.int32()),
            "offset": pa.array(range(len(scores)), pa.int64()),
            "lateness": ["on_time"] * len(scores),
            "score": pa.array(scores, pa.float64()),
            "top_metric": ["temperature"] * len(scores),
        }
    )
    ours = anomaly_rows(table, REF)
    theirs = as_anomalies(spark.createDataFrame(table), REF).toArrow()
    assert ours.column_names == theirs.column_names == ANOMALIES_SCHEMA.fieldNames()
    assert ours.column("is_anomaly").to_pylist() == [False, False, True, True, None]
    for name in ours.column_names:
        if name == "event_time":
            continue  # Spark's Arrow carries the session's zone; the instants are compared below
        assert _plain(ours.column(name).cast(theirs.column(name).type)) == _plain(theirs.column(name)), name
    assert [t.replace(tzinfo=None) for t in theirs.column("event_time").to_pylist()] == table.column(
        "event_time"
    ).to_pylist()
