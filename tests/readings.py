"""Silver-shaped and scored readings for tests of the stages downstream of silver."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pyspark.sql import DataFrame, SparkSession

from iotmon.schema import ANOMALIES_SCHEMA, SILVER_SCHEMA

T0 = dt.datetime(2026, 11, 22, 0, 0, 0)


def at(seconds: float) -> dt.datetime:
    """``T0`` plus ``seconds``: tests speak in seconds of event time."""
    return T0 + dt.timedelta(seconds=seconds)


def silver_row(device_id: str, seq: int, seconds: float, **values: Any) -> dict[str, Any]:
    """A healthy reading of a pump at site-1, ``seconds`` after ``T0``; ``values`` override any column."""
    row: dict[str, Any] = {
        "device_id": device_id,
        "seq": seq,
        "event_time": at(seconds),
        "temperature": 20.0,
        "humidity": 40.0,
        "vibration": 2.0,
        "pressure": 101.0,
        "battery": 90.0,
        "device_type": "pump",
        "site": "site-1",
        "model": "P-100",
        "out_of_range": None,
        "arrival_delay_s": 0.1,
        "lateness": "on_time",
        "partition": 0,
        "offset": seq,
        "kafka_timestamp": at(seconds + 0.1),
    }
    unknown = set(values) - set(row)
    assert not unknown, f"not silver columns: {unknown}"
    row.update(values)
    return row


def silver_frame(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    return spark.createDataFrame([tuple(row[f.name] for f in SILVER_SCHEMA) for row in rows], SILVER_SCHEMA)


def scored_row(device_id: str, seq: int, seconds: float, score: float = 0.5, **values: Any) -> dict[str, Any]:
    """A scored reading of a pump at site-1 as the scorer writes it to ``anomalies``: anomalous when
    ``score`` exceeds the threshold of 1.0; ``values`` override any column."""
    row: dict[str, Any] = {
        "device_id": device_id,
        "seq": seq,
        "event_time": at(seconds),
        "device_type": "pump",
        "site": "site-1",
        "partition": 0,
        "offset": seq,
        "lateness": "on_time",
        "score": score,
        "threshold": 1.0,
        "is_anomaly": score > 1.0,
        "top_metric": "temperature",
        "model_name": "iotmon-anomaly",
        "model_version": 1,
    }
    unknown = set(values) - set(row)
    assert not unknown, f"not anomalies columns: {unknown}"
    row.update(values)
    return row


def scored_frame(spark: SparkSession, rows: list[dict[str, Any]]) -> DataFrame:
    return spark.createDataFrame([tuple(row[f.name] for f in ANOMALIES_SCHEMA) for row in rows], ANOMALIES_SCHEMA)
