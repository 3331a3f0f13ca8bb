"""What the supervisor tells the user: a failed query's error summarised, and progress as news only; what it
knows of its queries' runs."""

from __future__ import annotations

import json
from typing import Any

from pyspark.sql import SparkSession

from iotmon.queries import ProgressReport, QueryEvents, _EventsFromJson, explain, query_settings


def _progress(batch: int, rows: int, run: str = "run-1", wrote: bool = True) -> dict[str, Any]:
    durations = {"triggerExecution": 1500, **({"addBatch": 1200} if wrote else {})}
    return {
        "runId": run,
        "batchId": batch,
        "numInputRows": rows,
        "inputRowsPerSecond": 0.0,
        "processedRowsPerSecond": 0.0,
        "durationMs": durations,
        "sources": [],
    }


def test_a_query_is_reported_once_as_it_starts_then_once_per_batch_that_read_rows() -> None:
    events = QueryEvents()
    report = ProgressReport(events)
    runs = {"ingest": "run-1"}

    assert report.lines(runs) == ["ingest       starting"]
    assert report.lines(runs) == []

    events.progressed(_progress(0, 1_000))
    (line,) = report.lines(runs)
    assert line.startswith("ingest       batch     0  rows     1,000")
    assert report.lines(runs) == [], "the same batch again"

    events.progressed(_progress(1, 0))
    assert report.lines(runs) == [], "a batch without data"

    events.progressed(_progress(2, 500))
    (line,) = report.lines(runs)
    assert "batch     2  rows       500" in line


def test_a_batch_followed_by_one_without_data_is_still_reported() -> None:
    events = QueryEvents()
    report = ProgressReport(events)
    runs = {"alerts": "run-1"}
    events.progressed(_progress(0, 300))
    assert len(report.lines(runs)) == 1

    # Between two reports: a batch with rows, then the no-data batch a stateful query runs after it.
    events.progressed(_progress(1, 200))
    events.progressed(_progress(2, 0))
    (line,) = report.lines(runs)
    assert "batch     1  rows       200" in line
    events.progressed(_progress(3, 0))
    assert report.lines(runs) == [], "batch 1 was shown already"


def test_a_restarted_query_is_reported_again() -> None:
    events = QueryEvents()
    report = ProgressReport(events)
    events.progressed(_progress(3, 800))
    (line,) = report.lines({"device_windows": "run-1"})
    assert "rows       800" in line

    restarted = {"device_windows": "run-2"}
    assert report.lines(restarted) == ["device_windows starting"]
    events.progressed(_progress(3, 800, run="run-2"))  # the same batch id, replayed by the new run
    assert len(report.lines(restarted)) == 1


def test_query_events_keep_each_run_apart() -> None:
    events = QueryEvents()
    assert events.last("run-1") is None and not events.wrote("run-1") and not events.ended("run-1")

    events.progressed(_progress(0, 0, wrote=False))  # a trigger that found nothing to write
    assert events.last("run-1")["batchId"] == 0
    assert events.newest_with_rows("run-1") is None and not events.wrote("run-1")

    events.progressed(_progress(1, 40))
    events.progressed(_progress(2, 0))  # the batch that moves a watermark on
    assert events.last("run-1")["batchId"] == 2 and events.newest_with_rows("run-1")["batchId"] == 1
    assert events.wrote("run-1")

    events.terminated("run-1")
    assert events.ended("run-1")
    assert not events.ended("run-2") and not events.wrote("run-2"), "a restart is a run of its own"


def test_query_events_keep_the_input_rates_of_each_runs_last_batches_that_read_rows() -> None:
    events = QueryEvents()
    first = _progress(0, 900)  # a run's first batch: no trigger before it, so Spark reports no rate
    events.progressed(first)
    assert events.rates("run-1") == []
    for batch, rate in enumerate((100.0, 0.0, 200.0, 300.0, 400.0), start=1):
        rows = 0 if rate == 0 else 50  # a batch without rows (a watermark moving on) says nothing of the input
        events.progressed({**_progress(batch, rows), "inputRowsPerSecond": rate})
    assert events.rates("run-1") == [200.0, 300.0, 400.0]  # RATE_BATCHES of them, oldest first
    assert events.rates("run-2") == [], "a restart is a run of its own"


def test_a_python_error_inside_a_batch_is_summarised_by_its_cause() -> None:
    wrapped = (
        "An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):\n"
        '  File "job.py", line 3, in write\n'
        "    raise ValueError('bad row')\n"
        "ValueError: bad row\n"
    )
    assert explain(wrapped) == "ValueError: bad row"


def test_a_reset_broker_gets_a_hint() -> None:
    message = "[STREAM_FAILED] Partition t-0's offset was changed from 900 to 0, some data may have been missed.\nmore"
    summary, hint = explain(message).split("\n")
    assert summary.startswith("[STREAM_FAILED] Partition t-0's offset was changed")
    assert "iotmon reset" in hint


def test_an_ordinary_error_keeps_its_first_line() -> None:
    assert explain("Something broke\n\tat org.apache.Foo") == "Something broke"


def test_query_settings_hold_for_what_starts_inside_and_the_session_gets_its_own_back(spark: SparkSession) -> None:
    interval, unset = "spark.sql.streaming.noDataProgressEventInterval", "iotmon.test.neverSet"
    before = spark.conf.get(interval)
    with query_settings(spark, {interval: "10ms", unset: "x"}):
        assert (spark.conf.get(interval), spark.conf.get(unset)) == ("10ms", "x")
    assert spark.conf.get(interval) == before != "10ms"
    assert spark.conf.get(unset, None) is None


def test_a_reports_input_rate_is_over_the_time_since_the_runs_last_batch_not_its_last_poll() -> None:
    """The ingest query polls Kafka every second between batches: Spark's rate divides a batch's rows by one
    poll. Every listener gets the rate over the time since the run's previous batch began."""
    events = QueryEvents()
    bus = _EventsFromJson(events)

    class Event:
        def __init__(self, batch: int, at: str, spark_rate: float) -> None:
            sink = {"description": "ForeachBatchSink", "numOutputRows": -1}
            self.report = {
                **_progress(batch, 2_500),
                "id": "00000000-0000-0000-0000-000000000001",
                "runId": "00000000-0000-0000-0000-000000000002",
                "name": "ingest",
                "timestamp": at,
                "batchDuration": 1200,
                "stateOperators": [],
                "sink": sink,
                "inputRowsPerSecond": spark_rate,
            }

        def json(self) -> str:
            return json.dumps({"progress": self.report})

    run = "00000000-0000-0000-0000-000000000002"
    bus.onQueryProgress(Event(7, "2026-12-02T10:00:00.000Z", 2_500.0))
    assert events.last(run)["inputRowsPerSecond"] == 2_500.0  # no batch before it to count from
    bus.onQueryProgress(Event(8, "2026-12-02T10:00:05.000Z", 2_500.0))
    assert events.last(run)["batchId"] == 8 and events.last(run)["inputRowsPerSecond"] == 500.0
