"""``iotmon bench`` end to end with tiny sizes: real broker, Spark, Delta and MLflow, every section reported."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from bench.report import SECTIONS
from bench.run import BenchOptions, run_bench
from iotmon.config import Settings

pytestmark = pytest.mark.integration

EVENTS = 3_000


def test_bench_reports_every_section_with_plausible_figures(
    kafka: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    # A short feature history keeps the model archive small; the session's Spark and broker are reused.
    settings = dataclasses.replace(kafka, home=tmp_path, cache_dir=kafka.cache, feature_history="5 seconds")
    options = BenchOptions(
        events=EVENTS,
        devices=30,
        scale=(40,),
        scale_events=2_000,
        scale_batches=6,
        scale_span_s=600.0,
        train_sizes=(8_000,),
        steady_seconds=8.0,
        steady_rate=200.0,
        out=tmp_path / "bench",
    )
    report, out = run_bench(settings, options)

    written = json.loads((out / "report.json").read_text())
    assert set(SECTIONS) <= set(written)
    assert not any(isinstance(written[s], dict) and written[s].get("skipped") for s in SECTIONS)
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert written["machine"]["cores"] >= 1 and written["machine"]["memory_bytes"] > 0

    ceilings = written["ceilings"]
    assert ceilings["publish"]["records"] == EVENTS
    for name in ("consumer", "spark_noop_cold", "spark_noop"):
        assert ceilings[name]["records"] == EVENTS and ceilings[name]["events_per_s"] > 0

    drain = written["drain"]
    rows = {q["name"]: q["rows"] for q in drain["queries"]}
    assert rows["bronze"] == EVENTS and rows["quarantine"] == EVENTS and rows["silver"] == EVENTS
    assert not any(q["skipped"] for q in drain["queries"]), "the scorer must run with the bench's champion"
    assert rows["anomalies"] > 0.9 * EVENTS
    assert drain["events_per_s"] > 0 and drain["ceiling_share"] > 0
    assert drain["memory"]["jvm_rss_bytes"] > 100 * 1024**2

    steady = written["steady"]
    assert steady["caught_up"] and steady["records"] > 0
    latency = {row["table"]: row for row in steady["latency"]}
    assert latency["bronze"]["rows"] > 0 and 0 < latency["bronze"]["p50_s"] <= latency["bronze"]["p99_s"]
    assert latency["anomalies"]["rows"] > 0

    (point,) = written["scale"]["points"]
    assert point["caught_up"] and point["events"] == 2_000 and point["events_per_s"] > 0
    state = {q["name"]: q for q in point["state"]}
    assert state["device_status"]["state_rows_last"] >= 1 and state["device_windows"]["batches"] >= 2
    assert state["device_windows"]["state_disk_bytes"] > 0

    (run,) = written["training"]["runs"]
    assert 0.5 * 8_000 < run["readings"] < 2 * 8_000 and run["seconds"] > 0
    assert [t["what"] for t in written["targets"]] == [t["what"] for t in report["targets"]]
