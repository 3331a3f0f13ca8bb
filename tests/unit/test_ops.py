"""Progress reports become exact ``query_progress`` rows; the run file and ``iotmon status`` tell the truth.

The fixtures are progress JSON as Spark 4.2 writes it (``StreamingQueryProgress.json``): the stateful one
was recorded from a real windowed aggregation (RocksDB custom metrics trimmed), the others follow the same
format for a Kafka source and for a foreachBatch sink with ``observe``.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql.streaming.listener import QueryProgressEvent, QueryStartedEvent, QueryTerminatedEvent
from pyspark.sql.types import DoubleType, LongType, StringType, TimestampType

from iotmon.config import Settings
from iotmon.ops import ProgressRecorder, RunFile, kafka_lag, progress_row, read_run_file, run_file_path
from iotmon.schema import BRONZE, LAKE_TABLES, QUERY_PROGRESS, QUERY_PROGRESS_SCHEMA
from iotmon.status import EXIT_NOT_RUNNING, report

KAFKA_PROGRESS: dict[str, Any] = {
    "id": "5b1a3c1e-9f3e-4f7a-8d7c-0a4b8e1f2c3d",
    "runId": "e2d4f6a8-1b3c-4d5e-8f70-9a1b2c3d4e5f",
    "name": "bronze",
    "timestamp": "2026-11-22T03:30:05.001Z",
    "batchId": 42,
    "batchDuration": 1830,
    "numInputRows": 4000,
    "inputRowsPerSecond": 800.0,
    "processedRowsPerSecond": 2185.792349726776,
    "durationMs": {
        "addBatch": 1512,
        "commitOffsets": 61,
        "getBatch": 0,
        "latestOffset": 14,
        "queryPlanning": 88,
        "triggerExecution": 1830,
        "walCommit": 104,
    },
    "stateOperators": [],
    "sources": [
        {
            "description": "KafkaV2[Subscribe[iotmon.readings]]",
            "startOffset": {"iotmon.readings": {"2": 10000, "1": 10000, "3": 10000, "0": 10000}},
            "endOffset": {"iotmon.readings": {"2": 11000, "1": 11000, "3": 11000, "0": 11000}},
            "latestOffset": {"iotmon.readings": {"2": 11250, "1": 11000, "3": 11400, "0": 11050}},
            "numInputRows": 4000,
            "inputRowsPerSecond": 800.0,
            "processedRowsPerSecond": 2185.792349726776,
            "metrics": {
                "avgOffsetsBehindLatest": "175.0",
                "maxOffsetsBehindLatest": "400",
                "minOffsetsBehindLatest": "0",
            },
        }
    ],
    "sink": {"description": "DeltaSink[file:/srv/iotmon/lake/bronze]", "numOutputRows": -1},
}

STATEFUL_PROGRESS: dict[str, Any] = {
    "id": "2ac0f095-f084-47a5-9e89-44a536a1214d",
    "runId": "f1897aab-8d1e-475e-8798-8b47189664bd",
    "name": "device_windows",
    "timestamp": "2026-11-22T03:28:15.050Z",
    "batchId": 4,
    "batchDuration": 5791,
    "numInputRows": 2,
    "inputRowsPerSecond": 28.6,
    "processedRowsPerSecond": 0.3,
    "durationMs": {
        "addBatch": 5062,
        "commitOffsets": 76,
        "getBatch": 13,
        "latestOffset": 173,
        "queryPlanning": 217,
        "triggerExecution": 5790,
        "walCommit": 172,
    },
    "eventTime": {
        "avg": "2026-11-22T01:03:30.000Z",
        "max": "2026-11-22T01:06:00.000Z",
        "min": "2026-11-22T01:01:00.000Z",
        "watermark": "2026-11-22T01:02:00.000Z",
    },
    "stateOperators": [
        {
            "operatorName": "stateStoreSave",
            "numRowsTotal": 2,
            "numRowsUpdated": 1,
            "allUpdatesTimeMs": 13,
            "numRowsRemoved": 0,
            "allRemovalsTimeMs": 71,
            "commitTimeMs": 200,
            "memoryUsedBytes": 4272,
            "numRowsDroppedByWatermark": 1,
            "numShufflePartitions": 2,
            "numStateStoreInstances": 2,
            "customMetrics": {"rocksdbGetCount": 3, "rocksdbPutCount": 1, "rocksdbSstFileSize": 0},
        },
        {
            "operatorName": "dedupeWithinWatermark",
            "numRowsTotal": 5,
            "numRowsUpdated": 2,
            "allUpdatesTimeMs": 4,
            "numRowsRemoved": 0,
            "allRemovalsTimeMs": 0,
            "commitTimeMs": 150,
            "memoryUsedBytes": 1000,
            "numRowsDroppedByWatermark": 2,
            "numShufflePartitions": 2,
            "numStateStoreInstances": 2,
            "customMetrics": {},
        },
    ],
    "sources": [
        {
            "description": "DeltaSource[file:/srv/iotmon/lake/silver]",
            "startOffset": {
                "sourceVersion": 1,
                "reservoirId": "875b959b-a297-4fa5-b322-af254df1396e",
                "reservoirVersion": 2,
                "index": -1,
                "isStartingVersion": False,
            },
            "endOffset": {
                "sourceVersion": 1,
                "reservoirId": "875b959b-a297-4fa5-b322-af254df1396e",
                "reservoirVersion": 3,
                "index": -1,
                "isStartingVersion": False,
            },
            "latestOffset": None,
            "numInputRows": 2,
            "inputRowsPerSecond": 28.6,
            "processedRowsPerSecond": 0.3,
        }
    ],
    "sink": {"description": "DeltaSink[/srv/iotmon/lake/device_windows]", "numOutputRows": -1},
}

OBSERVED_PROGRESS: dict[str, Any] = {
    "id": "9d3f0c55-3e0b-4a43-bb5e-5d4f1e6a7b80",
    "runId": "0c6e2b1f-7a8d-4c9e-9f0a-1b2c3d4e5f60",
    "name": "quarantine",
    "timestamp": "2026-11-22T03:31:00.250Z",
    "batchId": 7,
    "batchDuration": 912,
    "numInputRows": 4000,
    "inputRowsPerSecond": 333.305557870177,
    "processedRowsPerSecond": 4385.964912280701,
    "durationMs": {"addBatch": 700, "getBatch": 5, "latestOffset": 31, "triggerExecution": 912, "walCommit": 80},
    "stateOperators": [],
    "sources": [
        {
            "description": "DeltaSource[file:/srv/iotmon/lake/bronze]",
            "startOffset": {
                "sourceVersion": 1,
                "reservoirId": "1c8f3b9a-2d4e-4f60-8a1b-3c5d7e9f0a2b",
                "reservoirVersion": 41,
                "index": -1,
                "isStartingVersion": False,
            },
            "endOffset": {
                "sourceVersion": 1,
                "reservoirId": "1c8f3b9a-2d4e-4f60-8a1b-3c5d7e9f0a2b",
                "reservoirVersion": 42,
                "index": -1,
                "isStartingVersion": False,
            },
            "latestOffset": None,
            "numInputRows": 4000,
            "inputRowsPerSecond": 333.305557870177,
            "processedRowsPerSecond": 4385.964912280701,
        }
    ],
    "sink": {"description": "ForeachBatchSink", "numOutputRows": -1},
    "observedMetrics": {"quality": {"rows": 4000, "malformed": 21, "max_delay_s": 12.5}},
}


def _compact(progress: dict[str, Any]) -> str:
    return json.dumps(progress, separators=(",", ":"))


def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# --- progress_row ------------------------------------------------------------------------------------------


def test_a_kafka_query_row_has_its_lag_and_no_state() -> None:
    assert progress_row(KAFKA_PROGRESS) == {
        "query_name": "bronze",
        "query_id": "5b1a3c1e-9f3e-4f7a-8d7c-0a4b8e1f2c3d",
        "run_id": "e2d4f6a8-1b3c-4d5e-8f70-9a1b2c3d4e5f",
        "batch_id": 42,
        "timestamp": _utc("2026-11-22T03:30:05.001"),
        "input_rows": 4000,
        "input_rows_per_second": 800.0,
        "processed_rows_per_second": 2185.792349726776,
        "batch_duration_ms": 1830,
        "watermark": None,
        "event_time_max": None,
        "state_rows": None,
        "state_memory_bytes": None,
        "rows_dropped_by_watermark": None,
        "kafka_lag": 250 + 0 + 400 + 50,
        "observed_metrics": None,
        "sink_description": "DeltaSink[file:/srv/iotmon/lake/bronze]",
        "progress_json": _compact(KAFKA_PROGRESS),
    }


def test_a_stateful_query_row_sums_its_state_operators() -> None:
    assert progress_row(STATEFUL_PROGRESS) == {
        "query_name": "device_windows",
        "query_id": "2ac0f095-f084-47a5-9e89-44a536a1214d",
        "run_id": "f1897aab-8d1e-475e-8798-8b47189664bd",
        "batch_id": 4,
        "timestamp": _utc("2026-11-22T03:28:15.050"),
        "input_rows": 2,
        "input_rows_per_second": 28.6,
        "processed_rows_per_second": 0.3,
        "batch_duration_ms": 5791,
        "watermark": _utc("2026-11-22T01:02:00"),
        "event_time_max": _utc("2026-11-22T01:06:00"),
        "state_rows": 7,
        "state_memory_bytes": 5272,
        "rows_dropped_by_watermark": 3,
        "kafka_lag": None,
        "observed_metrics": None,
        "sink_description": "DeltaSink[/srv/iotmon/lake/device_windows]",
        "progress_json": _compact(STATEFUL_PROGRESS),
    }


def test_observed_metrics_are_kept_as_json() -> None:
    assert progress_row(OBSERVED_PROGRESS) == {
        "query_name": "quarantine",
        "query_id": "9d3f0c55-3e0b-4a43-bb5e-5d4f1e6a7b80",
        "run_id": "0c6e2b1f-7a8d-4c9e-9f0a-1b2c3d4e5f60",
        "batch_id": 7,
        "timestamp": _utc("2026-11-22T03:31:00.250"),
        "input_rows": 4000,
        "input_rows_per_second": 333.305557870177,
        "processed_rows_per_second": 4385.964912280701,
        "batch_duration_ms": 912,
        "watermark": None,
        "event_time_max": None,
        "state_rows": None,
        "state_memory_bytes": None,
        "rows_dropped_by_watermark": None,
        "kafka_lag": None,
        "observed_metrics": '{"quality":{"rows":4000,"malformed":21,"max_delay_s":12.5}}',
        "sink_description": "ForeachBatchSink",
        "progress_json": _compact(OBSERVED_PROGRESS),
    }


def test_a_watermark_not_yet_set_is_null_not_1970() -> None:
    progress = {**STATEFUL_PROGRESS, "eventTime": {"watermark": "1970-01-01T00:00:00.000Z"}}
    row = progress_row(progress)
    assert row["watermark"] is None and row["event_time_max"] is None


def test_kafka_lag_also_reads_offsets_given_as_json_strings() -> None:
    """PySpark's ``StreamingQueryProgress`` objects carry offsets as JSON text, ``progress.json`` as objects."""
    source = KAFKA_PROGRESS["sources"][0]
    as_text = {**source, **{key: json.dumps(source[key]) for key in ("startOffset", "endOffset", "latestOffset")}}
    assert kafka_lag([as_text]) == kafka_lag([source]) == 700
    assert kafka_lag([{**source, "latestOffset": None}]) is None
    assert kafka_lag(STATEFUL_PROGRESS["sources"]) is None


