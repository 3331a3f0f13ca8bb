"""The dashboard's lake reads on tiny Delta tables written with delta-rs: missing tables, recent rows only,
row caps, and tables that appear or grow while the dashboard runs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import write_deltalake

from dashboard.lake import LakeReader, is_true
from dashboard.models import read_model_history
from iotmon.config import Settings
from iotmon.schema import SILVER

T0 = datetime(2026, 11, 22, 8, 0, tzinfo=UTC)


def _readings(minutes: list[int], device: str = "a", lateness: str = "on_time") -> pa.Table:
    return pa.table(
        {
            "device_id": [device] * len(minutes),
            "event_time": pa.array([T0 + timedelta(minutes=m) for m in minutes], pa.timestamp("us", tz="UTC")),
            "lateness": [lateness] * len(minutes),
        }
    )


def test_a_missing_table_reads_as_an_empty_frame_until_it_appears(tmp_path: Path) -> None:
    reader = LakeReader(Settings.from_env({}, home=tmp_path))
    assert reader.table(SILVER) is None and reader.newest(SILVER, "event_time") is None
    empty = reader.read(SILVER, ["device_id", "event_time"])
    assert empty.empty and list(empty.columns) == ["device_id", "event_time"]
    assert reader.counts(SILVER, "lateness").empty

    write_deltalake(reader.settings.table_path(SILVER), _readings([0, 1]))
    assert len(reader.read(SILVER, ["device_id"])) == 2
    write_deltalake(reader.settings.table_path(SILVER), _readings([2]), mode="append")
    assert len(reader.read(SILVER, ["device_id"])) == 3  # the cached table catches up with new commits
    assert reader.newest(SILVER, "event_time") == T0 + timedelta(minutes=2)


def test_only_recent_rows_are_read_and_older_files_are_not_opened(tmp_path: Path) -> None:
    reader = LakeReader(Settings.from_env({}, home=tmp_path))
    path = reader.settings.table_path(SILVER)
    write_deltalake(path, _readings([0, 1, 2]))  # an old file
    write_deltalake(path, _readings([50, 55], lateness="late"), mode="append")
    write_deltalake(path, _readings([60], device="b"), mode="append")

    since = ("event_time", T0 + timedelta(minutes=30))
    recent = reader.read(SILVER, ["device_id", "event_time", "missing_column"], since=since)
    assert sorted(recent["event_time"]) == [T0 + timedelta(minutes=m) for m in (50, 55, 60)]
    assert recent["missing_column"].isna().all()  # a column the table lacks reads as null
    dataset = reader.table(SILVER).to_pyarrow_dataset()
    bound = ds.field("event_time") >= pa.scalar(since[1], pa.timestamp("us", tz="UTC"))
    assert len(list(dataset.get_fragments(filter=bound))) == 2  # the old file is pruned by its statistics

    only_b = reader.read(SILVER, ["device_id"], since=since, where=ds.field("device_id") == "b")
    assert only_b["device_id"].tolist() == ["b"]
    latest = reader.read(SILVER, ["event_time"], newest_first="event_time", limit=2)
    assert sorted(latest["event_time"]) == [T0 + timedelta(minutes=55), T0 + timedelta(minutes=60)]
    assert reader.counts(SILVER, "lateness", since=since).to_dict() == {"late": 2, "on_time": 1}


def test_a_boolean_filter_finds_its_rows_in_a_spark_shaped_log(tmp_path: Path) -> None:
    """Spark logs a null count but no min/max for a boolean column; delta-rs 1.x turns that into a guarantee
    under which pyarrow drops every row for ``is_anomaly == true``. ``is_true`` must still find the rows."""
    reader = LakeReader(Settings.from_env({}, home=tmp_path))
    path = reader.settings.table_path(SILVER)
    write_deltalake(path, pa.table({"seq": [1, 2, 3], "is_anomaly": [False, True, True]}))
    log = Path(path) / "_delta_log" / f"{0:020d}.json"
    actions = [json.loads(line) for line in log.read_text().splitlines()]
    for action in actions:
        if "add" in action:
            stats = json.loads(action["add"]["stats"])
            for bound in ("minValues", "maxValues"):
                stats[bound].pop("is_anomaly")
            action["add"]["stats"] = json.dumps(stats)
    log.write_text("".join(json.dumps(action) + "\n" for action in actions))

    assert reader.read(SILVER, ["seq"], where=is_true("is_anomaly"))["seq"].tolist() == [2, 3]


def test_no_model_history_before_the_first_training_run_and_nothing_created(tmp_path: Path) -> None:
    settings = Settings.from_env({}, home=tmp_path)
    assert read_model_history(settings) is None
    assert not settings.mlflow_home.exists()
