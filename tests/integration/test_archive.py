"""Simulated fleet -> Kafka -> bronze/quarantine -> reconciliation, with the real broker, Spark and Delta."""

from __future__ import annotations

import dataclasses
import datetime as dt
import io
import json
from pathlib import Path
from typing import Any

import deltalake
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from ingest.landing import INGEST_QUERY
from ingest.silver import READING_KEY
from ingest.verify import reconcile
from iotmon.cli import main
from iotmon.config import Settings, interval_seconds
from iotmon.kafka import ensure_topic, make_producer
from iotmon.lake import planned_watermark, run_sql
from iotmon.queries import query_settings, start_query
from iotmon.schema import BRONZE, DEVICE_TYPES, DEVICES, DEVICES_SCHEMA, INGEST, QUARANTINE, SILVER
from pipeline.stream import drain_until_idle
from pipeline.topology import ensure_tables, trigger_of
from simulators.options import SimulationOptions
from simulators.publish import run_simulation
from simulators.truth import OFFSET_UNKNOWN
from tests.bad_input import iso
from tests.support import wait_for

pytestmark = pytest.mark.integration

# Which quarantine reason each injected corruption must produce.
REASON_OF_KIND = {
    "invalid_json": ("invalid_json", "invalid_utf8"),
    "missing_field": ("missing_field:",),
    "mistyped_field": ("mistyped_field:",),
    "non_finite": ("non_finite:",),
    "absurd_timestamp": ("absurd_event_time",),
    "oversized": ("oversized_payload:",),
}


def _simulate(settings: Settings, truth: Path, events: int, seed: int) -> None:
    options = SimulationOptions(
        devices=40,
        seed=seed,
        events=events,
        malformed_fraction=0.03,
        duplicate_fraction=0.02,
        truth_path=truth,
        progress=False,
    )
    summary = run_simulation(settings, options)
    assert summary.failed == 0


def test_backlog_is_archived_exactly_once_and_bad_records_quarantined(isolated: Settings, spark: SparkSession):
    truth = isolated.home / "truth-1.parquet"
    _simulate(isolated, truth, events=12_000, seed=7)
    ensure_tables(spark, isolated)

    drained = drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])
    assert drained[INGEST] == 12_000

    result = reconcile(spark, isolated, [truth])
    assert result.problems == [], result.report()
    assert result.truth is not None and result.truth.delivered == 12_000

    sent = spark.read.parquet(str(truth))
    quarantine = spark.read.format("delta").load(isolated.table_path(QUARANTINE))
    malformed_sent = sent.where(F.col("malformed_kind").isNotNull())
    assert quarantine.count() == malformed_sent.count() > 100
    for row in malformed_sent.join(quarantine, ["partition", "offset"]).select("malformed_kind", "reason").collect():
        assert row.reason.startswith(REASON_OF_KIND[row.malformed_kind]), row

    # Nothing new in Kafka: a second drain writes nothing.
    assert drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])[INGEST] == 0
    assert spark.read.format("delta").load(isolated.table_path(BRONZE)).count() == 12_000


def test_verify_catches_records_the_archive_has_not_seen(isolated: Settings, spark: SparkSession) -> None:
    truth = isolated.home / "truth.parquet"
    _simulate(isolated, truth, events=2_000, seed=11)
    ensure_tables(spark, isolated)
    drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])
    assert reconcile(spark, isolated, [truth]).problems == []

    # Acknowledged without an offset (an idempotent duplicate after a broker restart): found by content.
    sends = pq.read_table(truth)
    hidden = pc.or_(
        pc.equal(pc.bit_wise_and(sends.column("send_index"), 63), 5),  # 1 in 64, whatever they are
        pc.or_(pc.is_valid(sends.column("malformed_kind")), sends.column("is_duplicate")),
    )
    offsets = pc.if_else(hidden, pa.scalar(OFFSET_UNKNOWN, pa.int64()), sends.column("offset"))
    without_offsets = isolated.home / "truth-without-offsets.parquet"
    pq.write_table(sends.set_column(sends.schema.get_field_index("offset"), "offset", offsets), without_offsets)
    found = reconcile(spark, isolated, [without_offsets])
    assert found.problems == [], found.report()
    assert found.truth is not None and found.truth.offsets_unknown == pc.sum(hidden).as_py() > 50

    producer = make_producer(isolated)
    for i in range(25):
        producer.produce(isolated.topic, value=b'{"late": "arrival %d"}' % i, key=b"dev-x")
    assert producer.flush(30) == 0
    behind = reconcile(spark, isolated, [truth])
    missing = sum(p.missing for p in behind.partitions)
    assert missing == 25 and behind.problems

    drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])
    caught_up = reconcile(spark, isolated, [truth])
    assert caught_up.problems == [], caught_up.report()
    assert caught_up.quarantine_rows == caught_up.bronze_malformed


