"""The late-arrivals and ingest queries share silver: a commit of one that lands while the other looks silver up
makes the other's append refused, and the lookup is done again instead of failing the query."""

from __future__ import annotations

import threading

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession

from ingest import landing
from iotmon.config import Settings
from iotmon.lake import append_once, create_table, ledger_for
from iotmon.schema import SILVER, SILVER_SCHEMA, TOO_LATE
from tests.readings import silver_frame, silver_row

pytestmark = pytest.mark.integration


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
        new = silver_frame(spark, [silver_row("dev-b", 1, 1)]).toArrow()  # first seen by the state: no lookup
        landing.append_to_silver(isolated, ledger_for("test-writer"), 0, new, looked_up.toArrow(), spark)
    other.join(60)

    # The first append lost to the other commit and was not retried blindly: the second lookup saw reading 2.
    assert appends == ([3, 2] if writer == "late_arrivals" else [4, 3])
    rows = spark.read.format("delta").load(silver).groupBy("device_id", "seq").count().collect()
    expected = [("dev-a", 1, 1), ("dev-a", 2, 1), ("dev-a", 3, 1)] + ([("dev-b", 1, 1)] if writer == "ingest" else [])
    assert sorted((row["device_id"], row["seq"], row["count"]) for row in rows) == expected
