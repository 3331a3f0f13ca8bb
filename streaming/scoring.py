"""The streaming scorer: every silver reading scored by the champion model, into ``anomalies``, exactly once.

Each micro-batch of new silver readings is featurised with ``ml.features`` exactly as the trainer
featurises the archive: the same function over each device's readings in the lookback before them, which
the scorer keeps between batches (``streaming.history``, a cache of silver: what it lacks is read from
silver), so a reading gets the features it would get in training (no training/serving skew); then the
model's scores (``ml.model.ScoringRule``), the same numpy arithmetic as in training and in ``iotmon verify``.

The model is resolved per micro-batch: the ``champion`` alias, read at every batch, so a promotion takes
effect at the next trigger without a restart. The version a batch used is *pinned* in the checkpoint
(``<checkpoint>/model-pins/<batch id>``) before anything is written; a batch replayed after a crash reads
its pin and scores with the same version, and the write is tagged with the batch (``iotmon.lake.BatchLedger``),
so the table keeps one copy. A champion that cannot be loaded is skipped for the last good version; with no
usable model at all the query does not run (``scoring_ready``), and the archive and analytics go on. When
a model appears the scorer starts from its checkpoint, so every reading that arrived meanwhile is scored.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.ml import PipelineModel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from iotmon.config import Settings, interval_seconds
from iotmon.lake import BatchLedger, append_once, read_text, write_text
from iotmon.logs import say
from iotmon.queries import QuerySpec, Trigger
from iotmon.schema import ANOMALIES, ANOMALIES_SCHEMA, DEVICE_ID, EVENT_TIME, LATENESS, SEQ, SILVER
from ml import registry
from ml.features import FeatureSpec
from ml.model import ScoringRule, anomaly_scores, scored_batch
from streaming.history import FEATURE_INPUTS, DeviceHistory, SilverRanges, SilverReader
from streaming.sources import ensure_anomalies_table

KEPT_COLUMNS: tuple[str, ...] = ("device_type", "site", "partition", "offset", LATENESS)
"""Silver columns carried into ``anomalies`` besides the reading key: where it is, where it came from and how
late (alerts count only readings that arrived within the watermark)."""
PINS_KEPT = 200
"""Pins older than this many batches are deleted (Spark itself keeps 100 batches of offsets)."""


class ModelUnavailable(RuntimeError):
    """No registered model can be served yet; the scorer waits for one."""


def anomalies_of(featured: DataFrame, pipeline: PipelineModel, ref: registry.ModelRef) -> DataFrame:
    """Featured silver readings (``f_<metric>`` columns) scored by ``ref``: rows of ``ANOMALIES_SCHEMA``."""
    return as_anomalies(anomaly_scores(featured, pipeline, keep=KEPT_COLUMNS), ref)


def as_anomalies(scores: DataFrame, ref: registry.ModelRef) -> DataFrame:
    """Scored readings (a ``score`` each) as rows of ``ANOMALIES_SCHEMA``: ``ref``'s threshold, verdict and name."""
    columns = {
        "threshold": F.lit(ref.threshold),
        "is_anomaly": F.col("score") > F.lit(ref.threshold),
        "model_name": F.lit(ref.name),
        "model_version": F.lit(ref.version),
    }
    return scores.withColumns(columns).select(*[F.col(f.name).cast(f.dataType) for f in ANOMALIES_SCHEMA.fields])


def anomaly_rows(scores: pa.Table, ref: registry.ModelRef) -> pa.Table:
    """What ``as_anomalies`` makes of scored readings, from the scorer's Arrow: no trip through the JVM."""
    rows, score = scores.num_rows, scores.column("score")
    model = {
        "threshold": pa.array(np.full(rows, ref.threshold), pa.float64()),
        # Spark orders NaN above every number: a NaN score is over any threshold there, so here too.
        "is_anomaly": pc.or_(pc.greater(score, pa.scalar(ref.threshold, pa.float64())), pc.is_nan(score)),
        "model_name": pa.array([ref.name] * rows, pa.string()),
        "model_version": pa.array(np.full(rows, ref.version), pa.int32()),
    }
    columns = [model[name] if name in model else scores.column(name) for name in ANOMALIES_SCHEMA.fieldNames()]
    return pa.table(columns, names=ANOMALIES_SCHEMA.fieldNames())


def silver_reader(spark: SparkSession, settings: Settings) -> SilverReader:
    """Reads what the scorer's history lacks: silver's feature columns of some devices, each in its range."""

    def read(ranges: SilverRanges) -> pa.Table:
        wanted = spark.createDataFrame(
            [(device, start, through) for device, (start, through) in ranges.items()],
            "wanted_device string, from_us long, through_us long",
        )
        silver = spark.read.format("delta").load(settings.table_path(SILVER))
        # The ranges' span bounds the scan (Delta's data skipping reads it); each device's range picks its rows.
        starts = [start for start, _ in ranges.values()]
        ends = [end for _, end in ranges.values() if end is not None]
        in_span = silver.where(F.col(EVENT_TIME) >= F.timestamp_micros(F.lit(min(starts))))
        if len(ends) == len(ranges):  # no device read to silver's end
            in_span = in_span.where(F.col(EVENT_TIME) <= F.timestamp_micros(F.lit(max(ends))))
        event_us = F.unix_micros(F.col(EVENT_TIME))
        in_range = (
            (F.col(DEVICE_ID) == F.col("wanted_device"))
            & (event_us >= F.col("from_us"))
            & (F.col("through_us").isNull() | (event_us <= F.col("through_us")))
        )
        return in_span.join(F.broadcast(wanted), in_range, "left_semi").select(*FEATURE_INPUTS).toArrow()

    return read