# --- run file and listener ---------------------------------------------------------------------------------


def test_the_run_file_follows_a_query_from_start_to_failure(tmp_path: Path) -> None:
    path = tmp_path / "run" / "stream.json"
    run = RunFile(path)
    run.started("bronze", "q1", "r1")
    run.write()
    assert read_run_file(path)["queries"]["bronze"] == {
        "id": "q1",
        "run_id": "r1",
        "active": True,
        "last_progress": None,
        "last_exception": None,
    }
    row = progress_row(STATEFUL_PROGRESS)
    run.progressed("device_windows", row)
    run.terminated("device_windows", row["query_id"], row["run_id"], "java.lang.OutOfMemoryError: Java heap space")
    run.write()
    document = read_run_file(path)
    assert document["pid"] == os.getpid() and document["stopped_at"] is None
    assert document["queries"]["device_windows"] == {
        "id": "2ac0f095-f084-47a5-9e89-44a536a1214d",
        "run_id": "f1897aab-8d1e-475e-8798-8b47189664bd",
        "active": False,
        "last_progress": {
            "batch_id": 4,
            "timestamp": "2026-11-22T03:28:15.050000+00:00",
            "input_rows": 2,
            "input_rows_per_second": 28.6,
            "processed_rows_per_second": 0.3,
            "batch_duration_ms": 5791,
            "watermark": "2026-11-22T01:02:00+00:00",
            "state_rows": 7,
            "kafka_lag": None,
        },
        "last_exception": "java.lang.OutOfMemoryError: Java heap space",
    }
    run.stopped()
    run.write()
    document = read_run_file(path)
    assert document["stopped_at"] and not any(q["active"] for q in document["queries"].values())
    assert [p.name for p in path.parent.iterdir()] == ["stream.json"], "no temporary file left behind"


