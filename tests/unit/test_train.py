"""When the periodic trainer trains, and when it waits (decided from silver's extent, without Spark); when a
new model replaces the champion; which devices it trains on."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from pyspark.sql import SparkSession

from iotmon.schema import DEVICE_ID
from ml.features import FeatureSpec
from ml.registry import ModelRef
from ml.train import MIN_READINGS, MIN_SPAN_HISTORIES, ArchiveExtent, _decide, device_sample, reason_to_wait

SPEC = FeatureSpec(10.0)
START = datetime(2026, 1, 1)


def extent(version: int, readings: int, span_s: float) -> ArchiveExtent:
    return ArchiveExtent(version, readings, START, START + timedelta(seconds=span_s))


def test_an_archive_trains_once_it_spans_enough_histories_with_enough_readings() -> None:
    enough_span = MIN_SPAN_HISTORIES * SPEC.history_s
    assert reason_to_wait(extent(3, MIN_READINGS, enough_span), SPEC, trained_on=None) is None
    short = reason_to_wait(extent(3, MIN_READINGS, enough_span - 1), SPEC, trained_on=None)
    assert short and f"over {enough_span:.0f}s" in short
    sparse = reason_to_wait(extent(3, MIN_READINGS - 1, enough_span), SPEC, trained_on=None)
    assert sparse and f"needs {MIN_READINGS:,}" in sparse
    assert reason_to_wait(ArchiveExtent(0, 0, None, None), SPEC, trained_on=None)
    assert reason_to_wait(None, SPEC, trained_on=None) == "no silver table yet"


def test_a_periodic_trainer_waits_while_silver_has_not_changed_since_its_last_run() -> None:
    ready = extent(7, 10 * MIN_READINGS, 10 * SPEC.history_s)
    assert reason_to_wait(ready, SPEC, trained_on=7) == "silver v7 has not changed since the last run"
    assert reason_to_wait(ready, SPEC, trained_on=6) is None


CHAMPION = ModelRef("iotmon-anomaly", 3, threshold=1.0, feature_history_s=10.0)


def holdout(f1: float, false_alarm_rate: float) -> dict[str, float]:
    return {"f1": f1, "false_alarm_rate": false_alarm_rate}


def test_a_challenger_is_promoted_when_its_f1_is_not_worse_than_the_champions() -> None:
    assert _decide(holdout(0.85, 0.002), CHAMPION, holdout(0.80, 0.001), force=False)[0]
    assert _decide(holdout(0.80, 0.001), CHAMPION, holdout(0.80, 0.001), force=False)[0]
    promoted, decision = _decide(holdout(0.70, 0.0), CHAMPION, holdout(0.80, 0.001), force=False)
    assert not promoted
    assert decision == "holdout f1 0.700, false alarms 0.000% < champion v3's 0.800, 0.100%"


def test_on_a_holdout_without_episodes_the_false_alarms_decide() -> None:
    """No episode in the holdout: every model's F1 is 0, and a model that flags more normal readings is worse."""
    assert not _decide(holdout(0.0, 0.02), CHAMPION, holdout(0.0, 0.01), force=False)[0]
    assert _decide(holdout(0.0, 0.01), CHAMPION, holdout(0.0, 0.02), force=False)[0]
    assert _decide(holdout(0.0, 0.01), CHAMPION, holdout(0.0, 0.01), force=False)[0]


def test_without_labels_only_a_first_model_or_a_forced_one_is_promoted() -> None:
    unlabelled = {"holdout_readings": 100.0, "holdout_flagged": 1.0}
    assert _decide(unlabelled, None, None, force=False) == (True, "first model: no champion yet")
    assert not _decide(unlabelled, CHAMPION, None, force=False)[0]
    assert _decide(unlabelled, CHAMPION, None, force=True)[0]


def test_a_device_sample_keeps_whole_histories_and_grows_with_its_share(spark: SparkSession) -> None:
    readings = spark.createDataFrame(
        [(f"dev-{d:06d}", seq) for d in range(200) for seq in range(5)], f"{DEVICE_ID} string, seq long"
    )
    assert device_sample(readings, 1.0) is readings
    quarter = {
        r[DEVICE_ID]: r["n"]
        for r in device_sample(readings, 0.25).groupBy(DEVICE_ID).count().withColumnRenamed("count", "n").collect()
    }
    half = {r[DEVICE_ID] for r in device_sample(readings, 0.5).select(DEVICE_ID).distinct().collect()}
    assert set(quarter.values()) == {5}, "a kept device keeps all its readings"
    assert 25 <= len(quarter) <= 75 and 70 <= len(half) <= 130, (len(quarter), len(half))
    assert set(quarter) <= half, "a larger share keeps the devices a smaller one kept"


