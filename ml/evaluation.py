"""How good a model is against the simulator's ground truth: per reading and per anomaly episode.

Per type, recall is the share of that type's readings flagged; precision is the overall one (a false
alarm belongs to no type), so a type's F1 combines the two. An *episode* (a run of a device's consecutive
anomalous readings of one type) is detected when any of its readings is flagged: what an operator sees as one alert.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from iotmon.schema import ANOMALY_TYPES, DEVICE_ID, EVENT_TIME, SEQ
from simulators.truth import read_truth

LABEL = "anomaly_type"
"""Null for a normal reading."""


def truth_labels(spark: SparkSession, files: list[Path]) -> DataFrame:
    """The anomaly type of every delivered, well-formed reading in the truth files (one row per reading).

    Read here, whole (``read_truth``), not when an evaluation first needs them: the files may be the live parts of
    a running simulation, which are gone once it finishes, and the challenger and the champion are compared on
    the same labels.
    """
    delivered = pc.field("delivered") & pc.field("malformed_kind").is_null() & ~pc.field("is_duplicate")
    labels = spark.createDataFrame(read_truth(files, [DEVICE_ID, SEQ, EVENT_TIME, LABEL], where=delivered))
    return labels.select(DEVICE_ID, SEQ, F.col(EVENT_TIME).cast("timestamp").alias(EVENT_TIME), LABEL)


def label_scores(scores: DataFrame, labels: DataFrame) -> DataFrame:
    """Scores joined with labels; readings the truth does not know are left out (not guessed normal)."""
    return scores.join(labels, [DEVICE_ID, SEQ, EVENT_TIME], "inner")


def _f1(precision: float, recall: float) -> float:
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def detection_metrics(labelled: DataFrame, threshold: float) -> dict[str, float]:
    """Precision, recall and F1 overall and per type, plus episode recall per type, at ``threshold``."""
    flagged = F.col("score") > F.lit(threshold)
    counts = {
        (row["label"], row["flagged"]): row["count"]
        for row in labelled.groupBy(F.coalesce(F.col(LABEL), F.lit("normal")).alias("label"), flagged.alias("flagged"))
        .count()
        .collect()
    }
    false_alarms = counts.get(("normal", True), 0)
    normal = false_alarms + counts.get(("normal", False), 0)
    hits = sum(counts.get((kind, True), 0) for kind in ANOMALY_TYPES)
    precision = hits / (hits + false_alarms) if hits + false_alarms else 0.0
    metrics: dict[str, float] = {
        "readings": float(sum(counts.values())),
        "false_alarms": float(false_alarms),
        "false_alarm_rate": false_alarms / normal if normal else 0.0,
    }

    def score(prefix: str, hits: int, misses: int) -> None:
        recall = hits / (hits + misses) if hits + misses else 0.0
        metrics[f"{prefix}precision"], metrics[f"{prefix}recall"] = precision, recall
        metrics[f"{prefix}f1"] = _f1(precision, recall)

    score("", hits, sum(counts.get((kind, False), 0) for kind in ANOMALY_TYPES))
    for kind in ANOMALY_TYPES:
        metrics[f"{kind}_readings"] = float(counts.get((kind, True), 0) + counts.get((kind, False), 0))
        score(f"{kind}_", counts.get((kind, True), 0), counts.get((kind, False), 0))
    metrics.update(_episode_recall(labelled, flagged))
    return metrics


def _episode_recall(labelled: DataFrame, flagged) -> dict[str, float]:
    device = Window.partitionBy(DEVICE_ID).orderBy(EVENT_TIME, SEQ)
    starts = F.col(LABEL).isNotNull() & ~F.coalesce(F.lag(LABEL).over(device) == F.col(LABEL), F.lit(False))
    episodes = (
        labelled.withColumn("_start", starts.cast("int"))
        .withColumn("_episode", F.sum("_start").over(device))
        .where(F.col(LABEL).isNotNull())
        .groupBy(DEVICE_ID, "_episode", LABEL)
        .agg(F.max(flagged.cast("int")).alias("_detected"))
        .groupBy(LABEL)
        .agg(F.count("*").alias("episodes"), F.avg("_detected").alias("recall"))
        .collect()
    )
    result = {}
    for row in episodes:
        result[f"{row[LABEL]}_episodes"] = float(row["episodes"])
        result[f"{row[LABEL]}_episode_recall"] = float(row["recall"])
    return result