def _recorder(tmp_path: Path, session: Any = None, out: io.StringIO | None = None) -> ProgressRecorder:
    return ProgressRecorder(session or mock.MagicMock(), Settings(home=tmp_path), flush_every=3600, out=out)


def test_listener_events_update_the_run_file_and_name_a_failure(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    query_id, run_id = uuid.UUID(KAFKA_PROGRESS["id"]), uuid.UUID(KAFKA_PROGRESS["runId"])
    recorder.onQueryStarted(QueryStartedEvent(query_id, run_id, "bronze", "2026-11-22T03:30:00.000Z", set()))
    recorder.onQueryProgress(QueryProgressEvent.fromJson({"progress": KAFKA_PROGRESS}))
    failure = "[STREAM_FAILED] Query [id = ..., runId = ...] terminated with exception: boom\n\tat org.apache..."
    recorder.onQueryTerminated(QueryTerminatedEvent(query_id, run_id, failure, "STREAM_FAILED"))
    entry = read_run_file(run_file_path(Settings(home=tmp_path)))["queries"]["bronze"]
    assert entry["active"] is False and entry["last_progress"]["kafka_lag"] == 700
    assert entry["last_exception"] == "[STREAM_FAILED] Query [id = ..., runId = ...] terminated with exception: boom"
    assert recorder.last_batch("bronze") == 42


def test_a_failed_flush_is_reported_and_retried_as_the_same_transaction(tmp_path: Path) -> None:
    session, out = mock.MagicMock(), io.StringIO()
    recorder = _recorder(tmp_path, session, out)
    recorder.onQueryProgress(QueryProgressEvent.fromJson({"progress": KAFKA_PROGRESS}))
    with mock.patch("iotmon.ops.append_once", side_effect=RuntimeError("disk full")) as failing:
        assert recorder.flush() is False
    assert "could not append 1 rows" in out.getvalue() and "disk full" in out.getvalue()
    recorder.onQueryProgress(QueryProgressEvent.fromJson({"progress": STATEFUL_PROGRESS}))
    with mock.patch("iotmon.ops.append_once") as append:
        assert recorder.flush() is True
    sequences = [call.args[3] for call in append.call_args_list]
    assert sequences == [0, 1], "the failed batch is retried as transaction 0, the new row goes into 1"
    tables = [call.args[0] for call in [*failing.call_args_list, *append.call_args_list]]
    assert [table.column("batch_id").to_pylist() for table in tables] == [[42], [42], [4]]
    assert all(call.args[4] is session for call in append.call_args_list), "the ledger reads through the session"
    expected = progress_row(KAFKA_PROGRESS)
    written = tables[0].to_pylist()[0]
    assert written.keys() == {f.name for f in QUERY_PROGRESS_SCHEMA.fields}
    assert written == {name: expected[name] for name in written}


# --- status ------------------------------------------------------------------------------------------------

_ARROW_TYPES = {
    StringType(): pa.string(),
    LongType(): pa.int64(),
    DoubleType(): pa.float64(),
    TimestampType(): pa.timestamp("us", tz="UTC"),
}


def _write_progress_rows(settings: Settings, progress: list[dict[str, Any]]) -> None:
    """``query_progress`` as delta-rs writes it: status must read it whoever the writer was."""
    schema = pa.schema([(f.name, _ARROW_TYPES[f.dataType]) for f in QUERY_PROGRESS_SCHEMA.fields])
    write_deltalake(
        settings.table_path(QUERY_PROGRESS), pa.Table.from_pylist([progress_row(p) for p in progress], schema)
    )


@pytest.fixture(autouse=True)
def no_kafka(monkeypatch: pytest.MonkeyPatch) -> None:
    """Status asks Kafka for its newest event; these tests have no broker (tests/integration/test_ops.py does)."""
    monkeypatch.setattr("iotmon.status.kafka_newest_event", lambda settings: None)


def _status(settings: Settings, as_json: bool = False) -> tuple[int, str]:
    out = io.StringIO()
    return report(settings, as_json, out), out.getvalue()


def test_status_of_an_empty_lake(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    code, text = _status(settings)
    assert code == EXIT_NOT_RUNNING
    assert f"stream: not running (no run file at {run_file_path(settings)})" in text
    assert "queries: none recorded yet" in text
    assert all(f"{table} " in text for table in LAKE_TABLES) and text.count("not created yet") == len(LAKE_TABLES)
    code, text = _status(settings, as_json=True)
    document = json.loads(text)
    assert code == EXIT_NOT_RUNNING and document["running"] is False and document["queries"] == []
    assert [(t["name"], t["exists"], t["rows"]) for t in document["tables"]] == [(t, False, None) for t in LAKE_TABLES]


def _strip_stats(table_path: str) -> None:
    """Rewrite a Delta log without file statistics, as old or foreign writers leave it."""
    for commit in Path(table_path, "_delta_log").glob("*.json"):
        actions = [json.loads(line) for line in commit.read_text().splitlines()]
        for action in actions:
            action.get("add", {}).pop("stats", None)
        commit.write_text("".join(json.dumps(action) + "\n" for action in actions))


def test_status_counts_rows_from_file_statistics_or_a_scan(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    bronze = settings.table_path(BRONZE)
    write_deltalake(bronze, pa.table({"device_id": ["a", "b", "c"]}))
    write_deltalake(bronze, pa.table({"device_id": ["d", "e"]}), mode="append")
    write_deltalake(settings.table_path("devices"), pa.table({"device_id": ["a", "b"]}))
    _strip_stats(settings.table_path("devices"))
    assert (
        DeltaTable(settings.table_path("devices")).get_add_actions(flatten=True).column("num_records")[0].is_valid
        is False
    )

    code, text = _status(settings, as_json=True)
    tables = {t["name"]: t for t in json.loads(text)["tables"]}
    assert code == EXIT_NOT_RUNNING
    assert (tables[BRONZE]["rows"], tables[BRONZE]["counted_from"], tables[BRONZE]["version"]) == (5, "file stats", 1)
    assert (tables["devices"]["rows"], tables["devices"]["counted_from"]) == (2, "scan")
    assert tables[BRONZE]["last_commit"].startswith(datetime.now(UTC).strftime("%Y-%m-%d"))
    assert not tables["silver"]["exists"]
    _, text = _status(settings)
    assert any(line.split()[:3] == [BRONZE, "5", "rows"] for line in text.splitlines())


def test_status_after_a_crash_shows_the_tables_last_progress_and_the_run_files_error(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    earlier = {**KAFKA_PROGRESS, "batchId": 41, "timestamp": "2026-11-22T03:30:00.000Z"}
    _write_progress_rows(settings, [earlier, KAFKA_PROGRESS, STATEFUL_PROGRESS])
    run = RunFile(run_file_path(settings))
    run.document["pid"] = 2**22 + 1  # beyond pid_max: a process that is gone (SIGKILLed, no clean stop)
    run.terminated("bronze", KAFKA_PROGRESS["id"], KAFKA_PROGRESS["runId"], "kafka.UnknownTopicOrPartition")
    run.write()

    code, text = _status(settings, as_json=True)
    document = json.loads(text)
    assert code == EXIT_NOT_RUNNING and document["queries_from"] == "query_progress table"
    queries = {q["name"]: q for q in document["queries"]}
    assert sorted(queries) == ["bronze", "device_windows"]
    assert (
        queries["bronze"]["last_progress"]["batch_id"] == 42 and queries["bronze"]["last_progress"]["kafka_lag"] == 700
    )
    assert queries["bronze"]["last_exception"] == "kafka.UnknownTopicOrPartition"
    assert queries["device_windows"]["last_progress"]["watermark"] == "2026-11-22T01:02:00+00:00"
    assert queries["device_windows"]["last_progress"]["state_rows"] == 7
    _, text = _status(settings)
    assert "ended without a clean stop" in text and "last error: kafka.UnknownTopicOrPartition" in text
    assert "kafka behind 700" in text and "state rows 7" in text


def test_status_of_a_running_stream_comes_from_its_run_file(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    run = RunFile(run_file_path(settings))  # this process is alive, so "the stream" is running
    run.progressed("bronze", progress_row(KAFKA_PROGRESS))
    run.write()
    code, text = _status(settings)
    assert code == 0
    assert f"stream: running (pid {os.getpid()}" in text
    assert "queries (from the run file):" in text and "bronze" in text and "active" in text
    assert "in 800/s  done 2,186/s  took 1.83s" in text


def test_a_reused_pid_is_not_the_stream(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path)
    run = RunFile(run_file_path(settings))
    run.document["pid_start"] = (run.document["pid_start"] or 0) + 1  # same pid, a process started at another time
    run.write()
    code, text = _status(settings)
    assert code == EXIT_NOT_RUNNING and "ended without a clean stop" in text


def test_a_stream_on_another_host_is_trusted_to_its_run_file(tmp_path: Path) -> None:
    """`docker compose run ... status` shares the volume with the stream's container but not its pids."""
    settings = Settings(home=tmp_path)
    run = RunFile(run_file_path(settings))
    run.document.update(host="stream-container", pid=1)
    run.write()
    code, text = _status(settings)
    assert code == 0 and "pid 1 on host stream-container, cannot be checked from here" in text
    run.stopped()
    run.write()
    assert _status(settings)[0] == EXIT_NOT_RUNNING


def test_status_shows_how_far_each_table_is_behind_the_newest_event_in_kafka(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(home=tmp_path)
    kafka_newest = datetime(2026, 11, 25, 14, 0, 30, tzinfo=UTC)
    monkeypatch.setattr("iotmon.status.kafka_newest_event", lambda _: kafka_newest)
    times = [kafka_newest - timedelta(seconds=s) for s in (90, 45, 3)]
    write_deltalake(settings.table_path(BRONZE), pa.table({"event_time": pa.array(times, pa.timestamp("us", "UTC"))}))
    write_deltalake(settings.table_path("silver"), pa.table({"event_time": pa.array(times[:2], pa.timestamp("us"))}))
    write_deltalake(settings.table_path("devices"), pa.table({"device_id": ["a"]}))

    _, text = _status(settings, as_json=True)
    document = json.loads(text)
    tables = {t["name"]: t for t in document["tables"]}
    assert document["kafka_newest_event"] == kafka_newest.isoformat()
    assert (tables[BRONZE]["newest_event"], tables[BRONZE]["behind_kafka_s"]) == (times[2].isoformat(), 3.0)
    assert tables["silver"]["behind_kafka_s"] == 45.0  # a naive timestamp is UTC, as the session's time zone
    assert tables["devices"]["newest_event"] is None and tables["devices"]["behind_kafka_s"] is None
    _, text = _status(settings)
    assert "tables (newest event in Kafka: 2026-11-25 14:00:30 UTC):" in text
    assert "newest event 2026-11-25 13:59:45 UTC, 45.0s behind Kafka" in text
