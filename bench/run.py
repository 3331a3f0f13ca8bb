"""``iotmon bench``: every measurement in one run, on the embedded stack, into ``report.json`` and ``report.png``.

Phases, in order (each with a topic, lake and checkpoints of its own under the bench directory, so the
user's lake is never touched, and all sharing one Spark session and the bench's own MLflow store):

1. model: a small archive through bronze and silver, a model trained on it and made champion, so that
   scoring runs in every pipeline phase;
2. ceilings: a backlog published to the drain topic, then read by a plain consumer and by Spark into noop;
3. drain: the whole pipeline over that same backlog, query by query (available-now), then again over a lake of
   its own by the topology, as ``iotmon stream --until-idle`` drains;
4. writes: one Delta append and one MERGE (the project's, and Spark's for reference) of a row per device, timed
   alone (what a sink of each kind costs);
5. demo_rate: the demo's fleet in real time (500 events/s from 200 devices) into every query at once, beside a
   periodic trainer and a dashboard page: the stream's CPU at the demo's rate;
6. steady: the same at issue 17's steady rate (5,000 events/s from ``--devices``) for ten minutes: latency
   percentiles read from the Delta logs, silent devices marked offline, each table's freshness over the run;
7. scale: a backlog per fleet size drained by every query at once, state and memory per size;
8. training: ``iotmon train`` timed on archives of growing size.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import report as shaping
from bench.progress import ProgressCollector
from bench.stats import cpu_bound, ratio, summarise_progress
from bench.steady import steady_state
from bench.system import MemorySampler, directory_bytes, jvm_pid, machine_info
from bench.throughput import (
    consumer_ceiling,
    drain,
    drain_by_topology,
    drain_concurrently,
    phase_settings,
    preload,
    spark_noop_ceiling,
)
from bench.training import champion_model, training_cost
from bench.writes import write_costs
from iotmon.config import Settings
from iotmon.logs import say
from pipeline.demo import DemoOptions
from simulators.options import SimulationOptions
from simulators.publish import write_device_registry


@dataclass(frozen=True)
class BenchOptions:
    events: int = 200_000
    """Backlog of the ceilings and the drain (one topic for both)."""
    devices: int = 500
    scale: tuple[int, ...] = (1_000, 10_000, 100_000)
    scale_events: int = 100_000
    scale_span_s: float = 1_200.0
    """Simulated event time each scale point's backlog covers: several watermarks and sliding windows."""
    scale_batches: int = 10
    """Bronze batches per scale point (maxOffsetsPerTrigger = events / batches), so event time moves in steps."""
    scale_timeout_s: float = 900.0
    train_sizes: tuple[int, ...] = (100_000, 400_000)
    write_rounds: int = 20
    """Writes of each kind the writes phase times, after ``write_warmup`` untimed ones."""
    write_warmup: int = 10
    steady_rate: float = shaping.TARGET_STEADY_RATE
    """Events/s of the steady phase, from ``devices`` devices (issue 17: 5,000 from 500)."""
    steady_seconds: float = 600.0
    """Seconds the steady phase measures (issue 17: ten minutes)."""
    steady_warmup: float = 120.0
    """Seconds of publishing before the steady and demo-rate phases measure: the queries' start-up is not steady
    state."""
    demo_rate_seconds: float = 240.0
    """Seconds the demo-rate phase measures, at ``DemoOptions``' rate and fleet (issue 17's CPU target)."""
    retrain_every_s: float | None = 300.0
    """The trainer beside the stream in both phases retrains this long after each run (issue 17: 5 minutes);
    None runs none."""
    viewer: bool = True
    """A dashboard page open beside the stream in both phases (``bench.viewer``)."""
    seed: int = 7
    out: Path | None = None
    skip: frozenset[str] = field(default_factory=frozenset)

    def validate(self) -> None:
        unknown = set(self.skip) - set(shaping.PARTS)
        if unknown:
            raise ValueError(
                f"unknown part(s) to skip: {', '.join(sorted(unknown))}; parts: {', '.join(shaping.PARTS)}"
            )
        sizes = (self.events, self.devices, self.scale_events, self.scale_batches, *self.scale, *self.train_sizes)
        if min(*sizes, self.write_rounds) < 1 or self.write_warmup < 0:
            raise ValueError("sizes must be positive")
        if min(self.steady_rate, self.steady_seconds, self.demo_rate_seconds) <= 0 or self.steady_warmup < 0:
            raise ValueError("the steady rate and the measured seconds must be positive, the warm-up not negative")
        if self.out is not None and self.out.is_dir() and any(self.out.iterdir()):
            # Its checkpoints would resume against the new run's broker and topics, and fail half-way.
            raise ValueError(f"{self.out} is not empty: give --out a new or empty directory")

    def runs(self, part: str) -> bool:
        return part not in self.skip


