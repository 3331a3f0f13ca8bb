"""Silver's two writers: readings Kafka delivered later than the watermark reach silver once each, however their
copies fall between the ingest and late-arrivals queries, handed on through ``too_late_readings``; a commit of
one writer that lands while the other looks silver up makes the other's append refused, and the lookup is done
again instead of failing the query; an ingest batch killed between its bronze commit and its quarantine or
silver commit, replayed after a backfill, lands nothing twice."""

from __future__ import annotations

import datetime as dt
import json
import threading

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from ingest import landing
from ingest.verify import reconcile
from iotmon.config import Settings
from iotmon.kafka import ensure_topic, make_producer
from iotmon.lake import append_once, create_table, ledger_for
from iotmon.queries import QueryFailed
from iotmon.schema import (
    BRONZE,
    DEVICES,
    DEVICES_SCHEMA,
    INGEST,
    LATE,
    LATE_ARRIVALS,
    ON_TIME,
    QUARANTINE,
    SILVER,
    SILVER_SCHEMA,
    TOO_LATE,
    TOO_LATE_READINGS,
)
from pipeline.backfill import backfill
from pipeline.stream import drain_until_idle
from pipeline.topology import ensure_tables
from tests.readings import silver_frame, silver_row

pytestmark = pytest.mark.integration

TOO_LATE_S = 600.0
"""A delivery ten minutes after the reading: beyond the default watermark of two minutes."""
T0 = dt.datetime.now(dt.UTC).replace(tzinfo=None, microsecond=0) - dt.timedelta(hours=1)


def _at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def _publish(settings: Settings, sends: list[tuple[str, int, float, float]]) -> None:
    """Readings ``(device, seq, event seconds after T0, delivery delay seconds)`` to Kafka, in this order, each
    with the Kafka time stamp of its delivery."""
    producer = make_producer(settings)
    for device, seq, seconds, delay_s in sends:
        payload = {"device_id": device, "seq": seq, "event_time": _at(seconds).isoformat() + "Z", "temperature": 20.0}
        payload |= {"humidity": 40.0, "vibration": 2.0, "pressure": 101.0, "battery": 90.0, "firmware": "1.0"}
        millis = int(_at(seconds + delay_s).replace(tzinfo=dt.UTC).timestamp() * 1000)
        producer.produce(settings.topic, value=json.dumps(payload).encode(), key=device.encode(), timestamp=millis)
    assert producer.flush(30) == 0


def _silver(spark: SparkSession, settings: Settings) -> dict[tuple[str, int], list[tuple[str, dt.datetime]]]:
    """Silver's copies of each reading: (lateness, Kafka time stamp) by (device, seq)."""
    copies: dict[tuple[str, int], list[tuple[str, dt.datetime]]] = {}
    for row in spark.read.format("delta").load(settings.table_path(SILVER)).collect():
        copies.setdefault((row["device_id"], row["seq"]), []).append((row["lateness"], row["kafka_timestamp"]))
    return copies


def _lake(spark: SparkSession, settings: Settings) -> None:
    """The topic and the tables, with dev-a registered."""
    ensure_topic(settings)
    ensure_tables(spark, settings)
    devices = spark.createDataFrame([("dev-a", "pump", "site-1", "P-100", dt.date(2026, 1, 1))], DEVICES_SCHEMA)
    devices.write.format("delta").mode("append").save(settings.table_path(DEVICES))


def _handed_on(spark: SparkSession, settings: Settings) -> list[tuple[str, int, dt.datetime]]:
    """The copies in ``too_late_readings``: (device, seq, Kafka time stamp), sorted."""
    rows = spark.read.format("delta").load(settings.table_path(TOO_LATE_READINGS)).collect()
    return sorted((row["device_id"], row["seq"], row["kafka_timestamp"]) for row in rows)


def _rows(spark: SparkSession, settings: Settings, table: str) -> int:
    return spark.read.format("delta").load(settings.table_path(table)).count()


