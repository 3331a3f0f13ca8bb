"""``iotmon stream``: every query of the topology, continuously or until what Kafka holds is in every table."""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING

from iotmon.config import ConfigError, Settings
from iotmon.logs import say

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence
    from typing import TextIO

    from pyspark.sql import SparkSession

    from ml.train import PeriodicTrainer

FIRST_MODEL_POOL, RETRAINING_POOL = "first-model", "retraining"
"""The fair-scheduler pools of a trainer in the stream's session: the first model is as urgent as the scores
it enables (the scorer's weight, ``trainer_pool_weights``), retraining yields to every query."""
TRAINING_JOB_GROUP = "iotmon-training"


def run_stream(
    settings: Settings, stop: threading.Event | None, drain_on_stop: bool = False, train_every_s: float | None = None
) -> None:
    """Continuously until ``stop`` is set, or (``stop`` is None) until what Kafka holds now is in every table.

    With ``drain_on_stop``, a stop lets the running queries read all their sources hold before they stop
    (``pipeline.drain``): for a caller that has stopped what publishes to Kafka first. With ``train_every_s``,
    the model is also trained in the stream's own session (``start_trainer``), until ``stop``."""
    from iotmon.kafka import ensure_topic
    from iotmon.ops import install_progress_recorder
    from iotmon.preflight import require_writable
    from iotmon.schema import INGEST
    from iotmon.spark import spark_session
    from ml import registry
    from pipeline.drain import unread_now
    from pipeline.topology import (
        ensure_tables,
        lead_queries,
        moved_sources,
        outdated_checkpoints,
        pool_weights,
        retired_checkpoints,
        triggers_line,
    )
    from streaming.scoring import SCORING_QUERY

    require_writable(settings, "lake", "checkpoints", "home")
    start_over = "Start over with `iotmon reset`, which keeps Kafka's data for the stream to archive anew"
    if retired := retired_checkpoints(settings):
        raise ConfigError(
            f"{settings.checkpoint_root} holds checkpoints of queries this version replaced ({', '.join(retired)}): "
            f"its ingest query would archive every Kafka record again. {start_over} (or `make demo ARGS=--fresh`)"
        )
    if outdated := outdated_checkpoints(settings):
        remedy = (
            start_over
            if INGEST in outdated
            else "Rebuild the tables below silver from the archive with `iotmon backfill` (it starts those queries "
            "anew), or start over with `iotmon reset`"
        )
        raise ConfigError(
            f"{settings.checkpoint_root} holds checkpoints an earlier version planned otherwise "
            f"({', '.join(outdated)}), which Spark cannot continue. {remedy}"
        )
    if moved := moved_sources(settings):
        raise ConfigError(
            f"{settings.checkpoint_root} holds checkpoints of queries that streamed another table in an earlier "
            f"version ({', '.join(moved)}): Spark refuses them, and what they had not read of it would be in no "
            "table. Rebuild silver and the tables below it from the archive with `iotmon backfill` (it starts "
            "those queries anew), or start over with `iotmon reset`"
        )
    registry.import_mlflow()  # before the queries start: the scorer uses MLflow from their foreachBatch threads
    ensure_topic(settings)
    weights = {**pool_weights(), **(trainer_pool_weights() if train_every_s else {})}
    spark = spark_session(settings, "iotmon-stream", weights)
    ensure_tables(spark, settings)
    with install_progress_recorder(spark, settings):
        if stop is None:
            drain_until_idle(spark, settings)
            return
        say(
            f"streaming {settings.topic} -> {settings.lake_root} ({triggers_line(settings)}); "
            "Ctrl-C or SIGTERM stops cleanly",
            sys.stderr,
        )
        lead, hold = lead_queries(), None
        if train_every_s:
            first_model = registry.champion(settings) is None
            trainer, _ = start_trainer(spark, settings, stop, train_every_s)
            if first_model:
                lead, hold = (*lead, SCORING_QUERY.name), first_model_hold(settings, trainer)
        run_topology(
            spark,
            settings,
            stop,
            unread=(lambda: unread_now(spark, settings)) if drain_on_stop else None,
            lead=lead,
            hold=hold,
        )


