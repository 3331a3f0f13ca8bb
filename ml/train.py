"""``iotmon train``: learn the anomaly model from the archive, track it in MLflow, promote it if not worse.

One run reads silver at a pinned Delta version (recorded in the run with the data's time range), so the
run can be reproduced exactly. The older part of that snapshot trains; the most recent ``holdout`` share
of its time range evaluates. The challenger is registered as a new version either way; the ``champion``
alias moves only if, on the same holdout rows, the challenger's F1 against the ground truth is not below
the champion's. Without labels for the holdout there is nothing to compare: the first model becomes
champion, later ones wait for a data scientist's ``--promote``. Any failure leaves the alias untouched.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from iotmon.config import Settings
from iotmon.logs import say
from iotmon.schema import DEVICE_ID, EVENT_TIME, SILVER
from ml import registry
from ml.evaluation import detection_metrics, label_scores, truth_labels
from ml.features import FEATURE_VERSION, MIN_HISTORY, FeatureSpec, metric_rows, model_inputs, reading_features
from ml.model import ModelParams, anomaly_pipeline, anomaly_scores

MIN_READINGS = 1_000
MIN_SPAN_HISTORIES = 4
"""Event time silver must span, in feature histories: most training readings then have a full history."""
STEP_PREFIX = "train: "
"""Each step's progress line starts so (stderr): a supervisor can tell a working trainer from a stuck one."""
LOG_STEP = "logging the run and the model to MLflow"
"""The progress line of the step that writes to MLflow (run, model, registry, alias): where a crash hurts most."""


SAMPLE_BUCKETS = 10_000
"""Devices are sampled by a hash of their id into this many buckets."""


def device_sample(readings: DataFrame, share: float) -> DataFrame:
    """The readings of a fixed ``share`` of the devices, chosen by a hash of the id: each kept device keeps
    its whole history, so every kept reading has the features it has in the full archive, and a larger
    archive keeps the devices a smaller one kept."""
    if share >= 1.0:
        return readings
    return readings.where(F.pmod(F.xxhash64(DEVICE_ID), F.lit(SAMPLE_BUCKETS)) < F.lit(share * SAMPLE_BUCKETS))


def span_to_train_s(spec: FeatureSpec) -> float:
    """Seconds of event time silver must span before a model can be trained (a demo publishes that much past)."""
    return MIN_SPAN_HISTORIES * spec.history_s


class TrainingError(RuntimeError):
    """Training cannot run (no archive yet, too little data); the message says what to do."""


class TrainingStopped(RuntimeError):
    """The run was asked to stop (``train``'s ``stop``) and gave up before its next step."""


@dataclass(frozen=True)
class ArchiveExtent:
    """How much silver holds: enough to train on, or what is missing."""

    version: int
    readings: int
    start: datetime | None
    end: datetime | None

    def shortfall(self, spec: FeatureSpec) -> str | None:
        needed = span_to_train_s(spec)
        span = (self.end - self.start).total_seconds() if self.start and self.end else 0.0
        if self.readings >= MIN_READINGS and span >= needed:
            return None
        return (
            f"silver v{self.version} holds {self.readings:,} readings over {span:.0f}s of event time; training "
            f"needs {MIN_READINGS:,} over {needed:.0f}s ({MIN_SPAN_HISTORIES} feature histories)"
        )


def archive_extent(settings: Settings) -> ArchiveExtent | None:
    """Silver's extent from its Delta file statistics (delta-rs, no Spark): a periodic trainer can wait for
    enough data without a JVM of its own competing with the stream's start."""
    from deltalake import DeltaTable as RustDeltaTable

    from iotmon.status import newest, oldest, row_count

    path = settings.table_path(SILVER)
    if not RustDeltaTable.is_deltatable(path):
        return None
    table = RustDeltaTable(path)

    def naive_utc(moment: datetime | None) -> datetime | None:  # as Spark hands timestamps to Python
        return moment.astimezone(UTC).replace(tzinfo=None) if moment and moment.tzinfo else moment

    readings = row_count(table)
    if readings == 0:
        return ArchiveExtent(table.version(), 0, None, None)
    return ArchiveExtent(
        table.version(), readings, naive_utc(oldest(table, EVENT_TIME)), naive_utc(newest(table, EVENT_TIME))
    )


