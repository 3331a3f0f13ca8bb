"""Recorded files -> ``iotmon replay`` -> the real broker (and once, the real pipeline into silver)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from pathlib import Path
from typing import Any

import deltalake
import orjson
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from confluent_kafka import Consumer, TopicPartition
from pyspark.sql import SparkSession

from iotmon.cli import main
from iotmon.config import Settings
from iotmon.kafka import client_config
from iotmon.schema import DEVICES, DEVICES_SCHEMA, LIVE_WINDOWS, METRIC_NAMES, QUARANTINE, REQUIRED_FIELDS, SILVER
from pipeline.stream import drain_until_idle
from pipeline.topology import ensure_tables
from simulators.fleet import arrow_schema
from simulators.timefmt import format_timestamp

pytestmark = pytest.mark.integration

T0 = dt.datetime(2025, 6, 1, 8, 0, 0, tzinfo=dt.UTC)
ISO_MS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")
FILE_METRICS = ("temp", "hum", "vib", "pres", "batt")


def _recording(devices: list[str], per_device: int, step_s: float, shuffle: bool) -> pa.Table:
    """Readings every ``step_s`` seconds per device, under the file's own column names."""
    rows = [
        {
            "sensor": device,
            "ts_ms": int((T0 + dt.timedelta(seconds=i * step_s + d * 0.1)).timestamp() * 1000),
            **{name: round(10 * d + i + k / 10, 3) for k, name in enumerate(FILE_METRICS)},
        }
        for i in range(per_device)
        for d, device in enumerate(devices)
    ]
    if shuffle:
        rows = rows[1::2] + rows[::2]
    return pa.Table.from_pylist(rows)


def _mapping_flags() -> list[str]:
    return [
        *("--device-col", "sensor"),
        *(
            flag
            for metric, column in zip(METRIC_NAMES, FILE_METRICS, strict=True)
            for flag in (f"--{metric}-col", column)
        ),
    ]