def run_topology(
    spark: SparkSession,
    settings: Settings,
    stop: threading.Event,
    out: TextIO = sys.stderr,
    report_every: float = 10.0,
    unread: Callable[[], Sequence[str]] | None = None,
    lead: Iterable[str] | None = None,
    hold: Callable[[], str | None] | None = None,
) -> None:
    """Every query of the topology on its budget's trigger, supervised, with the event clock beside them,
    until ``stop`` (``iotmon.queries.run_continuously``: ``unread``, ``lead`` (by default the queries that read
    Kafka) and ``hold`` are its). What ``iotmon stream`` runs, and the bench measures."""
    from iotmon.queries import run_continuously
    from pipeline.clock import EventClock
    from pipeline.topology import lead_queries, queries, trigger_at, trigger_of, upstream_of

    EventClock(spark, settings, stop, out).start()
    run_continuously(
        spark,
        settings,
        queries(),
        stop,
        out,
        report_every,
        trigger_of=trigger_of(settings),
        trigger_at=trigger_at(settings),
        unread=unread,
        lead=tuple(lead) if lead is not None else lead_queries(),
        hold=hold,
        upstream=upstream_of,
    )


def drain_until_idle(
    spark: SparkSession, settings: Settings, producing: Iterable[str] | None = None, out: TextIO = sys.stderr
) -> dict[str, int]:
    """What the sources hold now through every query, or those the tables ``producing`` need, each with the
    available-now trigger once the queries upstream of it have finished (the others beside it); the rows each
    read. ``iotmon stream --until-idle``'s drain; the tables must exist (``pipeline.topology.ensure_tables``)."""
    from iotmon.queries import run_until_idle
    from pipeline.topology import queries, upstream_of

    return run_until_idle(spark, settings, queries(producing), out, upstream=upstream_of)


def first_model_hold(settings: Settings, trainer: PeriodicTrainer) -> Callable[[], str | None]:
    """What holds back a stream's queries besides ingest and the scorer while there is no model yet: the
    in-session trainer's first run, once silver holds enough to train on.

    Until a model exists nothing is scored, and the first training shares two cores with the other queries'
    cold starts: with them started, the demo's first training took 55 s instead of 25 s, and its first anomaly
    reached the lake 128-133 s after the start instead of 89-101 s (docs/cost-model.md). So the scorer is a lead
    query too, and the others wait for the first run, then for the scorer's first trigger. A silver too short
    to train on holds nothing back: the first run may be minutes away."""
    from ml.features import FeatureSpec
    from ml.train import archive_extent, reason_to_wait

    spec, enough = FeatureSpec.from_settings(settings), False

    def hold() -> str | None:
        nonlocal enough
        if trainer.ran.is_set():
            return None
        if not enough and reason_to_wait(archive_extent(settings), spec, None) is None:
            enough = True
            trainer.look_now()  # not at its next look, up to RETRY_SECONDS later
        return "the first model is training (the scorer needs it)" if enough else None

    return hold


def trainer_pool_weights() -> dict[str, int]:
    """The trainer's pools and their weights: the first model's is the scorer's (``pipeline.topology``)."""
    from pipeline.topology import node
    from streaming.scoring import SCORING_QUERY

    return {FIRST_MODEL_POOL: node(SCORING_QUERY.name).weight, RETRAINING_POOL: 1}


def start_trainer(
    spark: SparkSession, settings: Settings, stop: threading.Event, every_s: float
) -> tuple[PeriodicTrainer, threading.Thread]:
    """Train the anomaly model every ``every_s`` in the stream's session, on a thread of its own, until
    ``stop``; returns the trainer and its thread.

    A JVM that runs the stream has already run most of what training runs (Delta reads, Spark SQL, Python
    workers): the first model, the one the scorer waits for, trains sooner there than in a trainer's cold JVM
    beside it (the demo's: 122 s against 178 s, docs/cost-model.md). Its jobs run in a pool weighted as the
    scorer until a champion exists, then in one that yields to every query. A stop cancels the run in
    progress; the champion stays as it was.
    """
    from iotmon.queries import SCHEDULER_POOL
    from ml import registry
    from ml.train import PeriodicTrainer, default_options

    def session() -> SparkSession:  # called on the trainer's thread: pool and group are the thread's
        pool = RETRAINING_POOL if registry.champion(settings) is not None else FIRST_MODEL_POOL
        spark.sparkContext.setLocalProperty(SCHEDULER_POOL, pool)
        spark.sparkContext.setJobGroup(TRAINING_JOB_GROUP, "periodic training", interruptOnCancel=True)
        return spark

    trainer = PeriodicTrainer(settings, session, lambda: default_options(settings), every_s)
    thread = trainer.start(stop, lambda: spark.sparkContext.cancelJobGroup(TRAINING_JOB_GROUP))
    return trainer, thread
