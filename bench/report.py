"""The benchmark's outputs: the JSON report, the figures as a readable table, and one PNG of four charts.

The report is a plain dict with one section per phase (``SECTIONS``); a skipped phase's section says so
(``{"skipped": true}``), so a reader or a script never guesses whether a figure is missing or zero.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.progress import BATCH_PHASES
from bench.stats import Target, rate, ratio
from bench.viewer import GROWTH_LIMIT_S_PER_MIN
from iotmon.schema import ANOMALIES, BRONZE, LIVE_WINDOWS

SECTIONS: tuple[str, ...] = (
    "machine",
    "settings",
    "model",
    "ceilings",
    "drain",
    "writes",
    "demo_rate",
    "steady",
    "scale",
    "training",
)
PARTS: tuple[str, ...] = ("ceilings", "drain", "writes", "demo_rate", "steady", "scale", "training")
"""Phases ``--skip`` may leave out (machine, settings and the model are always there)."""
SKIPPED: dict[str, Any] = {"skipped": True}
TARGET_CEILING_SHARE = 0.10
"""The whole path draining a backlog, as a share of Spark's Kafka->noop ceiling measured in the same run."""
TARGET_STEADY_RATE = 5_000.0
TARGET_BRONZE_P95_S = 5.0
TARGET_ANOMALY_P95_S = 15.0
TARGET_LIVE_P95_S = 15.0
TARGET_CPU_RATE = 500.0
TARGET_CPU_CORES = 0.5
TARGET_OFFLINE_MARGIN_S = 15.0
"""Issue 17's targets on 2 cores: latency at 5,000 events/s, the stream's CPU at the demo's 500 events/s, a silent
device offline within ``IOTMON_OFFLINE_AFTER`` + 15 s, no table's freshness growing over the steady run."""
GIB = 1024**3
MIB = 1024**2


def _ran(section: Any) -> bool:
    return isinstance(section, Mapping) and not section.get("skipped")


def _p95(steady: Mapping[str, Any], table: str) -> float | None:
    row = next((r for r in steady["latency"] if r["table"] == table), None)
    return row["p95_s"] if row else None


def targets(report: Mapping[str, Any]) -> list[Target]:
    """Issue 17's targets against the report's figures (None where a phase did not run); a phase run at another
    rate than a target's is measured, and the note says at which."""
    drain, ceilings = report.get("drain"), report.get("ceilings")
    steady, demo = report.get("steady"), report.get("demo_rate")
    sustained = drain["by_topology"]["events_per_s"] if _ran(drain) else None  # the path as a drain runs it
    ceiling = ceilings["spark_noop"]["events_per_s"] if _ran(ceilings) else None
    latency: dict[str, float | None] = dict.fromkeys((BRONZE, ANOMALIES, LIVE_WINDOWS))
    offline_s, offline_limit, growth, note, offline_note, growth_note = None, TARGET_OFFLINE_MARGIN_S, None, "", "", ""
    if _ran(steady):
        latency = {table: _p95(steady, table) for table in latency}
        note = _rate_note(steady, TARGET_STEADY_RATE)
        offline = steady.get("offline") or {}
        offline_s, offline_limit = offline.get("max_s"), offline.get("offline_after_s", 0.0) + TARGET_OFFLINE_MARGIN_S
        offline_note = f"slowest of {offline.get('silences', 0)} silences" + (
            f", {offline['missed']} never marked (a lower bound)" if offline.get("missed") else ""
        )
        if fastest := steady.get("fastest_growth"):
            growth, growth_note = fastest["s_per_min"], f"{fastest['table']}, the fastest"
    cores, cpu_note = None, ""
    if _ran(demo):
        cores, cpu_note = (demo.get("stream_cpu") or {}).get("cores"), _rate_note(demo, TARGET_CPU_RATE)
    at_rate = f"at {TARGET_STEADY_RATE:,.0f} events/s"
    return [
        Target(
            "drain, share of Spark's Kafka->noop ceiling", ">= 0.10", ratio(sustained, ceiling), TARGET_CEILING_SHARE
        ),
        Target("p95 event->bronze", f"<= 5 s {at_rate}", latency[BRONZE], TARGET_BRONZE_P95_S, True, note),
        Target("p95 event->anomaly", f"<= 15 s {at_rate}", latency[ANOMALIES], TARGET_ANOMALY_P95_S, True, note),
        Target("p95 event->live window", f"<= 15 s {at_rate}", latency[LIVE_WINDOWS], TARGET_LIVE_P95_S, True, note),
        Target(
            "silent device -> offline row",
            f"<= offline_after + 15 s {at_rate}",
            offline_s,
            offline_limit,
            True,
            ", ".join(filter(None, (note, offline_note))),
        ),
        Target(
            "tables' freshness growth, s a minute",
            f"<= {GROWTH_LIMIT_S_PER_MIN:g} {at_rate}",
            growth,
            GROWTH_LIMIT_S_PER_MIN,
            True,
            ", ".join(filter(None, (note, growth_note))),
        ),
        Target(
            "stream CPU", f"<= 0.5 cores at {TARGET_CPU_RATE:,.0f} events/s", cores, TARGET_CPU_CORES, True, cpu_note
        ),
    ]