class ModelCache:
    """Loaded pipelines, and per registered model the last version that loaded: what a broken champion
    falls back to. Keyed by registry and model name too, so one process can serve several registries."""

    def __init__(self) -> None:
        self._loaded: dict[tuple[str, str, int], tuple[registry.ModelRef, PipelineModel]] = {}
        self._last_good: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def load(self, settings: Settings, ref: registry.ModelRef) -> PipelineModel:
        key = (settings.tracking_uri, ref.name, ref.version)
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = (ref, registry.load_pipeline(settings, ref))
            self._last_good[key[:2]] = ref.version
            return self._loaded[key][1]

    def fallback(self, settings: Settings) -> tuple[registry.ModelRef, PipelineModel] | None:
        model = (settings.tracking_uri, settings.model_name)
        with self._lock:
            version = self._last_good.get(model)
            return self._loaded[(*model, version)] if version is not None else None


MODELS = ModelCache()


def _warn(message: str) -> None:
    say(message, sys.stderr)


def serving_model(
    settings: Settings, pinned: int | None, warn: Callable[[str], None] = _warn
) -> tuple[registry.ModelRef, PipelineModel]:
    """The model for a batch: its pinned version when replayed, else the champion (or the last good one)."""
    if pinned is not None:
        ref = registry.model_ref(settings, pinned)
        return ref, MODELS.load(settings, ref)
    ref = registry.champion(settings)
    try:
        if ref is None:
            raise registry.ModelUnusable(f"no {registry.CHAMPION} alias on {settings.model_name} yet")
        return ref, MODELS.load(settings, ref)
    except registry.ModelUnusable as exc:
        fallback = MODELS.fallback(settings)
        if fallback is None:
            raise ModelUnavailable(f"{exc}; train one with `iotmon train`") from exc
        warn(f"{ANOMALIES}: {exc}; still scoring with v{fallback[0].version}")
        return fallback


def scoring_ready(spark: SparkSession, settings: Settings) -> str | None:
    """None when a model can be served, else why not (the query waits instead of failing)."""
    try:
        serving_model(settings, None, warn=lambda _: None)
    except (ModelUnavailable, registry.ModelUnusable) as exc:
        return str(exc)
    return None


def write_scores_batch(settings: Settings) -> Callable[[DataFrame, int], None]:
    checkpoint = settings.checkpoint_path(ANOMALIES)
    path = settings.table_path(ANOMALIES)
    ledger = BatchLedger(checkpoint)
    history = DeviceHistory(late_s=interval_seconds(settings.watermark))
    rules: dict[int, ScoringRule] = {}

    def write(batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        pin = f"{checkpoint}/model-pins/{batch_id}"
        pinned = read_text(spark, pin)
        ref, pipeline = serving_model(settings, int(pinned) if pinned else None)
        readings = batch.select(*FEATURE_INPUTS, *[c for c in KEPT_COLUMNS if c not in FEATURE_INPUTS]).toArrow()
        if readings.num_rows == 0:
            return
        featured = history.featured(readings, FeatureSpec(ref.feature_history_s), silver_reader(spark, settings))
        if ref.version not in rules:
            rules[ref.version] = ScoringRule.of(pipeline)
        scores = scored_batch(featured, rules[ref.version], [DEVICE_ID, SEQ, EVENT_TIME, *KEPT_COLUMNS])
        if not pinned:
            write_text(spark, pin, str(ref.version))
            write_text(spark, f"{checkpoint}/model-pins/{batch_id - PINS_KEPT}", None)
        append_once(anomaly_rows(scores, ref), path, ledger, batch_id, spark)

    return write


def start_scoring(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    """The scorer's query: silver in batches of at most ``IOTMON_SCORER_BATCH_BYTES``, so a scorer catching up
    (its first model, a restart) scores its backlog in several batches, each visible when done."""
    ensure_anomalies_table(spark, settings)
    checkpoint = settings.checkpoint_path(ANOMALIES)
    silver = spark.readStream.format("delta").option("maxBytesPerTrigger", settings.scorer_batch_bytes)
    silver = silver.load(settings.table_path(SILVER))
    return (
        silver.writeStream.queryName(ANOMALIES)
        .foreachBatch(write_scores_batch(settings))
        .option("checkpointLocation", checkpoint)
        .trigger(**trigger)
        .start()
    )


SCORING_QUERY = QuerySpec(ANOMALIES, start_scoring, ready=scoring_ready)
