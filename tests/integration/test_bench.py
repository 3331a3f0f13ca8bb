"""``iotmon bench`` end to end with tiny sizes: real broker, Spark, Delta and MLflow, every section reported."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import SparkSession

from bench.report import SECTIONS
from bench.run import BenchOptions, run_bench
from iotmon.config import Settings
from iotmon.schema import TOO_LATE_READINGS

pytestmark = pytest.mark.integration

EVENTS = 3_000


def test_bench_measures_ceilings_and_the_whole_pipeline_and_reports_them(
    kafka: Settings, spark: SparkSession, tmp_path: Path
) -> None:
    """The phases whose figures are counts: ceilings, the drain (with a champion, so scoring runs) and the writes.

    The demo-rate, steady, scale and training phases are timing-bound (a steady state catches up or not,
    depending on the machine's load) and take minutes even at tiny sizes; their pure parts have unit tests, and
    the default ``iotmon bench`` run exercises them (see docs/measurements.md).
    """
    # A short feature history keeps the model archive small; the session's Spark and broker are reused.
    settings = dataclasses.replace(kafka, home=tmp_path, cache_dir=kafka.cache, feature_history="5 seconds")
    timing_bound = frozenset({"demo_rate", "steady", "scale", "training"})
    options = BenchOptions(
        events=EVENTS, devices=30, write_rounds=2, write_warmup=1, skip=timing_bound, out=tmp_path / "bench"
    )
    report, out = run_bench(settings, options)

    written = json.loads((out / "report.json").read_text())
    assert set(SECTIONS) <= set(written)
    skipped = {s for s in SECTIONS if isinstance(written[s], dict) and written[s].get("skipped")}
    assert skipped == timing_bound
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert written["machine"]["cores"] >= 1 and written["machine"]["memory_bytes"] > 0

    ceilings = written["ceilings"]
    assert ceilings["publish"]["records"] == EVENTS
    for name in ("consumer", "spark_noop_cold", "spark_noop"):
        assert ceilings[name]["records"] == EVENTS and ceilings[name]["events_per_s"] > 0
    # Spark's CPU per event, beside the ceiling: the JVM reads the topic and this process waits.
    assert ceilings["spark_noop"]["cpu_seconds"] > 0 and ceilings["spark_noop"]["cpu_us_per_event"] > 0

    drain = written["drain"]
    rows = {q["name"]: q["rows"] for q in drain["queries"]}
    # The ingest query reads Kafka (its plan reads each batch twice, counted once); late_arrivals reads what it
    # handed on, the readings Kafka delivered later than the watermark (the simulator's few very late ones).
    assert rows["ingest"] == EVENTS
    handed_on = DeltaTable(str(out / "drain" / "lake" / TOO_LATE_READINGS)).to_pyarrow_table().num_rows
    assert 0 < rows["late_arrivals"] == handed_on < EVENTS / 50
    assert not any(q["skipped"] for q in drain["queries"]), "the scorer must run with the bench's champion"
    assert rows["anomalies"] > 0.9 * EVENTS
    assert drain["events_per_s"] > 0 and drain["ceiling_share"] > 0
    assert drain["memory"]["jvm_rss_bytes"] > 100 * 1024**2
    # Again by the topology, as `iotmon stream --until-idle` drains, over a lake of its own: every query read as
    # much as it did in turn.
    by_topology = drain["by_topology"]
    assert by_topology["rows"] == rows and by_topology["ceiling_share"] > 0
    # Each query's CPU in turn adds up to the path's; by the topology, the cores were busy for part of the wall
    # time at most, and the rate its CPU would allow on every usable core bounds the rate it reached.
    assert all(q["cpu_seconds"] > 0 for q in drain["queries"])
    assert drain["cpu_seconds"] == pytest.approx(sum(q["cpu_seconds"] for q in drain["queries"]), abs=0.01)
    assert 0 < by_topology["cores"] <= written["machine"]["usable_cores"] + 0.5
    assert "Spark tasks" in by_topology["cpu_parts"]
    assert by_topology["cpu_bound_events_per_s"] >= 0.9 * by_topology["events_per_s"]
    assert by_topology["cpu_bound_share"] >= 0.9 * by_topology["ceiling_share"]

    # Three appends of the fleet keep every row; three MERGEs of the same keys leave one row per device, the last.
    writes = written["writes"]["kinds"]
    for append in ("append", "spark_append"):  # the project's (delta-rs) and Spark's, the reference
        assert (writes[append]["rows"], writes[append]["devices"], writes[append]["last_round"]) == (90, 30, 2)
    for merge in ("merge", "spark_merge"):  # the project's (delta-rs) and Spark's, the reference
        assert (writes[merge]["rows"], writes[merge]["devices"], writes[merge]["last_round"]) == (30, 30, 2)
    assert all(kind["cpu_s"] > 0 and kind["wall_s"] > 0 for kind in writes.values())
    ratios = ("merge_to_append_cpu", "spark_merge_to_merge_cpu", "spark_append_to_append_cpu")
    assert all(written["writes"][name] > 0 for name in ratios)

    assert [t["what"] for t in written["targets"]] == [t["what"] for t in report["targets"]]