def test_a_second_run_appends_incrementally(isolated: Settings, spark: SparkSession) -> None:
    first, second = isolated.home / "a.parquet", isolated.home / "b.parquet"
    _simulate(isolated, first, events=3_000, seed=1)
    ensure_tables(spark, isolated)
    drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])
    _simulate(isolated, second, events=4_000, seed=2)
    assert drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])[INGEST] == 4_000
    result = reconcile(spark, isolated, [first, second])
    assert result.problems == [], result.report()
    assert result.truth is not None and result.truth.delivered == 7_000


def test_a_stream_starts_an_ingest_batch_once_enough_records_wait_and_none_without_records(
    isolated: Settings, spark: SparkSession
) -> None:
    """The ingest query as `iotmon stream` starts it (a processing-time trigger), with an interval no test could
    wait out: a batch starts before the interval is up once IOTMON_INGEST_BATCH_RECORDS records wait, not while
    fewer do, and no batch runs without records (Spark runs one after a batch that moved a stateful operator's
    watermark, and the plan has none)."""
    settings = dataclasses.replace(isolated, trigger_interval="1 hour", ingest_batch_records=300)
    ensure_tables(spark, settings)

    def batches() -> list[int]:
        """The records of each batch the query has run, in order (a batch without records counts 0)."""
        return [p["numInputRows"] for p in query.recentProgress if "addBatch" in p["durationMs"]]

    def idle_reports(since: int) -> list[Any]:
        return [p for p in query.recentProgress[since:] if "addBatch" not in p["durationMs"]]

    def waiting(report: Any) -> int:
        """How many records the poll that made ``report`` saw waiting in Kafka."""
        source = report["sources"][0]
        latest, read = (_offset_sum(source[key]) for key in ("latestOffset", "endOffset"))
        return latest - read

    _simulate(settings, settings.home / "a.parquet", events=100, seed=1)
    # An idle poll's report at every poll, not every 10 s, so the test can tell what each poll saw.
    with query_settings(spark, {"spark.sql.streaming.noDataProgressEventInterval": "10ms"}):
        query = start_query(INGEST_QUERY, spark, settings, trigger_of(settings)(INGEST_QUERY), io.StringIO())
    try:
        # No batch has run yet, so the interval is up at the first poll: what waits is read at once.
        wait_for(lambda: batches() == [100], 120, "the first batch")
        seen = len(query.recentProgress)
        _simulate(settings, settings.home / "b.parquet", events=100, seed=2)
        wait_for(lambda: any(waiting(r) == 100 for r in idle_reports(seen)), 60, "a poll that saw 100 records")
        assert batches() == [100]
        _simulate(settings, settings.home / "c.parquet", events=200, seed=3)
        wait_for(lambda: len(batches()) > 1, 60, "a batch once 300 records wait")
        assert batches() == [100, 300]
        seen = len(query.recentProgress)
        wait_for(lambda: len(idle_reports(seen)) >= 2, 60, "two polls after it")
        assert batches() == [100, 300], "a batch without records ran"
    finally:
        query.stop()
    assert spark.read.format("delta").load(settings.table_path(BRONZE)).count() == 400


def _offset_sum(offsets: Any) -> int:
    """The sum over partitions of a Kafka source's offsets in a progress report (a JSON object or its text)."""
    parsed = json.loads(offsets) if isinstance(offsets, str) else offsets
    return sum(int(offset) for partitions in parsed.values() for offset in partitions.values())