def test_each_reading_later_than_the_watermark_lands_in_silver_once(spark: SparkSession, isolated: Settings) -> None:
    _lake(spark, isolated)
    earlier = silver_row("dev-a", 1, 0, event_time=_at(0), kafka_timestamp=_at(0.1))
    append_once(silver_frame(spark, [earlier]), isolated.table_path(SILVER), ledger_for("an-earlier-writer"), 0)
    sends = [
        ("dev-a", 1, 0, TOO_LATE_S),  # silver holds it already
        ("dev-a", 2, 60, 0.5),  # new to the ingest writer's keys ...
        ("dev-a", 2, 60, TOO_LATE_S),  # ... and a copy too late for them, in the same batch
        ("dev-a", 3, 120, TOO_LATE_S + 100),  # two too-late copies of a reading silver lacks: the first wins
        ("dev-a", 3, 120, TOO_LATE_S),
        ("dev-a", 4, 180, 5.0),  # late, within the watermark
    ]
    _publish(isolated, sends)
    drained = drain_until_idle(spark, isolated, [SILVER])
    too_late = [send for send in sends if send[3] >= TOO_LATE_S]
    assert drained == {INGEST: len(sends), LATE_ARRIVALS: len(too_late)}  # one batch each; only the too-late read
    assert _handed_on(spark, isolated) == sorted((d, seq, _at(t + delay)) for d, seq, t, delay in too_late)

    assert _rows(spark, isolated, BRONZE) == len(sends)
    assert _silver(spark, isolated) == {
        ("dev-a", 1): [(ON_TIME, _at(0.1))],
        ("dev-a", 2): [(ON_TIME, _at(60.5))],
        ("dev-a", 3): [(TOO_LATE, _at(120 + TOO_LATE_S))],
        ("dev-a", 4): [(LATE, _at(185))],
    }

    # A later batch's too-late copy of a reading an earlier batch looked up and landed: silver answers for it.
    _publish(isolated, [("dev-a", 3, 120, TOO_LATE_S + 200)])
    assert drain_until_idle(spark, isolated, [SILVER]) == {INGEST: 1, LATE_ARRIVALS: 1}
    assert _silver(spark, isolated)[("dev-a", 3)] == [(TOO_LATE, _at(120 + TOO_LATE_S))]
    assert _rows(spark, isolated, BRONZE) == len(sends) + 1


