"""The progress recorder on real queries: every batch lands once in ``query_progress``, readable by delta-rs,
and ``iotmon status`` reports the query and the lake."""

from __future__ import annotations

import dataclasses
import itertools
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQueryListener

from iotmon.cli import main
from iotmon.config import Settings
from iotmon.kafka import ensure_topic, make_producer, newest_event_time, spark_kafka_options
from iotmon.ops import install_progress_recorder, read_run_file, run_file_path
from iotmon.queries import JsonEventListener
from iotmon.schema import QUERY_PROGRESS
from iotmon.status import table_status
from tests.support import wait_for

pytestmark = pytest.mark.integration

QUERY = "ops_windows"
START = datetime(2026, 11, 22, 1, 0, tzinfo=UTC)


def _use_settings(monkeypatch: pytest.MonkeyPatch, settings: Settings) -> None:
    """Make ``iotmon.cli.main`` see ``settings`` exactly as a child process started with them would."""
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)


def _status(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["status", *args])
    return code, capsys.readouterr().out


def _append_readings(spark: SparkSession, path: str, minutes: list[float]) -> None:
    rows = [(f"dev-{i % 2}", START + timedelta(minutes=m), float(i)) for i, m in enumerate(minutes)]
    spark.createDataFrame(rows, "device_id string, event_time timestamp, value double").write.format("delta").mode(
        "append"
    ).save(path)


def _windows(readings: DataFrame) -> DataFrame:
    """A stateful query with everything a progress row has a column for: watermark, state, observed metrics."""
    return (
        readings.observe("quality", F.count(F.lit(1)).alias("rows"), F.max("value").alias("max_value"))
        .withWatermark("event_time", "1 minute")
        .groupBy(F.window("event_time", "1 minute"), "device_id")
        .agg(F.count("*").alias("readings"))
    )