def test_a_periodic_trainer_waits_for_an_archive_without_starting_spark_and_ends_at_a_stop(tmp_path) -> None:
    import io
    import threading

    from iotmon.config import Settings
    from ml.train import RETRY_SECONDS, PeriodicTrainer, TrainOptions

    def no_session() -> SparkSession:
        raise AssertionError("no Spark session before there is an archive to train on")

    err, stop = io.StringIO(), threading.Event()
    stop.set()  # the run ends at its first wait
    settings = Settings.from_env({}, home=tmp_path)
    trainer = PeriodicTrainer(settings, no_session, TrainOptions, every_s=300.0, err=err)
    trainer.run(stop)
    assert err.getvalue() == f"iotmon train: no silver table yet; looking again every {RETRY_SECONDS:g}s\n"
    assert not trainer.ran.is_set(), "waiting for data is not a run: a stream's hold would end too soon"


def test_look_now_ends_a_wait_for_data_at_once(tmp_path, monkeypatch) -> None:
    """A stream that sees silver grow enough to train on asks the trainer to look now: the first model starts
    then, not at the trainer's next look (here an hour away); a stop still ends the wait at once."""
    import io
    import threading

    from iotmon.config import Settings
    from ml import train as train_module

    looks: list[threading.Event] = [threading.Event(), threading.Event()]

    def too_little(*_: object) -> str:
        next((look for look in looks if not look.is_set()), threading.Event()).set()
        return "too little yet"

    monkeypatch.setattr(train_module, "reason_to_wait", too_little)
    monkeypatch.setattr(train_module, "RETRY_SECONDS", 3600.0)
    stop = threading.Event()
    trainer = train_module.PeriodicTrainer(
        Settings.from_env({}, home=tmp_path), lambda: None, train_module.TrainOptions, every_s=7200.0, err=io.StringIO()
    )
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert looks[0].wait(60)
        trainer.look_now()
        assert looks[1].wait(60), "look_now did not end the wait"
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive(), "a stop ends the wait"


def test_a_look_asked_for_during_a_run_does_not_start_the_next_one_early(tmp_path, monkeypatch) -> None:
    """The stream's hold may ask for a look while the trainer, having looked itself, is already running: that run
    answered it, and the next still waits its interval (back-to-back runs would take the stream's cores)."""
    import threading

    class Looks(threading.Event):
        """The trainer's wake-up event, telling whether it was set when a wait began."""

        def __init__(self) -> None:
            super().__init__()
            self.set_at_wait: list[bool] = []
            self.waiting = threading.Event()

        def wait(self, timeout: float | None = None) -> bool:
            self.set_at_wait.append(self.is_set())
            self.waiting.set()
            return super().wait(timeout)

    def a_run(*_: object, **__: object) -> None:
        trainer.look_now()  # the hold's, landing mid-run
        raise RuntimeError("a run that ends")

    trainer, _, stop = _trainer_with_run(a_run, tmp_path, monkeypatch)
    looks = Looks()
    monkeypatch.setattr(trainer, "_look", looks)
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert looks.waiting.wait(60)
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    assert looks.set_at_wait == [False], looks.set_at_wait


def test_a_failed_run_has_ended_too(tmp_path, monkeypatch) -> None:
    """What a stream starting with no model holds its other queries back for: the first run, however it ends."""
    import io
    import threading

    from iotmon.config import Settings
    from ml import train as train_module

    def broken_session() -> SparkSession:
        raise RuntimeError("no cores left")

    monkeypatch.setattr(train_module, "reason_to_wait", lambda *_: None)  # enough data
    err, stop = io.StringIO(), threading.Event()
    trainer = train_module.PeriodicTrainer(
        Settings.from_env({}, home=tmp_path), broken_session, train_module.TrainOptions, every_s=300.0, err=err
    )
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert trainer.ran.wait(60), err.getvalue()
    finally:
        stop.set()
        thread.join(60)
    assert "run failed, champion unchanged: no cores left" in err.getvalue()


def _trainer_with_run(a_run, tmp_path, monkeypatch):
    """A periodic trainer with data enough whose every run is ``a_run``; its output and its stop event."""
    import io
    import threading

    from iotmon.config import Settings
    from ml import train as train_module

    monkeypatch.setattr(train_module, "reason_to_wait", lambda *_: None)  # enough data
    monkeypatch.setattr(train_module, "train", a_run)
    out, stop = io.StringIO(), threading.Event()
    trainer = train_module.PeriodicTrainer(
        Settings.from_env({}, home=tmp_path), lambda: None, train_module.TrainOptions, every_s=300.0, out=out
    )
    return trainer, out, stop