class _Log:
    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        say(f"[bench {time.monotonic() - self.started:7.1f}s] {message}", sys.stderr)


def kafka_answers(settings: Settings) -> bool:
    from iotmon.kafka import KafkaUnavailable, require_broker

    try:
        require_broker(settings, timeout=5)
    except KafkaUnavailable:
        return False
    return True


def default_out(settings: Settings, now: datetime) -> Path:
    return settings.home / "bench" / f"{now:%Y%m%d-%H%M%S}"


def run_bench(settings: Settings, options: BenchOptions) -> tuple[dict[str, Any], Path]:
    """Run every phase not skipped; returns the report and the directory holding report.json and report.png."""
    from iotmon import broker

    options.validate()
    now = datetime.now(UTC)
    out = (options.out or default_out(settings, now)).absolute()
    out.mkdir(parents=True, exist_ok=True)
    run_id = f"{now:%Y%m%d%H%M%S}"
    # The bench's own MLflow store and lake root; the jar cache stays the user's.
    base = replace(settings, home=out, cache_dir=settings.cache, lake=None, checkpoints=None, mlflow_tracking_uri=None)
    log = _Log()
    own_broker = not kafka_answers(base)
    if own_broker:
        log(f"starting an embedded broker at {base.kafka_bootstrap} (data under {out / 'kafka'})")
        broker.start(base)
    topics: list[str] = []
    try:
        return _phases(base, options, out, run_id, now, log, topics), out
    finally:
        if own_broker:
            broker.stop(base)
            log("stopped the broker the bench started")
        else:
            _delete_topics(base, topics)


def _delete_topics(settings: Settings, topics: list[str]) -> None:
    from iotmon.kafka import admin

    if topics:
        client = admin(settings)  # held until every future resolves: a dropped client cancels them
        for future in client.delete_topics(topics).values():
            try:
                future.result(30)
            except Exception as exc:  # left behind on the user's broker; say so, don't fail the report
                say(f"bench: could not delete a topic: {exc}", sys.stderr)