def past_to_publish_s(settings: Settings) -> float:
    """Seconds of a fleet's past a demo publishes before going live: the span the first model needs while
    silver is short of it (a fresh lake), none once it has enough (a resumed demo)."""
    spec = FeatureSpec.from_settings(settings)
    extent = archive_extent(settings)
    return span_to_train_s(spec) if extent is None or extent.shortfall(spec) else 0.0


def reason_to_wait(extent: ArchiveExtent | None, spec: FeatureSpec, trained_on: int | None) -> str | None:
    """Why a periodic trainer should not train now: no archive yet, too little of it, or nothing new since its
    last run (a stopped stream or an idle fleet would otherwise register the same model again and again)."""
    if extent is None:
        return "no silver table yet"
    if extent.version == trained_on:
        return f"silver v{extent.version} has not changed since the last run"
    return extent.shortfall(spec)


@dataclass(frozen=True)
class TrainOptions:
    params: ModelParams = field(default_factory=ModelParams)
    holdout: float = 0.2
    truth: tuple[Path, ...] = ()
    promote: bool = False
    """Promote even without labels to compare on (a data scientist's decision)."""


@dataclass
class TrainReport:
    run_id: str
    version: int
    silver_version: int
    readings: int
    device_share: float
    """The share of the devices trained and evaluated on (``IOTMON_TRAIN_MAX_READINGS``)."""
    data_start: datetime
    data_end: datetime
    threshold: float
    metrics: dict[str, float]
    champion_version: int | None
    champion_metrics: dict[str, float] | None
    promoted: bool
    decision: str
    seconds: dict[str, float]

    def report(self) -> str:
        lines = [
            f"trained {registry.EXPERIMENT} run {self.run_id}: registered version {self.version}",
            f"  data: silver v{self.silver_version}, {self.readings:,} readings, {self.data_start} .. {self.data_end}"
            + ("" if self.device_share >= 1.0 else f"; fitted on a {self.device_share:.0%} share of the devices"),
            f"  threshold {self.threshold:.4f}; time " + ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items()),
        ]
        if "f1" in self.metrics:
            lines.append("  holdout (per reading)   precision  recall     f1   episodes found")
            for prefix, name in [("", "all")] + [(f"{t}_", t) for t in _types(self.metrics)]:
                episodes = self.metrics.get(f"{prefix}episode_recall")
                lines.append(
                    f"    {name:<20} {self.metrics[prefix + 'precision']:>9.3f} {self.metrics[prefix + 'recall']:>7.3f}"
                    f" {self.metrics[prefix + 'f1']:>6.3f}" + (f"   {episodes:>6.1%}" if episodes is not None else "")
                )
            false_alarms = self.metrics["false_alarms"]
            lines.append(
                f"    false alarms {false_alarms:,.0f} ({self.metrics['false_alarm_rate']:.3%} of normal readings)"
            )
        if self.champion_metrics and "f1" in self.champion_metrics:
            current, rate = self.champion_metrics["f1"], self.champion_metrics["false_alarm_rate"]
            lines.append(
                f"  champion v{self.champion_version} on the same holdout: f1 {current:.3f}, false alarms {rate:.3%}"
            )
        lines.append(f"  {'PROMOTED' if self.promoted else 'not promoted'}: {self.decision}")
        return "\n".join(lines)


def _types(metrics: dict[str, float]) -> list[str]:
    from iotmon.schema import ANOMALY_TYPES

    return [t for t in ANOMALY_TYPES if f"{t}_f1" in metrics]


