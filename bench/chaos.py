"""``iotmon chaos``: inject faults at seeded random moments while a live fleet publishes, then prove nothing was
lost, doubled or corrupted.

A real-time simulator, the stream and a periodic trainer run as separate processes, each in a session of its
own. The stream is SIGKILLed over and over (the whole process group, like a crashed machine, or the Python
driver only, which orphans its Spark JVM), after a random delay or while a batch of a randomly chosen query is
in flight (seen in the query's checkpoint offsets log). The embedded broker is restarted under the running
stream, and the trainer is SIGKILLed while it writes its run and model to MLflow; after each trainer kill the
``champion`` alias must still point at a complete model. Then everything drains and every table is reconciled
with ``iotmon verify``'s own functions against Kafka and the simulator's ground truth.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from iotmon import broker
from iotmon.config import Settings
from iotmon.logs import say
from iotmon.schema import ALERTS, ANOMALIES, BRONZE, INGEST, QUARANTINE, SILVER

STREAM_KILL = "stream_kill"
BROKER_RESTART = "broker_restart"
TRAINER_KILL = "trainer_kill"
WHOLE_GROUP = "whole group"
DRIVER_ONLY = "driver only"
MODEL_QUERIES = (ANOMALIES, ALERTS)
"""Queries that only have batches once a champion exists: chosen as kill moments only then."""
IN_FLIGHT_PATIENCE_S = 600.0
"""How long a kill waits for a batch of its query; then it lands anyway (a slow start is a moment too). The
alerts' first batch waits for the scorer's, which scores all of silver: on 2 cores with the trainer running
that took more than 300 s (2026-11-25)."""
ORPHAN_PATIENCE_S = 30.0
"""How long a Spark JVM orphaned by a driver-only kill may take to exit by itself before it is killed."""
TRAINER_PATIENCE_S = 900.0
"""After the stream kills, how long the run waits for the trainer kills still planned without the trainer
making progress (a new step line); at most three times as long in all."""
STOP_PATIENCE_S = 180.0
DRAIN_PATIENCE_S = 3600.0
POLL_S = 0.05


class ChaosError(RuntimeError):
    """Chaos cannot run here (a broker or stream it cannot manage); the message says what to do."""


@dataclass(frozen=True)
class ChaosOptions:
    kills: int = 20
    broker_restarts: int = 2
    trainer_kills: int = 1
    seed: int = 1
    devices: int = 100
    rate: float = 100.0
    retrain_every_s: float = 60.0
    max_delay_s: float = 45.0
    """A kill after a random delay lands up to this long after the stream process started."""
    in_flight_share: float = 0.6
    """Share of stream kills timed by a batch in flight rather than by a random delay."""
    driver_only_share: float = 0.3
    """Share of stream kills that take only the Python driver, orphaning its JVM."""
    kill_in: tuple[str, ...] = ()
    """Queries whose batches in flight time the first kills, one kill each in this order (the rest are drawn
    at random): the way to make sure every stage is crashed mid-batch at least once."""

    def validate(self) -> None:
        if self.kills < 1:
            raise ValueError("--kills must be at least 1")
        if not 0 <= self.broker_restarts <= self.kills:
            raise ValueError("--broker-restarts must be between 0 and --kills (one restart per stream run at most)")
        if self.trainer_kills < 0 or self.devices < 1 or self.rate <= 0:
            raise ValueError("--trainer-kills must be >= 0, --devices >= 1 and --rate > 0")
        if unknown := [query for query in self.kill_in if query not in pipeline_queries()]:
            names = ", ".join(pipeline_queries())
            raise ValueError(f"--kill-in: no query named {', '.join(unknown)} (the queries: {names})")
        if len(self.kill_in) > self.kills:
            raise ValueError("--kill-in names more queries than --kills allows (one kill per query)")


@dataclass
class Fault:
    kind: str
    at_s: float
    """Seconds after the chaos run started."""
    detail: str
    facts: dict[str, Any] = field(default_factory=dict)


@dataclass
class ChaosReport:
    options: dict[str, Any]
    started_at: str
    seconds: float = 0.0
    faults: list[Fault] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    logs: str = ""
    process_groups: dict[str, list[int]] = field(default_factory=dict)
    """Every child started, by name: all gone when the run returns."""

    @property
    def exact(self) -> bool:
        return not self.mismatches

    def counts(self) -> dict[str, int]:
        return dict(Counter(fault.kind for fault in self.faults))

    def render(self) -> str:
        counts = self.counts()
        lines = [
            f"chaos run of {self.seconds:.0f}s (seed {self.options['seed']}), started {self.started_at}",
            "faults injected: " + ", ".join(f"{counts.get(kind, 0)} {kind.replace('_', ' ')}" for kind in _KINDS),
        ]
        lines += [f"  {fault.at_s:>7.1f}s  {fault.kind:<15} {fault.detail}" for fault in self.faults]
        lines.append("records checked:")
        lines += [f"  {table:<28} {count:>12,}" for table, count in self.checked.items()]
        lines.append(f"logs: {self.logs}")
        if self.mismatches:
            lines.append(f"RESULT: {len(self.mismatches)} MISMATCH(ES)")
            lines += [f"  {problem}" for problem in self.mismatches]
        else:
            lines.append("RESULT: exact")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "exact": self.exact, "fault_counts": self.counts()}


_KINDS = (STREAM_KILL, BROKER_RESTART, TRAINER_KILL)


class Group:
    """A child in a session (and process group) of its own: its Spark JVM and helpers die with it."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                list(argv),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.pid = self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def alive(self) -> bool:
        """Anything of the group left (the leader is reaped first, so a zombie does not count)."""
        self.process.poll()
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self, driver_only: bool = False) -> None:
        with contextlib.suppress(ProcessLookupError):
            if driver_only:
                self.process.send_signal(signal.SIGKILL)
            else:
                os.killpg(self.pid, signal.SIGKILL)
        self.process.wait()

    def gone_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(POLL_S)
        return True

    def make_gone(self, patience: float = 0.0) -> float:
        """Wait up to ``patience`` for the group to exit by itself, then kill what is left; seconds waited."""
        started = time.monotonic()
        if not self.gone_within(patience):
            self.kill()
            if not self.gone_within(60.0):
                raise ChaosError(f"{self.name} (process group {self.pid}) survived SIGKILL for 60s")
        return time.monotonic() - started

    def stop(self, signum: signal.Signals, patience: float) -> bool:
        """Ask the leader to stop; True if the group was gone within ``patience``, else it is killed."""
        if self.running():
            self.process.send_signal(signum)
        if self.gone_within(patience):
            return True
        self.make_gone()
        return False


