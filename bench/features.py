"""``python -m bench.features``: the shared anomaly features timed on their own, apart from the pipeline.

Featurising is most of the scorer's and the trainer's work, so a change to ``ml.features`` is measured
here before and after: on a synthetic archive (devices reporting every second, 3 % of readings late,
1 % spiked, stuck stretches), once whole (the trainer's case) and once as a scorer batch asks for it
(``since`` the batch's first reading, over its lookback), each after a warm-up run of the JVM.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from iotmon.config import Settings
from iotmon.logs import say
from iotmon.schema import DEVICE_ID, EVENT_TIME, LATE, LATENESS, METRIC_NAMES, ON_TIME, SEQ, SILVER_SCHEMA
from ml.features import FeatureSpec, reading_features

START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def synthetic_silver(spark: SparkSession, devices: int, readings: int, seed: int = 1) -> DataFrame:
    """``devices`` x ``readings`` silver rows, one per device per second from ``START``; columns the
    features do not read are null."""
    index = F.col("id")
    second = (index / devices).cast("long")
    metrics = {m: F.round(F.lit(20.0) + F.randn(seed + i) * 0.3, 2) for i, m in enumerate(METRIC_NAMES)}
    metrics["temperature"] = metrics["temperature"] + F.when(F.rand(seed + 10) < 0.01, F.lit(15.0)).otherwise(0.0)
    metrics["humidity"] = F.when(second % 50 < 8, F.lit(41.0)).otherwise(metrics["humidity"])
    values = {
        DEVICE_ID: F.format_string("dev-%06d", (index % devices).cast("int")),
        SEQ: second,
        EVENT_TIME: F.timestamp_seconds(F.lit(int(START.timestamp())) + second),
        LATENESS: F.when(F.rand(seed + 11) < 0.03, F.lit(LATE)).otherwise(F.lit(ON_TIME)),
        **metrics,
    }
    rows = spark.range(devices * readings).select(*[column.alias(name) for name, column in values.items()])
    return rows.select(
        *[
            (F.col(f.name) if f.name in values else F.lit(None)).cast(f.dataType).alias(f.name)
            for f in SILVER_SCHEMA.fields
        ]
    )


def timed(frame: DataFrame) -> float:
    """Seconds to compute every column of ``frame`` (the noop sink skips no column, unlike ``count``)."""
    started = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.features", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=500)
    parser.add_argument("--readings", type=int, default=400, help="per device, one a second (default 400)")
    parser.add_argument("--history", type=float, default=60.0, help="feature history in seconds (default 60)")
    parser.add_argument("--batch", type=float, default=5.0, help="seconds of event time in a scorer batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each case after the warm-up")
    args = parser.parse_args(argv)
    from iotmon.spark import spark_session

    spec = FeatureSpec(args.history)
    spark = spark_session(Settings.from_env(), "bench-features")
    archive = synthetic_silver(spark, args.devices, args.readings).persist()
    archive.count()
    batch_start = START + dt.timedelta(seconds=args.readings - args.batch)
    context = archive.where(F.col(EVENT_TIME) >= spec.lookback_start(batch_start))
    cases = {
        f"whole archive ({args.devices * args.readings:,} readings)": reading_features(archive, spec),
        f"a {args.batch:g} s scorer batch over its {spec.lookback_s:g} s lookback": reading_features(
            context, spec, since=batch_start
        ),
    }
    for name, frame in cases.items():
        timed(frame)
        seconds = sorted(timed(frame) for _ in range(args.repeats))
        runs = ", ".join(f"{s:.2f}" for s in seconds)
        say(f"{name:<55} median {seconds[len(seconds) // 2]:6.2f} s  (runs: {runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
