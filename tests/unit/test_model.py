"""The anomaly model's scores as column arithmetic equal what the fitted MLlib pipeline itself computes."""

from __future__ import annotations

import math

import numpy as np
from pyspark.ml.functions import vector_to_array
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from iotmon.schema import METRIC_NAMES
from ml.features import FeatureSpec, metric_rows, model_inputs, reading_features
from ml.model import ModelParams, anomaly_pipeline, anomaly_scores, training_rows
from tests.readings import silver_frame, silver_row


def _readings(n: int = 240) -> list[dict]:
    rng = np.random.default_rng(5)
    rows = []
    for device in ("dev-1", "dev-2", "dev-3"):
        for i in range(n):
            values = {m: round(float(v), 2) for m, v in zip(METRIC_NAMES, rng.normal(50, 0.4, 5), strict=True)}
            if i in (100, 170):
                values["temperature"] += 15.0  # spikes
            if 200 <= i < 212:
                values["humidity"] = 50.0  # stuck
            rows.append(silver_row(device, i + 1, i * 0.5, **values))
    return rows


def test_scores_are_the_pipelines_own_deviation_from_the_nearest_centre(spark: SparkSession) -> None:
    spec = FeatureSpec(history_s=10.0)
    silver = silver_frame(spark, _readings())
    model = anomaly_pipeline(ModelParams(clusters=3)).fit(training_rows(silver, spec))
    featured = reading_features(silver, spec).cache()

    # The pipeline's own way: a row per (reading, metric), transformed, regrouped per reading.
    centres = F.array(*[F.array(*[F.lit(float(x)) for x in c]) for c in model.stages[-1].clusterCenters()])
    rows = model.transform(model_inputs(metric_rows(featured)))
    centre = F.element_at(centres, F.col("_cluster") + 1)
    deviation = F.array_max(F.zip_with(vector_to_array("_scaled"), centre, lambda x, c: F.abs(x - c)))
    per_metric: dict[tuple[str, int], dict[str, float]] = {}
    for r in rows.select("device_id", "seq", "metric", deviation.alias("d")).collect():
        per_metric.setdefault((r.device_id, r.seq), {})[r.metric] = r.d

    actual = {(r.device_id, r.seq): (r.score, r.top_metric) for r in anomaly_scores(featured, model).collect()}
    assert actual.keys() == per_metric.keys() and len(actual) == 720
    for key, metrics in per_metric.items():
        score, top = actual[key]
        assert math.isclose(score, max(metrics.values()), rel_tol=1e-12, abs_tol=1e-12), key
        # The top metric is the first of the metrics with the highest score.
        assert top == next(m for m in METRIC_NAMES if metrics[m] == max(metrics.values())), key
    spikes = sorted(actual.items(), key=lambda item: -item[1][0])[:6]
    assert {top for _, (_, top) in spikes} == {"temperature"}
