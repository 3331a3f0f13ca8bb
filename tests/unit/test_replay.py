"""``iotmon replay``'s pure parts on tiny in-memory tables, and one run against a fake producer."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from iotmon.cli import EXIT_ERROR, main
from iotmon.config import Settings
from iotmon.schema import DEVICES, METRIC_NAMES, REQUIRED_FIELDS
from simulators.fleet import build_fleet
from simulators.publish import now_ms
from simulators.replay import (
    TIME_MS,
    ColumnMapping,
    DeviceSeen,
    ReplayError,
    ReplayOptions,
    SeqCounter,
    due_wall_ms,
    event_payloads,
    file_format,
    in_event_time_order,
    incomplete_fields,
    incomplete_rows,
    parse_chunk,
    parse_event_times,
    parse_numbers,
    parse_speed,
    publish_order,
    registry_rows,
    replay,
    restamp_lead_s,
    restamp_shift_ms,
)

T0 = dt.datetime(2026, 3, 1, 12, 0, 0, tzinfo=dt.UTC)
T0_MS = int(T0.timestamp() * 1000)


def _readings(**columns: list[Any]) -> pa.Table:
    """A file's table with the default column names; ``columns`` override or add columns."""
    n = len(next(iter(columns.values())))
    base: dict[str, list[Any]] = {
        "device_id": [f"d{i % 2}" for i in range(n)],
        "event_time": [(T0 + dt.timedelta(seconds=i)).isoformat() for i in range(n)],
        **{metric: [float(i)] * n for i, metric in enumerate(METRIC_NAMES)},
    }
    base.update(columns)
    return pa.table(base)


# --- column mapping ----------------------------------------------------------------------------------------


def test_a_missing_column_names_its_flag_and_lists_the_files_columns() -> None:
    mapping = ColumnMapping(device="sensor", time="ts", seq="n")
    with pytest.raises(ReplayError) as caught:
        mapping.check(["sensor", "time", "temperature", "humidity", "vibration", "pressure", "battery"])
    message = str(caught.value)
    assert "--time-col 'ts'" in message and "--seq-col 'n'" in message
    assert "--device-col" not in message
    assert "the file has: sensor, time, temperature" in message


def test_mapped_columns_are_read_once_each() -> None:
    mapping = ColumnMapping(site="device_id", metrics=(("temperature", "t"), ("humidity", "t")))
    assert mapping.columns == ["device_id", "event_time", "t"]


def test_metric_columns_are_renamed_into_the_event() -> None:
    raw = pa.table({"sensor": ["a"], "ts": ["2026-03-01T12:00:00Z"], "temp_c": [21.5], "h": [40], "v": [1.0]})
    raw = raw.append_column("p", pa.array([101.0])).append_column("b", pa.array([90.0]))
    mapping = ColumnMapping(
        device="sensor",
        time="ts",
        metrics=tuple(zip(METRIC_NAMES, ("temp_c", "h", "v", "p", "b"), strict=True)),
    )
    event = orjson.loads(event_payloads(parse_chunk(raw, mapping, None), [1], 0)[0])
    assert event == {
        "device_id": "a",
        "seq": 1,
        "event_time": "2026-03-01T12:00:00.000Z",
        "temperature": 21.5,
        "humidity": 40.0,
        "vibration": 1.0,
        "pressure": 101.0,
        "battery": 90.0,
    }
    assert list(event) == list(REQUIRED_FIELDS)


# --- time parsing ------------------------------------------------------------------------------------------


def test_iso_times_with_zone_offset_or_none_are_utc() -> None:
    texts = ["2026-03-01T12:00:00Z", "2026-03-01T13:00:00+01:00", "2026-03-01 12:00:00.250", "2026-03-01"]
    ms, text = parse_event_times(pa.array(texts), None)
    day = T0_MS - 12 * 3600_000
    assert ms.to_pylist() == [T0_MS, T0_MS, T0_MS + 250, day]
    assert text.null_count == len(texts)


