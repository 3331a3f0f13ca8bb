"""The anomaly loop on the real broker, Spark, Delta and a local MLflow: train, gate, score, hot-swap."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from ingest.silver import READING_KEY
from iotmon.config import Settings
from iotmon.schema import ANOMALIES, SILVER
from ml import registry
from ml.features import FEATURE_VERSION, FeatureSpec
from ml.model import ModelParams
from ml.train import TrainingError, TrainOptions, archive_extent, past_to_publish_s, span_to_train_s, train
from pipeline.stream import TRAINING_JOB_GROUP, drain_until_idle, start_trainer
from pipeline.topology import ensure_tables
from simulators.options import SimulationOptions
from simulators.publish import run_simulation
from streaming import scoring
from streaming.history import FEATURE_INPUTS
from streaming.scoring import SCORING_QUERY, serving_model, start_scoring
from streaming.verify import anomalies_against_silver
from tests.support import wait_for

pytestmark = pytest.mark.integration

START = dt.datetime(2026, 11, 21, 6, 0, 0, tzinfo=dt.UTC)


def _simulate(settings: Settings, truth: Path, start: dt.datetime, duration: float) -> None:
    """The same seed every time: a later run extends the fleet's history instead of replacing its registry."""
    options = SimulationOptions(
        devices=60, seed=21, duration=duration, interval=1.0, start=start, truth_path=truth, progress=False
    )
    assert run_simulation(settings, options).failed == 0


def _archive_to_silver(spark: SparkSession, settings: Settings) -> None:
    ensure_tables(spark, settings)
    drain_until_idle(spark, settings, [SILVER])


def _keys(spark: SparkSession, settings: Settings, table: str):
    return spark.read.format("delta").load(settings.table_path(table)).select(*READING_KEY)


def test_trainer_refuses_an_empty_archive_with_a_reason(isolated: Settings, spark: SparkSession) -> None:
    assert archive_extent(isolated) is None
    needed = span_to_train_s(FeatureSpec.from_settings(isolated))
    assert past_to_publish_s(isolated) == needed > 0, "a fresh demo publishes the past its first model needs"
    ensure_tables(spark, isolated)  # silver exists but holds nothing yet: the demo's first seconds
    assert archive_extent(isolated).readings == 0
    assert past_to_publish_s(isolated) == needed
    with pytest.raises(TrainingError, match=r"holds 0 readings .* training needs 1,000"):
        train(spark, isolated, TrainOptions(params=ModelParams()))
    assert registry.champion(isolated) is None


@pytest.fixture(scope="module")
def shared_archive(
    kafka: Settings, spark: SparkSession, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Settings, Path]:
    """One simulated archive for the module (the later test extends it); each test has an MLflow of its own."""
    root = tmp_path_factory.mktemp("ml-archive")
    settings = dataclasses.replace(
        kafka, topic="ml-archive", lake=str(root / "lake"), checkpoints=str(root / "checkpoints"), home=root
    )
    truth = root / "truth-a.parquet"
    _simulate(settings, truth, START, duration=900)
    _archive_to_silver(spark, settings)
    return settings, truth


@pytest.fixture
def archive(shared_archive: tuple[Settings, Path], tmp_path: Path) -> tuple[Settings, Path]:
    settings, truth = shared_archive
    return dataclasses.replace(settings, home=tmp_path), truth