def pipeline_queries() -> tuple[str, ...]:
    """The names of the stream's queries, the moments chaos can kill it in (imported late: it loads Spark)."""
    from pipeline.topology import TOPOLOGY

    return tuple(node.name for node in TOPOLOGY)


def batch_ids(checkpoint: str, log: str) -> set[int]:
    """Batch ids in a local streaming checkpoint's ``offsets`` (planned) or ``commits`` (finished) log."""
    folder = Path(checkpoint) / log
    return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.exists() else set()


def check_manageable(settings: Settings) -> None:
    """Chaos restarts the broker and kills the stream: refuse anything it did not start and cannot manage."""
    from iotmon.status import stream_process

    host, port = settings.kafka_host_port
    ports = "choose free ports with IOTMON_KAFKA_BOOTSTRAP=127.0.0.1:PORT and IOTMON_KAFKA_CONTROLLER_PORT"
    if host not in broker.LOOPBACK:
        raise ChaosError(
            f"IOTMON_KAFKA_BOOTSTRAP={settings.kafka_bootstrap} is not a broker chaos can restart: it starts, "
            f"restarts and stops an embedded broker of its own on loopback; {ports}"
        )
    running = broker.status(settings)
    if running.running:
        raise ChaosError(
            f"an embedded broker already runs for {settings.home} (pid {running.pid}); chaos starts and restarts "
            f"its own: stop it first (`iotmon kafka stop`) or {ports} and another IOTMON_HOME"
        )
    if any(_listening(host, p) for p in (port, settings.kafka_controller_port)):
        raise ChaosError(
            f"something chaos did not start listens on {host}:{port} or :{settings.kafka_controller_port}, a "
            f"broker it could not restart; {ports}"
        )
    stream, _ = stream_process(settings)
    if stream.running:
        raise ChaosError(f"`iotmon stream` is running (pid {stream.pid}) on this lake; stop it first")
    if "://" in settings.checkpoint_root and not settings.checkpoint_root.startswith("file:"):
        raise ChaosError(f"chaos reads the checkpoints' offset logs locally, not at {settings.checkpoint_root}")