def _rate_note(section: Mapping[str, Any], rate: float) -> str:
    return "" if section["rate"] == rate else f"measured at {section['rate']:,.0f} events/s"


def write_json(report: Mapping[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")


def _bytes(value: float | None, unit: int = MIB, suffix: str = "MiB") -> str:
    return "-" if value is None else f"{value / unit:,.0f} {suffix}"


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _cpu(row: Mapping[str, Any]) -> str:
    """A drain row's CPU: seconds, cores busy on average and microseconds per event (nothing if not measured)."""
    if row.get("cpu_seconds") is None:
        return ""
    return f"  CPU {row['cpu_seconds']:>6.1f}s = {row['cores']:.2f} cores, {_num(row['cpu_us_per_event'])} us/event"


def _shares(parts: Mapping[str, float], seconds: float) -> str:
    """CPU seconds per part over ``seconds`` of wall time as cores, the largest first (those that used any)."""
    ordered = sorted(parts.items(), key=lambda part: -part[1])
    return ", ".join(f"{name} {rate(cpu, seconds):.2f}" for name, cpu in ordered if cpu > 0)


def render(report: Mapping[str, Any]) -> str:
    """Every figure of the report as aligned text for the terminal."""
    lines: list[str] = []
    machine = report["machine"]
    lines.append(
        f"machine: {machine['cores']} cores ({machine['usable_cores']} usable), "
        f"{_bytes(machine['memory_bytes'], GIB, 'GiB')} memory, load {machine.get('load_average')}, "
        f"Spark {machine['pyspark']} {machine['spark_master']}, {machine.get('java') or 'java ?'}"
    )
    ceilings = report["ceilings"]
    if _ran(ceilings):
        lines.append("ceilings (same topic)                         records      seconds     events/s   CPU us/event")
        rows = [
            ("simulator publish (backlog)", ceilings["publish"]),
            ("Kafka consumer (confluent-kafka)", ceilings["consumer"]),
            ("Spark Kafka -> noop, cold", ceilings["spark_noop_cold"]),
            ("Spark Kafka -> noop, warm (the ceiling)", ceilings["spark_noop"]),
        ]
        for name, row in rows:
            records = row.get("records", row.get("sent"))
            lines.append(
                f"  {name:<42}{_num(records):>10} {row['seconds']:>10.2f} {_num(row['events_per_s']):>12}"
                f" {_num(row.get('cpu_us_per_event')):>14}"
            )
    drain = report["drain"]
    if _ran(drain):
        lines.append(f"full pipeline draining a backlog, {drain['mode']}; CPU of the Spark JVM and this process")
        for q in drain["queries"]:
            state = "skipped (not ready)" if q["skipped"] else f"{_num(q['rows_per_s']):>10} rows/s"
            lines.append(f"  {q['name']:<22}{_num(q['rows']):>12} rows {q['seconds']:>8.1f}s {state}{_cpu(q)}")
        topology = drain["by_topology"]
        for name, path in (("whole path in turn", drain), ("whole path by topology", topology)):
            lines.append(
                f"  {name:<22}{_num(path['events']):>12} evts {path['seconds']:>8.1f}s "
                f"{_num(path['events_per_s']):>10} events/s = {_num(path.get('ceiling_share'), 3)} x Spark's ceiling"
                + _cpu(path)
            )
        lines.append(f"  (by topology: {topology['mode']})")
        if topology.get("cpu_bound_events_per_s"):
            lines.append(
                f"  at its CPU per event, {report['machine']['usable_cores']} cores busy with nothing else would drain "
                f"{_num(topology['cpu_bound_events_per_s'])} events/s = {_num(topology.get('cpu_bound_share'), 3)} x "
                "Spark's ceiling: the bound no scheduling beats"
            )
        if topology.get("cpu_parts"):
            lines.append(f"  where the cores went: {_shares(topology['cpu_parts'], topology['seconds'])}")
    writes = report["writes"]
    if _ran(writes):
        lines.append(
            f"Delta writes of {writes['devices']:,} rows, one kind after the other ({writes['rounds']} each timed "
            f"after {writes['warmup']}): CPU of the Spark JVM and its children, and wall time, per write"
        )
        for kind, row in writes["kinds"].items():
            lines.append(f"  {kind:<22}{row['cpu_s']:>8.2f} s CPU {row['wall_s']:>8.2f} s wall")
        lines.append(
            f"  a MERGE costs {_num(writes['merge_to_append_cpu'], 1)} x an append's CPU; "
            f"Spark's MERGE {_num(writes.get('spark_merge_to_merge_cpu'), 1)} x the project's, "
            f"Spark's append {_num(writes.get('spark_append_to_append_cpu'), 1)} x the project's"
        )
    for part, title in (("demo_rate", "the demo's rate"), ("steady", "steady state")):
        if _ran(report[part]):
            lines.extend(_steady_lines(title, report[part]))
    scale = report["scale"]
    if _ran(scale):
        lines.append(f"scale ({scale['mode']}): devices, events, events/s, driver RSS peak (JVM + Python)")
        for point in scale["points"]:
            memory = point["memory"]
            lines.append(
                f"  {point['devices']:>8,} devices {point['events']:>10,} events {_num(point['events_per_s']):>8}/s "
                f"JVM {_bytes(memory.get('jvm_rss_bytes'))}, Python {_bytes(memory.get('python_rss_bytes'))}"
                + ("" if point["caught_up"] else f"  NOT caught up: {', '.join(point['behind'])}")
            )
            for q in point["state"]:
                bounded = {True: "bounded", False: "GROWING", None: "too few batches to tell"}[q["state_bounded"]]
                rows = f"{_num(q['state_rows_last']):>10} (max {_num(q['state_rows_max'])})"
                lines.append(
                    f"      {q['name']:<20} state rows {rows},"
                    f" memory {_bytes(q['state_memory_bytes_max'])}, disk {_bytes(q['state_disk_bytes'])}, {bounded}"
                )
    training = report["training"]
    if _ran(training):
        lines.append("training cost (iotmon train)")
        for run in training["runs"]:
            steps = ", ".join(f"{k} {v:.0f}s" for k, v in run["steps"].items())
            lines.append(f"  {run['readings']:>12,} readings {run['seconds']:>8.1f}s  ({steps})")
    lines.append("targets (2 cores)")
    for target in report["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        measured = _num(target["measured"], 3 if target["limit"] < 10 else 0)
        note = f" ({target['note']})" if target["note"] else ""
        lines.append(f"  {target['what']:<38} {target['goal']:<42} measured {measured:>10}  {verdict}{note}")
    return "\n".join(lines)


def _steady_lines(title: str, steady: Mapping[str, Any]) -> list[str]:
    """A steady phase's figures: the rate, the stream's CPU and where it went, each query's batches, what ran
    beside the stream, latency, silent devices, and each table's freshness over the measured window."""
    fleet = f"{steady['rate']:,.0f} events/s from {_num(steady.get('devices'))} devices"
    lines = [
        f"{title} at {fleet} for {steady['seconds']:g}s ({steady['mode']}); "
        f"{'caught up' if steady['caught_up'] else 'NOT caught up: ' + ', '.join(steady['behind'])}"
    ]
    if steady.get("stream_cpu"):
        cpu = steady["stream_cpu"]
        used = f"{cpu['cpu_seconds']:.0f} s in {cpu['seconds']:.0f} s"
        batches = sum(q["batches"] for q in steady.get("queries", []))
        if batches:
            # At a low rate this is what a batch costs whatever its rows: the stream's CPU is then about its
            # batches a second times this (docs/cost-model.md, "The floor").
            used += f"; {batches} batches, {cpu['cpu_seconds'] / batches:.2f} s of CPU each, records included"
        lines.append(f"  stream CPU while publishing: {cpu['cores']:.2f} cores ({used})")
        if cpu.get("parts"):
            lines.append(f"  where the cores went: {_shares(cpu['parts'], cpu['seconds'])}")
        if cpu.get("generated_classes") is not None:
            per_batch = f", {cpu['generated_classes'] / batches:.1f} per batch" if batches else ""
            lines.append(
                f"  classes generated and compiled meanwhile: {cpu['generated_classes']:,.0f}{per_batch} "
                "(near 0 once every plan's code is cached: a value written into a plan's code misses the cache)"
            )
    if steady.get("queries"):
        lines.append(f"  {'query':<22}{'batches':>10}{'rows':>10}{'in batches':>12}{'mean':>9}{'max':>9}")
        for q in steady["queries"]:
            lines.append(
                f"  {q['name']:<22}{q['batches']:>10}{_num(q['rows']):>10}{q['batch_seconds']:>11.0f}s"
                f"{q['mean_batch_s']:>8.2f}s{q['max_batch_s']:>8.1f}s"
            )
        if any(q.get("mean_phase_s") for q in steady["queries"]):
            lines.append("  a batch's phases, mean seconds (durationMs of each query's progress)")
            lines.append(f"  {'query':<22}" + "".join(f"{phase:>14}" for phase in BATCH_PHASES))
            for q in steady["queries"]:
                phases = q.get("mean_phase_s") or {}
                cells = "".join(
                    f"{'-' if phases.get(phase) is None else f'{phases[phase]:.2f}s':>14}" for phase in BATCH_PHASES
                )
                lines.append(f"  {q['name']:<22}{cells}")
    lines.append(f"  {'latency to':<22}{'rows':>10}{'p50':>10}{'p95':>10}{'p99':>10}")
    for row in steady["latency"]:
        cells = "".join(f"{_num(row[k], 2) + 's':>10}" for k in ("p50_s", "p95_s", "p99_s"))
        lines.append(f"  {row['table']:<22}{_num(row['rows']):>10}{cells}")
    beside = steady.get("beside") or {}
    if beside.get("cpu_cores"):
        used = ", ".join(f"{name} {cores:.2f}" for name, cores in beside["cpu_cores"].items())
        every = f" (the trainer every {beside['retrain_every_s']:g} s)" if beside.get("retrain_every_s") else ""
        lines.append(f"  beside the stream, cores: {used}{every}")
    if offline := steady.get("offline"):
        missed = f", {offline['missed']} NEVER marked offline" if offline["missed"] else ""
        lines.append(
            f"  silent device -> offline row: {offline['silences']} silences{missed}; "
            f"p50 {_num(offline['p50_s'], 1)} s, slowest {_num(offline['max_s'], 1)} s "
            f"(offline_after {offline['offline_after_s']:g} s of it by design)"
        )
    if freshness := steady.get("freshness"):
        lines.append(f"  {'freshness (behind Kafka)':<26}{'first':>8}{'last':>8}{'mean':>8}{'max':>8}{'s/min':>9}")
        for name, row in freshness.items():
            verdict = {True: "  GROWING", False: "", None: "  (not judged)"}[row["growing"]]
            lines.append(
                f"  {name:<26}{row['first_s']:>7.0f}s{row['last_s']:>7.0f}s{row['mean_s']:>7.0f}s{row['max_s']:>7.0f}s"
                f"{_num(row['growth_s_per_min'], 2):>9}{verdict}"
            )
    return lines


def plot(report: Mapping[str, Any], path: Path) -> None:
    """Four charts: throughput, steady-state latency, scale, training cost (a skipped phase says so)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, 2, figsize=(13, 9))
    machine = report["machine"]
    figure.suptitle(
        f"iotmon bench - {machine['cores']} cores, {_bytes(machine['memory_bytes'], GIB, 'GiB')} "
        f"({report['settings']['started_at']})"
    )
    throughput, latency, scale, training = axes.flat

    def skipped(ax: Any, title: str) -> None:
        ax.set_title(title)
        ax.text(0.5, 0.5, "skipped", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()

    bars: list[tuple[str, float]] = []
    if _ran(report["ceilings"]):
        c = report["ceilings"]
        bars += [("consumer", c["consumer"]["events_per_s"]), ("Spark noop", c["spark_noop"]["events_per_s"])]
    if _ran(report["drain"]):
        bars += [(q["name"], q["rows_per_s"]) for q in report["drain"]["queries"] if not q["skipped"]]
        bars.append(("whole path in turn", report["drain"]["events_per_s"]))
        bars.append(("whole path by topology", report["drain"]["by_topology"]["events_per_s"]))
    if bars:
        throughput.barh([name for name, _ in bars], [value for _, value in bars], color="tab:blue")
        if _ran(report["ceilings"]):
            goal = TARGET_CEILING_SHARE * report["ceilings"]["spark_noop"]["events_per_s"]
            throughput.axvline(goal, color="tab:red", linestyle="--", label="target: 0.10 x Spark's ceiling")
        throughput.set_xscale("log")
        throughput.set_xlabel("events (rows) per second")
        throughput.set_title("ceilings and the pipeline draining a backlog")
        throughput.legend(loc="lower right")
    else:
        skipped(throughput, "throughput")

    if _ran(report["steady"]):
        rows = [r for r in report["steady"]["latency"] if r["rows"]]
        names = [r["table"] for r in rows]
        for offset, key in enumerate(("p50_s", "p95_s", "p99_s")):
            positions = [i + (offset - 1) * 0.25 for i in range(len(rows))]
            latency.bar(positions, [r[key] or 0 for r in rows], width=0.25, label=key.removesuffix("_s"))
        latency.set_xticks(range(len(rows)), names, rotation=15)
        latency.axhline(TARGET_BRONZE_P95_S, color="tab:red", linestyle="--", label="bronze p95 target 5 s")
        latency.set_ylabel("seconds")
        latency.set_title(f"steady state at {report['steady']['rate']:,.0f} events/s: latency")
        latency.legend()
    else:
        skipped(latency, "steady-state latency")

    if _ran(report["scale"]):
        points = report["scale"]["points"]
        devices = [p["devices"] for p in points]
        states = [sum(q["state_rows_last"] or 0 for q in p["state"]) for p in points]
        scale.plot(devices, states, marker="o", label="state rows (all queries)")
        scale.plot(devices, [p["events_per_s"] for p in points], marker="s", label="events/s")
        scale.plot(
            devices, [(p["memory"].get("jvm_rss_bytes") or 0) / MIB for p in points], marker="^", label="JVM RSS MiB"
        )
        scale.set_xscale("log")
        scale.set_yscale("log")
        scale.set_xlabel("devices")
        scale.set_title("scale")
        scale.legend()
    else:
        skipped(scale, "scale")

    if _ran(report["training"]):
        runs = report["training"]["runs"]
        training.plot([r["readings"] for r in runs], [r["seconds"] for r in runs], marker="o")
        training.set_xlabel("readings in the archive")
        training.set_ylabel("seconds")
        training.set_title("training time")
    else:
        skipped(training, "training")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
