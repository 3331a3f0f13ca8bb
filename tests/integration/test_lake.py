"""Exactly-once writes by commit tag, on real Delta tables: a replayed batch is skipped where it landed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql.types import LongType, StructField, StructType

from iotmon.lake import (
    BatchLedger,
    append_once,
    create_table,
    held,
    ledger_for,
    merge_once,
    remove_unfinished_creation,
)

pytestmark = pytest.mark.integration


def _rows(spark: SparkSession, path: Path) -> list[tuple[int, str]]:
    return sorted((r.id, r.v) for r in spark.read.format("delta").load(str(path)).collect())


def _jobs_during(spark: SparkSession, action) -> int:
    tracker, group = spark.sparkContext.statusTracker(), f"ledger-{id(action)}"
    spark.sparkContext.setJobGroup(group, "counting jobs")
    try:
        action()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    return len(tracker.getJobIdsForGroup(group))


def test_a_batch_is_written_once_per_table_across_restarts(spark: SparkSession, tmp_path: Path) -> None:
    table, other = tmp_path / "t", tmp_path / "u"
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text(json.dumps({"id": "query-1"}))
    first = spark.createDataFrame([(1, "a"), (2, "b")], "id long, v string")
    second = spark.createDataFrame([(3, "c")], "id long, v string")

    ledger = BatchLedger(str(checkpoint))
    assert append_once(first, str(table), ledger, 0)
    assert append_once(first, str(other), ledger, 0)
    # Within a run, the ledger answers from memory: a write costs its one job, no log reading, no state.
    assert _jobs_during(spark, lambda: append_once(second, str(table), ledger, 1)) == 1
    assert not append_once(second, str(table), ledger, 1)

    # A restart (a new ledger, as a restarted query gets) replays batch 1: it is found in the log and skipped
    # where it landed, written where it did not.
    restarted = BatchLedger(str(checkpoint))
    assert not append_once(second, str(table), restarted, 1)
    assert append_once(second, str(other), restarted, 1)
    assert _rows(spark, table) == _rows(spark, other) == [(1, "a"), (2, "b"), (3, "c")]

    # Another writer's tags are not ours: a new checkpoint starts its own sequence at 0.
    (checkpoint / "metadata").write_text(json.dumps({"id": "query-2"}))
    assert append_once(second, str(table), BatchLedger(str(checkpoint)), 0)
    assert len(_rows(spark, table)) == 4


def test_an_append_is_one_file_so_a_stream_reading_the_table_gets_each_commit_whole(
    spark: SparkSession, tmp_path: Path
) -> None:
    # A Delta source rate-limits between files: the scorer's history counts on never seeing half a commit.
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text(json.dumps({"id": "query-1"}))
    table, ledger = tmp_path / "t", BatchLedger(str(checkpoint))
    for batch_id in range(2):
        frame = spark.range(batch_id * 1000, (batch_id + 1) * 1000, numPartitions=4).selectExpr("id", "'x' AS v")
        with held(frame) as rows:  # computed by 4 tasks, then written by one
            assert rows == 1000 and frame.is_cached
            assert append_once(frame, str(table), ledger, batch_id)
        assert not frame.is_cached
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").where("operation = 'WRITE'").collect()
    assert sorted(int(h.operationMetrics["numFiles"]) for h in history) == [1, 1]
    assert len(_rows(spark, table)) == 2000


def test_merge_is_tagged_and_skipped_on_replay(spark: SparkSession, tmp_path: Path) -> None:
    table = str(tmp_path / "t")
    spark.createDataFrame([(1, "a")], "id long, v string").write.format("delta").save(table)
    update = spark.createDataFrame([(1, "A"), (2, "b")], "id long, v string")
    assert merge_once(update, table, "t.id = s.id", ledger_for("merger"), 7)
    changed = spark.createDataFrame([(1, "wrong")], "id long, v string")
    # A replay of batch 7 by the same writer after a restart: the table holds it already.
    assert not merge_once(changed, table, "t.id = s.id", ledger_for("merger"), 7)
    assert _rows(spark, Path(table)) == [(1, "A"), (2, "b")]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").where("operation = 'MERGE'").first()
    assert json.loads(history.userMetadata) == {"app": "merger", "batch": 7}


def test_a_failed_write_is_looked_up_again_before_the_next_attempt(spark: SparkSession, tmp_path: Path) -> None:
    table = str(tmp_path / "t")
    ledger = ledger_for("writer")
    frame = spark.createDataFrame([(1, "a")], "id long, v string")
    append_once(frame, table, ledger, 0)
    bad = spark.createDataFrame([(1, 2)], "id long, v long")  # a schema Delta refuses to append
    with pytest.raises(Exception, match=r"(?i)schema|merge"):
        append_once(bad, table, ledger, 1)
    assert table not in ledger.committed
    assert append_once(frame, table, ledger, 1)
    assert len(_rows(spark, Path(table))) == 2


def test_a_table_is_created_once_and_its_schema_derived_only_then(spark: SparkSession, tmp_path: Path) -> None:
    derived: list[str] = []

    def schema() -> StructType:
        derived.append("planned")
        return StructType([StructField("id", LongType())])

    table = tmp_path / "t"
    create_table(spark, str(table), schema, "made once")
    assert derived == ["planned"] and spark.read.format("delta").load(str(table)).columns == ["id"]

    # An existing table is left as it is, whatever schema is given, and a schema function is not called.
    create_table(spark, str(table), schema, "made again")
    create_table(spark, str(table), StructType([StructField("other", LongType())]), "made again")
    assert derived == ["planned"] and spark.read.format("delta").load(str(table)).columns == ["id"]


def test_a_table_whose_creation_a_crash_interrupted_is_created_on_the_next_start(
    spark: SparkSession, tmp_path: Path
) -> None:
    # What a kill between Delta's first `mkdirs` of the log and its first commit's rename leaves: the log's
    # directories and, at worst, the commit's hidden temp file (and its checksum). Delta alone refuses such a
    # path on every start (DELTA_TABLE_NOT_FOUND).
    table = tmp_path / "t"
    log = table / "_delta_log"
    (log / "_staged_commits").mkdir(parents=True)
    (log / ".00000000000000000000.json.0f1e2d3c.tmp").write_text('{"commitInfo":{}}')
    (log / "..00000000000000000000.json.0f1e2d3c.tmp.crc").write_bytes(b"crc")
    create_table(spark, str(table), StructType([StructField("id", LongType())]), "created after the crash")
    assert spark.read.format("delta").load(str(table)).columns == ["id"]

    # A table with a commit is never touched, whatever else its log holds.
    (log / ".00000000000000000001.json.abcdef.tmp").write_text("{}")
    assert remove_unfinished_creation(spark, str(table)) == []
    assert spark.read.format("delta").load(str(table)).columns == ["id"]