def _phases(
    base: Settings, options: BenchOptions, out: Path, run_id: str, now: datetime, log: _Log, topics: list[str]
) -> dict[str, Any]:
    from iotmon.spark import spark_session

    def settings_for(name: str, **overrides: Any) -> Settings:
        phase = phase_settings(base, out, name, run_id, **overrides)
        topics.append(phase.topic)
        return phase

    from pipeline.topology import pool_weights

    spark = spark_session(base, "iotmon-bench", pool_weights())
    collector = ProgressCollector().install(spark)
    jvm = jvm_pid(spark)
    memory = MemorySampler(jvm)
    memory.start()
    report: dict[str, Any] = dict.fromkeys(shaping.SECTIONS, shaping.SKIPPED)
    report["machine"] = machine_info(base.spark_master)
    report["settings"] = {
        "started_at": now.isoformat(timespec="seconds"),
        "out": str(out),
        "options": {k: sorted(v) if isinstance(v, frozenset) else v for k, v in asdict(options).items()},
        "spark_driver_memory": base.spark_driver_memory,
        "shuffle_partitions": base.shuffle_partitions,
        "trigger_interval": base.trigger_interval,
        "gold_trigger_interval": base.gold_trigger_interval,
        "busy_trigger_interval": base.busy_trigger_interval,
        "busy_rows_per_second": base.busy_rows_per_second,
        "final_trigger_interval": base.final_trigger_interval,
        "max_offsets_per_trigger": base.max_offsets_per_trigger,
        "watermark": base.watermark,
        "topic_partitions": base.topic_partitions,
    }
    log(f"machine: {report['machine']['cores']} cores, output {out}")
    try:
        model_settings = settings_for("model")
        if any(options.runs(p) for p in ("drain", "demo_rate", "steady", "scale", "training")):
            log("model: a small archive through bronze and silver, then training a champion")
            with memory.phase("model"):
                report["model"] = champion_model(spark, model_settings, options.seed, log)
        drain_settings = settings_for("drain")
        if options.runs("ceilings") or options.runs("drain"):
            log(f"preload: {options.events:,} events from {options.devices:,} devices into {drain_settings.topic}")
            backlog = SimulationOptions(
                devices=options.devices,
                seed=options.seed,
                events=options.events,
                truth_path=out / "truth" / "drain.parquet",
                progress=False,
            )
            published = preload(drain_settings, backlog)
            log(f"preload: {published['records']:,} records at {published['events_per_s']:,.0f} events/s")
        if options.runs("ceilings"):
            log("ceilings: plain Kafka consumer")
            consumer = consumer_ceiling(drain_settings, published["records"])
            log(f"ceilings: consumer {consumer['events_per_s']:,.0f} events/s; Spark Kafka -> noop (cold, then warm)")
            checkpoints = Path(drain_settings.checkpoint_root)
            cold = spark_noop_ceiling(spark, drain_settings, str(checkpoints / "noop-cold"))
            warm = spark_noop_ceiling(spark, drain_settings, str(checkpoints / "noop-warm"))
            log(f"ceilings: Spark noop {cold['events_per_s']:,.0f} cold, {warm['events_per_s']:,.0f} events/s warm")
            report["ceilings"] = {
                "publish": published,
                "consumer": consumer,
                "spark_noop_cold": cold,
                "spark_noop": max(cold, warm, key=lambda r: r["events_per_s"]),
            }
        if options.runs("drain"):
            log("drain: the whole pipeline over the same backlog, one query after the other")
            with memory.phase("drain"):
                drained = drain(spark, drain_settings, published["records"], log)
            ceiling = report["ceilings"]["spark_noop"]["events_per_s"] if options.runs("ceilings") else None
            drained["ceiling_share"] = ratio(drained["events_per_s"], ceiling)
            drained["memory"] = memory.peaks("drain")
            log("drain: again over a lake of its own, by the topology, as `iotmon stream --until-idle` drains")
            by_topology = replace(
                drain_settings,
                lake=str((out / "drain-by-topology" / "lake").absolute()),
                checkpoints=str((out / "drain-by-topology" / "checkpoints").absolute()),
            )
            write_device_registry(by_topology, options.devices, options.seed)  # as the preload wrote the first's
            topology = drain_by_topology(spark, by_topology, published["records"], log)
            # What the same CPU per event would allow with every usable core busy: a bound no scheduling beats.
            bound = cpu_bound(topology["events"], topology["cpu_seconds"], report["machine"]["usable_cores"])
            topology["ceiling_share"] = ratio(topology["events_per_s"], ceiling)
            topology["cpu_bound_events_per_s"] = None if bound is None else round(bound, 1)
            topology["cpu_bound_share"] = ratio(bound, ceiling)
            drained["by_topology"] = topology
            report["drain"] = drained
        if options.runs("writes"):
            log(f"writes: Delta appends and MERGEs of {options.devices:,} rows, {options.write_rounds} of each timed")
            report["writes"] = write_costs(
                spark, out / "writes", jvm, options.devices, options.write_rounds, options.write_warmup, log
            )
        demo = DemoOptions()
        steady_runs = (
            ("demo_rate", demo.rate, demo.devices, options.demo_rate_seconds),
            ("steady", options.steady_rate, options.devices, options.steady_seconds),
        )
        for part, rate, devices, seconds in steady_runs:
            if not options.runs(part):
                continue
            wanted = (("a trainer", options.retrain_every_s), ("a dashboard page", options.viewer))
            company = [name for name, on in wanted if on]
            beside = f" beside {' and '.join(company)}" if company else ""
            log(
                f"{part}: {rate:,.0f} events/s from {devices:,} devices into every query at once{beside}, "
                f"{options.steady_warmup:g}s of warm-up then {seconds:g}s measured"
            )
            with memory.phase(part):
                steady = steady_state(
                    spark,
                    settings_for(part),
                    collector,
                    rate,
                    seconds,
                    devices,
                    options.seed,
                    log,
                    options.steady_warmup,
                    options.retrain_every_s,
                    options.viewer,
                    part,
                )
            steady["memory"] = memory.peaks(part)
            report[part] = steady
        if options.runs("scale"):
            report["scale"] = _scale(spark, options, settings_for, collector, memory, log)
        if options.runs("training"):
            sizes = list(options.train_sizes)
            log(f"training: archives of {', '.join(f'{s:,}' for s in sizes)} readings")
            with memory.phase("training"):
                runs = training_cost(spark, base, report["model"]["silver"], sizes, out / "training", log)
            report["training"] = {"base": report["model"]["silver"], "runs": runs, "memory": memory.peaks("training")}
    finally:
        memory.stop()
    report["targets"] = [target.to_dict() for target in shaping.targets(report)]
    shaping.write_json(report, out / "report.json")
    shaping.plot(report, out / "report.png")
    return report