class _Steps:
    """Progress lines, one per step, and how long each step took; between steps, whether to go on."""

    def __init__(self, out: TextIO, stop: threading.Event | None = None) -> None:
        self.out, self.stop = out, stop
        self.seconds: dict[str, float] = {}
        self.current: str | None = None
        self.started = 0.0

    def go_on(self) -> None:
        """Raise ``TrainingStopped`` if the run was asked to stop."""
        if self.stop is not None and self.stop.is_set():
            raise TrainingStopped(f"stopped after step {self.current or 'none'}")

    def __call__(self, name: str, message: str) -> None:
        self.go_on()
        self.finish()
        say(f"{STEP_PREFIX}{message}", self.out)
        self.current, self.started = name, time.monotonic()

    def finish(self) -> None:
        if self.current is not None:
            self.seconds[self.current] = time.monotonic() - self.started
            self.current = None


def pinned_silver(spark: SparkSession, settings: Settings) -> tuple[ArchiveExtent, DataFrame]:
    """Silver at its current version, with that version's extent from the Delta log's statistics: no scan of
    the archive to learn what it holds."""
    extent = archive_extent(settings)
    if extent is None:
        path = settings.table_path(SILVER)
        raise TrainingError(f"no silver table at {path}: run `iotmon stream` (and a simulator) first")
    return extent, spark.read.format("delta").option("versionAsOf", extent.version).load(settings.table_path(SILVER))


