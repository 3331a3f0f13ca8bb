"""Exactly-once writes by commit tag, on real Delta tables: a replayed batch is skipped where it landed."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable as RustDeltaTable
from pyspark.sql import SparkSession
from pyspark.sql.types import LongType, StructField, StructType

from iotmon.lake import (
    BatchLedger,
    absent,
    append_once,
    append_rows,
    create_table,
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
    for path in (table, other):
        create_table(spark, str(path), first.schema, "appended to")

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
    create_table(spark, str(table), spark.createDataFrame([], "id long, v string").schema, "appended to")
    for batch_id in range(2):
        frame = spark.range(batch_id * 1000, (batch_id + 1) * 1000, numPartitions=4).selectExpr("id", "'x' AS v")
        assert append_once(frame, str(table), ledger, batch_id)  # computed by 4 tasks, then written by one
    commits = [(table / "_delta_log" / f"{version:020d}.json").read_text().splitlines() for version in (1, 2)]
    assert [sum('"add"' in line for line in commit) for commit in commits] == [1, 1]
    assert len(_rows(spark, table)) == 2000


def test_merge_is_tagged_and_skipped_on_replay(spark: SparkSession, tmp_path: Path) -> None:
    table = str(tmp_path / "t")
    spark.createDataFrame([(1, "a")], "id long, v string").write.format("delta").save(table)
    update = spark.createDataFrame([(1, "A"), (2, "b")], "id long, v string")
    assert merge_once(update, table, ("id",), ledger_for("merger"), 7)
    changed = spark.createDataFrame([(1, "wrong")], "id long, v string")
    # A replay of batch 7 by the same writer after a restart: the table holds it already.
    assert not merge_once(changed, table, ("id",), ledger_for("merger"), 7)
    assert _rows(spark, Path(table)) == [(1, "A"), (2, "b")]
    history = spark.sql(f"DESCRIBE HISTORY delta.`{table}`").where("version = 1").first()
    assert json.loads(history.userMetadata) == {"app": "merger", "batch": 7}
    assert spark.sql(f"DESCRIBE HISTORY delta.`{table}`").count() == 2  # one commit, the replay skipped


def test_a_merge_rewrites_only_the_files_holding_its_keys(spark: SparkSession, tmp_path: Path) -> None:
    # A table of live windows: a row per (window, device), the windows of each batch in a file of their own.
    table = str(tmp_path / "windows")
    schema = "window_start timestamp not null, device_id string not null, readings long, mean double"
    create_table(spark, table, spark.createDataFrame([], schema).schema, "windows")
    ledger = ledger_for("windows")
    minute = [datetime(2026, 11, 28, 12, m) for m in range(3)]
    first = [(minute[0], "dev-a", 3, 1.5), (minute[0], "dev-b", 2, 2.5)]
    second = [(minute[1], "dev-a", 1, 9.0), (minute[1], "dev-b", 4, float("nan"))]
    assert merge_once(spark.createDataFrame(first, schema), table, ("window_start", "device_id"), ledger, 0)
    assert merge_once(spark.createDataFrame(second, schema), table, ("window_start", "device_id"), ledger, 1)
    # A late reading corrects dev-a's second window; dev-c's is new; nothing of the first window changes.
    third = [(minute[1], "dev-a", 2, 8.0), (minute[2], "dev-c", 1, 4.0)]
    assert merge_once(spark.createDataFrame(third, schema), table, ("window_start", "device_id"), ledger, 2)

    written = spark.read.format("delta").load(table).collect()
    rows = {(r.window_start, r.device_id): (r.readings, r.mean) for r in written}
    assert sorted(rows) == [
        (minute[0], "dev-a"),
        (minute[0], "dev-b"),
        (minute[1], "dev-a"),
        (minute[1], "dev-b"),
        (minute[2], "dev-c"),
    ]
    assert rows[(minute[0], "dev-a")] == (3, 1.5) and rows[(minute[1], "dev-a")] == (2, 8.0)
    assert rows[(minute[1], "dev-b")][0] == 4 and math.isnan(rows[(minute[1], "dev-b")][1])  # kept as it was
    assert rows[(minute[2], "dev-c")] == (1, 4.0)
    log = [json.loads(line) for line in (Path(table) / "_delta_log" / f"{3:020d}.json").read_text().splitlines()]
    removed = [a["remove"]["path"] for a in log if "remove" in a]
    added = [a["add"] for a in log if "add" in a]
    second_file = [
        json.loads(line)["add"]["path"]
        for line in (Path(table) / "_delta_log" / f"{2:020d}.json").read_text().splitlines()
        if "add" in line
    ]
    assert removed == second_file  # the first window's file holds none of the keys: untouched, not even read
    assert len(added) == 1 and json.loads(added[0]["stats"])["numRecords"] == 3
    assert json.loads(log[0]["commitInfo"]["userMetadata"]) == {"app": "windows", "batch": 2}

    # Readable by everyone as plain strings, filters included (delta-rs' own MERGE writes string_view, which
    # pyarrow's filters reject), and by the file statistics a reader prunes with.
    delta = RustDeltaTable(table)
    assert delta.to_pyarrow_table(filters=[("device_id", "=", "dev-b")]).num_rows == 2
    assert delta.to_pyarrow_table(filters=[("window_start", ">=", minute[1].replace(tzinfo=UTC))]).num_rows == 3
    stats = json.loads(added[0]["stats"])
    assert stats["minValues"] == {"window_start": "2026-11-28T12:01:00.000Z", "device_id": "dev-a", "readings": 1}
    assert stats["maxValues"] == {"window_start": "2026-11-28T12:02:00.000Z", "device_id": "dev-c", "readings": 4}
    assert stats["nullCount"] == {"window_start": 0, "device_id": 0, "readings": 0, "mean": 0}


def test_a_failed_write_is_looked_up_again_before_the_next_attempt(spark: SparkSession, tmp_path: Path) -> None:
    table = str(tmp_path / "t")
    ledger = ledger_for("writer")
    frame = spark.createDataFrame([(1, "a")], "id long, v string")
    create_table(spark, table, frame.schema, "appended to")
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


def test_each_commit_on_the_driver_has_a_checksum_as_spark_would_write_it(spark: SparkSession, tmp_path: Path) -> None:
    """Spark takes a table's protocol and metadata from the newest version's checksum, or replays the log."""
    table, ledger = str(tmp_path / "t"), ledger_for("checksums")
    log = tmp_path / "t" / "_delta_log"
    schema = "id long, v string"
    create_table(spark, table, spark.createDataFrame([], schema).schema, "checksummed")

    def checksum_agrees(version: int) -> None:
        stored = json.loads((log / f"{version:020d}.crc").read_text())
        files = pa.table(RustDeltaTable(table, version=version).get_add_actions(flatten=True))
        assert (stored["numFiles"], stored["tableSizeBytes"]) == (files.num_rows, sum(files["size_bytes"].to_pylist()))
        assert stored["metadata"] == json.loads((log / f"{0:020d}.crc").read_text())["metadata"]

    assert append_once(spark.createDataFrame([(1, "a"), (2, "b")], schema), table, ledger, 0)
    assert merge_once(spark.createDataFrame([(2, "B"), (3, "c")], schema), table, ("id",), ledger, 1)
    for version in (1, 2):
        checksum_agrees(version)
    # A kill between a commit and its checksum: the next commit counts the table's files itself.
    (log / f"{2:020d}.crc").unlink()
    assert append_once(spark.createDataFrame([(4, "d")], schema), table, ledger, 2)
    checksum_agrees(3)
    # Spark commits on top of it, and its own checksum agrees with what it counts.
    spark.createDataFrame([(5, "e")], schema).write.format("delta").mode("append").save(table)
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{table}`").first()
    checksum_agrees(4)
    assert detail.numFiles == json.loads((log / f"{4:020d}.crc").read_text())["numFiles"]
    # A write without a ledger (the event clock's ticks) commits the same way, untagged.
    append_rows(pa.table({"id": [6], "v": ["f"]}), table)
    checksum_agrees(5)
    assert spark.sql(f"DESCRIBE HISTORY delta.`{table}` LIMIT 1").first().userMetadata is None
    assert _rows(spark, Path(table)) == [(1, "a"), (2, "B"), (3, "c"), (4, "d"), (5, "e"), (6, "f")]


def test_a_lookup_on_the_driver_finds_what_the_table_held_at_its_version(spark: SparkSession, tmp_path: Path) -> None:
    """``absent``: the rows whose keys the table lacks at a version, reading only the files that may hold them."""
    table = str(tmp_path / "readings")
    schema = "device_id string, seq long, event_time timestamp, v double"
    create_table(spark, table, spark.createDataFrame([], schema).schema, "readings")
    at = [datetime(2026, 12, 1, 12, m, tzinfo=UTC) for m in range(4)]
    kind = pa.timestamp("us", tz="UTC")

    def readings(*rows: tuple[str, int, datetime]) -> pa.Table:
        device, seq, when = zip(*rows, strict=True)
        return pa.table({"device_id": device, "seq": seq, "event_time": pa.array(when, kind), "v": [1.0] * len(rows)})

    append_rows(readings(("dev-a", 1, at[0]), ("dev-b", 1, at[0])), table)  # version 1: an old file
    append_rows(readings(("dev-a", 2, at[2])), table)  # version 2
    version = RustDeltaTable(table).version()
    append_rows(readings(("dev-a", 3, at[3])), table)  # version 3: after the lookup's version
    # The old file cannot hold a key of the rows sought (its statistics say so): it is never opened.
    first = RustDeltaTable(table, version=1).get_add_actions(flatten=True).column("path")[0].as_py()
    (Path(table) / first).unlink()

    # The caller's rows keep their columns and order; their timestamps may be of another zone than the table's.
    sought = readings(("dev-a", 2, at[2]), ("dev-a", 3, at[3]), ("dev-b", 2, at[2]), ("dev-a", 2, at[3]))
    sought = sought.set_column(2, "event_time", sought["event_time"].cast(pa.timestamp("us", tz="Etc/UTC")))
    missing = absent(
        sought.select(["v", "event_time", "seq", "device_id"]), table, ("device_id", "seq", "event_time"), version
    )
    assert missing.column_names == ["v", "event_time", "seq", "device_id"]
    assert sorted(zip(missing["device_id"].to_pylist(), missing["seq"].to_pylist(), strict=True)) == [
        ("dev-a", 2),  # the same seq at another time is another reading
        ("dev-a", 3),  # committed after the version looked up
        ("dev-b", 2),
    ]
    assert absent(sought.slice(0, 0), table, ("device_id", "seq", "event_time"), version).num_rows == 0