class ChaosRun:
    """One chaos run: the children it started, the faults it injected, the checks it made."""

    def __init__(self, settings: Settings, options: ChaosOptions, out: TextIO) -> None:
        self.settings, self.options, self.out = settings, options, out
        self.rng = random.Random(options.seed)
        self.trainer_rng = random.Random(options.seed + 1)
        self.started = time.monotonic()
        stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
        self.logs = settings.home / "chaos" / f"chaos-{stamp}"
        self.report = ChaosReport(options=asdict(options), started_at=datetime.now(UTC).isoformat(timespec="seconds"))
        self.report.logs = str(self.logs)
        self.env = settings.child_env()
        self.groups: list[Group] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.draining = threading.Event()
        self.trainer_spawn = threading.Lock()
        """Held while a trainer is started and while the run stops, so none starts after the stop. A trainer
        started a moment before the stop got its SIGINT while still starting, trained on, and the run waited
        out ``STOP_PATIENCE_S`` for it (the suite's chaos test: 377 s instead of 247 s)."""
        self.trainer: Group | None = None
        self.trainer_thread: threading.Thread | None = None
        self.trainer_error: BaseException | None = None
        self.stale_runs: set[str] = set()
        self.broker_started = False

    # --- plumbing ------------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, line: str) -> None:
        say(line, self.out)

    def fault(self, kind: str, detail: str, **facts: Any) -> Fault:
        found = Fault(kind, round(self.elapsed(), 1), detail, facts)
        with self.lock:
            self.report.faults.append(found)
        return found

    def mismatch(self, problem: str) -> None:
        with self.lock:
            self.report.mismatches.append(problem)
        self.say(f"MISMATCH: {problem}")

    def spawn(self, name: str, *argv: str) -> Group:
        group = Group(name, [sys.executable, "-m", "iotmon.cli", *argv], self.env, self.logs / f"{name}.log")
        self.groups.append(group)
        self.report.process_groups.setdefault(name, []).append(group.pid)
        return group

    def wait(self, condition: Callable[[], Any], seconds: float) -> Any:
        """Poll ``condition`` until truthy or ``seconds`` pass (None); stops early when the run is stopping."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not self.stopping.is_set():
            result = condition()
            if result:
                return result
            time.sleep(POLL_S)
        return None

    def cleanup(self) -> None:
        """Whatever happened: every process started is gone, and so is the broker."""
        self.stopping.set()
        if self.trainer_thread is not None:  # first, so that it starts no trainer after this
            self.trainer_thread.join(60)
        for group in reversed(self.groups):
            with contextlib.suppress(ChaosError):
                group.make_gone()
        if self.broker_started:
            broker.stop(self.settings)

    # --- the run ---------------------------------------------------------------------------------------------

    def run(self) -> ChaosReport:

        options, settings = self.options, self.settings
        self.logs.mkdir(parents=True, exist_ok=True)
        broker.start(settings)
        self.broker_started = True
        truth = settings.truth_dir / f"chaos-{self.logs.name.removeprefix('chaos-')}.parquet"
        fleet = ["--devices", str(options.devices), "--rate", f"{options.rate:g}", "--seed", str(options.seed)]
        simulator = self.spawn("simulator", "simulate", "--quiet", "--truth", str(truth), *fleet)
        self.say(
            f"chaos: broker {settings.kafka_bootstrap}, simulator {options.devices} devices at {options.rate:g} "
            f"events/s (pid {simulator.pid}), logs in {self.logs}"
        )
        from ml.registry import import_mlflow

        import_mlflow()  # before the trainer thread: both threads use MLflow, whose first import is not thread-safe
        self.trainer_thread = threading.Thread(target=self._trainer_chaos, name="chaos-trainer", daemon=True)
        self.trainer_thread.start()

        restarts = set(self.rng.sample(range(options.kills), options.broker_restarts))
        for kill in range(1, options.kills + 1):
            self._stream_run(kill, restart_broker=kill - 1 in restarts)
        if not simulator.stop(signal.SIGINT, STOP_PATIENCE_S):
            self.mismatch("the simulator did not stop on SIGINT, so its ground truth is incomplete")
        # Nothing more is published: the drain can start at once, beside a trainer not yet killed mid-write.
        self.draining.set()
        drain = self._start_drain()
        if self._trainer_kills() < options.trainer_kills:
            self.say("chaos: stream kills done; the trainer runs on beside the drain until killed mid-write")
            self._wait_for_trainer_kills()
        with self.trainer_spawn:
            self.stopping.set()
        self.trainer_thread.join(STOP_PATIENCE_S + 60)
        if self.trainer_error is not None:
            raise self.trainer_error
        if self.trainer is not None and not self.trainer.stop(signal.SIGINT, STOP_PATIENCE_S):
            self.say("chaos: the trainer did not stop within its patience and was killed")
        for group in self.groups:
            if group is not drain:
                group.make_gone()
        self._shortfalls()
        if self._drained(drain):
            self._reconcile()
        self.report.seconds = round(self.elapsed(), 1)
        return self.report

    def _wait_for_trainer_kills(self) -> None:
        """While the trainer makes progress (a loaded machine makes it slow), until the planned kills landed."""
        from ml.train import STEP_PREFIX

        log = self.logs / "trainer.log"
        started = last_progress = time.monotonic()
        steps = _count(log, STEP_PREFIX)
        while self._trainer_kills() < self.options.trainer_kills and self.trainer_error is None:
            now = time.monotonic()
            if now - last_progress > TRAINER_PATIENCE_S or now - started > 3 * TRAINER_PATIENCE_S:
                return
            if (current := _count(log, STEP_PREFIX)) != steps:
                steps, last_progress = current, now
            if self.stopping.wait(1.0):
                return

    def _shortfalls(self) -> None:
        counts, options = self.report.counts(), self.options
        for kind, planned in ((STREAM_KILL, options.kills), (BROKER_RESTART, options.broker_restarts)):
            if counts.get(kind, 0) < planned:
                self.mismatch(f"planned {planned} {kind.replace('_', ' ')}(s), injected {counts.get(kind, 0)}")
        if self._trainer_kills() < options.trainer_kills:
            self.mismatch(
                f"planned {options.trainer_kills} trainer kill(s) mid-write, injected {self._trainer_kills()} "
                f"(did silver reach the trainer's minimum? see {self.logs / 'trainer.log'})"
            )

    # --- stream kills ----------------------------------------------------------------------------------------

    def _stream_run(self, kill: int, restart_broker: bool) -> None:
        from ml import registry

        options, settings = self.options, self.settings
        driver_only = self.rng.random() < options.driver_only_share
        in_flight = self.rng.random() < options.in_flight_share
        delay = self.rng.uniform(2.0, options.max_delay_s)
        if kill <= len(options.kill_in):
            query, in_flight = options.kill_in[kill - 1], True
        else:
            champion = registry.champion(settings) is not None
            names = pipeline_queries()
            query = self.rng.choice(names if champion else tuple(q for q in names if q not in MODEL_QUERIES))
        planned = {q: max(batch_ids(settings.checkpoint_path(q), "offsets"), default=-1) for q in pipeline_queries()}
        stream = self.spawn("stream", "stream")
        launched = time.monotonic()
        if restart_broker:
            self._restart_broker(stream)
        if in_flight and query in MODEL_QUERIES:
            # Its batches start with the first champion, trained on what this very run archives.
            self.wait(lambda: registry.champion(settings) is not None, TRAINER_PATIENCE_S)
        if in_flight:
            checkpoint, after = settings.checkpoint_path(query), planned[query]
            # A tuple, so that batch 0 counts as found.
            batch = self.wait(
                lambda: (b,) if (b := self._next_batch(checkpoint, after)) is not None else None, IN_FLIGHT_PATIENCE_S
            )
            moment = (
                f"while {query} batch {batch[0]} in flight"
                if batch
                else f"after {IN_FLIGHT_PATIENCE_S:.0f}s without a {query} batch"
            )
        else:
            self.wait(lambda: False, max(0.0, delay - (time.monotonic() - launched)))
            moment = f"{time.monotonic() - launched:.1f}s after the stream started"
        if self.stopping.is_set():
            return
        if not stream.running():
            self.mismatch(f"kill {kill}: the stream exited by itself (code {stream.process.returncode}) before it")
        stream.kill(driver_only=driver_only)
        kind = DRIVER_ONLY if driver_only else WHOLE_GROUP
        self.say(f"kill {kill}/{options.kills}: SIGKILL stream ({kind}) {moment}, {self.elapsed():.1f} s after start")
        fault = self.fault(
            STREAM_KILL,
            f"SIGKILL stream ({kind}) {moment}",
            kill=kill,
            scope=kind,
            query=query if in_flight else None,
            batch=batch[0] if in_flight and batch else None,
        )
        waited = stream.make_gone(ORPHAN_PATIENCE_S if driver_only else 0.0)
        if driver_only:
            alone = waited < ORPHAN_PATIENCE_S
            fault.facts["orphan_exited_by_itself_s" if alone else "orphan_killed_after_s"] = round(waited, 1)

    @staticmethod
    def _next_batch(checkpoint: str, after: int) -> int | None:
        """The first batch planned after ``after``: the run has it in flight (or has just finished it)."""
        planned = {b for b in batch_ids(checkpoint, "offsets") if b > after}
        return min(planned) if planned else None

    def _restart_broker(self, stream: Group) -> None:
        """Once the stream has archived something new, restart the broker under it."""
        checkpoint = self.settings.checkpoint_path(INGEST)
        committed = max(batch_ids(checkpoint, "commits"), default=-1)
        self.wait(lambda: max(batch_ids(checkpoint, "commits"), default=-1) > committed, IN_FLIGHT_PATIENCE_S)
        if self.stopping.is_set():
            return
        down = time.monotonic()
        broker.stop(self.settings)
        broker.start(self.settings)
        seconds = time.monotonic() - down
        survived = stream.running()
        self.say(
            f"broker restart: stopped and started in {seconds:.1f} s under a running stream, "
            f"{self.elapsed():.1f} s after start"
        )
        self.fault(BROKER_RESTART, f"broker stopped and restarted in {seconds:.1f}s, stream running", seconds=seconds)
        if not survived:
            self.mismatch("the stream died when the broker restarted")

    # --- trainer kills ---------------------------------------------------------------------------------------

    def _trainer_done(self) -> bool:
        """Whether a trainer has nothing left to do: every planned kill landed and the drain has begun."""
        return self.draining.is_set() and self._trainer_kills() >= self.options.trainer_kills

    def _trainer_kills(self) -> int:
        """Trainer kills that landed mid-write (left an unfinished MLflow run); a kill that came too late to
        catch the run open does not count, and the next run is killed instead."""
        with self.lock:
            return sum(1 for fault in self.report.faults if fault.kind == TRAINER_KILL and fault.facts["mid_write"])

    def _trainer_chaos(self) -> None:
        """Keep a periodic trainer going; once a champion exists (the first run to log promotes its model), kill
        it while it writes a run to MLflow until the planned kills landed; check the champion after each."""
        from ml.train import LOG_STEP

        try:
            log = self.logs / "trainer.log"
            every = f"{self.options.retrain_every_s:g} seconds"
            seen = 0
            self.stale_runs = self._unfinished_runs()  # left by an earlier run's kills, if this home saw one
            while True:
                with self.trainer_spawn:
                    if self.stopping.is_set() or self._trainer_done():
                        break
                    self.trainer = self.spawn("trainer", "train", "--every", every)
                while not self.stopping.is_set():
                    trainer = self.trainer
                    if not self.wait(lambda t=trainer, n=seen: _count(log, LOG_STEP) > n or not t.running(), 3600):
                        break
                    if not trainer.running():
                        self.say(f"chaos: the trainer exited by itself (code {trainer.process.returncode}); restarted")
                        break
                    seen = _count(log, LOG_STEP)
                    if seen >= 2 and self._trainer_kills() < self.options.trainer_kills:
                        self._kill_trainer(seen)
                        break
                if not self.stopping.is_set():
                    self.trainer.make_gone()
        except BaseException as exc:  # reported by the main thread
            self.trainer_error = exc
            self.stopping.set()

    def _unfinished_runs(self) -> set[str]:
        """Training runs MLflow holds as RUNNING: the one being written, and those of killed trainers."""
        from ml import registry

        client = registry.tracking(self.settings)
        return {
            r.info.run_id
            for r in client.search_runs([registry.experiment_id(self.settings)], "attributes.status = 'RUNNING'")
        }

    def _kill_trainer(self, log_step: int) -> None:
        """SIGKILL the trainer at a random moment after its run is open in MLflow (the step logs params,
        metrics, the model, registers a version, tags it and may move the alias: about two seconds)."""
        from ml import registry

        assert self.trainer is not None
        # Runs left open by earlier kills are known; the run may have opened before this looked.
        opened = self.wait(lambda: self._unfinished_runs() - self.stale_runs, 30.0)
        delay = self.trainer_rng.uniform(0.0, 0.6)
        time.sleep(delay)
        self.trainer.kill()
        self.trainer.make_gone()
        killed = sorted(self._unfinished_runs() - self.stale_runs)
        self.stale_runs.update(killed)
        client = registry.tracking(self.settings)
        versions = [int(v.version) for run_id in killed for v in client.search_model_versions(f"run_id = '{run_id}'")]
        champion, problems = self._check_champion()
        moment = f"{delay:.2f}s after it opened run {', '.join(killed)}" if opened else "(its run was not seen open)"
        detail = (
            f"SIGKILL trainer (whole group) while writing training run {log_step} to MLflow, {moment}"
            + (f", which registered v{', v'.join(map(str, versions))}" if versions else "")
            + ("" if killed else "; too late: the run had finished")
            + f"; champion -> {f'v{champion.version}, complete' if champion else 'none'}"
        )
        self.say(f"trainer kill: {detail}, {self.elapsed():.1f} s after start")
        self.fault(
            TRAINER_KILL,
            detail,
            mid_write=bool(killed),
            killed_runs=killed,
            killed_versions=versions,
            champion_version=champion.version if champion else None,
            champion_run=champion.run_id if champion else None,
            champion_problems=problems,
        )
        for problem in problems:
            self.mismatch(f"after trainer kill: {problem}")

    def _check_champion(self):
        from iotmon.spark import spark_session
        from ml import registry

        spark_session(self.settings, "iotmon-chaos")  # loading the model needs a session
        return registry.champion_problems(self.settings)

    # --- drain and reconcile ---------------------------------------------------------------------------------

    def _start_drain(self) -> Group:
        self.say(f"chaos: draining what Kafka holds, {self.elapsed():.1f} s after start")
        return self.spawn("drain", "stream", "--until-idle")

    def _drained(self, drain: Group) -> bool:
        """Whether the drain ended well; a mismatch otherwise."""
        if not drain.gone_within(DRAIN_PATIENCE_S):
            drain.make_gone()
        if drain.process.returncode != 0:
            self.mismatch(f"`iotmon stream --until-idle` failed (code {drain.process.returncode}); see drain.log")
            return False
        return True

    def _reconcile(self) -> None:
        from iotmon.spark import spark_session
        from pipeline.verify import reconcile_lake

        self.say(f"chaos: reconciling every table, {self.elapsed():.1f} s after start")
        truth = sorted(self.settings.truth_dir.glob("*.parquet"))
        spark = spark_session(self.settings, "iotmon-chaos")
        check = reconcile_lake(spark, self.settings, truth, progress=lambda what: self.say(f"chaos: checking {what}"))
        archive, analytics = check.archive, check.analytics
        self.say(archive.report())
        checked = self.report.checked
        checked["kafka records"] = sum(p.kafka_high - p.kafka_low for p in archive.partitions)
        checked[BRONZE] = sum(p.bronze_rows for p in archive.partitions)
        checked[QUARANTINE] = archive.quarantine_rows
        if archive.truth is not None:
            checked["ground truth sends"] = archive.truth.sends
        if analytics is None:
            self.mismatch(f"no {SILVER} table at {self.settings.table_path(SILVER)}: the stream never created it")
        else:
            self.say(analytics.report())
            checked.update(analytics.rows_checked)
            checked[ALERTS] = analytics.alerts
            checked["champion"] = analytics.champion.version if analytics.champion else 0
        for problem in check.problems:
            self.mismatch(problem)


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _count(log: Path, text: str) -> int:
    try:
        return log.read_text(errors="replace").count(text)
    except FileNotFoundError:
        return 0


def run_chaos(settings: Settings, options: ChaosOptions, out: TextIO = sys.stdout) -> ChaosReport:
    """Inject the faults, drain, reconcile; the report (also written as JSON under $IOTMON_HOME/chaos)."""
    options.validate()
    check_manageable(settings)
    chaos = ChaosRun(settings, options, out)
    try:
        report = chaos.run()
    finally:
        chaos.cleanup()
    path = chaos.logs.with_suffix(".json")
    path.write_text(json.dumps(report.to_json(), indent=2, default=str))
    say(report.render(), out)
    say(f"report: {path}", out)
    return report