def train(
    spark: SparkSession,
    settings: Settings,
    options: TrainOptions,
    out: TextIO = sys.stderr,
    stop: threading.Event | None = None,
) -> TrainReport:
    """Fit, evaluate and log a model on silver as it is now, and promote it if it is not worse than the champion.

    A set ``stop`` ends the run at its next step (``TrainingStopped``), and before a promotion: the repeated
    cancels of a stopped run's Spark jobs (``PeriodicTrainer.start``) miss what runs between them."""
    import mlflow
    import mlflow.spark

    step = _Steps(out, stop)
    step("read", "reading silver")
    extent, archive = pinned_silver(spark, settings)
    spec = FeatureSpec.from_settings(settings)
    shortfall = extent.shortfall(spec)
    if shortfall:
        raise TrainingError(shortfall)
    silver_version, readings, start, end = extent.version, extent.readings, extent.start, extent.end
    assert start is not None and end is not None  # a table with readings and no statistics falls short
    # Training, the threshold, the evaluation and the champion's comparison all see the same devices.
    share = min(1.0, settings.train_max_readings / readings)
    silver = device_sample(archive, share)
    split = start + (end - start) * (1 - options.holdout)
    sampled = "" if share >= 1.0 else f", a {share:.0%} share of the devices (IOTMON_TRAIN_MAX_READINGS)"
    step("features", f"silver v{silver_version}: {readings:,} readings {start} .. {end}{sampled}; computing features")
    featured = reading_features(silver, spec).persist()
    training = featured.where(F.col(EVENT_TIME) < F.lit(split))
    fit_rows = model_inputs(metric_rows(training)).persist()
    fit_rows.count()
    step("fit", f"fitting {options.params} on {fit_rows.count():,} (reading, metric) rows before {split}")
    pipeline = anomaly_pipeline(options.params).fit(fit_rows)
    fit_rows.unpersist()
    step("threshold", "choosing the threshold")
    train_scores = anomaly_scores(training, pipeline)
    threshold = train_scores.approxQuantile("score", [1.0 - options.params.contamination], 0.0001)[0]
    if threshold <= 0.0:
        raise TrainingError(
            f"the training readings barely have features: a device needs {MIN_HISTORY + 1} readings within "
            f"IOTMON_FEATURE_HISTORY ({spec.history_s:g}s) before its features count; raise it"
        )
    step("evaluate", f"threshold {threshold:.4f}; evaluating on the holdout after {split}")
    holdout = featured.where(F.col(EVENT_TIME) >= F.lit(split))
    labels = truth_labels(spark, list(options.truth)) if options.truth else None
    metrics = _evaluate(holdout, pipeline, threshold, labels)
    champion = registry.champion(settings)
    champion_metrics = None
    if champion is not None and "f1" in metrics:
        champion_metrics = _evaluate_champion(settings, champion, silver, featured, split, labels, spec)
    promoted, decision = _decide(metrics, champion, champion_metrics, options.promote)
    step("log", LOG_STEP)
    client = registry.tracking(settings)
    # MLflow's "Created version ..." prints stay off the console: the run's report says it.
    with registry.quiet(settings), mlflow.start_run(experiment_id=registry.experiment_id(settings)) as run:
        mlflow.log_params(
            {
                **{f"model_{k}": v for k, v in asdict(options.params).items()},
                "feature_history_s": spec.history_s,
                "holdout": options.holdout,
                "silver_path": settings.table_path(SILVER),
                "silver_version": silver_version,
                "readings": readings,
                "device_share": share,
                "data_start": start.isoformat(),
                "data_end": end.isoformat(),
                "holdout_start": split.isoformat(),
                "truth_files": ",".join(p.name for p in options.truth) or "none",
            }
        )
        mlflow.log_metrics({"threshold": threshold, **metrics})
        if champion_metrics:
            mlflow.log_metrics({f"champion_{k}": v for k, v in champion_metrics.items()})
        info = mlflow.spark.log_model(
            pipeline,
            registry.MODEL_ARTIFACT,
            registered_model_name=settings.model_name,
            dfs_tmpdir=registry.scratch_dir(settings),
            pip_requirements=registry.pip_requirements(),
        )
        version = int(info.registered_model_version)
        client.set_model_version_tag(settings.model_name, str(version), registry.THRESHOLD_TAG, repr(threshold))
        client.set_model_version_tag(settings.model_name, str(version), registry.HISTORY_TAG, repr(spec.history_s))
        client.set_model_version_tag(settings.model_name, str(version), registry.FEATURES_TAG, str(FEATURE_VERSION))
        mlflow.set_tags(
            {registry.DECISION_TAG: decision, registry.PROMOTED_TAG: str(promoted), "registered_version": str(version)}
        )
        if champion is not None:
            mlflow.set_tag("champion_version", str(champion.version))
        if promoted:
            step.go_on()  # a stop during the log step leaves a registered version, never a new champion
            registry.promote(settings, version)
    featured.unpersist()
    step.finish()
    return TrainReport(
        run.info.run_id,
        version,
        silver_version,
        readings,
        share,
        start,
        end,
        threshold,
        metrics,
        champion.version if champion else None,
        champion_metrics,
        promoted,
        decision,
        step.seconds,
    )


def _evaluate(holdout: DataFrame, pipeline, threshold: float, labels: DataFrame | None) -> dict[str, float]:
    scores = anomaly_scores(holdout, pipeline)
    if labels is None:
        flagged = scores.agg(F.count("*"), F.count(F.when(F.col("score") > threshold, 1))).first()
        return {"holdout_readings": float(flagged[0]), "holdout_flagged": float(flagged[1])}
    # Held: the metrics are three Spark actions over it, each of which would score the holdout again in Python
    # and join it with the labels (half the step's time, on the first model's path to the first anomaly).
    labelled = label_scores(scores, labels).persist()
    try:
        if labelled.isEmpty():
            return {"holdout_readings": float(scores.count())}
        return detection_metrics(labelled, threshold)
    finally:
        labelled.unpersist()


