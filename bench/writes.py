"""What one Delta write of each kind the stream makes costs, in the bench's warm session.

The stream writes its tables two ways: it appends (bronze, quarantine, silver, the scores, the status changes)
and it MERGEs by key (live windows, device status and alerts keep one row per window, device or incident).
Each kind is timed here through the project's own exactly-once writers, both done in this process in Arrow and
committed through delta-rs (``iotmon.lake.append_once`` and ``merge_once``), and beside each Spark's own write
of the same rows, the stream's until 2026-11-28 (the MERGE) and 2026-11-29 (the append), as the reference it
is measured against (``spark_append``, ``spark_merge``), one after the other on a table of one row per device
(the MERGE targets' size): the CPU of the Spark JVM, the commands it ran and reaped (``/proc``; a Delta write
runs no Python worker) and this Python process (the driver's side of every write), and the wall time per
write, after a warm-up.

A MERGE has to know the files of its target. delta-spark 4.4 finds them by rebuilding the table's snapshot
state: a log replay in Spark jobs whose tasks generate code for Delta's wide action schema (docs/cost-model.md,
"The MERGE tax"); ``merge_once`` reads the files the log's statistics leave possible. An append needs no file
list. The ratios, measured in the same run, are what a MERGE-per-batch sink costs against an append-only one,
and Spark's writes against the project's, whatever the host's speed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, LongType, StringType, StructField, StructType

from bench.stats import ratio
from bench.system import reaped_cpu_seconds
from bench.throughput import Log
from iotmon.lake import BatchLedger, append_once, create_table, ledger_for, merge_once
from iotmon.schema import DEVICE_ID

APPEND = "append"
SPARK_APPEND = "spark_append"
MERGE = "merge"
SPARK_MERGE = "spark_merge"
WRITE_KINDS: tuple[str, ...] = (APPEND, SPARK_APPEND, MERGE, SPARK_MERGE)
COMMIT_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
"""The session setting a Spark MERGE (which takes no write options) commits as its ``userMetadata``."""
WRITES_SCHEMA = StructType(
    [StructField(DEVICE_ID, StringType()), StructField("round", LongType()), StructField("value", DoubleType())]
)


def round_rows(spark: SparkSession, devices: int, round_id: int) -> DataFrame:
    """One row per device, stamped with the round: what a status batch writes for a fleet that all reported."""
    rows = [(f"dev-{d:06d}", round_id, float(d + round_id)) for d in range(devices)]
    return spark.createDataFrame(rows, WRITES_SCHEMA)


def spark_append(frame: DataFrame, path: str, tag: str) -> None:
    """Spark's append of ``frame`` to the table at ``path`` as one file, tagged as ``append_once`` tags."""
    writer = frame.coalesce(1).write.format("delta").mode("append").option("maxRecordsPerFile", 0)
    writer.option("userMetadata", tag).save(path)


def spark_merge(frame: DataFrame, path: str, tag: str) -> None:
    """Spark's MERGE of ``frame`` into the table at ``path`` on the device, tagged as ``merge_once`` tags."""
    session = frame.sparkSession
    merge = DeltaTable.forPath(session, path).alias("t").merge(frame.alias("s"), f"t.{DEVICE_ID} = s.{DEVICE_ID}")
    session.conf.set(COMMIT_METADATA, tag)
    try:
        merge.whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()
    finally:
        session.conf.unset(COMMIT_METADATA)


def _write(kind: str, frame: DataFrame, path: str, ledger: BatchLedger, round_id: int) -> None:
    if kind == APPEND:
        append_once(frame, path, ledger, round_id)
    elif kind == SPARK_APPEND:
        ledger.write(frame.sparkSession, path, round_id, lambda tag: spark_append(frame, path, tag))
    elif kind == MERGE:
        merge_once(frame, path, (DEVICE_ID,), ledger, round_id)
    else:
        ledger.write(frame.sparkSession, path, round_id, lambda tag: spark_merge(frame, path, tag))


def _cpu_seconds(jvm_pid: int) -> float:
    """The Spark JVM's CPU with its reaped children, and this process's (the Python driver, ``merge_once``)."""
    return reaped_cpu_seconds(jvm_pid) + time.process_time()


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
            cpu, wall = _cpu_seconds(jvm_pid), time.monotonic()
            _write(kind, frame, paths[kind], ledgers[kind], round_id)
            if round_id >= warmup:
                measured[kind].append((_cpu_seconds(jvm_pid) - cpu, time.monotonic() - wall))
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
    merge_share = ratio(kinds[MERGE]["cpu_s"], kinds[APPEND]["cpu_s"])
    spark_share = ratio(kinds[SPARK_MERGE]["cpu_s"], kinds[MERGE]["cpu_s"])
    spark_append_share = ratio(kinds[SPARK_APPEND]["cpu_s"], kinds[APPEND]["cpu_s"])
    report = {
        "devices": devices,
        "rounds": rounds,
        "warmup": warmup,
        "kinds": kinds,
        "merge_to_append_cpu": None if merge_share is None else round(merge_share, 2),
        "spark_merge_to_merge_cpu": None if spark_share is None else round(spark_share, 2),
        "spark_append_to_append_cpu": None if spark_append_share is None else round(spark_append_share, 2),
    }
    each = ", ".join(f"{kind} {row['cpu_s']:.2f} s of CPU ({row['wall_s']:.2f} s wall)" for kind, row in kinds.items())
    log(f"writes: {each} per write of {devices:,} rows")
    return report
