"""The dashboard's lake reads on tiny Delta tables written with delta-rs: missing tables, recent rows only,
row caps, and tables that appear or grow while the dashboard runs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
from deltalake import write_deltalake

from dashboard.lake import REMEMBERED_QUESTIONS, LakeReader, is_true
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


def test_reads_and_counts_over_a_lookback_take_each_file_once_and_equal_a_full_read(tmp_path: Path) -> None:
    """A refresh reads (or counts) the files wholly inside the window once (a data file never changes), filters
    only those the window's start cuts through, and forgets the files the window has left."""
    reader = LakeReader(Settings.from_env({}, home=tmp_path / "a home with spaces"))  # a file URI quotes them
    path = reader.settings.table_path(SILVER)
    write_deltalake(path, _readings([0, 1, 2]))
    write_deltalake(path, _readings([28, 31, 33], lateness="late"), mode="append")  # cut by a start at 30
    write_deltalake(path, _readings([40, 41]), mode="append")

    def full_count(start: datetime) -> dict[str, int]:
        rows = reader.read(SILVER, ["event_time", "lateness"])
        return rows[rows["event_time"] >= start]["lateness"].value_counts().to_dict()

    def full_read(start: datetime, device: str) -> list[datetime]:
        rows = reader.read(SILVER, ["device_id", "event_time"])
        return sorted(rows[(rows["event_time"] >= start) & (rows["device_id"] == device)]["event_time"])

    write_deltalake(path, _readings([35, 36], device="b"), mode="append")
    for minute in (30, 0, 45, 30):
        since = ("event_time", T0 + timedelta(minutes=minute))
        assert reader.counts(SILVER, "lateness", since=since).to_dict() == full_count(since[1]), minute
        for device in ("a", "b"):
            only = ds.field("device_id") == device
            read = reader.read(SILVER, ["device_id", "event_time"], since=since, where=only)
            assert sorted(read["event_time"]) == full_read(since[1], device), (minute, device)
    since = ("event_time", T0 + timedelta(minutes=30))
    assert reader.counts(SILVER, "lateness", since=since).to_dict() == {"late": 2, "on_time": 4}
    remembered = reader._remembered[(SILVER, ("counts", "lateness"))]
    assert len(remembered) == 2  # minutes 35-36 and 40-41; the file the start cuts through is never kept

    write_deltalake(path, _readings([50], lateness="too_late"), mode="append")
    assert reader.counts(SILVER, "lateness", since=since).to_dict() == {"late": 2, "on_time": 4, "too_late": 1}
    assert len(remembered) == 3
    later = ("event_time", T0 + timedelta(minutes=45))
    assert reader.counts(SILVER, "lateness", since=later).to_dict() == {"too_late": 1}
    assert len(remembered) == 1  # the window has left the files of minutes 35-41
    assert reader.counts(SILVER, "lateness").to_dict() == {"on_time": 7, "late": 3, "too_late": 1}


def test_what_is_remembered_per_file_is_bounded_by_the_reads_asked_lately(tmp_path: Path) -> None:
    reader = LakeReader(Settings.from_env({}, home=tmp_path))
    write_deltalake(reader.settings.table_path(SILVER), _readings([40, 41]))
    since = ("event_time", T0 + timedelta(minutes=30))
    for device in range(REMEMBERED_QUESTIONS + 5):  # an operator clicking through the fleet
        reader.read(SILVER, ["event_time"], since=since, where=ds.field("device_id") == f"dev-{device}")
    assert len(reader._remembered) == REMEMBERED_QUESTIONS
    assert len(reader.read(SILVER, ["event_time"], since=since, where=ds.field("device_id") == "a")) == 2
