"""``iotmon``: the command line. Thin on purpose: parse arguments, call a stage, report, exit."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from iotmon.config import ConfigError, Settings, describe_settings, interval_seconds
from iotmon.logs import say

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pipeline.verify import LakeCheck
    from simulators.options import SimulationOptions

EXIT_MISMATCH = 1
EXIT_ERROR = 2


class CommandError(RuntimeError):
    """A failure the user can act on; printed without a stack trace."""


def _known_errors() -> tuple[type[BaseException], ...]:
    from iotmon.broker import BrokerError
    from iotmon.jars import ResolutionError
    from iotmon.kafka import KafkaUnavailable
    from iotmon.queries import QueryFailed

    return (CommandError, ConfigError, BrokerError, ResolutionError, KafkaUnavailable, QueryFailed)


# --- kafka -------------------------------------------------------------------------------------------------


def cmd_kafka(settings: Settings, args: argparse.Namespace) -> int:
    from iotmon import broker

    if args.action == "start":
        started = time.monotonic()
        status = broker.start(settings)
        say(status.report())
        say(f"  ready after {time.monotonic() - started:.1f}s")
    elif args.action == "stop":
        say("kafka broker stopped" if broker.stop(settings) else "kafka broker was not running")
    else:
        status = broker.status(settings)
        say(status.report())
        return 0 if status.running else 3
    return 0


# --- simulate ----------------------------------------------------------------------------------------------


def _simulation_options(args: argparse.Namespace) -> SimulationOptions:
    from simulators.options import SimulationOptions

    options = SimulationOptions(
        devices=args.devices,
        seed=args.seed,
        events=args.events,
        duration=args.duration,
        rate=args.rate,
        past=args.past,
        interval=args.interval,
        start=args.start,
        late_fraction=args.late_fraction,
        very_late_fraction=args.very_late_fraction,
        duplicate_fraction=args.duplicate_fraction,
        malformed_fraction=args.malformed_fraction,
        anomaly_fraction=args.anomaly_fraction,
        dropout_fraction=args.dropout_fraction,
        truth_path=args.truth,
        progress=not args.quiet,
    )
    try:
        options.validate()
    except ValueError as exc:
        raise CommandError(f"{exc} (see `iotmon simulate --help`)") from None
    return options


def cmd_simulate(settings: Settings, args: argparse.Namespace) -> int:
    from iotmon.preflight import require_writable
    from simulators.publish import run_simulation

    options = _simulation_options(args)
    require_writable(settings, "lake", "home")  # the device registry, the ground-truth file
    summary = run_simulation(settings, options)
    say(summary.report())
    return 0 if summary.failed == 0 else EXIT_MISMATCH


# --- replay ------------------------------------------------------------------------------------------------


def cmd_replay(settings: Settings, args: argparse.Namespace) -> int:
    from iotmon.schema import METRIC_NAMES
    from simulators.replay import ColumnMapping, ReplayError, ReplayOptions, run_replay

    mapping = ColumnMapping(
        device=args.device_col,
        time=args.time_col,
        seq=args.seq_col,
        metrics=tuple((metric, getattr(args, f"{metric}_col")) for metric in METRIC_NAMES),
        device_type=args.device_type_col,
        site=args.site_col,
    )
    options = ReplayOptions(
        path=args.file,
        mapping=mapping,
        file_format=args.format,
        time_unit=args.time_unit,
        speed=args.speed,
        restamp=args.restamp,
        progress=not args.quiet,
    )
    try:
        summary = run_replay(settings, options)
    except ReplayError as exc:
        raise CommandError(f"{exc} (see `iotmon replay --help`)") from None
    say(summary.report())
    return 0 if summary.failed == 0 and summary.unconfirmed == 0 else EXIT_MISMATCH


# --- stream ------------------------------------------------------------------------------------------------


_INTERRUPTED_EARLY: list[int] = []
"""SIGINTs that arrived before ``stop_on_signals`` took over (``remember_interrupts``)."""


def remember_interrupts() -> None:
    """Python's own SIGINT handler, remembered. A library that imports inside ``except BaseException``
    (PySpark's ``pyspark.ml.linalg`` does, around SciPy) swallows the ``KeyboardInterrupt`` of a Ctrl-C or a
    supervisor's SIGINT that lands in that import, and a long-running command would then run on as if never
    asked to stop (a periodic trainer did, under ``iotmon chaos``). ``stop_on_signals`` honours it at once."""
    _INTERRUPTED_EARLY.clear()

    def handler(signum: int, _frame: object) -> None:
        _INTERRUPTED_EARLY.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)


def stop_on_signals(then: Callable[[], None] | None = None) -> threading.Event:
    """An event that SIGINT and SIGTERM set (and then call ``then``). Installed before anything starts, so a
    signal that arrives while Spark is still starting also ends in a clean stop rather than a kill; one that
    arrived even earlier, and was swallowed, sets it at once (``remember_interrupts``). A second signal does
    not wait for that clean stop: it raises ``KeyboardInterrupt``, as Python's default would."""
    stop = threading.Event()

    def handler(*_: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        if then is not None:
            then()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)
    if _INTERRUPTED_EARLY:
        _INTERRUPTED_EARLY.clear()
        handler()
    return stop


def cmd_stream(settings: Settings, args: argparse.Namespace) -> int:
    from pipeline.stream import run_stream

    run_stream(settings, None if args.until_idle else stop_on_signals())
    return 0


# --- verify ------------------------------------------------------------------------------------------------


def cmd_verify(settings: Settings, args: argparse.Namespace) -> int:
    from delta.tables import DeltaTable

    from iotmon.kafka import require_broker
    from iotmon.preflight import local_directory
    from iotmon.schema import BRONZE, QUARANTINE
    from iotmon.spark import spark_session
    from pipeline.verify import reconcile_lake

    def no_table(table: str) -> CommandError:
        return CommandError(f"no {table} table at {settings.table_path(table)}; run `iotmon stream` first")

    truth = _truth_files(settings, args.truth, args.all_truth)
    for table in (BRONZE, QUARANTINE):  # local tables and the broker are checked before Spark starts
        local = local_directory(settings.table_path(table))
        if local is not None and not (local / "_delta_log").is_dir():
            raise no_table(table)
    require_broker(settings)
    spark = spark_session(settings, "iotmon-verify")
    for table in (BRONZE, QUARANTINE):
        if not DeltaTable.isDeltaTable(spark, settings.table_path(table)):
            raise no_table(table)
    return _reported(reconcile_lake(spark, settings, truth, progress=reconciliation_progress))


def _reported(check: LakeCheck) -> int:
    """Print a lake's reconciliation; the exit code it calls for."""
    say(check.archive.report())
    if check.analytics is not None:
        say(check.analytics.report())
    return 0 if not check.problems else EXIT_MISMATCH


def reconciliation_progress(what: str) -> None:
    """A reconciliation's progress line (its comparisons run at once, on threads)."""
    say(f"verify: checking {what}", sys.stderr)


def _truth_files(settings: Settings, given: Sequence[Path], all_truth: bool) -> list[Path]:
    files = list(given)
    if all_truth:
        files += sorted(settings.truth_dir.glob("*.parquet"))
    missing = [path for path in files if not path.exists()]
    if missing:
        raise CommandError(f"ground-truth file not found: {missing[0]}")
    return files


# --- backfill --------------------------------------------------------------------------------------------


def cmd_backfill(settings: Settings, args: argparse.Namespace) -> int:
    from iotmon.preflight import require_writable
    from iotmon.spark import spark_session
    from iotmon.status import stream_process
    from pipeline.backfill import backfill
    from pipeline.topology import ensure_tables

    running, _ = stream_process(settings)
    if running.running:
        raise CommandError(
            f"the stream is running (pid {running.pid}); stop it first, backfill replaces its checkpoints"
        )
    require_writable(settings, "lake", "checkpoints")
    spark = spark_session(settings, "iotmon-backfill")
    ensure_tables(spark, settings)
    say(backfill(spark, settings).report())
    return 0


# --- train ----------------------------------------------------------------------------------------------


def cmd_train(settings: Settings, args: argparse.Namespace) -> int:
    """Once, or every ``--every`` until stopped; a failed run is reported and leaves the champion as it was."""
    from iotmon.preflight import require_writable
    from iotmon.processes import run_when_idle, yield_the_session
    from iotmon.spark import spark_session
    from ml.model import ModelParams
    from ml.train import PeriodicTrainer, TrainingError, TrainOptions, train

    if settings.mlflow_tracking_uri is None:
        require_writable(settings, "home")  # the local MLflow store

    def truth() -> tuple[Path, ...]:
        from simulators.truth import available_truth

        found = () if args.no_truth else available_truth(settings.truth_dir)
        return (*_truth_files(settings, args.truth, False), *found)

    options = TrainOptions(
        params=ModelParams(clusters=args.clusters, contamination=args.contamination or settings.anomaly_contamination),
        holdout=args.holdout,
        truth=truth(),
        promote=args.promote,
    )
    if args.every is None:
        try:
            say(train(spark_session(settings, "iotmon-train"), settings, options).report())
        except TrainingError as exc:
            raise CommandError(str(exc)) from None
        return 0
    sessions: list[SparkSession] = []  # none until there is data to train on

    def session() -> SparkSession:
        if not sessions:
            sessions.append(spark_session(settings, "iotmon-train"))
        return sessions[0]

    def abandon_run() -> None:  # a stop does not wait for a run: its jobs fail, and the champion stays
        for spark in sessions:
            spark.sparkContext.cancelAllJobs()

    def yield_the_cores() -> None:
        # Until the first champion nothing is scored, so that run is the most urgent work there is; retraining,
        # from the first run on when a champion exists already, runs on what the stream leaves (this process and
        # its Spark JVM, started by it or inheriting the policy), and so does its session if it is its own.
        run_when_idle(os.getpid())
        yield_the_session()

    stop = stop_on_signals()
    trainer = PeriodicTrainer(
        settings, session, lambda: replace(options, truth=truth()), args.every, on_retraining=yield_the_cores
    )
    try:
        trainer.start(stop, abandon_run).join()
    finally:
        for spark in sessions:  # its JVM and py4j's threads end with the session, so the process exits at once
            spark.stop()
    return 0


# --- sql -------------------------------------------------------------------------------------------------


def cmd_sql(settings: Settings, args: argparse.Namespace) -> int:
    """One statement, or a prompt when none is given; every lake table is a view named after it."""
    from pyspark.errors import PySparkException

    from iotmon.lake import register_tables, run_sql
    from iotmon.spark import spark_session

    # PySpark logs every failed statement in full (JVM trace as JSON); the one-line error below suffices.
    logging.getLogger("SQLQueryContextLogger").disabled = True
    spark = spark_session(settings, "iotmon-sql")

    def show(statement: str) -> bool:
        try:
            run_sql(spark, settings, statement).show(args.limit, truncate=False)
        except PySparkException as exc:
            say(f"error: {str(exc).strip().splitlines()[0]}", sys.stderr)
            return False
        return True

    if args.statement:
        return 0 if show(args.statement) else EXIT_ERROR
    tables = ", ".join(register_tables(spark, settings)) or "(none yet)"
    say(f"tables: {tables}; end a statement with ';', quit with Ctrl-D")
    buffer: list[str] = []
    while True:
        try:
            line = input("...> " if buffer else "sql> ")
        except EOFError:
            say("")
            return 0
        buffer.append(line)
        if line.rstrip().endswith(";"):
            show("\n".join(buffer).rstrip().rstrip(";"))
            buffer.clear()


# --- latency ---------------------------------------------------------------------------------------------


def cmd_latency(settings: Settings, args: argparse.Namespace) -> int:
    """Read back from the Delta logs: when each on-time reading's rows were committed, against its event."""
    from bench.latency import measure, render
    from iotmon.spark import spark_session

    since = args.since or datetime.now(UTC).replace(tzinfo=None) - timedelta(seconds=args.last)
    spark = spark_session(settings, "iotmon-latency")
    say(f"event -> readable in Delta, on-time readings with events since {since:%Y-%m-%d %H:%M:%S}Z")
    say(render(measure(spark, settings, since)))
    return 0


# --- bench -----------------------------------------------------------------------------------------------


def _positive_ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of positive integers, e.g. '1000,10000,100000'."""
    try:
        values = tuple(int(part.replace("_", "")) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers, e.g. 1000,10000, not {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive whole numbers, not {text!r}")
    return values


def cmd_bench(settings: Settings, args: argparse.Namespace) -> int:
    """Every measurement in one run on the embedded stack; the user's lake, topic and models are not touched."""
    from bench.report import render
    from bench.run import BenchOptions, run_bench

    options = BenchOptions(
        events=args.events,
        devices=args.devices,
        scale=args.scale,
        scale_events=args.scale_events,
        train_sizes=args.train_sizes,
        write_rounds=args.write_rounds,
        steady_rate=args.steady_rate,
        steady_seconds=args.steady_seconds,
        steady_warmup=args.steady_warmup,
        demo_rate_seconds=args.demo_rate_seconds,
        retrain_every_s=None if args.no_trainer else args.retrain_every,
        viewer=not args.no_viewer,
        seed=args.seed,
        out=args.out,
        skip=frozenset(args.skip),
    )
    try:
        options.validate()
    except ValueError as exc:
        raise CommandError(f"{exc} (see `iotmon bench --help`)") from None
    report, out = run_bench(settings, options)
    say(render(report))
    say(f"report: {out / 'report.json'}\nplot:   {out / 'report.png'}")
    return 0


# --- status ----------------------------------------------------------------------------------------------


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    """No Spark: the stream's run file and the lake's Delta logs answer, in about a second."""
    from iotmon.status import report

    return report(settings, args.json, sys.stdout)


# --- dashboard -------------------------------------------------------------------------------------------


def cmd_dashboard(settings: Settings, args: argparse.Namespace) -> int:
    """No Spark: the page reads the Delta tables with delta-rs and MLflow's registry, and refreshes itself."""
    try:
        from dashboard.app import serve
    except ImportError as exc:
        raise CommandError(f"the dashboard needs Dash and plotly ({exc}): pip install -e .") from None
    overrides = {"dashboard_host": args.host, "dashboard_port": args.port}
    serve(replace(settings, **{name: value for name, value in overrides.items() if value is not None}))
    return 0


def cmd_mlflow(settings: Settings, args: argparse.Namespace) -> int:
    """Become the MLflow UI (exec, so signals reach it directly) on the project's tracking store."""
    from ml import registry

    if settings.tracking_uri.startswith(("http://", "https://")):
        raise CommandError(f"the tracking server {settings.tracking_uri} serves its own UI; open it there")
    registry.experiment_id(settings)  # a fresh local store gets its schema and experiment before the UI reads it
    host, port = args.host or settings.mlflow_ui_host, args.port or settings.mlflow_ui_port
    say(f"mlflow ui: http://{host}:{port}/ (store {settings.tracking_uri}); Ctrl-C stops")
    ui = ["mlflow", "ui", "--backend-store-uri", settings.tracking_uri, "--host", host, "--port", str(port)]
    # MLflow 3's server otherwise starts a job runner and a pool of huey consumers (GenAI scoring, trace
    # archival): eight more Python processes the project never uses, on a machine the stream needs.
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    from iotmon import logs

    with logs.output_to_log(settings):  # exec keeps the log file as the server's output (uvicorn, gunicorn)
        os.execv(sys.executable, [sys.executable, "-m", *ui, "--workers", "1"])
    return 0  # not reached: the process became the UI


# --- setup, config, reset ----------------------------------------------------------------------------------


def cmd_setup(settings: Settings, args: argparse.Namespace) -> int:
    """Resolve every jar now, so later starts (broker, Spark) work offline; compile the local file system without
    child processes, and build the JVM's class archive, so that they start sooner."""
    from iotmon import class_archive, local_fs
    from iotmon.jars import bundle_dir, kafka_broker_bundle, resolve, spark_extras_bundle

    for bundle in (kafka_broker_bundle(), spark_extras_bundle()):
        jars = resolve(settings, bundle)
        say(f"{bundle.name}: {len(jars)} jars in {bundle_dir(settings, bundle)}")
    local_fs.set_up(settings)  # before the archive: its jar is on the class path the archive is built for
    class_archive.set_up(settings)
    return 0


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    for variable, default, meaning in describe_settings():
        say(f"{variable:<32} {default or '-':<24} {meaning}")
    return 0


def cmd_reset(settings: Settings, args: argparse.Namespace) -> int:
    """Wipe lake and checkpoints together (and Kafka's data with --kafka): they are only valid together."""
    from iotmon import broker

    targets = [Path(settings.lake_root), Path(settings.checkpoint_root), settings.truth_dir]
    if args.models:
        if settings.mlflow_tracking_uri is not None:
            raise CommandError(f"refusing to delete the models of {settings.mlflow_tracking_uri}; use MLflow's tools")
        targets.append(settings.mlflow_home)
    if args.kafka:
        if broker.status(settings).running:
            raise CommandError("stop the broker first (`iotmon kafka stop`), then reset with --kafka")
        targets.append(broker.broker_paths(settings).data)
    for target in targets:
        if "://" in str(target):
            raise CommandError(f"refusing to delete remote storage {target}; remove it with your storage tools")
        if target.exists():
            shutil.rmtree(target)
            say(f"removed {target}")
    return 0


# --- demo --------------------------------------------------------------------------------------------------


def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from iotmon import broker
    from pipeline.demo import DemoOptions, run_demo

    stop = stop_on_signals()
    if args.fresh:
        if broker.status(settings).running:
            raise CommandError("--fresh deletes the broker's data: stop it first (`iotmon kafka stop`)")
        cmd_reset(settings, argparse.Namespace(kafka=True, models=settings.mlflow_tracking_uri is None))
    options = DemoOptions(args.devices, args.rate, args.duration, args.retrain_every)
    return _reported(run_demo(settings, options, stop, progress=reconciliation_progress))


# --- chaos -------------------------------------------------------------------------------------------------


def cmd_chaos(settings: Settings, args: argparse.Namespace) -> int:
    """Faults at seeded random moments under a live fleet, then drain and reconcile; 0 only if all exact."""
    from bench.chaos import ChaosError, ChaosOptions, run_chaos

    options = ChaosOptions(
        kills=args.kills,
        broker_restarts=args.broker_restarts,
        trainer_kills=args.trainer_kills,
        seed=args.seed,
        devices=args.devices,
        rate=args.rate,
        retrain_every_s=args.retrain_every,
        kill_in=tuple(args.kill_in.split(",")) if args.kill_in else (),
    )
    try:
        options.validate()
    except ValueError as exc:
        raise CommandError(f"{exc} (see `iotmon chaos --help`)") from None
    # SIGTERM ends the run like Ctrl-C: every process it started is killed, the broker stopped.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        report = run_chaos(settings, options)
    except ChaosError as exc:
        raise CommandError(str(exc)) from None
    return 0 if report.exact else EXIT_MISMATCH


# --- parser ------------------------------------------------------------------------------------------------


def _add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    from simulators.options import SimulationOptions as Defaults

    def fraction(flag: str, meaning: str) -> None:
        default = getattr(Defaults, flag.removeprefix("--").replace("-", "_"))
        parser.add_argument(flag, type=float, default=default, help=f"{meaning} (default {default:g})")

    parser.add_argument(
        "--devices", type=int, default=Defaults.devices, help=f"fleet size (default {Defaults.devices})"
    )
    parser.add_argument(
        "--seed", type=int, default=Defaults.seed, help="random seed: same seed, same fleet and readings"
    )
    parser.add_argument("--events", type=int, help="stop after this many records")
    parser.add_argument("--duration", type=float, help="seconds: simulated time (backlog) or wall time (--rate)")
    parser.add_argument("--rate", type=float, help="real time at this many events/s (event time = wall clock)")
    parser.add_argument(
        "--past", type=float, default=0.0, help="real time: first publish this many seconds of history at once"
    )
    parser.add_argument(
        "--interval", type=float, default=Defaults.interval, help="backlog: seconds between a device's readings"
    )
    parser.add_argument("--start", type=datetime.fromisoformat, help="backlog: first event time (ISO-8601)")
    fraction("--late-fraction", "late, within the watermark")
    fraction("--very-late-fraction", "late, far beyond the watermark")
    fraction("--duplicate-fraction", "the same reading sent twice")
    fraction("--malformed-fraction", "corrupted payloads")
    fraction("--anomaly-fraction", "readings inside anomaly episodes")
    fraction("--dropout-fraction", "device time spent silent")
    parser.add_argument("--truth", type=Path, help="ground-truth Parquet (default $IOTMON_HOME/truth/run-SEED.parquet)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


REPLAY_EPILOG = """\
Each row becomes one event, published in event-time order with the device id as key. Rows with a missing or
unparsable value are published too (bronze quarantines them with the reason), rows without a usable time
last. Devices missing from the devices table are added to it; existing rows are kept.

Timing: the event time in each event is the recorded one; the Kafka timestamp is the send time. The stream
measures lateness as Kafka time minus event time, so history older than the watermark
(IOTMON_WATERMARK) is archived but marked too_late and left out of the windowed aggregates. --restamp
shifts every event time by one constant so the first reading happens now: at the original pace the replay
then looks live on the dashboards (faster, event times run ahead of the wall clock). A file not sorted by
time is sorted in memory (about 100 bytes a row).

example: iotmon replay readings.csv --device-col sensor --time-col ts --speed 60 --restamp"""


def _replay_speed(text: str) -> float | None:
    from simulators.replay import parse_speed

    try:
        return parse_speed(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    from iotmon.schema import DEVICE_ID, EVENT_TIME, METRIC_NAMES

    parser.add_argument("file", type=Path, metavar="FILE", help="recorded readings: CSV (.csv, .csv.gz) or Parquet")
    parser.add_argument("--format", choices=("csv", "parquet"), help="file format (default: from the file name)")
    parser.add_argument(
        "--speed",
        type=_replay_speed,
        default=1.0,
        metavar="N|max",
        help="N times the original pace (60: an hour per minute), or max: no waiting (default 1)",
    )
    parser.add_argument(
        "--restamp", action="store_true", help="shift all event times by one constant so the first is now"
    )
    columns = parser.add_argument_group("columns", "which column of the file holds each field of the event")
    columns.add_argument("--device-col", default=DEVICE_ID, metavar="COL", help=f"device id (default {DEVICE_ID})")
    columns.add_argument(
        "--time-col",
        default=EVENT_TIME,
        metavar="COL",
        help=f"event time: ISO-8601, timestamp or epoch (default {EVENT_TIME})",
    )
    columns.add_argument(
        "--time-unit", choices=("s", "ms"), help="epoch seconds or milliseconds, if the time is numeric"
    )
    columns.add_argument(
        "--seq-col", metavar="COL", help="per-device sequence number (default: assigned 1, 2, 3 ... in time order)"
    )
    for metric in METRIC_NAMES:
        columns.add_argument(f"--{metric}-col", default=metric, metavar="COL", help=f"(default {metric})")
    columns.add_argument(
        "--device-type-col", metavar="COL", help="device type for new registry rows (default: unknown)"
    )
    columns.add_argument("--site-col", metavar="COL", help="site for new registry rows (default: replay)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def _utc_time(text: str) -> datetime:
    """An ISO-8601 time; without an offset it is UTC, as every time in the lake is."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an ISO-8601 time, e.g. 2026-11-22T10:00:00, not {text!r}") from None
    return moment.astimezone(UTC).replace(tzinfo=None) if moment.tzinfo else moment


def _seconds(text: str) -> float:
    """An interval argument such as '10 minutes', in seconds."""
    try:
        return interval_seconds(text)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected '<number> seconds|minutes|hours', not {text!r}") from None


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.report import PARTS
    from bench.run import BenchOptions as Defaults

    def sizes(values: tuple[int, ...]) -> str:
        return ",".join(str(v) for v in values)

    parser.add_argument(
        "--events",
        type=int,
        default=Defaults.events,
        help=f"backlog for ceilings and drain (default {Defaults.events})",
    )
    parser.add_argument(
        "--devices", type=int, default=Defaults.devices, help=f"fleet size (default {Defaults.devices})"
    )
    parser.add_argument(
        "--scale",
        type=_positive_ints,
        default=Defaults.scale,
        metavar="N,N,...",
        help=f"fleet sizes of the scale phase (default {sizes(Defaults.scale)})",
    )
    parser.add_argument(
        "--scale-events",
        type=int,
        default=Defaults.scale_events,
        help=f"backlog per fleet size (default {Defaults.scale_events})",
    )
    parser.add_argument(
        "--train-sizes",
        type=_positive_ints,
        default=Defaults.train_sizes,
        metavar="N,N,...",
        help=f"archive sizes (readings) to time training on (default {sizes(Defaults.train_sizes)})",
    )
    parser.add_argument(
        "--write-rounds",
        type=int,
        default=Defaults.write_rounds,
        help=f"appends and MERGEs the writes phase times, each (default {Defaults.write_rounds})",
    )
    parser.add_argument(
        "--steady-rate",
        type=float,
        default=Defaults.steady_rate,
        help=f"events/s of the steady phase, from --devices devices (default {Defaults.steady_rate:g})",
    )
    parser.add_argument(
        "--steady-seconds",
        type=float,
        default=Defaults.steady_seconds,
        help=f"seconds the steady phase measures (default {Defaults.steady_seconds:g})",
    )
    parser.add_argument(
        "--demo-rate-seconds",
        type=float,
        default=Defaults.demo_rate_seconds,
        help=f"seconds the demo-rate phase measures (default {Defaults.demo_rate_seconds:g})",
    )
    parser.add_argument(
        "--steady-warmup",
        type=float,
        default=Defaults.steady_warmup,
        help="publishing before the steady and demo-rate phases measure: the queries' start-up "
        f"(default {Defaults.steady_warmup:g})",
    )
    parser.add_argument(
        "--retrain-every",
        type=_seconds,
        default=Defaults.retrain_every_s,
        help="how often the trainer beside the stream retrains in the steady and demo-rate phases "
        f"(default {Defaults.retrain_every_s:g} seconds)",
    )
    parser.add_argument("--no-trainer", action="store_true", help="no trainer beside the stream")
    parser.add_argument("--no-viewer", action="store_true", help="no dashboard page open beside the stream")
    parser.add_argument("--seed", type=int, default=Defaults.seed, help=f"simulator seed (default {Defaults.seed})")
    parser.add_argument(
        "--out", type=Path, help="output directory, new or empty (default $IOTMON_HOME/bench/<timestamp>)"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=PARTS,
        metavar="PART",
        help=f"leave out a part: {', '.join(PARTS)}",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iotmon",
        description="IoT device monitoring on Kafka, Spark Structured Streaming and Delta Lake.",
        epilog="Configuration comes from IOTMON_* environment variables: see `iotmon config`.",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Spark's, Kafka's, MLflow's and the servers' log lines on the console too (IOTMON_LOG_LEVEL=INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Callable[[Settings, argparse.Namespace], int], help_text: str):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    kafka = command("kafka", cmd_kafka, "start, stop or inspect the embedded single-node Kafka broker")
    kafka.add_argument("action", choices=("start", "stop", "status"))
    _add_simulate_arguments(command("simulate", cmd_simulate, "publish a simulated sensor fleet to Kafka"))
    replay = command("replay", cmd_replay, "publish recorded readings (CSV or Parquet) to Kafka in event-time order")
    replay.epilog = REPLAY_EPILOG
    replay.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_replay_arguments(replay)
    stream = command(
        "stream", cmd_stream, "run the streaming queries (Kafka -> bronze -> silver -> gold, device status)"
    )
    stream.add_argument("--until-idle", action="store_true", help="process what Kafka holds now, then exit 0")
    verify = command("verify", cmd_verify, "reconcile Kafka, the lake and the ground truth; non-zero on mismatch")
    verify.add_argument("--truth", type=Path, action="append", default=[], help="ground-truth file (repeatable)")
    verify.add_argument("--all-truth", action="store_true", help="use every file in $IOTMON_HOME/truth")
    from ml.model import ModelParams

    trainer = command("train", cmd_train, "train the anomaly model on silver, log it to MLflow, promote if not worse")
    trainer.add_argument(
        "--every", type=_seconds, help="retrain this long after each run ends, e.g. '10 minutes' (default: once)"
    )
    trainer.add_argument(
        "--clusters", type=int, default=ModelParams.clusters, help=f"KMeans clusters (default {ModelParams.clusters})"
    )
    trainer.add_argument(
        "--contamination", type=float, help="share of readings to flag (default $IOTMON_ANOMALY_CONTAMINATION)"
    )
    trainer.add_argument("--holdout", type=float, default=0.2, help="latest share of the data kept for evaluation")
    trainer.add_argument("--truth", type=Path, action="append", default=[], help="labels: ground-truth file")
    trainer.add_argument("--no-truth", action="store_true", help="ignore $IOTMON_HOME/truth (evaluate unlabelled)")
    trainer.add_argument("--promote", action="store_true", help="make this model champion whatever its score")
    command("backfill", cmd_backfill, "rebuild silver and gold from the bronze archive (stop the stream first)")
    sql = command("sql", cmd_sql, "Spark SQL over the lake tables (bronze, quarantine, devices, ...)")
    sql.add_argument("statement", nargs="?", help='e.g. "SELECT parse_error, count(*) FROM bronze GROUP BY 1"')
    sql.add_argument("--limit", type=int, default=50, help="rows to show (default 50)")
    latency = command(
        "latency", cmd_latency, "event-to-Delta-commit latency percentiles of bronze, silver, anomalies, live windows"
    )
    latency.add_argument("--since", type=_utc_time, help="events from this UTC time, e.g. 2026-11-22T10:00:00")
    latency.add_argument("--last", type=_seconds, default=600.0, help="else the last DURATION (default 10 minutes)")
    _add_bench_arguments(
        command("bench", cmd_bench, "measure ceilings, pipeline throughput, latency, scale and training cost")
    )
    status = command("status", cmd_status, "is the stream running, its queries' last progress, the lake's tables")
    status.add_argument("--json", action="store_true", help="the same as JSON, for scripts and dashboards")
    dashboard = command(
        "dashboard",
        cmd_dashboard,
        "web dashboard over the lake (no Spark): fleet, devices, anomalies, pipeline health, models",
    )
    dashboard.add_argument("--host", help="address to listen on (default $IOTMON_DASHBOARD_HOST, 127.0.0.1)")
    dashboard.add_argument("--port", type=int, help="port to listen on (default $IOTMON_DASHBOARD_PORT, 8050)")
    ui = command("mlflow", cmd_mlflow, "the MLflow UI on the project's tracking store: runs, versions, champion")
    ui.add_argument("--host", help="address to listen on (default $IOTMON_MLFLOW_UI_HOST, 127.0.0.1)")
    ui.add_argument("--port", type=int, help="port to listen on (default $IOTMON_MLFLOW_UI_PORT, 5000)")
    command("setup", cmd_setup, "download the broker's and Spark's jars and build the JVM's class archive now")
    command("config", cmd_config, "list the IOTMON_* settings with their defaults")
    reset = command("reset", cmd_reset, "delete the lake, checkpoints and truth files (they go together)")
    reset.add_argument("--kafka", action="store_true", help="also delete the embedded broker's data")
    reset.add_argument("--models", action="store_true", help="also delete the local MLflow runs and models")
    from bench.chaos import ChaosOptions
    from pipeline.demo import DemoOptions

    chaos = command(
        "chaos",
        cmd_chaos,
        "SIGKILL the stream, restart the broker, kill the trainer mid-write under a live fleet; reconcile exactly",
    )
    chaos.add_argument(
        "--kills", type=int, default=ChaosOptions.kills, help=f"stream SIGKILLs (default {ChaosOptions.kills})"
    )
    chaos.add_argument(
        "--broker-restarts",
        type=int,
        default=ChaosOptions.broker_restarts,
        help=f"broker restarts under a running stream (default {ChaosOptions.broker_restarts})",
    )
    chaos.add_argument(
        "--trainer-kills",
        type=int,
        default=ChaosOptions.trainer_kills,
        help=f"trainer SIGKILLs while it writes to MLflow (default {ChaosOptions.trainer_kills})",
    )
    chaos.add_argument(
        "--seed", type=int, default=ChaosOptions.seed, help="random seed of the faults and the fleet (default 1)"
    )
    chaos.add_argument(
        "--devices", type=int, default=ChaosOptions.devices, help=f"fleet size (default {ChaosOptions.devices})"
    )
    chaos.add_argument(
        "--rate", type=float, default=ChaosOptions.rate, help=f"events/s (default {ChaosOptions.rate:g})"
    )
    chaos.add_argument(
        "--retrain-every",
        type=_seconds,
        default=ChaosOptions.retrain_every_s,
        help=f"how often the trainer runs, e.g. '2 minutes' (default {ChaosOptions.retrain_every_s:g} seconds)",
    )
    chaos.add_argument(
        "--kill-in",
        metavar="QUERY,...",
        help="time the first kills by a batch in flight in these queries, in order "
        "(e.g. bronze,silver,device_status,anomalies,alerts); the rest at random",
    )
    demo = command(
        "demo",
        cmd_demo,
        "broker, real-time fleet, stream, periodic trainer, dashboard, MLflow UI; Ctrl-C drains and reconciles",
    )
    demo.add_argument("--devices", type=int, default=DemoOptions.devices)
    demo.add_argument("--rate", type=float, default=DemoOptions.rate, help=f"events/s (default {DemoOptions.rate:g})")
    demo.add_argument("--duration", type=float, help="seconds to run (default: until Ctrl-C)")
    demo.add_argument(
        "--retrain-every",
        type=_seconds,
        default=DemoOptions.retrain_every_s,
        help=f"how often the trainer runs, e.g. '2 minutes' (default {DemoOptions.retrain_every_s:g} seconds)",
    )
    demo.add_argument("--fresh", action="store_true", help="start over: delete lake, checkpoints, Kafka data, models")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if threading.current_thread() is threading.main_thread():  # signal handlers belong to the main thread
        remember_interrupts()
    from iotmon import logs

    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # Ctrl-C, or a supervisor's SIGINT, while the parser imports the stages
        say("iotmon: interrupted", sys.stderr)
        return 130
    if args.verbose and not os.environ.get("IOTMON_LOG_LEVEL"):
        os.environ["IOTMON_LOG_LEVEL"] = "INFO"  # for this process and every process it starts
    settings: Settings | None = None
    log = None
    try:
        settings = Settings.from_env()
        log = logs.setup(settings, args.command)
        return args.handler(settings, args)
    except _known_errors() as exc:
        message = str(exc) if settings is None else settings.redact(str(exc))
        say(f"iotmon {args.command}: error: {message}", sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        say(f"iotmon {args.command}: interrupted", sys.stderr)
        return 130
    except Exception as exc:  # a bug or an unforeseen failure: one line here, the traceback in the log
        from iotmon.queries import explain

        logging.getLogger("iotmon").exception("iotmon %s failed", args.command)
        message = explain(exc).splitlines()[0]
        message = settings.redact(message) if settings is not None else message
        where = f"; details in {log}" if log is not None and not logs.on_console(settings) else ""
        say(f"iotmon {args.command}: unexpected error: {message}{where}", sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
