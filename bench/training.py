"""Cost growth: training time against archive size, and the small model the pipeline phases score with.

An archive of N readings is built from one real silver table (filled by the real pipeline) by copying it
under new device ids (``<id>-r<k>``) and keeping whole devices until about N readings remain: every device
keeps its full, realistic history, so the features cost what they would on a fleet that size. The same
event-time span at every size means the growth measured is the fleet's, as in ``docs/measurements.md``.
The trainer itself fits on a device sample of about ``IOTMON_TRAIN_MAX_READINGS`` readings, so beyond that
size what grows is the scan of the archive, not the features.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from bench.throughput import Log
from iotmon.config import Settings
from iotmon.schema import DEVICE_ID, SILVER
from ml.features import FeatureSpec
from ml.train import MIN_SPAN_HISTORIES, TrainOptions, device_sample, train
from pipeline.stream import drain_until_idle
from pipeline.topology import ensure_tables
from simulators.options import SimulationOptions
from simulators.publish import run_simulation

MODEL_DEVICES = 100
MODEL_SPAN_HISTORIES = MIN_SPAN_HISTORIES + 1
"""The model archive spans one feature history more than training needs."""
MIN_MODEL_SPAN_S = 60.0


def model_archive_options(settings: Settings, seed: int, truth: Path) -> SimulationOptions:
    span = max(MIN_MODEL_SPAN_S, MODEL_SPAN_HISTORIES * FeatureSpec.from_settings(settings).history_s)
    return SimulationOptions(devices=MODEL_DEVICES, seed=seed, duration=span, truth_path=truth, progress=False)


def champion_model(spark: SparkSession, settings: Settings, seed: int, log: Log) -> dict[str, Any]:
    """A small archive through bronze and silver, a model trained on it and made champion in the bench's
    own MLflow store, so the scorer runs in every pipeline phase."""
    options = model_archive_options(settings, seed, settings.home / "truth" / f"model-{settings.topic}.parquet")
    summary = run_simulation(settings, options)
    ensure_tables(spark, settings)
    # Bronze and silver only: quarantine and gold are not what the trainer reads.
    drain_until_idle(spark, settings, [SILVER])
    started = time.monotonic()
    report = train(spark, settings, TrainOptions(promote=True))
    seconds = time.monotonic() - started
    log(f"model: version {report.version} on {report.readings:,} readings in {seconds:.1f}s, champion")
    return {
        "events": summary.sent,
        "readings": report.readings,
        "version": report.version,
        "seconds": round(seconds, 3),
        "silver": settings.table_path(SILVER),
    }


def copies_and_share(base_rows: int, target_rows: int) -> tuple[int, float]:
    """How many copies of the base archive, and which share of their devices, make about ``target_rows``."""
    if base_rows <= 0 or target_rows <= 0:
        raise ValueError("both the base archive and the target need rows")
    copies = max(1, math.ceil(target_rows / base_rows))
    return copies, min(1.0, target_rows / (copies * base_rows))


def build_archive(spark: SparkSession, base_silver: str, target_rows: int, path: str) -> int:
    """Silver of about ``target_rows`` readings at ``path`` from copies of ``base_silver`` (see module doc)."""
    base = spark.read.format("delta").load(base_silver)
    copies, share = copies_and_share(base.count(), target_rows)
    copied = base.withColumn("copy", F.explode(F.sequence(F.lit(0), F.lit(copies - 1)))).withColumn(
        DEVICE_ID, F.concat(F.col(DEVICE_ID), F.lit("-r"), F.col("copy").cast("string"))
    )
    kept = device_sample(copied, share)
    kept.drop("copy").write.format("delta").mode("overwrite").save(path)
    return spark.read.format("delta").load(path).count()


def training_cost(
    spark: SparkSession, settings: Settings, base_silver: str, sizes: list[int], root: Path, log: Log
) -> list[dict[str, Any]]:
    """``iotmon train`` timed on archives of each size, each with an MLflow store of its own."""
    results = []
    for size in sizes:
        home = root / f"train-{size}"
        sized = replace(settings, home=home, lake=str((home / "lake").absolute()))
        built_at = time.monotonic()
        readings = build_archive(spark, base_silver, size, sized.table_path(SILVER))
        built = time.monotonic() - built_at
        log(f"training: archive of {readings:,} readings built in {built:.1f}s; training")
        started = time.monotonic()
        report = train(spark, sized, TrainOptions(promote=True))
        seconds = time.monotonic() - started
        log(f"training: {readings:,} readings in {seconds:.1f}s")
        results.append(
            {
                "target_rows": size,
                "readings": readings,
                "seconds": round(seconds, 3),
                "steps": {name: round(value, 3) for name, value in report.seconds.items()},
                "readings_per_s": round(readings / seconds, 1) if seconds else None,
            }
        )
    return results
