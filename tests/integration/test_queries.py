"""The stream supervisor restarts a failed query from its checkpoint, and gives up loudly after too many."""

from __future__ import annotations

import dataclasses
import io
import itertools
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from iotmon import queries
from iotmon.config import Settings
from iotmon.queries import (
    AVAILABLE_NOW,
    SCHEDULER_POOL,
    QueryFailed,
    QuerySpec,
    Trigger,
    run_continuously,
    run_until_idle,
)
from tests.support import wait_for

pytestmark = pytest.mark.integration


def _spec(
    name: str, read: Callable[[SparkSession], DataFrame], write: Callable[[DataFrame, int], None], checkpoint: str
) -> QuerySpec:
    """A query over ``read(spark)`` whose batches go to ``write``, checkpointed at ``checkpoint``."""

    def start(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
        stream = read(spark).writeStream.queryName(name).foreachBatch(write)
        return stream.option("checkpointLocation", checkpoint).trigger(**trigger).start()

    return QuerySpec(name, start)


def _rate_spec(tmp_path: Path, name: str, write: Callable[[DataFrame, int], None]) -> QuerySpec:
    """A rate-source query whose batches go to ``write``, checkpointed under ``tmp_path``."""
    return _spec(
        name,
        lambda spark: spark.readStream.format("rate").option("rowsPerSecond", 10).load(),
        write,
        str(tmp_path / name),
    )


def _flaky_spec(tmp_path: Path, failures: int, batches_seen: list[int]) -> QuerySpec:
    """A rate-source query whose first ``failures`` batches raise, as a broken sink would."""

    def write(batch: DataFrame, batch_id: int) -> None:
        batches_seen.append(batch_id)
        if len(batches_seen) <= failures:
            raise RuntimeError(f"injected failure in batch {batch_id}")
        batch.count()  # read it: a batch nobody reads has no input rows in its progress

    return _rate_spec(tmp_path, "flaky", write)


@contextmanager
def _supervising(
    spark: SparkSession,
    settings: Settings,
    specs: list[QuerySpec],
    out: io.StringIO,
    release: threading.Event | None = None,
    **options: Any,
) -> Iterator[threading.Event]:
    """``run_continuously`` on a thread of its own; yields its stop. At the end ``release`` lets a held batch go,
    the run is stopped, and it must have ended."""
    stop = threading.Event()
    supervisor = threading.Thread(
        target=run_continuously, args=(spark, settings, specs, stop, out), kwargs=options, daemon=True
    )
    supervisor.start()
    try:
        yield stop
    finally:
        if release is not None:
            release.set()
        stop.set()
        supervisor.join(60)
    assert not supervisor.is_alive(), out.getvalue()


def test_a_failed_query_is_restarted_and_resumes(spark: SparkSession, base_settings: Settings, tmp_path: Path):
    batches: list[int] = []
    out = io.StringIO()

    def reported() -> list[str]:
        return [line for line in out.getvalue().splitlines() if line.startswith("flaky        batch ")]

    with _supervising(spark, base_settings, [_flaky_spec(tmp_path, 1, batches)], out, report_every=0.5):
        wait_for(
            lambda: len(batches) >= 3 and len(set(reported())) >= 2,
            120,
            "the query to run again after its failure, and two batches of it reported",
        )
    assert "flaky: query ended (" in out.getvalue() and "injected failure" in out.getvalue()
    assert batches[1] == batches[0], "the failed batch must be re-run from the checkpoint, same id"
    assert len(reported()) == len(set(reported())), "each batch reported once, not at every report"
    assert not [q for q in spark.streams.active if q.name == "flaky"]


def test_too_many_failures_stop_the_supervisor(spark: SparkSession, base_settings: Settings, tmp_path: Path):
    settings = dataclasses.replace(base_settings, query_restarts=0)
    with pytest.raises(QueryFailed, match=r"query flaky failed 1 times in a row; last error: .*injected failure"):
        run_continuously(spark, settings, [_flaky_spec(tmp_path, 99, [])], threading.Event(), io.StringIO())


def test_failures_that_each_follow_a_working_batch_do_not_add_up(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
):
    """A stream runs for days: a query failing now and then (a write conflict, a broker restart), each time
    after batches that worked, is restarted every time, though it failed more often than the limit in all."""
    settings = dataclasses.replace(base_settings, query_restarts=1)
    calls: list[int] = []
    stop = threading.Event()

    def write(batch: DataFrame, batch_id: int) -> None:
        calls.append(batch_id)
        if len(calls) in (2, 4):  # each failure follows a batch that worked (call 1, then call 3: the replay)
            raise RuntimeError(f"injected failure in batch {batch_id}")

    out, failed = io.StringIO(), []

    def supervise() -> None:
        try:
            run_continuously(spark, settings, [_rate_spec(tmp_path, "now-and-then", write)], stop, out)
        except QueryFailed as exc:
            failed.append(exc)

    supervisor = threading.Thread(target=supervise, daemon=True)
    supervisor.start()
    try:
        wait_for(lambda: len(calls) >= 6 or failed, 180, "the query to run on after its second failure")
    finally:
        stop.set()
        supervisor.join(60)
    assert not failed, failed
    assert out.getvalue().count("now-and-then: query ended (") == 2
    assert calls[2] == calls[1] and calls[4] == calls[3], "each failed batch re-run from the checkpoint"


def test_a_failure_long_after_a_working_batch_is_not_one_in_a_row(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
):
    """Spark keeps only a query's last progress reports (99 by default; 1 here), and an idle query fills them with
    reports of triggers that found no data. A failure after such a quiet spell still follows a working batch:
    the supervisor saw it while the query ran, so two such failures with a limit of 1 do not end the run."""
    settings = dataclasses.replace(base_settings, query_restarts=1)
    source = tmp_path / "source"
    source.mkdir()
    fail_next, calls = threading.Event(), []

    def write(batch: DataFrame, batch_id: int) -> None:
        calls.append(batch_id)
        if fail_next.is_set():
            fail_next.clear()  # the replay of this batch works
            raise RuntimeError(f"injected failure in batch {batch_id}")

    quiet = _spec(
        "quiet", lambda spark: spark.readStream.schema("n INT").json(str(source)), write, str(tmp_path / "quiet")
    )

    def quiet_spell() -> None:
        """Until every progress report Spark still keeps is of a trigger that found no data."""

        def kept_reports() -> list[dict]:
            running = [q for q in spark.streams.active if q.name == "quiet"]
            return running[0].recentProgress if running else []

        wait_for(
            lambda: (kept := kept_reports()) and not any("addBatch" in p["durationMs"] for p in kept),
            120,
            "a report of a trigger without data",
        )

    def new_file(n: int) -> None:
        """A file of one row, renamed into place: the file source never sees it half written."""
        (source / f".{n}.json").write_text(f'{{"n": {n}}}\n')
        (source / f".{n}.json").rename(source / f"{n}.json")

    out, failed = io.StringIO(), []
    stop = threading.Event()

    def supervise() -> None:
        try:
            run_continuously(
                spark,
                settings,
                [quiet],
                stop,
                out,
                trigger_of=lambda _: {"processingTime": "0.2 seconds"},
            )
        except QueryFailed as exc:
            failed.append(exc)

    # One report kept (Spark keeps one fewer than the setting); a trigger without data reported every 2 s, still
    # longer than the supervisor's polls.
    retention, interval = (
        "spark.sql.streaming.numRecentProgressUpdates",
        "spark.sql.streaming.noDataProgressEventInterval",
    )
    spark.conf.set(retention, "2")
    spark.conf.set(interval, "2s")
    supervisor = threading.Thread(target=supervise, daemon=True)
    try:
        supervisor.start()
        new_file(0)
        wait_for(lambda: calls or failed, 120, "a first batch")
        for failure in (1, 2):
            quiet_spell()
            fail_next.set()
            new_file(failure)
            # The batch that fails, then its replay after the restart.
            replayed = 1 + 2 * failure
            wait_for(lambda n=replayed: len(calls) == n or failed, 120, f"failure {failure} and the replay")
    finally:
        stop.set()
        supervisor.join(60)
        spark.conf.unset(retention)
        spark.conf.unset(interval)
    assert not failed, failed
    assert out.getvalue().count("quiet: query ended (") == 2


def test_a_crash_in_the_first_offset_write_does_not_block_the_query_forever(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    """Killed between writing batch 0's offsets to a temp file and renaming it, a query leaves only that
    temp file; Spark 4.2 then refuses batch 0 on every start. ``start_query`` clears it."""
    settings = dataclasses.replace(base_settings, checkpoints=str(tmp_path / "checkpoints"))
    source = str(tmp_path / "source")
    spark.range(5).write.format("delta").save(source)
    seen: list[int] = []

    spec = _spec(
        "first",
        lambda spark: spark.readStream.format("delta").load(source),
        lambda batch, _: seen.append(batch.count()),
        settings.checkpoint_path("first"),
    )
    offsets = Path(settings.checkpoint_path("first")) / "offsets"
    offsets.mkdir(parents=True)
    (offsets / ".0.5b5a3108-152f-4a30-b5e0-cc790d5b3a60.tmp").write_text("v1\n{half written")
    with pytest.raises(StreamingQueryException, match="STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY"):
        spec.start(spark, settings, AVAILABLE_NOW).awaitTermination(120)

    out = io.StringIO()
    run_until_idle(spark, settings, [spec], out)
    assert seen == [5]
    assert "first: removed .0.5b5a3108-152f-4a30-b5e0-cc790d5b3a60.tmp" in out.getvalue()


def test_a_drain_counts_every_batch_it_read(spark: SparkSession, base_settings: Settings, tmp_path: Path) -> None:
    """Spark keeps only a query's last progress reports (99 by default; 1 here): a drain of more batches than
    that still counts the rows of all of them."""
    source = str(tmp_path / "source")
    for n in range(3):
        spark.range(n * 10, n * 10 + 10).write.format("delta").mode("append").save(source)
    out = io.StringIO()

    def write(batch: DataFrame, batch_id: int) -> None:
        batch.count()  # read it: a batch nobody reads has no input rows in its progress
        # Each batch after the first waits until the drain has reported the one before it, so that batch's
        # report was read before a newer one could replace it.
        if batch_id:
            pattern = rf"batch\s+{batch_id - 1}\s+rows"
            wait_for(lambda: re.search(pattern, out.getvalue()), 120, f"batch {batch_id - 1} to be reported")

    files = _spec(
        "files",
        lambda spark: spark.readStream.format("delta").option("maxFilesPerTrigger", 1).load(source),
        write,
        str(tmp_path / "files"),
    )

    retention = "spark.sql.streaming.numRecentProgressUpdates"
    spark.conf.set(retention, "2")
    try:
        drained = run_until_idle(spark, base_settings, [files], out, report_every=0.1)
    finally:
        spark.conf.unset(retention)
    assert drained == {"files": 30}
    assert re.search(r"batch\s+2\s+rows", out.getvalue()), out.getvalue()  # more batches than reports kept


def _copy_spec(tmp_path: Path, name: str, source: str, during: Callable[[], Any] = lambda: None) -> QuerySpec:
    """A query appending what the Delta table at ``source`` gets to a table of its own, ``tmp_path / name``;
    ``during()`` runs in each of its batches."""

    def write(batch: DataFrame, _: int) -> None:
        during()
        batch.write.format("delta").mode("append").save(str(tmp_path / name))

    return _spec(name, lambda spark: spark.readStream.format("delta").load(source), write, str(tmp_path / f"{name}.ck"))


def test_a_drain_runs_a_query_once_its_upstream_has_finished_and_siblings_at_once(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    source = str(tmp_path / "source")
    spark.range(10).write.format("delta").save(source)
    # Both readers of `up` wait for each other inside their batch: only together do they get past it.
    together = threading.Barrier(2, timeout=120)
    up = _copy_spec(tmp_path, "up", source)
    left = _copy_spec(tmp_path, "left", str(tmp_path / "up"), during=together.wait)
    right = _copy_spec(tmp_path, "right", str(tmp_path / "up"), during=together.wait)
    last = _copy_spec(tmp_path, "last", str(tmp_path / "left"))
    upstream = {"up": (), "left": ("up",), "right": ("up",), "last": ("up", "left")}

    out = io.StringIO()
    drained = run_until_idle(spark, base_settings, [up, left, right, last], out, upstream=upstream.__getitem__)
    # Each read everything its upstream wrote, so it started once that had ended; left and right met.
    assert drained == {"up": 10, "left": 10, "right": 10, "last": 10}, out.getvalue()


def test_a_drain_raises_a_failed_query_once_the_others_ended_and_starts_none_after_it(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    source = str(tmp_path / "source")
    spark.range(10).write.format("delta").save(source)

    def fail() -> None:  # once the query beside it has started, so the failure cannot keep it from starting
        wait_for((tmp_path / "beside.ck").exists, 120, "the query beside it to start")
        raise RuntimeError("injected failure")

    broken = _copy_spec(tmp_path, "broken", source, during=fail)
    beside = _copy_spec(tmp_path, "beside", source)
    after = _copy_spec(tmp_path, "after", str(tmp_path / "broken"))
    upstream = {"broken": (), "beside": (), "after": ("broken",)}

    out = io.StringIO()
    with pytest.raises(QueryFailed, match="query broken failed"):
        run_until_idle(spark, base_settings, [broken, beside, after], out, upstream=upstream.__getitem__)
    assert "beside       drained 10 rows" in out.getvalue()
    assert "after" not in out.getvalue() and not (tmp_path / "after.ck").exists()


def test_a_drain_without_upstream_runs_the_queries_one_after_the_other(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    source = str(tmp_path / "source")
    spark.range(10).write.format("delta").save(source)
    running: list[set[str]] = []

    def note_running() -> None:
        running.append({query.name for query in spark.streams.active})

    specs = [_copy_spec(tmp_path, name, source, during=note_running) for name in ("first", "second")]
    assert run_until_idle(spark, base_settings, specs, io.StringIO()) == {"first": 10, "second": 10}
    assert running == [{"first"}, {"second"}]


def test_each_query_runs_its_jobs_in_a_fair_scheduler_pool_of_its_own(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    settings = dataclasses.replace(base_settings, checkpoints=str(tmp_path / "checkpoints"))
    source = str(tmp_path / "source")
    spark.range(5).write.format("delta").save(source)
    pools: list[str | None] = []

    def write(batch: DataFrame, _: int) -> None:
        pools.append(batch.sparkSession.sparkContext.getLocalProperty(SCHEDULER_POOL))
        batch.count()  # a job, which the scheduler files under the batch's pool

    pooled = _spec(
        "pooled", lambda spark: spark.readStream.format("delta").load(source), write, settings.checkpoint_path("pooled")
    )

    context = spark.sparkContext
    assert context.getConf().get("spark.scheduler.mode") == "FAIR"
    run_until_idle(spark, settings, [pooled], io.StringIO())
    assert pools == ["pooled"]
    assert context._jsc.sc().getPoolForName("pooled").isDefined(), "no task set ran in the query's pool"
    assert context.getLocalProperty(SCHEDULER_POOL) is None, "the starting thread's own jobs stay in the default pool"


def _lead_and_follower(tmp_path: Path, release: threading.Event, seen: list[str]) -> list[QuerySpec]:
    """A lead query whose first batch holds until ``release``, and a query that follows it."""

    def lead(_: DataFrame, __: int) -> None:
        seen.append("lead")
        release.wait(120)

    def follower(_: DataFrame, __: int) -> None:
        seen.append("follower")

    return [_rate_spec(tmp_path, "lead", lead), _rate_spec(tmp_path, "follower", follower)]


def _follower_waits_for(first: str, spark: SparkSession, seen: list[str], release: threading.Event) -> None:
    """The follower does not start while ``first``'s first batch is held, and runs once it is released."""
    wait_for(lambda: first in seen, 120, f"the {first} query's first batch")
    assert "follower" not in {q.name for q in spark.streams.active}, f"started before the {first} query's first batch"
    release.set()
    wait_for(lambda: "follower" in seen, 120, "the follower's first batch")


def test_the_lead_query_starts_first_and_the_others_after_its_first_batch(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    release, seen, out = threading.Event(), [], io.StringIO()
    specs = _lead_and_follower(tmp_path, release, seen)
    # No periodic report within the test: each start is announced as it happens, not at the next report.
    with _supervising(spark, base_settings, specs, out, release, lead=("lead",), report_every=3600.0):
        wait_for(lambda: "lead" in seen, 120, "the lead query's first batch")
        assert out.getvalue().splitlines() == ["lead         starting"]
        _follower_waits_for("lead", spark, seen, release)
        printed = out.getvalue().splitlines()
    assert printed[1:] == ["starting the other queries: lead finished its first trigger", "follower     starting"]


def test_a_hold_keeps_the_others_back_until_a_waiting_lead_query_it_made_ready_has_run(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    # The demo's start with no model: the scorer is a lead query waiting for one, and the others wait for the
    # first training run (the hold), then for the scorer's first trigger.
    release, model, seen, out = threading.Event(), threading.Event(), [], io.StringIO()
    lead, follower = (_rate_spec(tmp_path, name, lambda *_, n=name: seen.append(n)) for name in ("lead", "follower"))

    def scored(_: DataFrame, __: int) -> None:
        seen.append("scorer")
        release.wait(120)

    scorer = dataclasses.replace(
        _rate_spec(tmp_path, "scorer", scored), ready=lambda *_: None if model.is_set() else "no model yet"
    )

    def hold() -> str | None:
        return None if model.is_set() else "the first model"

    specs = [lead, scorer, follower]
    with _supervising(spark, base_settings, specs, out, release, lead=("lead", "scorer"), hold=hold):
        wait_for(lambda: "the other queries wait: the first model" in out.getvalue(), 120, "the hold")
        assert "scorer: waiting: no model yet" in out.getvalue()
        assert {q.name for q in spark.streams.active} == {"lead"}
        model.set()  # the hold ends and the scorer is ready: it starts, the others wait for its first trigger
        _follower_waits_for("scorer", spark, seen, release)
    assert "starting the other queries: lead and scorer finished their first trigger" in out.getvalue()


def test_a_stop_while_the_lead_query_is_in_its_first_batch_drains_the_others_too(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    release, seen, out = threading.Event(), [], io.StringIO()
    specs = _lead_and_follower(tmp_path, release, seen)

    def unread() -> list[str]:
        """The drain ends once the follower has had a batch: it started although the lead had not finished one."""
        return [] if "follower" in seen else ["follower"]

    with _supervising(spark, base_settings, specs, out, release, lead=("lead",), unread=unread) as stop:
        wait_for(lambda: "lead" in seen, 120, "the lead query's first batch")
        stop.set()
        wait_for(lambda: "follower" in seen, 120, "the follower to start and run a batch for the drain")
    assert "starting the other queries: a stop drains every query" in out.getvalue()


def test_a_drain_moves_a_query_on_a_slow_trigger_to_the_default_one(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    # The final windows run every 30 s: at a stop, a drain would wait for their next trigger. Here the trigger
    # is an hour, so only the move to the default trigger (1 s here) lets the drain end.
    seen, out = [], io.StringIO()
    slow = _rate_spec(tmp_path, "slow", lambda _, batch_id: seen.append(batch_id))

    def hourly(_: QuerySpec) -> Trigger:
        return {"processingTime": "1 hour"}

    def unread() -> list[str]:
        return [] if len(seen) > 1 else ["slow"]

    with _supervising(spark, base_settings, [slow], out, trigger_of=hourly, unread=unread) as stop:
        wait_for(lambda: seen, 120, "the first batch")  # a processing-time trigger runs one at once
        stop.set()  # the run must now end by itself, within the minute it is given
    assert "draining: slow move to the default trigger (1 seconds)" in out.getvalue()
    assert seen[:2] == [0, 1], "the next batch ran on the default trigger; the first was not run again"


def test_a_query_moves_to_the_trigger_its_inputs_rate_asks_for_between_two_batches(
    spark: SparkSession, base_settings: Settings, tmp_path: Path
) -> None:
    # The rate source gives 10 rows a second. Below 5 rows/s the query would run every second, from 5 rows/s
    # every 2 seconds: once three batches in a row ask for that, the supervisor moves it there, once, and the
    # query goes on from its checkpoint.
    seen, out = [], io.StringIO()

    def write(batch: DataFrame, batch_id: int) -> None:
        batch.count()  # read it: a batch nobody reads has no input rows in its progress, so no rate
        seen.append(batch_id)

    steady = _rate_spec(tmp_path, "steady", write)
    every_second, every_two = {"processingTime": "1 second"}, {"processingTime": "2 seconds"}

    def at(_: QuerySpec, rows_per_second: float) -> Trigger:
        return every_two if rows_per_second >= 5 else every_second

    moved = "steady: its last batches read "
    with _supervising(spark, base_settings, [steady], out, trigger_of=lambda _: every_second, trigger_at=at):
        wait_for(lambda: moved in out.getvalue(), 120, "the move to the busy trigger")
        moved_after = len(seen)
        wait_for(lambda: len(seen) >= moved_after + 4, 120, "four batches on the new trigger")
        (query,) = spark.streams.active
        # A batch's progress is posted after its writer has run: wait for the progress itself, so that the last
        # three are batches of the new trigger and not the new run's first, which starts at once.
        wait_for(lambda: len(query.recentProgress) >= 4, 120, "four batches' progress on the new trigger")
        progress = query.recentProgress
    line = next(line for line in out.getvalue().splitlines() if line.startswith(moved))
    assert line.endswith("rows/s: every 2 seconds from now"), line
    assert out.getvalue().count(moved) == 1, "the new trigger is what the rate asks for: no move back"
    assert moved_after >= queries.RATE_BATCHES, seen  # three batches with a rate, then between two batches
    # The new run went on from the checkpoint, a trigger every 2 s (Spark's own timestamps).
    assert sorted(set(seen)) == list(range(max(seen) + 1)), "no batch lost"
    starts = [datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")) for p in progress[-3:]]
    assert all((b - a).total_seconds() >= 1.9 for a, b in itertools.pairwise(starts)), starts


def test_a_drain_restarts_each_parked_query_on_the_default_trigger_once_its_upstream_has_read_all(
    spark: SparkSession, base_settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # At a demo's stop the ingest query still has Kafka to read; the others, all on slower triggers, wait
    # (stopped) until every query upstream of them has read all its source holds, then read what is left once:
    # here "upstream" after the lead, "downstream" after both. The drain asks after each batch, not on a clock:
    # with an hour between its clock's checks it still ends within the test's minutes.
    monkeypatch.setattr(queries, "DRAIN_CHECK_SECONDS", 3600.0)
    seen: list[str] = []
    restarts: list[tuple[str, int]] = []
    """Each start after the stop: the query, and how many batches "upstream" had run by then."""
    stopping = threading.Event()

    def recorded(spec: QuerySpec) -> QuerySpec:
        def start(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
            if stopping.is_set():
                restarts.append((spec.name, seen.count("upstream")))
            return spec.start(spark, settings, trigger)

        return dataclasses.replace(spec, start=start)

    names = ("lead", "upstream", "downstream")
    specs = [recorded(_rate_spec(tmp_path, name, lambda *_, n=name: seen.append(n))) for name in names]
    followers = names[1:]
    upstream = {"lead": (), "upstream": ("lead",), "downstream": ("lead", "upstream")}
    lead_read_all, checks, out = threading.Event(), [], io.StringIO()

    def hourly_followers(spec: QuerySpec) -> Trigger:
        return {"processingTime": "1 hour" if spec.name in followers else base_settings.trigger_interval}

    def unread() -> list[str]:
        checks.append(len(seen))
        if not lead_read_all.is_set():
            return ["lead"]
        running = {q.name for q in spark.streams.active}
        return [name for name in followers if name in running and seen.count(name) < 2]

    options = {"lead": ("lead",), "trigger_of": hourly_followers, "unread": unread, "upstream": upstream.__getitem__}
    with _supervising(spark, base_settings, specs, out, **options) as stop:
        wait_for(lambda: all(name in seen for name in followers), 120, "the followers' first batches")
        stopping.set()
        stop.set()
        wait_for(lambda: {q.name for q in spark.streams.active}.isdisjoint(followers), 120, "the followers to stop")
        parked_at = len(checks)
        wait_for(lambda: len(checks) >= parked_at + 2, 60, "two drain checks while the lead query reads")
        assert [seen.count(name) for name in followers] == [1, 1], "a follower ran again before the lead had read all"
        assert restarts == []
        lead_read_all.set()
        wait_for(lambda: all(seen.count(name) > 1 for name in followers), 120, "the followers' default triggers")
    assert "draining: downstream, upstream move to the default trigger (1 seconds)" in out.getvalue()
    # "upstream" started again first, and "downstream" only once "upstream" had read all (its second batch).
    assert [name for name, _ in restarts] == ["upstream", "downstream"], restarts
    assert restarts[1][1] >= 2, restarts
