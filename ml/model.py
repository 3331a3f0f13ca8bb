"""The anomaly model: an MLlib pipeline over the shared features, and how it turns features into scores.

Unsupervised, because a fleet in production has no labels. Each (reading, metric) row of
``ml.features`` becomes a vector of log-compressed feature magnitudes; ``RobustScaler`` puts them on
one scale and ``KMeans`` learns the few shapes normal behaviour takes (a quiet sensor, a noisy one, a
slow trend). A row's score is its largest standardised deviation from the nearest of those centres, and
a reading's score is that of its most anomalous metric (``top_metric``). The decision threshold is the
score quantile that flags ``contamination`` of the training readings: the expected share of anomalies,
the one assumption an unsupervised detector cannot avoid, and a setting.

The fitted pipeline is what MLflow stores; ``anomaly_scores`` applies it identically in the trainer
(threshold, evaluation) and the streaming scorer, as column arithmetic on its fitted numbers
(``ScoringRule``): the pipeline's own transform needs a row per metric and a regrouping per reading, which
cost the scorer most of its time (docs/cost-model.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.clustering import KMeans, KMeansModel
from pyspark.ml.feature import RobustScaler, RobustScalerModel, VectorAssembler
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from iotmon.schema import DEVICE_ID, EVENT_TIME, METRIC_NAMES, SEQ
from ml.features import (
    FEATURE_COLUMNS,
    MODEL_INPUT_COLUMNS,
    FeatureSpec,
    metric_rows,
    model_input,
    model_inputs,
    reading_features,
)

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


@dataclass(frozen=True)
class ScoringRule:
    """What a fitted pipeline does to one metric's features, as numbers: the scaler's centre and factor per
    feature, and the KMeans centres. Scoring with them is plain column arithmetic, so a reading's five
    metrics are scored side by side in one projection: no row per metric, no vectors, no regrouping."""

    centre: tuple[float, ...]
    factor: tuple[float, ...]
    """1 / the scaler's quantile range (0 where the range is 0, as Spark's scaler does)."""
    clusters: tuple[tuple[float, ...], ...]

    @classmethod
    def of(cls, model: PipelineModel) -> ScoringRule:
        scaler: RobustScalerModel = model.stages[1]
        kmeans: KMeansModel = model.stages[-1]
        centre = scaler.median.toArray() if scaler.getWithCentering() else [0.0] * len(MODEL_INPUT_COLUMNS)
        ranges = scaler.range.toArray() if scaler.getWithScaling() else [1.0] * len(MODEL_INPUT_COLUMNS)
        return cls(
            tuple(float(c) for c in centre),
            tuple(1.0 / float(r) if r != 0 else 0.0 for r in ranges),
            tuple(tuple(float(x) for x in cluster) for cluster in kmeans.clusterCenters()),
        )

    def metric_score(self, features: Column) -> Column:
        """The score of one metric's feature struct (``f_<metric>``): its largest scaled deviation from the
        nearest cluster centre."""
        scaled = [
            (model_input(features[name]) - F.lit(centre)) * F.lit(factor)
            for name, centre, factor in zip(FEATURE_COLUMNS, self.centre, self.factor, strict=True)
        ]
        distances = [
            sum(((x - F.lit(c)) * (x - F.lit(c)) for x, c in zip(scaled, cluster, strict=True)), F.lit(0.0))
            for cluster in self.clusters
        ]
        deviations = [
            F.greatest(*[F.abs(x - F.lit(c)) for x, c in zip(scaled, cluster, strict=True)])
            for cluster in self.clusters
        ]
        score, nearest = deviations[0], distances[0]
        for distance, deviation in zip(distances[1:], deviations[1:], strict=True):
            score = F.when(distance < nearest, deviation).otherwise(score)
            nearest = F.least(nearest, distance)
        return score


def anomaly_scores(featured: DataFrame, model: PipelineModel, keep: tuple[str, ...] = ()) -> DataFrame:
    """One row per reading of ``featured`` (the output of ``reading_features``): its key, ``keep`` columns,
    ``score`` (its most anomalous metric's) and ``top_metric`` (that metric; the first of equals). Native Spark
    expressions only, the same in the trainer and the streaming scorer."""
    rule = ScoringRule.of(model)
    per_metric = featured.select(
        DEVICE_ID, SEQ, EVENT_TIME, *keep, *[rule.metric_score(F.col(f"f_{m}")).alias(f"_s_{m}") for m in METRIC_NAMES]
    )
    score = F.greatest(*[F.col(f"_s_{m}") for m in METRIC_NAMES])
    top = F.lit(None).cast("string")
    for m in reversed(METRIC_NAMES):
        top = F.when(F.col(f"_s_{m}") == F.col("score"), F.lit(m)).otherwise(top)
    return per_metric.withColumn("score", score).select(
        DEVICE_ID, SEQ, EVENT_TIME, *keep, "score", top.alias("top_metric")
    )