def _scale(spark, options: BenchOptions, settings_for, collector, memory, log) -> dict[str, Any]:
    points = []
    for devices in options.scale:
        per_batch = math.ceil(options.scale_events / options.scale_batches)
        settings = settings_for(f"scale-{devices}", max_offsets_per_trigger=per_batch)
        interval = devices * options.scale_span_s / options.scale_events
        log(f"scale: {devices:,} devices, {options.scale_events:,} events (a reading every {interval:g}s)")
        backlog = SimulationOptions(
            devices=devices,
            seed=options.seed,
            events=options.scale_events,
            interval=interval,
            truth_path=settings.home / "truth" / f"scale-{devices}.parquet",
            progress=False,
        )
        published = preload(settings, backlog)
        name = f"scale-{devices}"
        with memory.phase(name):
            run = drain_concurrently(spark, settings, collector, options.scale_timeout_s, log)
        summaries = summarise_progress(collector.since(run["mark"]))
        state = []
        for summary in summaries.values():
            if summary.state_rows_max is None:
                continue
            state.append(
                {
                    **summary.to_dict(),
                    "state_disk_bytes": directory_bytes(Path(settings.checkpoint_path(summary.name)) / "state"),
                }
            )
        records = published["records"]
        point = {
            "devices": devices,
            "events": records,
            "seconds": run["seconds"],
            "events_per_s": round(records / run["seconds"], 1) if run["seconds"] else None,
            "caught_up": run["caught_up"],
            "behind": run["behind"],
            "state": state,
            "memory": memory.peaks(name),
        }
        log(f"scale: {devices:,} devices drained in {run['seconds']:.1f}s ({point['events_per_s']:,.0f} events/s)")
        points.append(point)
    return {"mode": "concurrent (every query at once, as iotmon stream runs)", "points": points}
