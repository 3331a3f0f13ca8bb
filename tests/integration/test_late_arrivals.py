"""The late-arrivals writer shares silver with the ingest query: an ingest commit that lands while it looks
silver up makes Delta refuse its append, and the lookup is done again instead of failing the query."""

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


def test_a_lookup_an_ingest_commit_made_stale_is_done_again(
    spark: SparkSession, isolated: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    silver = isolated.table_path(SILVER)
    create_table(spark, silver, SILVER_SCHEMA, "silver, fed by the test")
    late = silver_frame(spark, [silver_row("dev-a", seq, seq, lateness=TOO_LATE) for seq in (1, 2, 3)])
    started, go = tmp_path / "append-started", tmp_path / "ingest-committed"
    appends: list[int] = []
    real_append = landing.append_checked_once

    def append_held_once(frame: DataFrame, path: str, *args) -> bool:
        """The late-arrivals append; the first one is held inside its transaction until the ingest commits."""
        appends.append(frame.count())
        if len(appends) == 1:
            frame = frame.where(_held_until(go, started)(F.col("seq")))
        return real_append(frame, path, *args)

    def ingest_commits_reading_2() -> None:
        wait_for(started.exists, 120, "the late-arrivals append to start")
        append_once(silver_frame(spark, [silver_row("dev-a", 2, 2)]), silver, ledger_for("test-ingest"), 0)
        go.touch()

    monkeypatch.setattr(landing, "append_checked_once", append_held_once)
    ingest = threading.Thread(target=ingest_commits_reading_2, daemon=True)
    ingest.start()
    landing.write_late_arrivals(isolated, ledger_for("test-late-arrivals"))(late, 0)
    ingest.join(60)

    # The first append lost to the ingest commit and was not retried blindly: the second lookup saw reading 2.
    assert appends == [3, 2]
    rows = spark.read.format("delta").load(silver).groupBy("seq").count().collect()
    assert sorted((row["seq"], row["count"]) for row in rows) == [(1, 1), (2, 1), (3, 1)]
