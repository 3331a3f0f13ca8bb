"""``iotmon backfill``: rebuild silver and gold from the bronze archive as one batch job.

After a logic fix the tables must show the new logic for all history, not only from now on. The same
functions the stream runs are applied to a pinned bronze snapshot, each table is replaced in one Delta
commit (readers see the old table or the new one, never a mix), and the downstream checkpoints are
reset so the stream resumes on top of the rebuilt tables:

* the late-arrivals query starts anew on an empty ``too_late_readings``: the rebuilt silver holds every
  too-late reading bronze holds, and a batch the ingest query replays hands its own on again;
* the ingest query, which reads Kafka, goes on appending to the rebuilt silver and quarantine, whose
  commits carry the ingest query's ledger tag of the last batch bronze holds: a batch killed after its bronze
  commit and before its quarantine or silver one is replayed after the backfill without landing its rejects or
  readings twice;
* the gold queries re-derive their state from the rebuilt silver and skip final rows the backfill
  already wrote (``iotmon.finalThrough`` on ``device_windows``), so nothing is written twice;
* device status is cleared and re-derived by its query from silver.

The stream must be stopped while this runs: its checkpoints are being replaced.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TextIO

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from ingest.bronze import quarantine_rows
from ingest.silver import (
    LatenessRules,
    classify_readings,
    distinct_readings,
    rejected_rows,
    silver_rows,
)
from iotmon.config import Settings, interval_seconds
from iotmon.lake import BatchLedger, commit_tag, last_tagged_batch
from iotmon.logs import say
from iotmon.schema import (
    ALERTS,
    ANOMALIES,
    BRONZE,
    DEVICE_STATUS,
    DEVICE_STATUS_CHANGES,
    DEVICE_WINDOWS,
    DEVICES,
    EVENT_TIME,
    INGEST,
    LIVE_WINDOWS,
    QUARANTINE,
    SILVER,
    TOO_LATE_READINGS,
)
from pipeline.topology import downstream_of
from streaming.jobs import FINAL_THROUGH
from streaming.windows import END_COLUMN, FINAL_TABLES, WindowSpec, tumbling_device_windows

RESET_QUERIES: tuple[str, ...] = downstream_of(SILVER)
"""The queries that read silver, whose checkpoints a backfill replaces (the ingest query reads Kafka and goes
on appending to the rebuilt silver)."""
REBUILT_BY_STREAM: tuple[str, ...] = (DEVICE_STATUS, DEVICE_STATUS_CHANGES, ANOMALIES, ALERTS)
"""Tables a backfill empties for the resumed stream to rebuild from the new silver: state machines, whose
history only the stream replays faithfully, and the scores (the current champion rescores everything)."""
REBUILDS_AT_ONCE = 3
"""How many of the tables below silver are rebuilt together: each depends on silver alone, and each is a few
Spark jobs whose driver's side (planning, the Delta commit) leaves a core idle for another's tasks."""


@dataclass
class BackfillResult:
    bronze_version: int
    final_through: datetime | None
    rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def report(self) -> str:
        lines = [f"bronze version   {self.bronze_version}"]
        lines.append(f"final through    {self.final_through.isoformat() if self.final_through else '-'}")
        lines += [f"{table:<16} {rows:,} rows" for table, rows in self.rows.items()]
        lines.append(f"rebuilt in {self.seconds:.1f}s; `iotmon stream` resumes on top of it")
        return "\n".join(lines)


def _replace(frame: DataFrame, path: str, tag: str | None = None) -> int:
    writer = frame.write.format("delta").mode("overwrite")
    if tag is not None:
        writer = writer.option("userMetadata", tag)
    writer.save(path)
    return DeltaTable.forPath(frame.sparkSession, path).toDF().count()


def ingest_tag(spark: SparkSession, settings: Settings, bronze_version: int) -> str | None:
    """The ingest query's ledger tag (``iotmon.lake.BatchLedger``) of the last batch bronze holds at
    ``bronze_version``, for silver's and quarantine's rebuilt commits; None before the query has landed a batch.

    Silver and quarantine rebuilt from bronze hold every reading and every reject of every batch bronze holds.
    An ingest batch killed after its bronze commit and before its quarantine or silver one is replayed when the
    stream resumes: its state says its readings are new, and its rejects are in no table it has tagged, so
    without the tag it would append them to the rebuilt tables a second time."""
    ledger = BatchLedger(settings.checkpoint_path(INGEST))
    try:
        app_id = ledger.identify(spark)
    except FileNotFoundError:
        return None
    batch = last_tagged_batch(spark, settings.table_path(BRONZE), app_id, ledger.not_before_ms, bronze_version)
    return commit_tag(app_id, batch) if batch >= 0 else None


def _set_property(spark: SparkSession, path: str, key: str, value: str) -> None:
    spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('{key}' = '{value}')")


def _remove_checkpoint(spark: SparkSession, checkpoint: str) -> None:
    if "://" in checkpoint:
        jvm = spark.sparkContext._jvm
        path = jvm.org.apache.hadoop.fs.Path(checkpoint)
        path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).delete(path, True)
    else:
        shutil.rmtree(checkpoint, ignore_errors=True)


def backfill(spark: SparkSession, settings: Settings, out: TextIO = sys.stderr) -> BackfillResult:
    started = time.monotonic()
    table = settings.table_path
    bronze_version = DeltaTable.forPath(spark, table(BRONZE)).history(1).first().version
    bronze = spark.read.format("delta").option("versionAsOf", bronze_version).load(table(BRONZE))
    devices = spark.read.format("delta").load(table(DEVICES))
    result = BackfillResult(bronze_version, None)

    def step(name: str) -> None:
        say(f"backfill: {name} ({time.monotonic() - started:.0f}s)", out)

    step(f"silver and quarantine from bronze version {bronze_version}")
    classified = classify_readings(bronze, devices, LatenessRules.from_settings(settings)).localCheckpoint()
    tag = ingest_tag(spark, settings, bronze_version)
    result.rows[SILVER] = _replace(distinct_readings(silver_rows(classified)), table(SILVER), tag)
    # Quarantine whole, as the ingest query wrote it, with the same tag: bronze keeps each record's parse error,
    # so its rejects come back as they were, and silver's are judged again (the registry may have changed).
    rejects = quarantine_rows(bronze).unionByName(rejected_rows(classified))
    result.rows[QUARANTINE] = _replace(rejects, table(QUARANTINE), tag)

    silver = spark.read.format("delta").load(table(SILVER)).localCheckpoint()
    newest = silver.agg(F.max(EVENT_TIME)).first()[0]
    if newest is not None:
        result.final_through = newest - timedelta(seconds=interval_seconds(settings.watermark))
    spec = WindowSpec.from_settings(settings)

    def final_table(name: str) -> Callable[[], int]:
        def rebuild() -> int:
            step(name)
            # Materialised before filtering: Spark would push a filter on a session's end below the merge
            # of sessions and truncate them.
            rows = FINAL_TABLES[name](silver, spec).localCheckpoint()
            final = rows.where(F.col(END_COLUMN[name]) <= F.lit(result.final_through)) if newest else rows.limit(0)
            return _replace(final, table(name))

        return rebuild

    def live_windows() -> int:
        step(LIVE_WINDOWS)
        return _replace(tumbling_device_windows(silver, spec), table(LIVE_WINDOWS))

    def emptied(name: str) -> Callable[[], int]:
        return lambda: _replace(spark.read.format("delta").load(table(name)).limit(0), table(name))

    rebuilds = {name: final_table(name) for name in FINAL_TABLES} | {LIVE_WINDOWS: live_windows}
    rebuilds |= {name: emptied(name) for name in REBUILT_BY_STREAM if DeltaTable.isDeltaTable(spark, table(name))}
    rebuilds[TOO_LATE_READINGS] = emptied(TOO_LATE_READINGS)  # handed on, and in the rebuilt silver already
    with ThreadPoolExecutor(REBUILDS_AT_ONCE, thread_name_prefix="iotmon-backfill") as pool:
        result.rows |= dict(zip(rebuilds, pool.map(lambda rebuild: rebuild(), rebuilds.values()), strict=True))
    if result.final_through is not None:
        _set_property(spark, table(DEVICE_WINDOWS), FINAL_THROUGH, result.final_through.isoformat())

    step("resetting the downstream checkpoints")
    for query in RESET_QUERIES:
        _remove_checkpoint(spark, settings.checkpoint_path(query))
    result.seconds = time.monotonic() - started
    return result