@pytest.mark.parametrize("writer", ["late_arrivals", "ingest"])
def test_a_lookup_the_other_writers_commit_made_stale_is_done_again(
    spark: SparkSession, isolated: Settings, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Each writer of silver looks readings up (late arrivals: all of them; ingest: those behind the
    watermark, beside its new ones); the other one commits reading 2 while the first append is held."""
    silver = isolated.table_path(SILVER)
    create_table(spark, silver, SILVER_SCHEMA, "silver, fed by the test")
    looked_up = silver_frame(spark, [silver_row("dev-a", seq, seq, lateness=TOO_LATE) for seq in (1, 2, 3)])
    started, go = threading.Event(), threading.Event()
    appends: list[int] = []
    real_append = landing.append_once

    def append_held_once(rows: pa.Table, path: str, *args, **options) -> bool:
        """The writer's append; the first one is held, after its lookup read silver, until the other commits."""
        appends.append(rows.num_rows)
        if len(appends) == 1:
            started.set()
            assert go.wait(120), "the other writer did not commit"
        return real_append(rows, path, *args, **options)

    def other_commits_reading_2() -> None:
        assert started.wait(120), "the held append did not start"
        append_once(silver_frame(spark, [silver_row("dev-a", 2, 2)]), silver, ledger_for("the-other-writer"), 0)
        go.set()

    monkeypatch.setattr(landing, "append_once", append_held_once)
    other = threading.Thread(target=other_commits_reading_2, daemon=True)
    other.start()
    if writer == "late_arrivals":
        landing.write_late_arrivals(isolated, ledger_for("test-writer"))(looked_up, 0)
    else:
        new = silver_frame(spark, [silver_row("dev-b", 1, 1)]).toArrow()  # new to the writer's keys: no lookup
        landing.append_to_silver(isolated, ledger_for("test-writer"), 0, new, looked_up.toArrow(), spark)
    other.join(60)

    # The first append lost to the other commit and was not retried blindly: the second lookup saw reading 2.
    assert appends == ([3, 2] if writer == "late_arrivals" else [4, 3])
    rows = spark.read.format("delta").load(silver).groupBy("device_id", "seq").count().collect()
    expected = [("dev-a", 1, 1), ("dev-a", 2, 1), ("dev-a", 3, 1)] + ([("dev-b", 1, 1)] if writer == "ingest" else [])
    assert sorted((row["device_id"], row["seq"], row["count"]) for row in rows) == expected


def test_a_batch_killed_between_bronze_and_silver_and_replayed_after_a_backfill_lands_its_readings_once(
    spark: SparkSession, isolated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lake(spark, isolated)
    _publish(isolated, [("dev-a", seq, 2 * seq, 0.5) for seq in range(1, 11)])
    drain_until_idle(spark, isolated, [SILVER])
    # The killed batch: ten readings, and two Kafka delivered too late, handed on before the kill.
    _publish(isolated, [("dev-a", seq, 2 * seq, 0.5) for seq in range(11, 21)])
    _publish(isolated, [("dev-a", seq, 2 * seq, TOO_LATE_S) for seq in (21, 22)])

    def killed(*args: object, **options: object) -> None:
        raise RuntimeError("killed between the bronze and the silver commit")

    monkeypatch.setattr(landing, "append_to_silver", killed)
    with pytest.raises(QueryFailed, match="killed between the bronze and the silver commit"):
        drain_until_idle(spark, isolated, [SILVER])
    monkeypatch.undo()
    assert (_rows(spark, isolated, BRONZE), _rows(spark, isolated, SILVER)) == (22, 10)
    assert len(_handed_on(spark, isolated)) == 2

    backfill(spark, isolated)  # silver rebuilt from bronze holds the killed batch's readings
    assert (_rows(spark, isolated, SILVER), _rows(spark, isolated, TOO_LATE_READINGS)) == (22, 0)
    assert drain_until_idle(spark, isolated, [SILVER])[INGEST] == 12  # the killed batch, replayed
    counts = {key: len(copies) for key, copies in _silver(spark, isolated).items()}
    assert counts == {("dev-a", seq): 1 for seq in range(1, 23)}
    assert _rows(spark, isolated, BRONZE) == 22


def test_a_batch_killed_between_bronze_and_quarantine_and_replayed_after_a_backfill_quarantines_each_reject_once(
    spark: SparkSession, isolated: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    _lake(spark, isolated)
    _publish(isolated, [("dev-a", seq, 2 * seq, 0.5) for seq in range(1, 6)])
    drain_until_idle(spark, isolated, [SILVER])
    # The next batch: a reading, a reading of a device the registry lacks (silver's reject) and a record no
    # parser reads (bronze's).
    _publish(isolated, [("dev-a", 6, 12, 0.5), ("dev-z", 1, 12, 0.5)])
    producer = make_producer(isolated)
    producer.produce(isolated.topic, value=b"{not json", key=b"dev-a")
    assert producer.flush(30) == 0

    quarantine = isolated.table_path(QUARANTINE)

    def killed_at_quarantine(rows: pa.Table, path: str, *args: object, **options: object) -> None:
        if path == quarantine:
            raise RuntimeError("killed between the bronze and the quarantine commit")
        append_once(rows, path, *args, **options)

    monkeypatch.setattr(landing, "append_once", killed_at_quarantine)
    with pytest.raises(QueryFailed, match="killed between the bronze and the quarantine commit"):
        drain_until_idle(spark, isolated, [SILVER])
    monkeypatch.undo()
    assert (_rows(spark, isolated, BRONZE), _rows(spark, isolated, QUARANTINE)) == (8, 0)

    def stages() -> list[tuple[str, str | None]]:
        rows = spark.read.format("delta").load(quarantine).select("stage", "key").collect()
        return sorted((row["stage"], row["key"]) for row in rows)

    backfill(spark, isolated)  # quarantine rebuilt from bronze holds the killed batch's rejects of both stages
    assert stages() == [("bronze", "dev-a"), ("silver", "dev-z")]
    assert drain_until_idle(spark, isolated, [SILVER])[INGEST] == 3  # the killed batch, replayed
    assert stages() == [("bronze", "dev-a"), ("silver", "dev-z")]
    assert {key: len(copies) for key, copies in _silver(spark, isolated).items()} == {
        ("dev-a", seq): 1 for seq in range(1, 7)
    }
    archive = reconcile(spark, isolated)
    assert archive.problems == [] and archive.quarantine_rows == archive.bronze_malformed == 1, archive.report()
    # What the old backfill left after the replay, a silver-stage reject twice, is what verify now reports.
    spark.read.format("delta").load(quarantine).where("stage = 'silver'").write.format("delta").mode("append").save(
        quarantine
    )
    assert reconcile(spark, isolated).problems == ["1 rejected readings are quarantined more than once"]
