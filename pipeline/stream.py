"""``iotmon stream``: every query of the topology, continuously or until what Kafka holds is in every table."""

from __future__ import annotations

import sys
import threading

from iotmon.config import ConfigError, Settings


def run_stream(settings: Settings, stop: threading.Event | None, drain_on_stop: bool = False) -> None:
    """Continuously until ``stop`` is set, or (``stop`` is None) until what Kafka holds now is in every table.

    With ``drain_on_stop``, a stop lets the running queries read all their sources hold before they stop
    (``pipeline.drain``): for a caller that has stopped what publishes to Kafka first."""
    from iotmon.kafka import ensure_topic
    from iotmon.ops import install_progress_recorder
    from iotmon.preflight import require_writable
    from iotmon.queries import run_continuously, run_until_idle
    from iotmon.spark import spark_session
    from ml.registry import import_mlflow
    from pipeline.clock import EventClock
    from pipeline.drain import unread_now
    from pipeline.topology import (
        ensure_tables,
        pool_weights,
        queries,
        retired_checkpoints,
        source_reads,
        trigger_of,
        triggers_line,
    )

    require_writable(settings, "lake", "checkpoints", "home")
    if retired := retired_checkpoints(settings):
        raise ConfigError(
            f"{settings.checkpoint_root} holds checkpoints of queries this version replaced ({', '.join(retired)}): "
            "its ingest query would archive every Kafka record again. Start over with `iotmon reset`, which "
            "keeps Kafka's data for the stream to archive anew (or `make demo ARGS=--fresh`)"
        )
    import_mlflow()  # before the queries start: the scorer uses MLflow from their foreachBatch threads
    ensure_topic(settings)
    spark = spark_session(settings, "iotmon-stream", pool_weights())
    ensure_tables(spark, settings)
    with install_progress_recorder(spark, settings, source_reads=source_reads()):
        if stop is None:
            run_until_idle(spark, settings, queries())
            return
        EventClock(spark, settings, stop).start()
        print(
            f"streaming {settings.topic} -> {settings.lake_root} ({triggers_line(settings)}); "
            "Ctrl-C or SIGTERM stops cleanly",
            file=sys.stderr,
            flush=True,
        )
        run_continuously(
            spark,
            settings,
            queries(),
            stop,
            trigger_of=trigger_of(settings),
            unread=(lambda: unread_now(spark, settings)) if drain_on_stop else None,
        )