def _normalised(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """PySpark returns naive local-time datetimes, delta-rs aware UTC ones: compare them as instants."""
    for row in rows:
        for key, value in row.items():
            if isinstance(value, datetime):
                row[key] = value.astimezone(UTC)
    return sorted(rows, key=lambda row: (row["run_id"], row["batch_id"]))


class _Events:
    """What a listener saw, as plain values: each event's kind, query and content."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def onQueryStarted(self, event: Any) -> None:
        self.seen.append(("started", (event.name, str(event.id), str(event.runId))))

    def onQueryProgress(self, event: Any) -> None:
        self.seen.append(("progress", json.loads(event.progress.json)))

    def onQueryIdle(self, event: Any) -> None:
        self.seen.append(("idle", str(event.runId)))

    def onQueryTerminated(self, event: Any) -> None:
        self.seen.append(("terminated", (str(event.runId), event.exception)))


class _FromJson(_Events, JsonEventListener):
    pass


class _PySparks(_Events, StreamingQueryListener):
    pass


def test_a_json_event_listener_sees_what_pyspark_s_own_adapter_sees(spark: SparkSession, tmp_path: Path) -> None:
    """The recorder's and the bench's listeners read each event from its JSON (one py4j call), not field by
    field: they must get the same events, with the same progress, as a listener on PySpark's adapter, but for
    the input rate, which is over the time since the run's previous batch (Spark's is since its last trigger)."""
    source = str(tmp_path / "readings")
    _append_readings(spark, source, [0, 0.2, 3, 1.0, 6])
    from_json, pysparks = _FromJson(), _PySparks()
    for listener in (from_json, pysparks):
        spark.streams.addListener(listener)
    try:
        query = (
            _windows(spark.readStream.format("delta").option("maxFilesPerTrigger", 1).load(source))
            .writeStream.format("noop")
            .queryName("ops_json_events")
            .outputMode("append")
            .option("checkpointLocation", str(tmp_path / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        assert query.awaitTermination(120)
        ended = (from_json, pysparks)
        wait_for(lambda: all(e.seen and e.seen[-1][0] == "terminated" for e in ended), 60, "both listeners' last event")
    finally:
        for listener in (from_json, pysparks):
            spark.streams.removeListener(listener)

    progress = [content for kind, content in from_json.seen if kind == "progress"]
    sparks = [content for kind, content in pysparks.seen if kind == "progress"]
    assert len(progress) == len(sparks) >= 2
    assert progress[0]["inputRowsPerSecond"] == sparks[0]["inputRowsPerSecond"]  # no batch before it
    for before, report in itertools.pairwise(progress):
        started, previous = (datetime.fromisoformat(r["timestamp"]) for r in (report, before))
        seconds = (started - previous).total_seconds()
        assert report["inputRowsPerSecond"] == pytest.approx(report["numInputRows"] / seconds)

    def without_rate(seen: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return [(kind, {**c, "inputRowsPerSecond": None} if kind == "progress" else c) for kind, c in seen]

    assert without_rate(from_json.seen) == without_rate(pysparks.seen)
    assert [p["batchId"] for p in progress] == [p["batchId"] for p in query.recentProgress]
    assert sum(p["observedMetrics"]["quality"]["rows"] for p in progress if "observedMetrics" in p) == 5
    assert all(p["stateOperators"] for p in progress)
    assert from_json.seen[0] == ("started", ("ops_json_events", str(query.id), str(query.runId)))


def test_every_batch_of_a_stateful_query_is_recorded_once(
    spark: SparkSession,
    base_settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    settings = dataclasses.replace(
        base_settings, home=tmp_path, lake=str(tmp_path / "lake"), checkpoints=str(tmp_path / "checkpoints")
    )
    _use_settings(monkeypatch, settings)
    source, sink = str(tmp_path / "readings"), settings.table_path("device_windows")
    _append_readings(spark, source, [0, 0.2, 0.5])

    recorder = install_progress_recorder(spark, settings, flush_every=0.5)
    query = None
    try:
        query = (
            _windows(spark.readStream.format("delta").load(source))
            .writeStream.format("delta")
            .queryName(QUERY)
            .outputMode("append")
            .option("checkpointLocation", settings.checkpoint_path(QUERY))
            .start(sink)
        )
        query.processAllAvailable()
        _append_readings(spark, source, [3, 3.5])
        query.processAllAvailable()
        _append_readings(spark, source, [1.0, 6])  # 01:01 is behind the watermark (01:02:30) by now: dropped
        query.processAllAvailable()
        # The watermark moved to 01:05, so Spark runs one more (no-data) batch to emit the closed windows.
        final_watermark = "2026-11-22T01:05:00.000Z"
        wait_for(lambda: query.lastProgress["eventTime"].get("watermark") == final_watermark, 60, "the last batch")
        wait_for(lambda: recorder.last_batch(QUERY) is not None, 60, "the first progress event to arrive")

        code, out = _status(capsys)
        assert code == 0, out
        assert "stream: running" in out and "queries (from the run file):" in out
        assert any(line.split()[:2] == [QUERY, "active"] for line in out.splitlines()), out
    finally:
        if query is not None:
            query.stop()
        recorder.close()

    batches = sorted(progress["batchId"] for progress in query.recentProgress)
    assert len(batches) >= 3
    table = settings.table_path(QUERY_PROGRESS)
    seen_by_spark = [row.asDict() for row in spark.read.format("delta").load(table).collect()]
    assert sorted(row["batch_id"] for row in seen_by_spark if row["query_name"] == QUERY) == batches
    seen_by_delta_rs = DeltaTable(table).to_pyarrow_table().to_pylist()
    assert _normalised(seen_by_delta_rs) == _normalised(seen_by_spark)

    rows = {row["batch_id"]: row for row in seen_by_spark}
    assert all(row["state_rows"] is not None and row["kafka_lag"] is None for row in rows.values())
    assert rows[batches[0]]["watermark"] is None, "no watermark before the first event"
    assert rows[batches[-1]]["watermark"].astimezone(UTC) == START + timedelta(minutes=5)  # 01:06 - 1 minute
    assert rows[batches[-1]]["event_time_max"] is None, "a no-data batch sees no event time"
    assert sum(row["rows_dropped_by_watermark"] for row in rows.values()) == 1
    observed = [json.loads(row["observed_metrics"])["quality"] for row in rows.values() if row["observed_metrics"]]
    assert sum(metrics["rows"] for metrics in observed) == 7
    assert all(json.loads(row["progress_json"])["batchId"] == batch for batch, row in rows.items())

    document = read_run_file(run_file_path(settings))
    assert document["stopped_at"] is not None
    entry = document["queries"][QUERY]
    assert entry["active"] is False and entry["id"] == str(query.id) and entry["last_exception"] is None
    assert entry["last_progress"]["batch_id"] == batches[-1]

    code, out = _status(capsys)
    assert code == 3, out
    assert "stream: not running" in out and "queries (from the query_progress table):" in out
    assert any(line.split()[:3] == [QUERY, "stopped", "batch"] for line in out.splitlines()), out
    assert "watermark 2026-11-22 01:05:00 UTC" in out
    counts = {t["name"]: t for t in json.loads(_status(capsys, "--json")[1])["tables"]}
    assert counts[QUERY_PROGRESS]["rows"] == len(seen_by_spark)
    assert counts["device_windows"]["rows"] == spark.read.format("delta").load(sink).count() > 0
    assert counts["bronze"]["exists"] is False


def test_kafka_lag_is_recorded_until_the_topic_is_drained(
    isolated: Settings, spark: SparkSession, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    ensure_topic(isolated)
    producer = make_producer(isolated)
    for i in range(200):
        producer.produce(isolated.topic, key=f"dev-{i % 7}", value=b"{}")
    assert producer.flush(30) == 0

    recorder = install_progress_recorder(spark, isolated, flush_every=0.5)
    try:
        query = (
            spark.readStream.format("kafka")
            .options(**spark_kafka_options(isolated))
            .option("subscribe", isolated.topic)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", 80)
            .load()
            .writeStream.format("noop")
            .queryName("ops_kafka")
            .option("checkpointLocation", isolated.checkpoint_path("ops_kafka"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination(120)
    finally:
        recorder.close()

    rows = spark.read.format("delta").load(isolated.table_path(QUERY_PROGRESS)).orderBy("batch_id").collect()
    assert [row.batch_id for row in rows] == sorted(p["batchId"] for p in query.recentProgress)
    assert sum(row.input_rows for row in rows) == 200 and len(rows) >= 3
    lags = [row.kafka_lag for row in rows]
    assert lags[0] == 200 - rows[0].input_rows and lags[-1] == 0, lags
    assert all(row.state_rows is None and row.watermark is None for row in rows)
    assert json.loads(rows[0].progress_json)["sources"][0]["description"].startswith("KafkaV2[Subscribe[")

    _use_settings(monkeypatch, isolated)
    code, out = _status(capsys)
    assert code == 3 and "kafka behind 0" in out, out


def test_status_counts_rows_deleted_by_deletion_vectors(spark: SparkSession, tmp_path: Path) -> None:
    """Spark's DELETE on a table with deletion vectors leaves the files and their num_records as they were."""
    path = str(tmp_path / "devices")
    spark.range(10).write.format("delta").option("delta.enableDeletionVectors", "true").save(path)
    spark.sql(f"DELETE FROM delta.`{path}` WHERE id < 3")
    assert DeltaTable(path).deletion_vectors().read_all().num_rows > 0, "the DELETE wrote a deletion vector"
    table = table_status("devices", path)
    assert (table.rows, table.counted_from, table.error) == (7, "file stats", None)