@pytest.mark.parametrize("champion", [None, "v1"])
def test_a_run_yields_the_cores_before_it_starts_once_a_champion_exists(tmp_path, monkeypatch, champion) -> None:
    """The first model is urgent (nothing is scored without it), a retraining is not, even the first run of a
    trainer restarted beside a stream that scores with the champion it finds: that run yields before it starts,
    not after it has competed with the stream for the cores."""
    import threading

    from ml import train as train_module

    yields: list[str] = []
    yielded_at_run: list[int] = []

    def a_run(*_: object, **__: object) -> None:
        yielded_at_run.append(len(yields))
        stop.set()  # one run is enough
        raise RuntimeError("a run that ends")

    trainer, _, stop = _trainer_with_run(a_run, tmp_path, monkeypatch)
    monkeypatch.setattr(train_module.registry, "champion", lambda _settings: champion)
    trainer.on_retraining = lambda: yields.append("yield")
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive()
    assert yielded_at_run == [0 if champion is None else 1]


def test_a_stop_cancels_the_runs_jobs_until_the_run_gives_up(tmp_path, monkeypatch) -> None:
    """A stop that lands while the run computes in Python finds no job to cancel; the job it starts next is
    cancelled too, so the run is given up rather than finished (and promoted)."""
    import threading

    started, cancelled = threading.Event(), threading.Event()
    jobs: list[threading.Event] = []
    cancels: list[int] = []  # how many jobs the run had started at each cancel
    ran_to_its_end: list[bool] = []

    def cancel() -> None:
        cancels.append(len(jobs))
        for job in jobs:
            job.set()
        cancelled.set()

    def a_run(*_: object, **__: object) -> None:
        started.set()
        assert cancelled.wait(60)  # the features, in Python: the stop's first cancel finds no job
        job = threading.Event()
        jobs.append(job)
        ran_to_its_end.append(not job.wait(60))  # the next Spark job: a cancel ends it
        raise RuntimeError("Job cancelled")

    trainer, out, stop = _trainer_with_run(a_run, tmp_path, monkeypatch)
    thread = trainer.start(stop, cancel)
    assert started.wait(60)
    stop.set()
    thread.join(120)
    assert not thread.is_alive()
    assert ran_to_its_end == [False], "the job ran to its end: the run was not given up"
    assert cancels[0] == 0 and cancels[-1] == 1, cancels
    assert "iotmon train: stopped; the run in progress was abandoned, champion unchanged" in out.getvalue()


def test_once_the_trainers_thread_has_ended_no_cancel_runs_or_follows(tmp_path, monkeypatch) -> None:
    """`iotmon train --every` stops its Spark session as soon as the trainer's thread has ended: a cancel still
    running then, or called after, fails on a stopped SparkContext (a chaos run's trainer log showed the
    traceback). Here the run ends while a cancel is in progress: the thread must outlast that cancel, and no
    thread it started may be left to call another."""
    import threading

    running, cancelled, run_returned = threading.Event(), threading.Event(), threading.Event()
    calls: list[str] = []

    def cancel() -> None:
        calls.append("cancel")
        cancelled.set()
        assert run_returned.wait(60)  # the run gives up and returns while this cancel is still going on
        calls.append("returned")

    def a_run(*_: object, **__: object) -> None:
        running.set()
        assert cancelled.wait(60)
        raise RuntimeError("Job cancelled")

    trainer, out, stop = _trainer_with_run(a_run, tmp_path, monkeypatch)
    run = trainer.run

    def run_and_say_so(stop: threading.Event) -> None:
        try:
            run(stop)
        finally:
            run_returned.set()

    monkeypatch.setattr(trainer, "run", run_and_say_so)
    before = set(threading.enumerate())
    thread = trainer.start(stop, cancel)
    assert running.wait(60)  # the stop lands in the run, not before it
    started = set(threading.enumerate()) - before
    stop.set()
    thread.join(120)
    assert not thread.is_alive()
    assert calls and calls[-1] == "returned", calls  # no cancel still in progress
    assert not [t.name for t in started if t.is_alive()]  # nor a canceller left to call again
    assert calls == ["cancel", "returned"], calls
    assert "the run in progress was abandoned" in out.getvalue()


def test_a_stopped_run_goes_no_further_than_the_step_it_is_in() -> None:
    """The step boundaries are where a stopped run gives up, whether or not a Spark job was there to cancel."""
    import io
    import threading

    import pytest

    from ml.train import TrainingStopped, _Steps

    out, stop = io.StringIO(), threading.Event()
    step = _Steps(out, stop)
    step("read", "reading silver")
    step("features", "computing features")
    stop.set()
    with pytest.raises(TrainingStopped, match="after step features"):
        step("fit", "fitting")
    assert out.getvalue().splitlines()[-1].endswith("computing features"), "the next step never started"
    with pytest.raises(TrainingStopped):
        step.go_on()  # as before a promotion
