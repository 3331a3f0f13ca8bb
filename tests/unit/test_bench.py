"""The benchmark's pure parts: percentiles, state verdicts, machine info, catch-up, report shaping and plot."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from bench import report as shaping
from bench.detectability import THRESHOLDS, anomalous_readings, ceilings, report
from bench.detectability import main as detectability_main
from bench.features import main as features_main
from bench.features import synthetic_silver
from bench.latency import SETTLE_S, Latency, offline_delays
from bench.progress import BATCH_PHASES, ProgressCollector
from bench.run import BenchOptions
from bench.stats import Target, cpu_bound, percentile, rate, ratio, state_bounded, summarise_progress
from bench.system import (
    ENDED_THREADS,
    OTHER_THREADS,
    PYTHON_DRIVER,
    CpuMeter,
    cpu_by_role,
    java_version,
    machine_info,
    parse_meminfo,
    parse_stat_cpu_ticks,
    parse_status_rss,
    process_tree_cpu_seconds,
    reaped_cpu_seconds,
    thread_role,
)
from bench.throughput import behind
from bench.training import copies_and_share
from bench.viewer import GROWTH_LIMIT_S_PER_MIN, fastest_growth, freshness_sample, freshness_trend
from iotmon.cli import build_parser
from iotmon.processes import process_tree, run_when_idle
from iotmon.schema import SILVER_SCHEMA
from pipeline.topology import KAFKA

MEMINFO = (
    "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\nHugePages_Total:       0\n"
)


def test_percentiles_interpolate_between_ranks() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == pytest.approx(50.5)
    assert percentile(values, 0.99) == pytest.approx(99.01)
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([], 0.5) is None
    with pytest.raises(ValueError):
        percentile(values, 1.5)


def test_rates_and_ratios_never_divide_by_zero() -> None:
    assert rate(100, 4.0) == 25.0
    assert rate(100, 0.0) == 0.0
    assert ratio(50.0, 100.0) == 0.5
    assert ratio(50.0, None) is None and ratio(None, 2.0) is None and ratio(1.0, 0.0) is None


def test_the_cpu_bound_is_what_every_core_could_drain_at_the_cpu_per_event_spent() -> None:
    # 40 s of CPU for 200,000 events is 200 us an event: two cores busy with nothing else drain 10,000 a second.
    assert cpu_bound(200_000, 40.0, 2) == pytest.approx(10_000.0)
    assert cpu_bound(200_000, 40.0, 1) == pytest.approx(5_000.0)
    assert cpu_bound(200_000, 0.0, 2) is None and cpu_bound(0, 40.0, 2) is None and cpu_bound(10, 1.0, None) is None


def test_state_is_bounded_when_it_stops_growing() -> None:
    assert state_bounded([10, 50, 90, 100, 110, 100, 105, 110, 100]) is True
    assert state_bounded([10, 20, 30, 40, 50, 60, 70, 80, 90]) is False
    assert state_bounded([1, 2, 3]) is None


def _progress(name: str, batch: int, rows: int, state: int | None, memory: int | None = None) -> dict:
    return {
        "query_name": name,
        "query_id": "id-" + name,
        "batch_id": batch,
        "timestamp": f"2026-11-22T10:00:{batch:02d}Z",
        "input_rows": rows,
        "batch_duration_ms": 500,
        "state_rows": state,
        "state_memory_bytes": memory,
    }


def test_progress_summaries_per_query() -> None:
    rows = [_progress("windows", b, 100, 10 * (b + 1), 1000 * (b + 1)) for b in reversed(range(3))]
    rows += [_progress("silver", 0, 300, None)]
    summaries = summarise_progress(rows)
    windows = summaries["windows"]
    assert (windows.batches, windows.input_rows, windows.batch_seconds) == (3, 300, 1.5)
    assert windows.state_rows_series == (10, 20, 30)
    assert (windows.state_rows_last, windows.state_rows_max, windows.state_memory_bytes_max) == (30, 30, 3000)
    assert summaries["silver"].state_rows_max is None and summaries["silver"].input_rows == 300


def test_meminfo_and_status_parsing() -> None:
    memory = parse_meminfo(MEMINFO)
    assert memory["MemTotal"] == 24576000 * 1024
    assert memory["HugePages_Total"] == 0
    assert parse_status_rss("Name:\tjava\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n") == 1024 * 1024
    assert parse_status_rss("Name:\tzombie\n") is None


def test_machine_info_reports_cores_and_memory() -> None:
    info = machine_info("local[2]", meminfo=MEMINFO)
    assert info["cores"] >= 1 and 1 <= info["usable_cores"] <= info["cores"]
    assert info["memory_bytes"] == 24576000 * 1024
    assert info["spark_master"] == "local[2]" and info["pyspark"]


def test_cpu_is_counted_for_a_process_and_the_children_it_reaped() -> None:
    # /proc/<pid>/stat after "(comm)": state ppid ... utime(11) stime(12) cutime(13) cstime(14) ...
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "100", "0", "0", "0", "700", "50", "30", "20", "20", "0", "1"]
    assert parse_stat_cpu_ticks(fields) == 800
    before, reaped_before = process_tree_cpu_seconds(os.getpid()), reaped_cpu_seconds(os.getpid())
    child = subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
    assert child.returncode == 0 and process_tree_cpu_seconds(os.getpid()) > before  # the reaped child counts
    assert reaped_cpu_seconds(os.getpid()) - reaped_before >= 0.05  # in the process's own figure too
    meter = CpuMeter(os.getpid()).start()
    sum(i * i for i in range(2_000_000))
    used = meter.stop()
    assert used["cpu_seconds"] > 0 and used["cores"] == pytest.approx(used["cpu_seconds"] / used["seconds"], rel=0.02)
    assert used["parts"][OTHER_THREADS] > 0  # this process's main thread has no Spark role
    assert used["cpu_seconds"] == pytest.approx(sum(used["parts"].values()), abs=0.01)


def test_a_jvm_s_threads_are_told_apart_by_their_names() -> None:
    names = {
        "C2 CompilerThre": "JIT compiler",
        "GC Thread#1": "garbage collector",
        "G1 Refine#0": "garbage collector",
        "Executor task l": "Spark tasks",
        "Executor task i": "Spark tasks",
        "stream executio": "query drivers",
        "spark-listener-": "listener bus",
        "dag-scheduler-e": "DAG scheduler",
        "VM Thread": OTHER_THREADS,
    }
    assert {name: thread_role(name) for name in names} == names


def test_cpu_by_role_counts_new_threads_from_zero_and_what_ended_threads_used_apart() -> None:
    before = {1: ("C2 CompilerThre", 10.0), 2: ("Executor task l", 5.0), 3: ("Executor task l", 4.0)}
    after = {1: ("C2 CompilerThre", 12.5), 2: ("Executor task l", 6.0), 4: ("Executor task l", 0.5)}
    by_role = cpu_by_role(before, after, process_seconds=7.0)  # thread 3 used 3 s and ended
    assert by_role["JIT compiler"] == pytest.approx(2.5)
    assert by_role["Spark tasks"] == pytest.approx(1.5)
    assert by_role[ENDED_THREADS] == pytest.approx(3.0)
    assert sum(by_role.values()) == pytest.approx(7.0)


def test_the_cpu_meter_counts_the_python_driver_apart_from_the_jvm() -> None:
    # A stand-in for the JVM (any busy process), and this test's process as the Python driver.
    spin = "import time\nend = time.time() + 60\nwhile time.time() < end: pass"
    busy = subprocess.Popen([sys.executable, "-c", spin])
    try:
        meter = CpuMeter(busy.pid, os.getpid()).start()
        sum(i * i for i in range(2_000_000))
        used = meter.stop()
    finally:
        busy.kill()
        busy.wait()
    assert used["parts"][PYTHON_DRIVER] > 0 and used["parts"][OTHER_THREADS] > 0
    assert used["cpu_seconds"] == pytest.approx(sum(used["parts"].values()), abs=0.01)


def test_the_java_reported_is_the_one_spark_launches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    java = tmp_path / "bin" / "java"
    java.parent.mkdir()
    java.write_text("#!/bin/sh\necho 'openjdk version \"25.0.3\" 2026-04-21 LTS' >&2\n")
    java.chmod(0o755)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))  # spark-class runs $JAVA_HOME/bin/java when it is set
    assert java_version() == 'openjdk version "25.0.3" 2026-04-21 LTS'


def test_the_cpu_meter_reports_each_counter_s_growth_between_start_and_stop() -> None:
    generated = iter([4_000, 4_360])
    used = CpuMeter(os.getpid(), counters={"generated_classes": lambda: next(generated)}).start().stop()
    assert used["generated_classes"] == 360


def test_batch_costs_sum_each_query_s_batches_since_a_mark() -> None:
    collector = ProgressCollector()
    rows = [("bronze", 10, 1000), ("silver", 8, 3000), ("bronze", 20, 500)]
    collector._rows = [{"query_name": "old", "query_id": "x", "input_rows": 1, "batch_duration_ms": 1}]
    collector._rows += [
        {
            "query_name": name,
            "query_id": name,
            "input_rows": n,
            "batch_duration_ms": ms,
            "phases_ms": {"addBatch": ms * 0.6, "walCommit": ms * 0.1},
        }
        for name, n, ms in rows
    ]
    costs = {c["name"]: c for c in collector.batch_costs(1)}
    assert set(costs) == {"bronze", "silver"}
    assert costs["bronze"] == {
        "name": "bronze",
        "batches": 2,
        "rows": 30,
        "batch_seconds": 1.5,
        "mean_batch_s": 0.75,
        "max_batch_s": 1.0,
        "mean_phase_s": dict.fromkeys(BATCH_PHASES, 0.0) | {"addBatch": 0.45, "walCommit": 0.075},
    }


def test_a_query_is_behind_until_it_read_what_its_source_holds() -> None:
    held = {KAFKA: 100, "too_late_readings": 2, "silver": 95, "anomalies": 95}
    read = {"ingest": 100, "late_arrivals": 2, "device_windows": 95, "device_windows_live": 95}
    read |= {"device_status": 95, "anomalies": 95, "alerts": 90}
    assert behind(read, held) == ["alerts"]
    assert behind({**read, "alerts": 95}, held) == []
    assert "ingest" in behind({}, held)
    assert behind({**read, "late_arrivals": 1, "alerts": 95}, held) == ["late_arrivals"]


def test_archive_copies_keep_whole_devices_to_reach_a_size() -> None:
    assert copies_and_share(30_000, 100_000) == (4, pytest.approx(100_000 / 120_000))
    assert copies_and_share(30_000, 10_000) == (1, pytest.approx(1 / 3))
    with pytest.raises(ValueError):
        copies_and_share(0, 10)


def test_targets_are_judged_against_what_ran() -> None:
    report = _report()
    verdicts = {t.what: t for t in shaping.targets(report)}
    # The path as `iotmon stream --until-idle` drains it, not the sum of its queries in turn (0.1).
    assert verdicts["drain, share of Spark's Kafka->noop ceiling"].measured == pytest.approx(0.125)
    assert verdicts["drain, share of Spark's Kafka->noop ceiling"].met is True
    # Latency from the steady phase, which ran at another rate than the target's: the note says so.
    assert verdicts["p95 event->bronze"].met is True and "2,000 events/s" in verdicts["p95 event->bronze"].note
    assert verdicts["p95 event->anomaly"].met is False  # 20 s
    assert verdicts["p95 event->live window"].measured is None  # no rows
    # A silence never marked offline counts as still waiting: a lower bound, over offline_after + 15 s.
    offline = verdicts["silent device -> offline row"]
    assert (offline.measured, offline.limit, offline.met) == (80.0, 75.0, False) and "1 never marked" in offline.note
    growth = verdicts["tables' freshness growth, s a minute"]
    assert growth.measured == pytest.approx(6.0) and growth.met is False and "silver" in growth.note
    # The CPU from the demo's rate, the target's own: no note.
    cpu = verdicts["stream CPU"]
    assert cpu.measured == pytest.approx(0.7) and cpu.met is False and cpu.note == ""
    skipped = shaping.targets({**report, "steady": shaping.SKIPPED, "demo_rate": shaping.SKIPPED})
    assert [t.met for t in skipped][1:] == [None] * 6
    assert Target("x", "", 3.0, 2.0, at_most=True).met is False


def _steady(rate: float, devices: int) -> dict:
    latency = [
        Latency("bronze", 100, (0.5, 1.0, 1.5)).to_dict(),
        Latency("anomalies", 100, (5.0, 20.0, 30.0)).to_dict(),
        Latency("device_windows", 0, ()).to_dict(),
        Latency("device_windows_live", 0, ()).to_dict(),
    ]
    return {
        "mode": "concurrent",
        "rate": rate,
        "devices": devices,
        "seconds": 10,
        "caught_up": True,
        "behind": [],
        "latency": latency,
        "stream_cpu": {
            "seconds": 10.0,
            "cpu_seconds": 7.0,
            "cores": 0.7,
            "parts": {"Spark tasks": 4.0, "JIT compiler": 2.0, "Python driver": 1.0},
            "generated_classes": 40,
        },
        "queries": [
            {
                "name": "bronze",
                "batches": 5,
                "rows": 5000,
                "batch_seconds": 4.0,
                "mean_batch_s": 0.8,
                "max_batch_s": 1.2,
                "mean_phase_s": {"addBatch": 0.5, "walCommit": 0.1},
            }
        ],
    }


FRESHNESS = freshness_trend(
    [{"at": 100.0 + 30 * i, "behind_kafka_s": {"silver": 5.0 + 3 * i, "alerts": 30.0 * i}} for i in range(10)],
    100.0,
    370.0,
)


def _report() -> dict:
    return {
        "machine": {**machine_info("local[2]", meminfo=MEMINFO), "cores": 2, "usable_cores": 2},
        "settings": {"started_at": "2026-11-22T10:00:00+00:00"},
        "model": {"readings": 6000},
        "ceilings": {
            "publish": {"sent": 1000, "records": 1000, "seconds": 0.1, "events_per_s": 10_000.0},
            "consumer": {"records": 1000, "seconds": 0.05, "events_per_s": 20_000.0},
            "spark_noop_cold": {"records": 1000, "seconds": 0.2, "events_per_s": 5_000.0},
            "spark_noop": {
                "records": 1000,
                "seconds": 0.1,
                "events_per_s": 10_000.0,
                "cpu_seconds": 0.15,
                "cores": 1.5,
                "cpu_us_per_event": 150.0,
            },
        },
        "drain": {
            "mode": "in turn",
            "events": 1000,
            "seconds": 1.0,
            "events_per_s": 1000.0,
            "ceiling_share": 0.1,
            "queries": [
                {
                    "name": "bronze",
                    "rows": 1000,
                    "seconds": 0.5,
                    "rows_per_s": 2000.0,
                    "skipped": False,
                    "cpu_seconds": 0.8,
                    "cores": 1.6,
                    "cpu_us_per_event": 800.0,
                },
                {"name": "anomalies", "rows": None, "seconds": 0.0, "rows_per_s": 0.0, "skipped": True},
            ],
            "by_topology": {
                "mode": "by the topology",
                "events": 1000,
                "seconds": 0.8,
                "events_per_s": 1250.0,
                "ceiling_share": 0.125,
                "cpu_seconds": 1.2,
                "cores": 1.5,
                "cpu_us_per_event": 1200.0,
                "cpu_parts": {"Spark tasks": 0.8, "Python driver": 0.4, "JIT compiler": 0.0},
                "cpu_bound_events_per_s": 1666.7,
                "cpu_bound_share": 0.16667,
                "rows": {"bronze": 1000},
            },
        },
        "writes": {
            "devices": 500,
            "rounds": 20,
            "warmup": 10,
            "kinds": {
                "append": {"cpu_s": 0.04, "wall_s": 0.05, "rows": 15_000, "devices": 500, "last_round": 29},
                "spark_append": {"cpu_s": 0.16, "wall_s": 0.15, "rows": 15_000, "devices": 500, "last_round": 29},
                "merge": {"cpu_s": 1.28, "wall_s": 0.9, "rows": 500, "devices": 500, "last_round": 29},
                "spark_merge": {"cpu_s": 25.6, "wall_s": 1.2, "rows": 500, "devices": 500, "last_round": 29},
            },
            "merge_to_append_cpu": 8.0,
            "spark_merge_to_merge_cpu": 20.0,
            "spark_append_to_append_cpu": 4.0,
        },
        "demo_rate": _steady(500.0, 200),
        "steady": {
            **_steady(2_000.0, 500),
            "beside": {"retrain_every_s": 300.0, "viewer": True, "cpu_cores": {"trainer": 0.31, "viewer": 0.05}},
            "offline": {"silences": 4, "missed": 1, "offline_after_s": 60.0, "p50_s": 70.0, "max_s": 80.0},
            "freshness": FRESHNESS,
            "fastest_growth": {"table": "silver", "s_per_min": 6.0},
        },
        "scale": {
            "mode": "concurrent",
            "points": [
                {
                    "devices": devices,
                    "events": 1000,
                    "events_per_s": 900.0,
                    "caught_up": True,
                    "behind": [],
                    "memory": {"jvm_rss_bytes": 2 * 1024**3, "python_rss_bytes": 2 * 1024**2},
                    "state": [
                        {
                            "name": "device_windows",
                            "state_rows_last": 10 * devices,
                            "state_rows_max": 11 * devices,
                            "state_memory_bytes_max": 1024**2,
                            "state_disk_bytes": 2 * 1024**2,
                            "state_bounded": True,
                        }
                    ],
                }
                for devices in (10, 100)
            ],
        },
        "training": {"runs": [{"readings": 1000, "seconds": 3.0, "steps": {"read": 1.0, "fit": 2.0}}]},
    }


def test_render_names_every_phase_and_target(tmp_path: Path) -> None:
    report = _report()
    report["targets"] = [t.to_dict() for t in shaping.targets(report)]
    text = shaping.render(report)
    for needle in ("machine: ", "Kafka consumer", "whole path by topology", "skipped (not ready)", "p95", "scale"):
        assert needle in text
    for needle in (
        "the demo's rate at 500 events/s from 200 devices for 10s (concurrent); caught up",
        "steady state at 2,000 events/s from 500 devices for 10s",
        "beside the stream, cores: trainer 0.31, viewer 0.05 (the trainer every 300 s)",
        "silent device -> offline row: 4 silences, 1 NEVER marked offline; p50 70.0 s, slowest 80.0 s",
        "  silver                          5s     32s     18s     32s     6.00  GROWING",
        "  alerts                          0s    270s    135s    270s    60.00  (not judged)",
        "stream CPU while publishing: 0.70 cores (7 s in 10 s; 5 batches, 1.40 s of CPU each, records included)",
        "where the cores went: Spark tasks 0.40, JIT compiler 0.20, Python driver 0.10",
        "Delta writes of 500 rows, one kind after the other (20 each timed after 10)",
        "  merge                     1.28 s CPU     0.90 s wall",
        "  Spark Kafka -> noop, warm (the ceiling)        1,000       0.10       10,000            150",
        "  bronze                       1,000 rows      0.5s      2,000 rows/s  CPU    0.8s = 1.60 cores, 800 us/event",
        "= 0.125 x Spark's ceiling  CPU    1.2s = 1.50 cores, 1,200 us/event",
        "at its CPU per event, 2 cores busy with nothing else would drain 1,667 events/s = 0.167 x Spark's ceiling",
        "  where the cores went: Spark tasks 1.00, Python driver 0.50\n",
        "a MERGE costs 8.0 x an append's CPU; Spark's MERGE 20.0 x the project's, Spark's append 4.0 x the project's",
        "in batches",
        "classes generated and compiled meanwhile: 40, 8.0 per batch",
        "a batch's phases, mean seconds",
        "bounded",
        "  bronze                             -             -             -         0.50s         0.10s             -",
    ):
        assert needle in text
    assert "training cost" in text and "NOT met" in text
    shaping.write_json(report, tmp_path / "report.json")
    assert json.loads((tmp_path / "report.json").read_text())["drain"]["events"] == 1000


def test_render_and_plot_with_skipped_parts(tmp_path: Path) -> None:
    report = {**_report(), **dict.fromkeys(shaping.PARTS, shaping.SKIPPED)}
    report["targets"] = [t.to_dict() for t in shaping.targets(report)]
    assert "not measured" in shaping.render(report)
    shaping.plot(report, tmp_path / "skipped.png")
    shaping.plot(_report(), tmp_path / "full.png")
    assert (tmp_path / "skipped.png").stat().st_size > 1000
    assert (tmp_path / "full.png").read_bytes()[:4] == b"\x89PNG"


def test_options_are_validated(tmp_path: Path) -> None:
    BenchOptions().validate()
    BenchOptions(out=tmp_path / "new").validate()
    BenchOptions(out=tmp_path).validate()  # empty
    (tmp_path / "report.json").write_text("{}")  # an earlier run's
    with pytest.raises(ValueError, match="not empty"):
        BenchOptions(out=tmp_path).validate()
    with pytest.raises(ValueError, match="unknown part"):
        BenchOptions(skip=frozenset({"everything"})).validate()
    with pytest.raises(ValueError, match="positive"):
        BenchOptions(write_rounds=0).validate()
    with pytest.raises(ValueError, match="positive"):
        BenchOptions(steady_seconds=0).validate()
    # The steady phase runs at its own rate: it needs no drain any more.
    BenchOptions(skip=frozenset({"drain"})).validate()


def test_bench_flags_parse() -> None:
    args = build_parser().parse_args(
        ["bench", "--scale", "1000,10_000", "--train-sizes", "5000", "--skip", "steady", "--skip", "training"]
    )
    assert args.scale == (1000, 10_000) and args.train_sizes == (5000,) and args.write_rounds == 20
    assert args.skip == ["steady", "training"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--scale", "lots"])


def test_the_features_benchmark_builds_its_archive_and_prints_both_cases(
    spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    archive = synthetic_silver(spark, devices=4, readings=50)
    assert [(f.name, f.dataType) for f in archive.schema] == [(f.name, f.dataType) for f in SILVER_SCHEMA]
    assert archive.count() == 200 and archive.select("device_id", "seq").distinct().count() == 200
    assert archive.where(F.col("lateness") == "late").count() > 0
    assert features_main(["--devices", "3", "--readings", "40", "--history", "5", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["whole", "a"] and all("median" in line for line in lines)


def test_the_detection_ceiling_falls_with_the_threshold_and_leaves_part_of_drifts_and_bursts_undetectable() -> None:
    kind, off, share = anomalous_readings(devices=300, ticks=2_000, fraction=0.01, seed=3)
    assert 0.005 < share < 0.02  # the schedule keeps about the asked-for share of readings in episodes
    rows = ceilings(kind, off, share, THRESHOLDS)
    recalls = [row.overall_recall for row in rows]
    alarms = [row.false_alarm_rate for row in rows]
    assert recalls == sorted(recalls, reverse=True) and alarms == sorted(alarms, reverse=True)
    for row in rows:
        assert row.recall["spike"] == 1.0  # 4 to 8 anomaly scales, at least 24 noise units: never missed
        # A ramp starts inside the noise and a burst sometimes lands on the normal value.
        assert row.recall["drift"] < 1.0 and row.recall["noise_burst"] < 1.0
        assert 0.0 < row.f1 < 1.0
    # Stuck: the first SUSPECT_REPEATS readings of a run do not repeat often enough yet, whatever the threshold.
    assert len({row.recall["stuck"] for row in rows}) == 1 and rows[0].recall["stuck"] < 1.0
    printed = report(rows, share)
    assert "best per-reading F1 of the oracle" in printed and "noise_burst" in printed
    assert detectability_main(["--devices", "50", "--ticks", "300"]) == 0


def test_run_when_idle_reaches_every_thread_of_a_child_process() -> None:
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        threads: list[int] = []
        for _ in range(200):  # until the child has started its second thread
            threads = [int(t.name) for t in Path(f"/proc/{child.pid}/task").iterdir()]
            if len(threads) >= 2:
                break
            time.sleep(0.05)
        assert len(threads) >= 2 and child.pid in process_tree(os.getpid())
        assert all(os.sched_getscheduler(tid) == os.SCHED_OTHER for tid in threads)
        assert run_when_idle(child.pid) >= 2
        assert all(os.sched_getscheduler(tid) == os.SCHED_IDLE for tid in threads)
        assert run_when_idle(child.pid) == 0  # already there: nothing to switch
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("own_session", [True, False])
def test_a_process_lowers_its_session_only_if_it_leads_it(own_session: bool) -> None:
    # A process in the boot session's autogroup (PID 1's, which a container's or CI's first shell may share)
    # reads an empty /proc/self/autogroup: sched_autogroup prints nothing for the root group. So the whole text
    # is compared, not its last word.
    code = (
        "import json; from pathlib import Path; from iotmon.processes import yield_the_session; "
        "group = Path('/proc/self/autogroup'); "
        "print(json.dumps([yield_the_session(), group.read_text().strip() if group.exists() else None]))"
    )
    done = subprocess.run([sys.executable, "-c", code], start_new_session=own_session, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lowered, group = json.loads(done.stdout)
    ours = Path("/proc/self/autogroup")
    if not ours.exists():  # a kernel without autogroups: there is nothing to lower
        assert (lowered, group) == (False, None)
        return
    assert lowered is own_session
    if own_session:  # a new session is a new autogroup, lowered to the weakest nice
        assert group.endswith(" nice 19")
    else:  # the caller's session, and so its autogroup, left as it was
        assert group == ours.read_text().strip()


def test_freshness_trend_judges_the_tables_every_reading_moves() -> None:
    samples = [
        freshness_sample(1000.0 + 5 * i, {"bronze": None, "silver": None, "anomalies": None}, None) for i in range(2)
    ]
    # No answer from Kafka or a table yet: nothing to judge.
    assert freshness_trend(samples, 0.0, 2000.0) == {}
    samples = [
        {"at": 1000.0 + 30 * i, "behind_kafka_s": {"bronze": 4.0 + (i % 2), "silver": 10.0 + 3 * i, "alerts": 20.0 * i}}
        for i in range(10)
    ] + [{"at": 5000.0, "behind_kafka_s": {"bronze": 900.0}}]  # after the window: left out
    trend = freshness_trend(samples, 1000.0, 1270.0)
    assert trend["bronze"]["samples"] == 10 and trend["bronze"]["max_s"] == 5.0
    assert trend["bronze"]["growing"] is False and abs(trend["bronze"]["growth_s_per_min"]) < GROWTH_LIMIT_S_PER_MIN
    assert trend["silver"]["growth_s_per_min"] == pytest.approx(6.0) and trend["silver"]["growing"] is True
    assert trend["alerts"]["growing"] is None  # its newest event moves only with an incident
    # A table written once a minute: its freshness a 60-s saw tooth, which a line fitted over the run would
    # tilt by seconds a minute; it comes back to the same trough after each write, so it keeps up.
    tooth = [{"at": float(t), "behind_kafka_s": {"device_windows": 120.0 + (t + 40) % 60}} for t in range(0, 600, 5)]
    assert freshness_trend(tooth, 0.0, 600.0)["device_windows"]["growing"] is False
    # A table at 0 s behind but for a write every minute and one stall of 20 s late in the run (a retraining
    # beside it): it keeps up, though its peaks rose from 4 s to 20 s.
    stalled = {t: 20.0 if 575 <= t < 590 else 4.5 if t % 60 == 25 else 0.0 for t in range(0, 720, 5)}
    spiky = freshness_trend([{"at": float(t), "behind_kafka_s": {"live": b}} for t, b in stalled.items()], 0, 720)
    assert spiky["live"]["max_s"] == 20.0 and spiky["live"]["growing"] is False
    # A saw tooth whose trough rises by 3 s at each of its writes: it falls 3 s a minute further behind.
    behind = [{"at": float(t), "behind_kafka_s": {"final": 120.0 + 3 * (t // 60) + t % 60}} for t in range(0, 600, 5)]
    assert freshness_trend(behind, 0.0, 600.0)["final"]["growth_s_per_min"] == pytest.approx(3.0)
    assert freshness_trend(behind, 0.0, 600.0)["final"]["growing"] is True
    # Too short a run to tell a trend (fewer than three slices of 75 s).
    assert freshness_trend(tooth, 0.0, 200.0)["device_windows"]["growing"] is None
    assert fastest_growth(trend) == ("silver", pytest.approx(6.0))
    assert fastest_growth({"alerts": trend["alerts"]}) is None


def test_offline_delays_count_each_silence_the_run_could_see_through() -> None:
    def at(seconds: float) -> dt.datetime:
        return dt.datetime(2026, 11, 28, 12, 0, 0) + dt.timedelta(seconds=seconds)

    since, until, measured_at = at(0), at(600), at(900)
    episodes = [
        ("dev-1", at(100)),  # marked offline 70 s after its last reading (at 99.5)
        ("dev-2", at(200)),  # never marked: still waiting at measured_at
        ("dev-3", at(-50)),  # began before the measured window
        ("dev-4", at(600 - 60 - SETTLE_S + 1)),  # due too close to the fleet's stop to be seen through
        ("dev-5", at(300)),  # an offline row of an earlier silence does not answer it
    ]
    rows = [
        ("dev-1", at(99.5), at(169.5)),
        ("dev-3", at(-50.2), at(20.0)),
        ("dev-5", at(100.0), at(170.0)),
    ]
    delays = offline_delays(episodes, rows, since, until, 60.0, measured_at)
    assert delays == {
        "silences": 3,
        "missed": 2,
        "offline_after_s": 60.0,
        "p50_s": 600.0,
        "max_s": 700.0,
    }
    assert offline_delays(episodes[:1], rows, since, until, 60.0, measured_at)["max_s"] == 70.0
    assert offline_delays([], rows, since, until, 60.0, measured_at)["max_s"] is None