def test_trainer_registers_promotes_and_keeps_the_champion_against_worse_or_broken_ones(
    archive, spark, monkeypatch, capsys
) -> None:
    settings, truth = archive
    assert registry.champion(settings) is None
    assert SCORING_QUERY.waiting_for(spark, settings) is not None  # no model: the scorer waits

    first = train(spark, settings, TrainOptions(truth=(truth,)))
    assert (first.version, first.promoted) == (1, True)
    console = capsys.readouterr()
    assert "Successfully registered" not in console.err and "Created version" not in console.err, "MLflow's prints"
    # The periodic trainer's Spark-free look at silver sees what the run read.
    extent = archive_extent(settings)
    assert (extent.readings, extent.start, extent.end) == (first.readings, first.data_start, first.data_end)
    assert past_to_publish_s(settings) == 0.0, "a resumed demo's silver already spans enough: no past"
    assert first.metrics["f1"] > 0.6, first.report()
    assert registry.champion(settings).version == 1
    run = registry.tracking(settings).get_run(first.run_id)
    silver_version = spark.sql(f"DESCRIBE HISTORY delta.`{settings.table_path(SILVER)}`").first()["version"]
    assert run.data.params["silver_version"] == str(silver_version)
    assert run.data.params["data_start"] == first.data_start.isoformat()
    assert float(run.data.params["device_share"]) == first.device_share
    assert float(registry.champion(settings).threshold) == pytest.approx(first.threshold)

    # A challenger that flags a third of all readings: registered, compared on the same holdout, refused.
    worse = train(spark, settings, TrainOptions(params=ModelParams(contamination=0.3), truth=(truth,)))
    assert worse.version == 2 and not worse.promoted
    assert worse.champion_metrics is not None
    assert worse.metrics["f1"] < worse.champion_metrics["f1"] == pytest.approx(first.metrics["f1"])
    assert registry.champion(settings).version == 1
    assert registry.tracking(settings).get_run(worse.run_id).data.tags["promoted"] == "False"
    assert SCORING_QUERY.waiting_for(spark, settings) is None  # v1 loads: the scorer can run

    # Someone promotes a version whose artifacts are gone: the scorer keeps serving the last good one.
    client = registry.tracking(settings)
    broken = client.create_model_version(settings.model_name, source=str(settings.home / "nowhere"))
    tags = {registry.THRESHOLD_TAG: "1.0", registry.HISTORY_TAG: "60.0", registry.FEATURES_TAG: str(FEATURE_VERSION)}
    for tag, value in tags.items():
        client.set_model_version_tag(settings.model_name, broken.version, tag, value)
    registry.promote(settings, int(broken.version))

    warnings: list[str] = []
    ref, _ = serving_model(settings, None, warn=warnings.append)
    assert ref.version == 1 and f"v{broken.version} cannot be loaded" in warnings[0]
    # A process that never loaded a good version waits instead of failing.
    monkeypatch.setattr(scoring, "MODELS", scoring.ModelCache())
    with pytest.raises(scoring.ModelUnavailable):
        serving_model(settings, None)
    assert "cannot be loaded" in SCORING_QUERY.waiting_for(spark, settings)