def _evaluate_champion(
    settings: Settings,
    champion: registry.ModelRef,
    silver: DataFrame,
    featured: DataFrame,
    split: datetime,
    labels: DataFrame | None,
    spec: FeatureSpec,
) -> dict[str, float] | None:
    """The champion on the same holdout, with the features it was trained with; None if it cannot load."""
    try:
        pipeline = registry.load_pipeline(settings, champion)
    except registry.ModelUnusable:
        return None
    if champion.feature_history_s != spec.history_s:
        featured = reading_features(silver, replace(spec, history_s=champion.feature_history_s))
    holdout = featured.where(F.col(EVENT_TIME) >= F.lit(split))
    return _evaluate(holdout, pipeline, champion.threshold, labels)


def _decide(
    metrics: dict[str, float],
    champion: registry.ModelRef | None,
    champion_metrics: dict[str, float] | None,
    force: bool,
) -> tuple[bool, str]:
    if force:
        return True, "promoted on request (--promote)"
    if champion is None:
        return True, "first model: no champion yet"
    if champion_metrics is None and "f1" in metrics:
        return True, f"champion v{champion.version} cannot be loaded or evaluated"
    if "f1" not in metrics:
        return False, "no ground truth for the holdout to compare with; promote with --promote"
    # F1 first; on a tie, fewer false alarms. A holdout without an anomaly episode scores every model's F1 at
    # 0, and then only the false alarms tell a better model from a worse one.
    challenger, current = _merit(metrics), _merit(champion_metrics)
    verdict = ">=" if challenger >= current else "<"
    decision = (
        f"holdout f1 {metrics['f1']:.3f}, false alarms {metrics['false_alarm_rate']:.3%} {verdict} champion "
        f"v{champion.version}'s {champion_metrics['f1']:.3f}, {champion_metrics['false_alarm_rate']:.3%}"
    )
    return challenger >= current, decision


def _merit(metrics: dict[str, float]) -> tuple[float, float]:
    """What a promotion compares: F1, then the false-alarm rate (lower is better)."""
    return metrics["f1"], -metrics["false_alarm_rate"]


def default_options(settings: Settings) -> TrainOptions:
    """``iotmon train``'s defaults, evaluated against every simulator run's ground truth there is now."""
    from simulators.truth import available_truth

    params = ModelParams(contamination=settings.anomaly_contamination)
    return TrainOptions(params=params, truth=tuple(available_truth(settings.truth_dir)))


# -- Periodic training ------------------------------------------------------------------------------------

RETRY_SECONDS = 5.0
"""How soon a periodic trainer looks again when the archive is still too small to train on (or unchanged)."""
WAIT_LINE_SECONDS = 60.0
"""... and how often it says so."""
CANCEL_EVERY_SECONDS = 1.0
"""After a stop, how often the run's Spark jobs are cancelled again until it has given up."""