def test_status_sets_each_table_against_the_newest_event_in_kafka(
    isolated: Settings, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    ensure_topic(isolated)
    newest = datetime(2026, 11, 25, 14, 0, 30, 250000, tzinfo=UTC)
    producer = make_producer(isolated)
    # More records than status reads at the end of each partition; the newest reading is not the last one
    # sent, and malformed records are mixed in: unreadable ones, and readings whose event time the archive
    # quarantines as absurd (centuries ahead, or before any sensor ran).
    ages = [*range(60, 3, -1), 0, 3, 2, 1]
    for i, age in enumerate(ages):
        moment = newest - timedelta(seconds=age)
        producer.produce(isolated.topic, key=f"dev-{i % 5}", value=json.dumps({"event_time": moment.isoformat()}))
        producer.produce(isolated.topic, key=f"dev-{i % 5}", value=b"not json")
    for absurd in ("2999-11-25T14:00:30Z", "1970-01-01T00:00:00Z"):
        for device in range(5):
            producer.produce(isolated.topic, key=f"dev-{device}", value=json.dumps({"event_time": absurd}))
    assert producer.flush(30) == 0
    assert newest_event_time(isolated) == newest
    times = pa.array([newest - timedelta(seconds=12)], pa.timestamp("us", "UTC"))
    write_deltalake(isolated.table_path("silver"), pa.table({"event_time": times}))

    _use_settings(monkeypatch, isolated)
    _, out = _status(capsys, "--json")
    silver = next(t for t in json.loads(out)["tables"] if t["name"] == "silver")
    assert silver["behind_kafka_s"] == 12.0, silver