def test_the_scorers_silver_reader_reads_each_device_in_its_range(archive, spark) -> None:
    """What the scorer's history relies on (tests/unit/test_history.py replays it): the rows of the devices it
    is asked for, each from its time on, through its end time or to the end of silver when it has none."""
    settings, _ = archive
    silver = spark.read.format("delta").load(settings.table_path(SILVER))
    devices = [row[0] for row in silver.select("device_id").distinct().orderBy("device_id").collect()]
    event_us = F.unix_micros("event_time")

    def times(device: str) -> list[int]:
        return sorted(row[0] for row in silver.where(F.col("device_id") == device).select(event_us).collect())

    def read_times(read: pa.Table, device: str) -> list[int]:
        return sorted(
            us
            for d, us in zip(
                read.column("device_id").to_pylist(),
                read.column("event_time").cast(pa.int64()).to_pylist(),
                strict=True,
            )
            if d == device
        )

    to_end, bounded = times(devices[0]), times(devices[1])  # of several: the others must not be read
    start_us, (from_us, through_us) = to_end[len(to_end) // 2], (bounded[10], bounded[20])
    read = scoring.silver_reader(spark, settings)({devices[0]: (start_us, None), devices[1]: (from_us, through_us)})
    assert len(devices) > 2 and set(read.column("device_id").to_pylist()) == set(devices[:2])
    assert read_times(read, devices[0]) == to_end[len(to_end) // 2 :]  # from the time given to silver's end
    assert read_times(read, devices[1]) == bounded[10:21]  # both ends included
    assert read.column_names == list(FEATURE_INPUTS)
    # The range alone, without a device read to silver's end beside it.
    read = scoring.silver_reader(spark, settings)({devices[1]: (from_us, through_us)})
    assert read_times(read, devices[1]) == bounded[10:21] and read.num_rows == 11


def test_scorer_scores_every_reading_and_follows_a_promotion_without_restart(archive, spark) -> None:
    settings, truth = archive
    assert train(spark, settings, TrainOptions(truth=(truth,))).version == 1
    # A cap of one byte: the backlog is scored a file a batch (the cap is soft: whole files).
    settings = dataclasses.replace(settings, scorer_batch_bytes=1)
    silver_files = spark.sql(f"DESCRIBE DETAIL delta.`{settings.table_path(SILVER)}`").first()["numFiles"]
    query = start_scoring(spark, settings, {"processingTime": "1 second"})
    try:
        silver_rows = _keys(spark, settings, SILVER).count()
        wait_for(lambda: _keys(spark, settings, ANOMALIES).count() >= silver_rows, 240, "first scores")
        first_batches = len(query.recentProgress)
        backlog_batches = [p for p in query.recentProgress if p["numInputRows"] > 0]
        assert silver_files > 1 and len(backlog_batches) == silver_files, (silver_files, len(backlog_batches))

        # A data scientist promotes a new version while the scorer runs; then new readings arrive. This one is
        # fitted on a fifth of the fleet's devices: the sample a large archive gets.
        sampled = train(spark, dataclasses.replace(settings, train_max_readings=10_000), TrainOptions(promote=True))
        assert sampled.version == 2 and 0.1 < sampled.device_share < 0.3, sampled.device_share
        _simulate(settings, settings.home / "truth-b.parquet", START + dt.timedelta(seconds=900), duration=120)
        _archive_to_silver(spark, settings)
        silver_rows = _keys(spark, settings, SILVER).count()
        wait_for(lambda: _keys(spark, settings, ANOMALIES).count() >= silver_rows, 240, "scores of the new readings")
        assert query.isActive and len(query.recentProgress) > first_batches
    finally:
        query.stop()

    anomalies = spark.read.format("delta").load(settings.table_path(ANOMALIES))
    # Every silver reading scored exactly once.
    assert anomalies.count() == silver_rows
    assert anomalies.select(*READING_KEY).distinct().count() == silver_rows
    assert _keys(spark, settings, SILVER).exceptAll(anomalies.select(*READING_KEY)).isEmpty()
    # The first backlog under v1, what came after the promotion under v2.
    cut = F.lit(START + dt.timedelta(seconds=900))
    versions = {
        (row["new"], row["model_version"])
        for row in anomalies.select((F.col("event_time") >= cut).alias("new"), "model_version").distinct().collect()
    }
    assert versions == {(False, 1), (True, 2)}
    flagged = anomalies.where("is_anomaly").count()
    assert 0 < flagged < silver_rows * 0.05
    assert anomalies.where("is_anomaly != (score > threshold)").isEmpty()
    # Scored batch by batch from the scorer's history as a batch job over all of silver scores them.
    checked, problems = anomalies_against_silver(
        spark, settings, spark.read.format("delta").load(settings.table_path(SILVER))
    )
    assert problems == [] and checked == silver_rows


def test_a_trainer_in_the_stream_session_gives_up_its_run_at_a_stop_and_otherwise_promotes(
    archive, spark, capsys
) -> None:
    # The demo's trainer: a thread of the stream's process, its jobs in a group that a stop cancels.
    settings, _ = archive
    jobs = spark.sparkContext.statusTracker()
    stop = threading.Event()
    _, thread = start_trainer(spark, settings, stop, every_s=300.0)
    wait_for(lambda: jobs.getJobIdsForGroup(TRAINING_JOB_GROUP), 300, "a training job", poll=0.1)
    stop.set()
    wait_for(lambda: not thread.is_alive(), 120, "the trainer to give up its run")
    assert "iotmon train: stopped; the run in progress was abandoned" in capsys.readouterr().out
    assert registry.champion(settings) is None, "a run given up promotes nothing"

    stop = threading.Event()
    trainer, thread = start_trainer(spark, settings, stop, every_s=300.0)
    wait_for(trainer.ran.is_set, 600, "the first run to end")  # what a stream's hold waits for
    assert registry.champion(settings) is not None, "the first model"
    stop.set()  # the trainer now waits for its next run: it ends at once
    wait_for(lambda: not thread.is_alive(), 60, "the trainer to stop")
    out = capsys.readouterr().out
    assert "trained iotmon-anomaly run " in out and "PROMOTED: first model" in out, out
    assert registry.champion(settings).version == 1