def _replay(settings: Settings, monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    for variable, value in settings.to_env().items():
        monkeypatch.setenv(variable, value)
    return main(["replay", "--quiet", *args])


def _consume(settings: Settings, expected: int, timeout: float = 60.0) -> list[Any]:
    """Every record of the topic, read from the start of each partition."""
    consumer = Consumer({**client_config(settings), "group.id": "replay-test", "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(settings.topic, timeout=30).topics[settings.topic].partitions
        consumer.assign([TopicPartition(settings.topic, p, 0) for p in partitions])
        records: list[Any] = []
        deadline = dt.datetime.now() + dt.timedelta(seconds=timeout)
        while len(records) < expected and dt.datetime.now() < deadline:
            for message in consumer.consume(1000, timeout=1.0):
                assert message.error() is None, message.error()
                records.append(message)
        extra = consumer.consume(100, timeout=2.0)  # nothing more than expected
        return records + [m for m in extra if m.error() is None]
    finally:
        consumer.close()


def _registry(settings: Settings, device_ids: list[str]) -> None:
    """A registry that already knows ``device_ids`` (as the simulator would have written it)."""
    rows = [
        {
            "device_id": d,
            "device_type": "pump",
            "site": "site-01",
            "model": "pump-P200",
            "install_date": dt.date(2020, 1, 1),
        }
        for d in device_ids
    ]
    path = settings.table_path(DEVICES)
    Path(path).mkdir(parents=True)
    deltalake.write_deltalake(path, pa.Table.from_pylist(rows, schema=arrow_schema(DEVICES_SCHEMA)))


def _assert_every_row_arrived_once_in_order(records: list[Any], recording: pa.Table) -> None:
    events = [orjson.loads(m.value()) for m in records]
    assert len(events) == recording.num_rows
    for message, event in zip(records, events, strict=True):
        assert list(event) == list(REQUIRED_FIELDS) and ISO_MS.match(event["event_time"]), event
        assert message.key().decode() == event["device_id"]
        assert isinstance(event["seq"], int) and all(isinstance(event[m], float) for m in METRIC_NAMES)
    # Kafka orders each partition: there, and per device, event time never goes back and seq counts up.
    for partition in {m.partition() for m in records}:
        times = [e["event_time"] for m, e in zip(records, events, strict=True) if m.partition() == partition]
        assert times == sorted(times)
    for device in set(recording.column("sensor").to_pylist()):
        mine = sorted((m.offset(), e) for m, e in zip(records, events, strict=True) if e["device_id"] == device)
        assert [e["seq"] for _, e in mine] == list(range(1, len(mine) + 1))
    # Each row once, with the values of its mapped columns.
    expected = {
        (row["sensor"], format_timestamp(row["ts_ms"])): tuple(row[c] for c in FILE_METRICS)
        for row in recording.to_pylist()
    }
    got = {(e["device_id"], e["event_time"]): tuple(e[m] for m in METRIC_NAMES) for e in events}
    assert got == expected


def test_csv_and_parquet_replays_arrive_once_in_order_and_register_missing_devices(
    isolated: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _registry(isolated, ["pump-1", "other-9"])
    recording = _recording(["pump-1", "pump-2", "fan-3"], per_device=40, step_s=2.0, shuffle=True)
    csv_path = tmp_path / "history.csv"
    pa_csv.write_csv(recording, csv_path)
    assert (
        _replay(
            isolated,
            monkeypatch,
            str(csv_path),
            "--speed",
            "max",
            "--time-col",
            "ts_ms",
            "--time-unit",
            "ms",
            *_mapping_flags(),
        )
        == 0
    )
    report = capsys.readouterr().out
    assert "120 records" in report and "delivered  120, failed 0" in report and "not in event-time order" in report
    assert "2 registered, 1 already known" in report
    _assert_every_row_arrived_once_in_order(_consume(isolated, 120), recording)

    registry = deltalake.DeltaTable(isolated.table_path(DEVICES)).to_pyarrow_table().to_pylist()
    assert sorted(r["device_id"] for r in registry) == ["fan-3", "other-9", "pump-1", "pump-2"]
    assert {r["device_id"]: r["site"] for r in registry}["pump-1"] == "site-01"  # kept as it was
    new = [r for r in registry if r["device_id"] in ("fan-3", "pump-2")]
    assert all((r["device_type"], r["site"], r["model"]) == ("unknown", "replay", "replay") for r in new)
    assert all(r["install_date"] == T0.date() for r in new)

    # A sorted Parquet file with a timestamp column and its own seq, onto a fresh topic.
    parquet = recording.sort_by("ts_ms")
    parquet = parquet.append_column(
        "when", pa.array(parquet.column("ts_ms").to_pylist(), pa.int64()).cast(pa.timestamp("ms", tz="UTC"))
    )
    parquet = parquet.append_column("n", pa.array(range(1, parquet.num_rows + 1)))
    parquet_path = tmp_path / "history.parquet"
    pq.write_table(parquet, parquet_path, row_group_size=25)
    second = dataclasses.replace(isolated, topic=isolated.topic + "-parquet")
    assert (
        _replay(
            second,
            monkeypatch,
            str(parquet_path),
            "--speed",
            "max",
            "--time-col",
            "when",
            "--seq-col",
            "n",
            *_mapping_flags(),
        )
        == 0
    )
    assert "0 registered, 3 already known" in capsys.readouterr().out
    records = _consume(second, 120)
    assert sorted(orjson.loads(m.value())["seq"] for m in records) == list(range(1, 121))
    assert deltalake.DeltaTable(isolated.table_path(DEVICES)).to_pyarrow_table().num_rows == 4


def test_a_restamped_replay_reaches_silver_with_every_reading(
    isolated: Settings, spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recording = _recording(["m-1", "m-2"], per_device=30, step_s=1.0, shuffle=False)
    rows = recording.to_pylist()
    rows.append({**rows[-1], "temp": None})  # incomplete: published, quarantined by bronze with the reason
    path = tmp_path / "history.csv"
    pa_csv.write_csv(pa.Table.from_pylist(rows), path)
    flags = ("--speed", "max", "--restamp", "--time-col", "ts_ms", "--time-unit", "ms", *_mapping_flags())
    assert _replay(isolated, monkeypatch, str(path), *flags) == 0

    # The stages the assertions need, not the whole pipeline: archive, silver, live windows.
    ensure_tables(spark, isolated)
    drain_until_idle(spark, isolated, [SILVER, LIVE_WINDOWS])
    silver = spark.read.format("delta").load(isolated.table_path(SILVER))
    assert silver.count() == 60 and silver.select("device_id", "seq").distinct().count() == 60
    assert {r.lateness for r in silver.select("lateness").distinct().collect()} == {"on_time"}
    assert {r.site for r in silver.select("site").distinct().collect()} == {"replay"}
    # Restamped to now, the readings count in the live windows of the dashboards.
    live = spark.read.format("delta").load(isolated.table_path(LIVE_WINDOWS))
    assert {r.device_id for r in live.select("device_id").distinct().collect()} == {"m-1", "m-2"}
    reasons = [r.reason for r in spark.read.format("delta").load(isolated.table_path(QUARANTINE)).collect()]
    assert reasons == ["missing_field:temperature"]