class PeriodicTrainer:
    """Train, then again ``every_s`` after each run ends, until ``stop``: what ``iotmon train --every`` runs in a
    process of its own, and ``iotmon demo`` in the stream's Spark session (``pipeline.stream``).

    Whether to train is decided without Spark (``archive_extent``): no session is asked for until there is
    data. A run that fails, or finds too little or nothing new, leaves the champion as it was and is tried
    again; ``on_retraining`` is called before each run that has a champion to replace: only a run with none to
    score with is urgent, so a trainer started beside a stream that already scores yields from its first run
    on. ``ran`` is set once a run has ended, whatever its outcome: a stream starting with no model holds back
    the queries the first one does not need until then (``pipeline.stream``). ``start`` runs it on a thread of
    its own and gives up the run in progress at the stop.
    """

    def __init__(
        self,
        settings: Settings,
        session: Callable[[], SparkSession],
        options: Callable[[], TrainOptions],
        every_s: float,
        on_retraining: Callable[[], None] = lambda: None,
        out: TextIO | None = None,
        err: TextIO | None = None,
    ) -> None:
        self.settings, self.session, self.options, self.every_s = settings, session, options, every_s
        self.on_retraining, self.out, self.err = on_retraining, out or sys.stdout, err or sys.stderr
        self.ran = threading.Event()
        self._look = threading.Event()
        """Ends a wait between looks: set by ``look_now`` and by the stop."""

    def look_now(self) -> None:
        """Look at the archive now instead of at the next look: for a caller that has just seen it grow enough to
        train on (``pipeline.stream``: the first model, which the scorer waits for, starts at once)."""
        self._look.set()

    def run(self, stop: threading.Event) -> None:
        """Train periodically until ``stop``, on the calling thread."""

        def wake_at_stop() -> None:
            stop.wait()
            self._look.set()

        waker = threading.Thread(target=wake_at_stop, name="iotmon-trainer-wake", daemon=True)
        waker.start()
        try:
            self._train_until(stop)
        finally:
            if stop.is_set():
                waker.join()  # it has seen the stop: gone before the caller's thread is

    def _train_until(self, stop: threading.Event) -> None:
        spec, trained_on = FeatureSpec.from_settings(self.settings), None
        last_wait_line = -WAIT_LINE_SECONDS
        while True:
            started, wait, attempted = time.monotonic(), self.every_s, False
            try:
                if reason := reason_to_wait(archive_extent(self.settings), spec, trained_on):
                    raise TrainingError(reason)
                if stop.is_set():  # stopped while deciding: no run to start
                    return
                attempted = True
                if registry.champion(self.settings) is not None:  # nothing waits for this run: it yields
                    self.on_retraining()
                report = train(self.session(), self.settings, self.options(), stop=stop)
                # The next run starts a full interval after this one ended: on a busy machine a run can outlast
                # the interval, and back-to-back runs would hold the cores the stream needs.
                started, trained_on = time.monotonic(), report.silver_version
                say(report.report(), self.out)
            except TrainingError as exc:  # not enough data, or nothing new, yet: look again soon
                wait = min(self.every_s, RETRY_SECONDS)
                if time.monotonic() - last_wait_line >= WAIT_LINE_SECONDS:
                    say(f"iotmon train: {exc}; looking again every {wait:g}s", self.err)
                    last_wait_line = time.monotonic()
            except Exception as exc:  # keep retraining; the champion stays whatever it was
                if stop.is_set():
                    say("iotmon train: stopped; the run in progress was abandoned, champion unchanged", self.out)
                    return
                say(f"iotmon train: run failed, champion unchanged: {exc}", self.err)
            if attempted:
                self.ran.set()
                self._look.clear()  # a look asked for during the run was the run: the next waits its interval
            if not stop.is_set():
                self._look.wait(max(0.0, wait - (time.monotonic() - started)))
                self._look.clear()
            if stop.is_set():
                return

    def start(self, stop: threading.Event, cancel: Callable[[], None]) -> threading.Thread:
        """``run`` on a thread of its own (returned) until ``stop``; at the stop, ``cancel`` (the run's Spark jobs)
        is called until the run gives up. Once is not enough: a run computing features in Python, or starting
        its session, meanwhile starts its next job after the cancel, and would otherwise finish (and promote).

        Once the returned thread has ended, ``cancel`` is neither running nor called again, so the caller may
        then stop the session it cancels jobs in: the thread retires its canceller before it ends."""
        finished = threading.Event()

        def cancel_at_stop() -> None:
            while not stop.wait(CANCEL_EVERY_SECONDS):
                if finished.is_set():  # the run ended without a stop (it raised): nothing to cancel, ever
                    return
            while not finished.is_set():
                cancel()
                finished.wait(CANCEL_EVERY_SECONDS)

        canceller = threading.Thread(target=cancel_at_stop, name="iotmon-trainer-stop", daemon=True)

        def run_then_retire_the_canceller() -> None:
            try:
                self.run(stop)
            finally:
                finished.set()
                canceller.join()

        thread = threading.Thread(target=run_then_retire_the_canceller, name="iotmon-trainer", daemon=True)
        canceller.start()
        thread.start()
        return thread
