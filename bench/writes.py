"""What one Delta write of each kind the stream makes costs, in the bench's warm session.

The stream writes its tables two ways: it appends (bronze, quarantine, silver, the scores, the status changes)
and it MERGEs by key (live windows, device status and alerts keep one row per window, device or incident).
Each kind is timed here through the project's own exactly-once writers (``iotmon.lake.append_once``,
``merge_once``), alone and one after the other, on a table of one row per device (the MERGE targets' size):
the CPU of the Spark JVM and the commands it ran and reaped (``/proc``; a Delta write runs no Python worker) and
the wall time per write, after a warm-up.

A MERGE has to know the files of its target, and delta-spark 4.4 finds them by rebuilding the table's snapshot
state: a log replay in Spark jobs whose tasks generate code for Delta's wide action schema (docs/cost-model.md,
"The MERGE tax"). An append needs no file list. The ratio of the two, measured in the same run, is what a
MERGE-per-batch sink costs against an append-only one, whatever the host's speed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from bench.stats import ratio
from bench.system import reaped_cpu_seconds
from bench.throughput import Log
from iotmon.lake import BatchLedger, append_once, create_table, ledger_for, merge_once
from iotmon.schema import DEVICE_ID

APPEND = "append"
MERGE = "merge"
WRITE_KINDS: tuple[str, ...] = (APPEND, MERGE)
WRITES_SCHEMA = StructType(
    [StructField(DEVICE_ID, StringType()), StructField("round", LongType()), StructField("value", DoubleType())]
)


def round_rows(spark: SparkSession, devices: int, round_id: int) -> DataFrame:
    """One row per device, stamped with the round: what a status batch writes for a fleet that all reported."""
    rows = [(f"dev-{d:06d}", round_id, float(d + round_id)) for d in range(devices)]
    return spark.createDataFrame(rows, WRITES_SCHEMA)


def _write(kind: str, frame: DataFrame, path: str, ledger: BatchLedger, round_id: int) -> None:
    if kind == APPEND:
        append_once(frame, path, ledger, round_id)
    else:
        same_device = F.col(f"t.{DEVICE_ID}") == F.col(f"s.{DEVICE_ID}")
        merge_once(frame, path, same_device, ledger, round_id, update=True)


def write_costs(
    spark: SparkSession, root: Path, jvm_pid: int, devices: int, rounds: int, warmup: int, log: Log
) -> dict[str, Any]:
    """``warmup`` then ``rounds`` writes of each kind, alternating, each kind into its own table under ``root``;
    mean CPU and wall seconds per measured write, and what each table holds at the end."""
    paths = {kind: str(root / kind) for kind in WRITE_KINDS}
    ledgers = {kind: ledger_for(f"iotmon-bench-writes-{kind}-{time.time_ns()}") for kind in WRITE_KINDS}
    for kind, path in paths.items():
        create_table(spark, path, WRITES_SCHEMA, f"iotmon bench: {kind} cost")
    measured: dict[str, list[tuple[float, float]]] = {kind: [] for kind in WRITE_KINDS}
    for round_id in range(warmup + rounds):
        for kind in WRITE_KINDS:
            frame = round_rows(spark, devices, round_id)
            cpu, wall = reaped_cpu_seconds(jvm_pid), time.monotonic()
            _write(kind, frame, paths[kind], ledgers[kind], round_id)
            if round_id >= warmup:
                measured[kind].append((reaped_cpu_seconds(jvm_pid) - cpu, time.monotonic() - wall))
    kinds: dict[str, dict[str, Any]] = {}
    for kind in WRITE_KINDS:
        written = spark.read.format("delta").load(paths[kind])
        last = written.agg(F.count(F.lit(1)), F.max("round"), F.countDistinct(DEVICE_ID)).first()
        assert last is not None
        kinds[kind] = {
            "cpu_s": round(sum(cpu for cpu, _ in measured[kind]) / rounds, 3),
            "wall_s": round(sum(wall for _, wall in measured[kind]) / rounds, 3),
            "rows": last[0],
            "devices": last[2],
            "last_round": last[1],
        }
    share = ratio(kinds[MERGE]["cpu_s"], kinds[APPEND]["cpu_s"])
    report = {
        "devices": devices,
        "rounds": rounds,
        "warmup": warmup,
        "kinds": kinds,
        "merge_to_append_cpu": None if share is None else round(share, 2),
    }
    log(
        f"writes: append {kinds[APPEND]['cpu_s']:.2f} s of CPU ({kinds[APPEND]['wall_s']:.2f} s wall), "
        f"MERGE {kinds[MERGE]['cpu_s']:.2f} s ({kinds[MERGE]['wall_s']:.2f} s wall) per write of {devices:,} rows"
    )
    return report
