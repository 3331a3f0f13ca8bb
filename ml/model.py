"""The anomaly model: an MLlib pipeline over the shared features, and how it turns features into scores.

Unsupervised, because a fleet in production has no labels. Each (reading, metric) row of
``ml.features`` becomes a vector of log-compressed feature magnitudes; ``RobustScaler`` puts them on
one scale and ``KMeans`` learns the few shapes normal behaviour takes (a quiet sensor, a noisy one, a
slow trend). A row's score is its largest standardised deviation from the nearest of those centres, and
a reading's score is that of its most anomalous metric (``top_metric``). The decision threshold is the
score quantile that flags ``contamination`` of the training readings: the expected share of anomalies,
the one assumption an unsupervised detector cannot avoid, and a setting.

The fitted pipeline is what MLflow stores; ``ScoringRule`` holds its fitted numbers and scores features with
numpy, one function for the trainer (threshold, evaluation), ``iotmon verify`` and the streaming scorer:
the pipeline's own transform needs a row per metric and a regrouping per reading, and the same arithmetic
as a Spark expression took the scorer about a second per batch to build and analyse (docs/cost-model.md).
On a Spark frame ``anomaly_scores`` applies it to Arrow batches (``mapInArrow``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.clustering import KMeans, KMeansModel
from pyspark.ml.feature import RobustScaler, RobustScalerModel, VectorAssembler
from pyspark.sql import DataFrame
from pyspark.sql.types import DoubleType, StringType, StructField, StructType

from iotmon.schema import DEVICE_ID, EVENT_TIME, METRIC_NAMES, SEQ
from ml.features import (
    FEATURE_COLUMNS,
    MODEL_INPUT_COLUMNS,
    FeatureSpec,
    metric_rows,
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

    def scores(self, features: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Features ``(readings, metrics, FEATURE_COLUMNS)`` -> each reading's score and its top metric's index:
        per metric the largest scaled deviation from the nearest cluster centre, per reading its worst metric's
        (the first of equals)."""
        scaled = (np.log1p(np.abs(features)) - np.array(self.centre)) * np.array(self.factor)
        score = nearest = None
        for cluster in np.array(self.clusters):
            offset = scaled - cluster
            distance, deviation = (offset * offset).sum(axis=-1), np.abs(offset).max(axis=-1)
            if score is None:
                score, nearest = deviation, distance
            else:
                score = np.where(distance < nearest, deviation, score)
                nearest = np.minimum(nearest, distance)
        assert score is not None, "a model has at least one cluster"
        return score.max(axis=1), score.argmax(axis=1)


def anomaly_scores(featured: DataFrame, model: PipelineModel, keep: tuple[str, ...] = ()) -> DataFrame:
    """One row per reading of ``featured`` (the output of ``reading_features``): its key, ``keep`` columns,
    ``score`` (its most anomalous metric's) and ``top_metric`` (that metric; the first of equals): the same
    numpy arithmetic as the streaming scorer (``ScoringRule``), on Arrow batches."""
    rule = ScoringRule.of(model)
    columns = [DEVICE_ID, SEQ, EVENT_TIME, *keep]
    kept = featured.select(*columns)
    schema = StructType(
        [*kept.schema.fields, StructField("score", DoubleType()), StructField("top_metric", StringType())]
    )

    def scored(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in batches:
            yield scored_batch(pa.Table.from_batches([batch]), rule, columns).to_batches()[0]

    return featured.select(*columns, *[f"f_{m}" for m in METRIC_NAMES]).mapInArrow(scored, schema)


def feature_array(table: pa.Table) -> np.ndarray:
    """The ``f_<metric>`` struct columns of an Arrow table as ``(readings, metrics, FEATURE_COLUMNS)``."""

    def metric(name: str) -> np.ndarray:
        struct = table.column(f"f_{name}").combine_chunks()
        return np.column_stack([struct.field(c).to_numpy(zero_copy_only=False) for c in FEATURE_COLUMNS])

    return np.stack([metric(m) for m in METRIC_NAMES], axis=1).astype(np.float64)


def scored_batch(table: pa.Table, rule: ScoringRule, columns: list[str]) -> pa.Table:
    """``columns`` of an Arrow table of featured readings, with ``score`` and ``top_metric``."""
    score, top = rule.scores(feature_array(table))
    names = np.array(METRIC_NAMES, dtype=object)[top] if len(top) else np.empty(0, dtype=object)
    return (
        table.select(columns)
        .append_column("score", pa.array(score, pa.float64()))
        .append_column("top_metric", pa.array(names, pa.string()))
    )
