"""The topology's declaration: what each query reads and writes, and the guard against an earlier layout."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from ingest.landing import early_batches
from iotmon.config import ConfigError, Settings
from iotmon.lake import table_id
from iotmon.schema import (
    ALERTS,
    ANOMALIES,
    BRONZE,
    DEVICE_STATUS,
    DEVICE_WINDOWS,
    INGEST,
    LATE_ARRIVALS,
    LIVE_WINDOWS,
    QUARANTINE,
    SILVER,
    TOO_LATE_READINGS,
)
from pipeline.backfill import RESET_QUERIES
from pipeline.stream import run_stream
from pipeline.topology import (
    KAFKA,
    TOPOLOGY,
    Budget,
    downstream_of,
    lead_queries,
    moved_sources,
    node,
    outdated_checkpoints,
    queries,
    retired_checkpoints,
    trigger_at,
    trigger_of,
    triggers_line,
    upstream_of,
)


def test_one_query_reads_kafka_and_writes_the_landing_tables() -> None:
    readers = [n for n in TOPOLOGY if n.source == KAFKA]
    assert [n.name for n in readers] == [INGEST]
    assert set(node(INGEST).writes) == {BRONZE, QUARANTINE, SILVER, TOO_LATE_READINGS}
    assert node(LATE_ARRIVALS).source == TOO_LATE_READINGS  # not bronze: a reading in two hundred, not every one
    assert TOPOLOGY[0].name == INGEST  # upstream first
    assert lead_queries() == (INGEST,)  # a stream starts it first, the others after its first trigger


def test_queries_producing_a_table_include_what_is_upstream_of_it() -> None:
    assert [q.name for q in queries([SILVER])] == [INGEST, LATE_ARRIVALS]
    assert INGEST in {q.name for q in queries([DEVICE_WINDOWS])}


def test_a_draining_query_waits_for_every_query_writing_what_it_streams_from() -> None:
    assert upstream_of(INGEST) == ()
    assert upstream_of(LATE_ARRIVALS) == (INGEST,)
    # Silver has two writers: a silver reader started before the late arrivals drained would need a second batch.
    assert upstream_of(DEVICE_STATUS) == upstream_of(DEVICE_WINDOWS) == (INGEST, LATE_ARRIVALS)
    assert upstream_of(ALERTS) == (INGEST, LATE_ARRIVALS, ANOMALIES)


def test_a_backfill_resets_what_reads_silver_but_not_the_ingest_query() -> None:
    assert set(RESET_QUERIES) == {n.name for n in TOPOLOGY} - {INGEST}
    assert downstream_of(TOO_LATE_READINGS) == RESET_QUERIES  # the late arrivals' hand-off, which it empties


def test_checkpoints_of_the_retired_bronze_and_silver_queries_are_found(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    root = Path(settings.checkpoint_root)
    assert retired_checkpoints(settings) == []
    (root / "silver" / "commits").mkdir(parents=True)
    (root / "bronze" / "commits").mkdir(parents=True)
    assert retired_checkpoints(settings) == ["bronze", "silver"]
    (root / INGEST).mkdir()  # this version has run here: the old folders are left over, not resumed
    assert retired_checkpoints(settings) == []


def test_a_stream_refuses_to_start_on_checkpoints_of_retired_queries(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    (Path(settings.checkpoint_root) / "bronze" / "commits").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"replaced \(bronze\).*`iotmon reset`, which keeps Kafka's data.*--fresh"):
        run_stream(settings, threading.Event())  # before it touches Kafka or Spark


def _operator_metadata(checkpoint: Path, batch: int, *state_variables: str) -> None:
    """What Spark 4.2 writes for a transformWithState operator at a batch (``state/0/_metadata/v2/<batch>``)."""
    names = [*state_variables, "$eventTimers_keyToTimestamp"]
    properties = {"timeMode": "EventTime", "stateVariables": [{"stateName": n, "ttlEnabled": False} for n in names]}
    metadata = {"operatorInfo": {"operatorId": 0}, "operatorPropertiesJson": json.dumps(properties)}
    folder = checkpoint / "state" / "0" / "_metadata" / "v2"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(batch)).write_text("v2\n" + json.dumps(metadata))


def test_checkpoints_holding_state_of_an_earlier_version_are_found(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    checkpoint = Path(settings.checkpoint_path(DEVICE_STATUS))
    assert outdated_checkpoints(settings) == []
    _operator_metadata(checkpoint, 0, *node(DEVICE_STATUS).query.state_variables)
    assert outdated_checkpoints(settings) == []
    _operator_metadata(checkpoint, 7, "device")  # one value per device, as before the shards
    assert outdated_checkpoints(settings) == [DEVICE_STATUS]
    _operator_metadata(checkpoint, 9, "devices_of_8_shards", "timer")  # another shard count
    assert outdated_checkpoints(settings) == [DEVICE_STATUS]
    _operator_metadata(checkpoint, 12, *node(DEVICE_STATUS).query.state_variables)
    assert outdated_checkpoints(settings) == []


def test_an_ingest_checkpoint_of_an_earlier_version_is_found(tmp_path: Path) -> None:
    """Earlier versions deduplicated in the plan's state (``dropDuplicates``, before it
    ``dropDuplicatesWithinWatermark``), reading Kafka twice; the plan now keeps none and reads it once."""
    settings = Settings(home=tmp_path)
    checkpoint = Path(settings.checkpoint_path(INGEST))
    (checkpoint / "offsets").mkdir(parents=True)
    assert outdated_checkpoints(settings) == []
    for operator in ("dedupe", "dedupeWithinWatermark"):
        info = {"operatorId": 0, "operatorName": operator}
        metadata = {"operatorInfo": info, "stateStoreInfo": [{"storeName": "default", "numPartitions": 2}]}
        folder = checkpoint / "state" / "0" / "_metadata"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metadata").write_text("v1\n" + json.dumps(metadata))
        assert outdated_checkpoints(settings) == [INGEST]
    with pytest.raises(ConfigError, match=r"planned otherwise \(ingest\).*`iotmon reset`, which keeps Kafka's data"):
        run_stream(settings, threading.Event())  # before it touches Kafka or Spark


def _offsets(checkpoint: Path, batch: int, *table_ids: str) -> None:
    """What Spark 4.2 writes for a batch of a query streaming Delta tables (``offsets/<batch>``)."""
    sources = [{"sourceVersion": 1, "reservoirId": i, "reservoirVersion": 3, "index": -1} for i in table_ids]
    (checkpoint / "offsets").mkdir(parents=True, exist_ok=True)
    lines = ["v1", json.dumps({"batchWatermarkMs": 0, "conf": {}}), *map(json.dumps, sources)]
    (checkpoint / "offsets" / str(batch)).write_text("\n".join(lines))


def test_checkpoints_that_streamed_another_table_are_found(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    checkpoint = Path(settings.checkpoint_path(LATE_ARRIVALS))
    assert moved_sources(settings) == []
    write_deltalake(settings.table_path(TOO_LATE_READINGS), pa.table({"seq": pa.array([], pa.int64())}))
    handed_on = table_id(settings.table_path(TOO_LATE_READINGS))
    _offsets(checkpoint, 0, handed_on)
    assert moved_sources(settings) == []
    _offsets(checkpoint, 4, "the-id-of-bronze")  # an earlier version's late arrivals, newest
    assert moved_sources(settings) == [LATE_ARRIVALS]
    _offsets(Path(settings.checkpoint_path(DEVICE_WINDOWS)), 2, "the-id-of-silver-before-a-reset")
    assert moved_sources(settings) == [LATE_ARRIVALS, DEVICE_WINDOWS]
    _offsets(checkpoint, 5, handed_on)
    assert moved_sources(settings) == [DEVICE_WINDOWS]


def test_a_stream_refuses_to_start_on_a_checkpoint_of_another_table(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    _offsets(Path(settings.checkpoint_path(LATE_ARRIVALS)), 7, "the-id-of-bronze")
    with pytest.raises(ConfigError, match=r"streamed another table .*\(late_arrivals\).*backfill"):
        run_stream(settings, threading.Event())  # before it touches Kafka or Spark


def test_a_stream_refuses_to_start_on_state_of_an_earlier_version(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    _operator_metadata(Path(settings.checkpoint_path(DEVICE_STATUS)), 3, "device")
    with pytest.raises(ConfigError, match=r"planned otherwise \(device_status\).*backfill"):
        run_stream(settings, threading.Event())  # before it touches Kafka or Spark


def test_each_query_runs_as_often_as_its_tables_are_due() -> None:
    settings = Settings.from_env({"IOTMON_TRIGGER_INTERVAL": "1 second", "IOTMON_GOLD_TRIGGER_INTERVAL": "4 seconds"})
    trigger = trigger_of(settings)
    assert trigger(node(INGEST).query) == {"processingTime": "1 second"}
    assert trigger(node(ANOMALIES).query) == {"processingTime": "4 seconds"}
    assert trigger(node(DEVICE_WINDOWS).query) == {"processingTime": settings.final_trigger_interval}
    assert {n.budget for n in TOPOLOGY} == set(Budget)
    line = triggers_line(settings)
    assert line.startswith("ingest every 1 second; ") and "anomalies" in line and "device_windows" in line
    assert triggers_line(Settings()).startswith("ingest every 5 seconds or 10,000 records; ")


def test_the_queries_due_within_seconds_run_sooner_while_their_input_is_busy() -> None:
    settings = Settings()
    at = trigger_at(settings)
    calm, busy = {"processingTime": "15 seconds"}, {"processingTime": "5 seconds"}
    for name in (ANOMALIES, ALERTS, DEVICE_STATUS, LIVE_WINDOWS):
        assert at(node(name).query, 500.0) == calm  # the demo's rate
        assert at(node(name).query, 1_999.0) == calm
        assert at(node(name).query, 2_000.0) == busy
        assert at(node(name).query, 5_000.0) == busy  # the bench's steady state
    for name in (INGEST, LATE_ARRIVALS, DEVICE_WINDOWS):  # their budgets are not about seconds after silver
        assert at(node(name).query, 5_000.0) == trigger_of(settings)(node(name).query)
    assert "every 15 seconds (every 5 seconds from 2,000 rows/s)" in triggers_line(settings)

    # A "busy" trigger no sooner than the calm one never moves a query.
    slower = Settings.from_env({"IOTMON_BUSY_TRIGGER_INTERVAL": "15 seconds"})
    assert trigger_at(slower)(node(ANOMALIES).query, 5_000.0) == calm
    assert "from" not in triggers_line(slower).split("; ")[2]


def test_the_ingest_query_starts_a_batch_once_enough_records_wait_or_its_interval_is_up() -> None:
    settings = Settings()
    early = early_batches(trigger_of(settings)(node(INGEST).query), settings)
    assert early is not None
    assert early.trigger == {"processingTime": "1000 milliseconds"}
    # Half a poll short of the interval, so that the poll ending the interval starts the batch.
    assert early.options == {"minOffsetsPerTrigger": "10000", "maxTriggerDelay": "4500ms"}
    fewer = Settings.from_env({"IOTMON_INGEST_BATCH_RECORDS": "300", "IOTMON_TRIGGER_INTERVAL": "1 minute"})
    assert early_batches({"processingTime": fewer.trigger_interval}, fewer).options == {
        "minOffsetsPerTrigger": "300",
        "maxTriggerDelay": "59500ms",
    }
    # A trigger no longer than a poll has nothing to start sooner; available-now reads what there is.
    assert early_batches({"processingTime": "1 second"}, settings) is None
    assert early_batches({"availableNow": True}, settings) is None
