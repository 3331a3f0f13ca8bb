"""Detection metrics on a tiny labelled holdout: what the trainer reports and the promotion gate compares."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from pyspark.sql import SparkSession

from ml.evaluation import LABEL, detection_metrics

START = datetime(2026, 1, 1)


def test_metrics_count_hits_misses_and_false_alarms_per_type(spark: SparkSession) -> None:
    #   device, seq, score, label: two drift readings (one missed), a spike, and four normal readings, one flagged.
    rows = [
        ("dev-1", 1, 0.1, None),
        ("dev-1", 2, 5.0, "drift"),
        ("dev-1", 3, 0.5, "drift"),
        ("dev-1", 4, 0.2, None),
        ("dev-2", 1, 9.0, "spike"),
        ("dev-2", 2, 3.0, None),
        ("dev-2", 3, 0.3, None),
    ]
    labelled = spark.createDataFrame(
        [(d, s, START + timedelta(seconds=s), score, label) for d, s, score, label in rows],
        f"device_id string, seq long, event_time timestamp, score double, {LABEL} string",
    )
    metrics = detection_metrics(labelled, threshold=1.0)
    assert metrics["readings"] == 7
    assert metrics["false_alarms"] == 1 and metrics["false_alarm_rate"] == pytest.approx(1 / 4)
    assert metrics["precision"] == pytest.approx(2 / 3) and metrics["recall"] == pytest.approx(2 / 3)
    assert metrics["drift_recall"] == pytest.approx(1 / 2) and metrics["spike_recall"] == 1.0
    assert metrics["drift_episode_recall"] == 1.0  # the episode was flagged, though not every reading of it


def test_a_holdout_without_anomalies_scores_f1_zero_and_counts_its_false_alarms(spark: SparkSession) -> None:
    labelled = spark.createDataFrame(
        [("dev-1", s, START + timedelta(seconds=s), float(s), None) for s in range(10)],
        f"device_id string, seq long, event_time timestamp, score double, {LABEL} string",
    )
    metrics = detection_metrics(labelled, threshold=7.5)
    assert metrics["f1"] == 0.0
    assert metrics["false_alarms"] == 2 and metrics["false_alarm_rate"] == pytest.approx(0.2)
