"""The late-arrivals and ingest queries share silver: a commit of one that lands while the other looks silver up
makes the other's append refused, and the lookup is done again instead of failing the query."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import BooleanType

from ingest import landing
from iotmon.config import Settings
from iotmon.lake import append_once, create_table, ledger_for
from iotmon.schema import SILVER, SILVER_SCHEMA, TOO_LATE
from tests.readings import silver_frame, silver_row
from tests.support import wait_for

pytestmark = pytest.mark.integration


def _held_until(go: Path, started: Path):
    """A filter that, evaluated in a write's job, says it started and holds the job until ``go`` exists.

    Nondeterministic, so that Spark does not push it below the join into the readings' scan, where a task per
    partition would hold both cores and leave none for the commit it waits for."""

    def hold(_):  # no type hints: PySpark would try to read a pandas UDF's kind from them, and warn
        started.touch()
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return True

    return F.udf(hold, BooleanType()).asNondeterministic()


@pytest.mark.parametrize("writer", ["late_arrivals", "ingest"])
def test_a_lookup_the_other_writers_commit_made_stale_is_done_again(
    spark: SparkSession, isolated: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str
) -> None:
    """Each writer of silver looks readings up (late arrivals: all of them; ingest: those behind the
    watermark, beside its new ones); the other one commits reading 2 while the first append is held."""
    silver = isolated.table_path(SILVER)
    create_table(spark, silver, SILVER_SCHEMA, "silver, fed by the test")
    looked_up = silver_frame(spark, [silver_row("dev-a", seq, seq, lateness=TOO_LATE) for seq in (1, 2, 3)])
    started, go = tmp_path / "append-started", tmp_path / "other-committed"
    appends: list[int] = []
    real_append = landing.append_once

    def append_held_once(frame: DataFrame, path: str, *args, **options) -> bool:
        """The writer's append; the first one is held, after its lookup read silver, until the other commits."""
        appends.append(frame.count())
        if len(appends) == 1:
            frame = frame.where(_held_until(go, started)(F.col("seq")))
        return real_append(frame, path, *args, **options)

    def other_commits_reading_2() -> None:
        wait_for(started.exists, 120, "the held append to start")
        append_once(silver_frame(spark, [silver_row("dev-a", 2, 2)]), silver, ledger_for("the-other-writer"), 0)
        go.touch()

    monkeypatch.setattr(landing, "append_once", append_held_once)
    other = threading.Thread(target=other_commits_reading_2, daemon=True)
    other.start()
    if writer == "late_arrivals":
        landing.write_late_arrivals(isolated, ledger_for("test-writer"))(looked_up, 0)
    else:
        new = silver_frame(spark, [silver_row("dev-b", 1, 1)])  # first seen by the state: no lookup
        landing.append_to_silver(isolated, ledger_for("test-writer"), 0, new, looked_up)
    other.join(60)

    # The first append lost to the other commit and was not retried blindly: the second lookup saw reading 2.
    assert appends == ([3, 2] if writer == "late_arrivals" else [4, 3])
    rows = spark.read.format("delta").load(silver).groupBy("device_id", "seq").count().collect()
    expected = [("dev-a", 1, 1), ("dev-a", 2, 1), ("dev-a", 3, 1)] + ([("dev-b", 1, 1)] if writer == "ingest" else [])
    assert sorted((row["device_id"], row["seq"], row["count"]) for row in rows) == expected
