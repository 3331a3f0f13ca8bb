"""The anomaly model: an MLlib pipeline over the shared features, and how it turns features into scores.

Unsupervised, because a fleet in production has no labels. Each (reading, metric) row of
``ml.features`` becomes a vector of log-compressed feature magnitudes; ``StandardScaler`` puts them on
one scale and ``KMeans`` learns the few shapes normal behaviour takes (a quiet sensor, a noisy one, a
slow trend). A row's score is its largest standardised deviation from the nearest of those centres, and
a reading's score is that of its most anomalous metric (``top_metric``). The decision threshold is the
score quantile that flags ``contamination`` of the training readings: the expected share of anomalies,
the one assumption an unsupervised detector cannot avoid, and a setting.

The fitted pipeline is what MLflow stores; ``anomaly_scores`` applies it identically in the trainer
(threshold, evaluation) and the streaming scorer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.clustering import KMeans, KMeansModel
from pyspark.ml.feature import RobustScaler, VectorAssembler
from pyspark.ml.functions import vector_to_array
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from iotmon.schema import DEVICE_ID, EVENT_TIME, SEQ
from ml.features import MODEL_INPUT_COLUMNS, FeatureSpec, metric_rows, model_inputs, reading_features

_VECTOR, _SCALED, _CLUSTER = "_features", "_scaled", "_cluster"


@dataclass(frozen=True)
class ModelParams:
    clusters: int = 2
    tail: float = 0.99
    contamination: float = 0.01
    seed: int = 1
    max_iterations: int = 20


def anomaly_pipeline(params: ModelParams) -> Pipeline:
    return Pipeline(
        stages=[
            VectorAssembler(inputCols=list(MODEL_INPUT_COLUMNS), outputCol=_VECTOR),
            RobustScaler(
                inputCol=_VECTOR, outputCol=_SCALED, lower=0.5, upper=params.tail, withCentering=True, withScaling=True
            ),
            KMeans(
                featuresCol=_SCALED,
                predictionCol=_CLUSTER,
                k=params.clusters,
                seed=params.seed,
                maxIter=params.max_iterations,
            ),
        ]
    )


def training_rows(readings: DataFrame, spec: FeatureSpec) -> DataFrame:
    """What the pipeline is fitted on: one row per (reading, metric) with the model's inputs."""
    return model_inputs(metric_rows(reading_features(readings, spec)))


def anomaly_scores(featured: DataFrame, model: PipelineModel, keep: tuple[str, ...] = ()) -> DataFrame:
    """One row per reading of ``featured`` (the output of ``reading_features``): its key, ``keep`` columns,
    ``score`` and ``top_metric``. Native Spark expressions only: no Python in the scoring path."""
    kmeans: KMeansModel = model.stages[-1]
    centres = F.array(*[F.array(*[F.lit(float(x)) for x in centre]) for centre in kmeans.clusterCenters()])
    rows = model.transform(model_inputs(metric_rows(featured, keep)))
    centre = F.element_at(centres, F.col(_CLUSTER) + 1)
    deviation = F.array_max(F.zip_with(vector_to_array(_SCALED), centre, lambda x, c: F.abs(x - c)))
    scored = rows.select(DEVICE_ID, SEQ, EVENT_TIME, *keep, "metric", deviation.alias("score"))
    return scored.groupBy(DEVICE_ID, SEQ, EVENT_TIME, *keep).agg(
        F.max("score").alias("score"), F.max_by("metric", "score").alias("top_metric")
    )