def test_timestamp_and_epoch_columns() -> None:
    naive = pa.array([T0.replace(tzinfo=None)], pa.timestamp("us"))
    aware = pa.array([T0], pa.timestamp("ns", tz="Europe/Berlin"))
    assert parse_event_times(naive, None)[0].to_pylist() == [T0_MS]
    assert parse_event_times(aware, None)[0].to_pylist() == [T0_MS]
    assert parse_event_times(pa.array([T0_MS / 1000 + 0.5]), "s")[0].to_pylist() == [T0_MS + 500]
    assert parse_event_times(pa.array([T0_MS]), "ms")[0].to_pylist() == [T0_MS]
    assert parse_event_times(pa.array([str(T0_MS // 1000)]), "s")[0].to_pylist() == [T0_MS]  # CSV text


def test_numeric_times_need_a_unit() -> None:
    for values in (pa.array([T0_MS]), pa.array(["1772366400", "1772366401"])):
        with pytest.raises(ReplayError, match="--time-unit s\\|ms"):
            parse_event_times(values, None)


def test_unparsable_and_missing_times_are_kept_apart() -> None:
    ms, text = parse_event_times(pa.array(["2026-03-01T12:00:00Z", "yesterday", None, "", "12"]), None)
    assert ms.to_pylist() == [T0_MS, None, None, None, None]
    assert text.to_pylist() == [None, "yesterday", None, None, "12"]


# --- values ------------------------------------------------------------------------------------------------


def test_numbers_from_text_keep_what_does_not_parse() -> None:
    values, text = parse_numbers(pa.array(["1.5", "n/a", None, "nan", " 2 "]))
    assert values.to_pylist() == [1.5, None, None, None, 2.0]
    assert text.to_pylist() == [None, "n/a", None, None, None]


def test_non_finite_numbers_are_missing_and_seq_must_be_whole() -> None:
    values, text = parse_numbers(pa.array([1.0, float("nan"), float("inf")]))
    assert values.to_pylist() == [1.0, None, None] and text.null_count == 3
    seqs, seq_text = parse_numbers(pa.array([3.0, 3.5, None]), integral=True)
    assert seqs.to_pylist() == [3, None, None] and seq_text.to_pylist() == [None, "3.5", None]


def test_incomplete_rows_are_published_with_the_problem_visible() -> None:
    raw = _readings(
        device_id=["a", "", "c"],
        event_time=["2026-03-01T12:00:00Z", "2026-03-01T12:00:01Z", "soon"],
        temperature=["20", None, "warm"],
    )
    parsed = parse_chunk(raw, ColumnMapping(), None)
    assert incomplete_rows(parsed) == 2
    assert incomplete_fields(parsed) == {
        "missing:device_id": 1,
        "missing:temperature": 1,
        "unparsable:temperature": 1,
        "unparsable:event_time": 1,
    }
    first, second, third = (orjson.loads(p) for p in event_payloads(parsed, [1, 1, 1], 0))
    assert first["temperature"] == 20.0
    assert "device_id" not in second and "temperature" not in second  # bronze: missing_field
    assert third["event_time"] == "soon" and third["temperature"] == "warm"  # bronze: mistyped_field


# --- order, seq, pacing, restamping ------------------------------------------------------------------------


def test_publish_order_is_stable_with_untimed_rows_last() -> None:
    ms = pa.array([30, None, 10, 30, 20, None, 10], pa.int64())
    assert publish_order(ms).tolist() == [2, 6, 4, 0, 3, 1, 5]


def test_order_is_checked_across_chunks() -> None:
    assert in_event_time_order(pa.array([1, None, 1, 5]), None) == (True, 5)
    assert in_event_time_order(pa.array([6, 7]), 5) == (True, 7)
    assert in_event_time_order(pa.array([4, 7]), 5) == (False, 7)
    assert in_event_time_order(pa.array([3, 2]), None)[0] is False
    assert in_event_time_order(pa.array([None], pa.int64()), 5) == (True, 5)


def test_seq_is_assigned_per_device_across_chunks() -> None:
    counter = SeqCounter()
    assert counter.assign(["a", "b", "a"]) == [1, 1, 2]
    assert counter.assign(["b", "a", None]) == [2, 3, 1]


def test_a_seq_column_is_published_as_given() -> None:
    parsed = parse_chunk(_readings(seq=[7, 9]), ColumnMapping(seq="seq"), None)
    assert [orjson.loads(p)["seq"] for p in event_payloads(parsed, None, 0)] == [7, 9]


def test_restamping_shifts_every_time_by_one_constant() -> None:
    start = T0_MS + 86_400_000 * 300
    shift = restamp_shift_ms(T0_MS, start, restamp=True)
    assert restamp_shift_ms(T0_MS, start, restamp=False) == 0
    parsed = parse_chunk(_readings(device_id=["a", "a"]), ColumnMapping(), None)
    times = [orjson.loads(p)["event_time"] for p in event_payloads(parsed, [1, 2], shift)]
    first = dt.datetime.fromisoformat(times[0])
    assert int(first.timestamp() * 1000) == start
    assert dt.datetime.fromisoformat(times[1]) - first == dt.timedelta(seconds=1)


def test_restamped_times_lead_the_clock_when_replayed_faster() -> None:
    hour = 3600_000
    assert restamp_lead_s(T0_MS, T0_MS + hour, 1.0) == 0
    assert restamp_lead_s(T0_MS, T0_MS + hour, 60.0) == pytest.approx(3600 * 59 / 60)
    assert restamp_lead_s(T0_MS, T0_MS + hour, None) == 3600


def test_records_are_due_at_their_offset_divided_by_the_speed() -> None:
    due = due_wall_ms(pa.array([T0_MS, T0_MS + 60_000, T0_MS + 3600_000]).to_numpy(), T0_MS, 1_000, 60.0)
    assert due.tolist() == [1_000, 2_000, 61_000]


def test_speed_is_a_positive_factor_or_max() -> None:
    assert parse_speed("max") is None and parse_speed("60") == 60.0 and parse_speed("0.5") == 0.5
    for bad in ("0", "-1", "fast", "inf"):
        with pytest.raises(ValueError, match="positive number or 'max'"):
            parse_speed(bad)


def test_format_comes_from_the_name_or_the_flag() -> None:
    assert file_format(Path("a.csv")) == "csv" and file_format(Path("a.csv.gz")) == "csv"
    assert file_format(Path("a.parquet")) == "parquet" and file_format(Path("a.txt"), "csv") == "csv"
    with pytest.raises(ReplayError, match="--format csv\\|parquet"):
        file_format(Path("a.txt"))


# --- registry ----------------------------------------------------------------------------------------------


def test_registry_rows_only_for_unknown_devices_with_defaults() -> None:
    seen = {
        "known": DeviceSeen(T0_MS),
        "new": DeviceSeen(T0_MS, device_type="pump", site="plant-7"),
        "bare": DeviceSeen(T0_MS + 86_400_000),
        "timeless": DeviceSeen(None),
    }
    rows = registry_rows(seen, {"known"}, shift_ms=0, today=dt.date(2030, 1, 1)).to_pylist()
    assert [tuple(row.values()) for row in rows] == [
        ("bare", "unknown", "replay", "replay", dt.date(2026, 3, 2)),
        ("new", "pump", "plant-7", "replay", dt.date(2026, 3, 1)),
        ("timeless", "unknown", "replay", "replay", dt.date(2030, 1, 1)),
    ]
    assert list(rows[0]) == ["device_id", "device_type", "site", "model", "install_date"]


# --- a whole run against a fake producer -------------------------------------------------------------------


class FakeProducer:
    """Records what was produced (and when); every send is delivered at flush."""

    def __init__(self, on_delivery) -> None:
        self.on_delivery = on_delivery
        self.sent: list[tuple[bytes | None, dict[str, Any], int]] = []
        self.reported = 0

    def produce(self, topic: str, value: bytes, key: bytes | None) -> None:
        self.sent.append((key, orjson.loads(value), now_ms()))

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        for _ in self.sent[self.reported :]:
            self.on_delivery(None, None)
        self.reported = len(self.sent)
        return 0


def _run(settings: Settings, options: ReplayOptions) -> tuple[Any, FakeProducer]:
    producers: list[FakeProducer] = []

    def factory(on_delivery) -> FakeProducer:
        producers.append(FakeProducer(on_delivery))
        return producers[0]

    return replay(settings, options, factory), producers[0]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings.from_env({}, home=tmp_path, lake=str(tmp_path / "lake"))


def test_an_unsorted_multi_chunk_file_is_published_in_time_order(settings: Settings, tmp_path: Path) -> None:
    n = 300
    order = [(i * 37) % n for i in range(n)]  # a permutation: the file is not in time order
    raw = _readings(
        device_id=[f"d{i % 3}" for i in order],
        event_time=[(T0 + dt.timedelta(seconds=i)).isoformat() for i in order],
        temperature=[str(i) if i != 5 else "hot" for i in order],
    )
    path = tmp_path / "history.csv"
    pa.csv.write_csv(raw, path)
    summary, producer = _run(settings, ReplayOptions(path, speed=None, progress=False, csv_block_bytes=2048))

    assert summary.rows == summary.sent == summary.delivered == n and not summary.in_order
    times = [event["event_time"] for _, event, _ in producer.sent]
    assert times == sorted(times) and len(set(times)) == n
    assert [event.get("temperature") for _, event, _ in producer.sent[:7]] == [0.0, 1.0, 2.0, 3.0, 4.0, "hot", 6.0]
    for device in ("d0", "d1", "d2"):
        seqs = [event["seq"] for key, event, _ in producer.sent if key == device.encode()]
        assert seqs == list(range(1, n // 3 + 1))
    assert summary.incomplete == {"unparsable:temperature": 1}
    assert summary.devices_registered == 3


def test_a_sorted_parquet_file_is_streamed_and_untimed_rows_go_last(settings: Settings, tmp_path: Path) -> None:
    times = pa.array([T0 + dt.timedelta(seconds=i) for i in range(50)], pa.timestamp("ms", tz="UTC"))
    raw = _readings(device_id=["a"] * 50).set_column(1, "event_time", times)
    raw = raw.set_column(1, "event_time", pa.array([None, *times.to_pylist()[1:]], pa.timestamp("ms", tz="UTC")))
    path = tmp_path / "history.parquet"
    pq.write_table(raw, path, row_group_size=10)
    summary, producer = _run(settings, ReplayOptions(path, speed=None, progress=False, chunk_rows=10))
    assert summary.in_order and summary.sent == 50 and summary.incomplete == {"missing:event_time": 1}
    assert "event_time" not in producer.sent[-1][1]
    assert [event.get("event_time") for _, event, _ in producer.sent[:-1]] == sorted(
        event["event_time"] for _, event, _ in producer.sent[:-1]
    )


def test_paced_replay_waits_for_each_records_due_time(settings: Settings, tmp_path: Path) -> None:
    path = tmp_path / "history.csv"
    pa.csv.write_csv(_readings(device_id=["a", "a", "a"]), path)  # one second apart
    before = now_ms()
    summary, producer = _run(settings, ReplayOptions(path, speed=10.0, progress=False))
    # Due 0, 100 and 200 ms after the replay's start, which follows `before`. Dues are anchored to the start, not
    # to the previous send: a first send delayed by a busy machine shortens the next gap, not the wait for a due.
    sent_at = [at - before for _, _, at in producer.sent]
    assert sent_at[1] >= 100 and sent_at[2] >= 200
    assert summary.elapsed_s < 2


def test_existing_registry_rows_are_never_overwritten(settings: Settings, tmp_path: Path) -> None:
    registry = settings.table_path(DEVICES)
    os.makedirs(registry)
    fleet = build_fleet(2, seed=3).registry_table()
    write_deltalake(registry, fleet)
    path = tmp_path / "history.csv"
    known = fleet.column("device_id")[0].as_py()
    pa.csv.write_csv(_readings(device_id=[known, "new-1", known], site=["x", "plant-2", "y"]), path)
    mapping = ColumnMapping(site="site")
    summary, _ = _run(settings, ReplayOptions(path, mapping=mapping, speed=None, progress=False))
    assert (summary.devices_registered, summary.devices_known) == (1, 1)
    rows = DeltaTable(registry).to_pyarrow_table().sort_by("device_id").to_pylist()
    assert rows[:2] == fleet.sort_by("device_id").to_pylist()
    assert rows[2]["device_id"] == "new-1" and rows[2]["site"] == "plant-2"


def test_cli_reports_a_missing_column_without_a_stack_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    for variable in [v for v in os.environ if v.startswith("IOTMON_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("IOTMON_HOME", str(tmp_path))
    monkeypatch.setenv("IOTMON_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # never reached: the file is checked first
    path = tmp_path / "history.csv"
    pa.csv.write_csv(
        _readings(device_id=["a"]).rename_columns(["sensor", *_readings(device_id=["a"]).column_names[1:]]), path
    )
    assert main(["replay", str(path), "--speed", "max"]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "--device-col 'device_id'" in err and "the file has: sensor, event_time" in err
    assert "Traceback" not in err


def test_cli_rejects_a_bad_speed(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["replay", "x.csv", "--speed", "fast"])
    assert "speed must be a positive number or 'max'" in capsys.readouterr().err


def test_parsed_chunks_have_the_time_in_ms() -> None:
    parsed = parse_chunk(_readings(device_id=["a"]), ColumnMapping(), None)
    assert parsed.column(TIME_MS).to_pylist() == [T0_MS]
