"""Truth files read while the simulator that writes them runs: a real-time run publishes live parts and removes
them when it finishes, and the periodic trainer, another process, reads whatever it listed minutes before."""

from __future__ import annotations

import os
import shutil
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from ml.evaluation import truth_labels
from simulators.truth import TRUTH_SCHEMA, TruthWriter, available_truth, live_parts, read_truth

START = datetime(2026, 11, 22, tzinfo=UTC)


def sends(first: int, count: int) -> pa.Table:
    """Truth rows ``first`` .. ``first + count - 1``: every 5th a spike, every 7th undelivered, every 11th malformed,
    every 13th a duplicate."""
    rows = [
        {
            "send_index": i,
            "device_id": f"dev-{i % 3}",
            "seq": i,
            "event_time": START + timedelta(seconds=i),
            "send_time": START + timedelta(seconds=i),
            "delay_s": 0.0,
            "late_kind": "on_time",
            "is_duplicate": i % 13 == 0,
            "malformed_kind": "truncated" if i % 11 == 0 else None,
            "anomaly_type": "spike" if i % 5 == 0 else None,
            "anomaly_metric": "temperature" if i % 5 == 0 else None,
            "payload_bytes": 150,
            "topic": "iotmon.readings",
            "partition": 0,
            "offset": i if i % 7 else -1,
            "delivered": i % 7 != 0,
        }
        for i in range(first, first + count)
    ]
    return pa.Table.from_pylist(rows, schema=TRUTH_SCHEMA)


def live_writer(path: Path, batches: int, rows: int = 10) -> TruthWriter:
    """A real-time run's writer that has published ``batches`` live parts of ``rows`` rows."""
    writer = TruthWriter(path, live_every_s=0.0)  # a part at every write
    for batch in range(batches):
        writer.write(sends(batch * rows, rows))
    return writer


def indexes(table: pa.Table) -> list[int]:
    return table.column("send_index").to_pylist()


def test_a_listing_of_live_parts_read_after_the_run_finished_reads_the_finished_file(tmp_path: Path) -> None:
    writer = live_writer(tmp_path / "demo.parquet", batches=4)
    listed = available_truth(tmp_path)
    assert [path.name for path in listed] == [f"part-0000{n}.parquet" for n in range(4)]
    assert indexes(read_truth(listed)) == list(range(40))
    writer.write(sends(40, 10))
    writer.close()
    assert not live_parts(tmp_path / "demo.parquet").exists()
    assert indexes(read_truth(listed)) == list(range(50))  # what the trainer failed on: the parts are gone


def test_between_publishing_the_finished_file_and_removing_the_parts_the_file_alone_is_read(tmp_path: Path) -> None:
    path = tmp_path / "demo.parquet"
    writer = live_writer(path, batches=3)
    listed = available_truth(tmp_path)
    shutil.copytree(live_parts(path), tmp_path / "parts")
    writer.close()
    shutil.copytree(tmp_path / "parts", live_parts(path))  # as close() leaves them for a moment
    assert available_truth(tmp_path) == [path]
    assert indexes(read_truth(listed)) == list(range(30))  # each row once


def test_an_earlier_run_of_the_same_name_is_read_beside_the_next_runs_live_parts(tmp_path: Path) -> None:
    path = tmp_path / "run-1.parquet"
    TruthWriter(path).close()
    earlier = path.stat().st_mtime_ns - 60 * 10**9
    os.utime(path, ns=(earlier, earlier))  # a minute before the next run's first part
    crashed = live_writer(tmp_path / "elsewhere" / "run-1.parquet", batches=2)
    shutil.copytree(live_parts(crashed.path), live_parts(path))  # a second run that was killed left its parts
    assert available_truth(tmp_path) == [path, *sorted(live_parts(path).iterdir())]
    # The next run starts with the crashed one's parts removed (numbered alike, they would be read as its own).
    writer = TruthWriter(path, live_every_s=0.0)
    assert available_truth(tmp_path) == [path]
    writer.write(sends(100, 5))
    listed = available_truth(tmp_path)
    assert listed == [path, live_parts(path) / "part-00000.parquet"]
    assert indexes(read_truth(listed)) == list(range(100, 105))  # the earlier run had no rows
    writer.close()
    assert indexes(read_truth(listed)) == list(range(100, 105))  # replaced: each row once


def test_readers_never_fail_and_see_every_row_while_runs_publish_and_finish(tmp_path: Path) -> None:
    rows, batches = 10, 200
    for run in range(3):
        folder = tmp_path / f"round-{run}"
        writer = TruthWriter(folder / "demo.parquet", row_group_rows=64, live_every_s=0.0)
        read_while_live = threading.Event()

        def publish(writer: TruthWriter = writer, halfway: threading.Event = read_while_live) -> None:
            for batch in range(batches):
                writer.write(sends(batch * rows, rows))
                if batch == batches // 2:
                    halfway.wait(60)  # so that at least one read sees live parts, whatever the scheduling
            writer.close()

        thread = threading.Thread(target=publish, name="truth-writer")
        thread.start()
        stale: list[Path] = []  # the previous listing: the trainer lists, then reads a while later
        try:
            while True:
                finished = not thread.is_alive()  # then one more look, at the finished file
                listed = available_truth(folder)
                for files in (listed, stale):
                    got = indexes(read_truth(files))
                    # Every row of the parts listed (whole parts, in order) or of the finished file; none twice.
                    assert got == list(range(len(got))) and len(got) % rows == 0
                    if 0 < len(got) < rows * batches:
                        read_while_live.set()
                stale = listed
                if finished:
                    break
        finally:
            read_while_live.set()
            thread.join()
        assert len(got) == rows * batches


def test_truth_labels_of_a_run_that_finished_after_it_was_listed(spark: SparkSession, tmp_path: Path) -> None:
    writer = live_writer(tmp_path / "demo.parquet", batches=2, rows=50)
    listed = available_truth(tmp_path)
    writer.write(sends(100, 50))
    writer.close()
    labels = truth_labels(spark, listed).collect()
    delivered = [i for i in range(150) if i % 7 and i % 11 and i % 13]
    assert sorted(row.seq for row in labels) == delivered
    assert {row.seq for row in labels if row.anomaly_type == "spike"} == {i for i in delivered if i % 5 == 0}
    assert {row.event_time for row in labels if row.seq == 1} == {datetime(2026, 11, 22, 0, 0, 1)}  # UTC session


@pytest.mark.parametrize("columns", [None, ["seq", "anomaly_type"]])
def test_no_truth_reads_as_no_rows_with_the_truth_columns(tmp_path: Path, columns: list[str] | None) -> None:
    table = read_truth(available_truth(tmp_path), columns)
    assert table.num_rows == 0 and table.column_names == (columns or TRUTH_SCHEMA.names)