def test_lake_is_queryable_by_name_and_readable_without_spark(
    isolated: Settings, spark: SparkSession, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _simulate(isolated, isolated.home / "truth.parquet", events=2_000, seed=21)
    ensure_tables(spark, isolated)
    drain_until_idle(spark, isolated, [BRONZE, QUARANTINE])

    per_type = run_sql(
        spark,
        isolated,
        "SELECT d.device_type, count(*) AS readings FROM bronze b JOIN devices d USING (device_id) "
        "WHERE b.parse_error IS NULL GROUP BY d.device_type",
    ).collect()
    clean = spark.read.format("delta").load(isolated.table_path(BRONZE)).where("parse_error IS NULL").count()
    assert {row.device_type for row in per_type} == set(DEVICE_TYPES)
    assert sum(row.readings for row in per_type) == clean

    for variable, value in isolated.to_env().items():
        monkeypatch.setenv(variable, value)
    assert main(["sql", "SELECT count(*) AS n FROM quarantine"]) == 0
    quarantined = spark.read.format("delta").load(isolated.table_path(QUARANTINE)).count()
    assert f"|{quarantined}|" in capsys.readouterr().out.replace(" ", "")

    # Ops dashboards read the tables without Spark: delta-rs sees the same rows and columns.
    for table in (BRONZE, QUARANTINE, DEVICES):
        spark_frame = spark.read.format("delta").load(isolated.table_path(table))
        arrow = deltalake.DeltaTable(isolated.table_path(table)).to_pyarrow_table()
        assert arrow.num_rows == spark_frame.count() > 0, table
        assert arrow.column_names == spark_frame.columns, table


def _reading(device: str, seq: int, event_time: dt.datetime, temperature: object = 21.5) -> bytes:
    payload = {"device_id": device, "seq": seq, "event_time": iso(event_time), "temperature": temperature}
    payload |= {"humidity": 40.0, "vibration": 2.0, "pressure": 101.0, "battery": 90.0}
    return json.dumps(payload).encode()


def _publish(settings: Settings, records: list[tuple[bytes, dt.datetime]]) -> None:
    """Each payload with its own Kafka timestamp, keyed by its device as the simulator keys them."""
    producer = make_producer(settings)
    for value, kafka_ts in records:
        millis = int(kafka_ts.replace(tzinfo=dt.UTC).timestamp() * 1000)
        producer.produce(settings.topic, value=value, key=json.loads(value)["device_id"], timestamp=millis)
    assert producer.flush(30) == 0


@pytest.mark.parametrize("run", ["restarted", "running"])
def test_each_reading_reaches_silver_once_however_its_copies_arrive(
    isolated: Settings, spark: SparkSession, run: str
) -> None:
    """The ingest query's deduplication, batch by batch: copies in one batch and in later ones, a rejected
    record holding a later reading's key, a copy and a new reading behind the watermark. ``restarted``: a query
    started for each batch, whose writer reads the keys it needs back from silver; ``running``: one query for
    all, whose writer keeps them between its batches."""
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0)
    watermark_s = interval_seconds(isolated.watermark)
    ensure_topic(isolated)
    ensure_tables(spark, isolated)
    devices = [(device, "pump", "site-1", "m1", dt.date(2026, 1, 1)) for device in ("dev-a", "dev-b")]
    spark.createDataFrame(devices, DEVICES_SCHEMA).write.format("delta").mode("append").save(
        isolated.table_path(DEVICES)
    )
    first = _reading("dev-a", 1, now - dt.timedelta(seconds=1))
    batches = [
        [
            (first, now),
            (first, now),  # a copy in the same batch
            (_reading("dev-a", 2, now - dt.timedelta(seconds=1), temperature="NaN"), now),  # rejected: non_finite
            (_reading("dev-z", 1, now), now),  # rejected: unregistered
        ],
        [
            (first, now + dt.timedelta(seconds=1)),  # a copy in a later batch
            (_reading("dev-a", 2, now - dt.timedelta(seconds=1)), now),  # the rejected record's key, now valid
            # Moves the watermark past the readings above.
            (_reading("dev-b", 1, now + dt.timedelta(seconds=watermark_s + 80)), now + dt.timedelta(seconds=1)),
        ],
        [
            (first, now),  # a copy behind the watermark, which the state no longer asks: silver does
            (_reading("dev-a", 9, now + dt.timedelta(seconds=10)), now + dt.timedelta(seconds=11)),  # new, behind it
        ],
    ]
    checkpoint = isolated.checkpoint_path(INGEST)
    if run == "restarted":
        for records in batches:
            _publish(isolated, records)
            assert drain_until_idle(spark, isolated, [SILVER, QUARANTINE])[INGEST] == len(records)
    else:
        settings = dataclasses.replace(isolated, trigger_interval="1 hour", ingest_batch_records=1)
        query = start_query(INGEST_QUERY, spark, settings, trigger_of(settings)(INGEST_QUERY), io.StringIO())
        try:
            for published, records in enumerate(batches, start=1):
                _publish(isolated, records)
                total = sum(len(batch) for batch in batches[:published])
                wait_for(lambda t=total: sum(p["numInputRows"] for p in query.recentProgress) == t, 120, "the batch")
            assert len({p["runId"] for p in query.recentProgress}) == 1
        finally:
            query.stop()
    last_batch = max(int(name.name) for name in Path(checkpoint).joinpath("commits").iterdir() if name.name.isdigit())
    watermark = planned_watermark(spark, checkpoint, last_batch)
    assert watermark is not None and watermark > now + dt.timedelta(seconds=10), "the last batch ran behind it"

    bronze = spark.read.format("delta").load(isolated.table_path(BRONZE))
    assert bronze.count() == bronze.select("partition", "offset").distinct().count() == 9
    reasons = sorted(row.reason for row in spark.read.format("delta").load(isolated.table_path(QUARANTINE)).collect())
    assert reasons == ["non_finite:temperature", "unregistered_device"]
    silver = [
        tuple(row)
        for row in spark.read.format("delta").load(isolated.table_path(SILVER)).select(*READING_KEY).collect()
    ]
    assert sorted(silver) == sorted(
        [
            ("dev-a", 1, now - dt.timedelta(seconds=1)),
            ("dev-a", 2, now - dt.timedelta(seconds=1)),
            ("dev-a", 9, now + dt.timedelta(seconds=10)),
            ("dev-b", 1, now + dt.timedelta(seconds=watermark_s + 80)),
        ]
    )
    # The keys are the writer's, on the driver: the plan keeps no state of its own.
    assert not Path(checkpoint, "state").exists()
