"""What the supervisor tells the user: a failed query's error summarised, and progress as news only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iotmon.queries import ProgressReport, explain


@dataclass
class _Query:
    """The members of a ``StreamingQuery`` the report reads; ``progress`` holds its batches, oldest first."""

    name: str
    runId: str
    progress: list[dict[str, Any]] = field(default_factory=list)

    @property
    def lastProgress(self) -> dict[str, Any] | None:
        return self.progress[-1] if self.progress else None

    @property
    def recentProgress(self) -> list[dict[str, Any]]:
        return self.progress


def _progress(batch: int, rows: int) -> dict[str, Any]:
    return {
        "batchId": batch,
        "numInputRows": rows,
        "inputRowsPerSecond": 0.0,
        "processedRowsPerSecond": 0.0,
        "durationMs": {"triggerExecution": 1500},
        "sources": [],
    }


def test_a_query_is_reported_once_as_it_starts_then_once_per_batch_that_read_rows() -> None:
    report = ProgressReport()
    query = _Query("ingest", "run-1")
    queries = {"ingest": query}

    assert report.lines(queries, {}) == ["ingest       starting"]
    assert report.lines(queries, {}) == []

    query.progress.append(_progress(0, 1_000))
    (line,) = report.lines(queries, {})
    assert line.startswith("ingest       batch     0  rows     1,000")
    assert report.lines(queries, {}) == [], "the same batch again"

    query.progress.append(_progress(1, 0))
    assert report.lines(queries, {}) == [], "a batch without data"

    query.progress.append(_progress(2, 500))
    (line,) = report.lines(queries, {})
    assert "batch     2  rows       500" in line


def test_a_batch_followed_by_one_without_data_is_still_reported() -> None:
    report = ProgressReport()
    query = _Query("alerts", "run-1", [_progress(0, 300)])
    queries = {"alerts": query}
    assert len(report.lines(queries, {})) == 1

    # Between two reports: a batch with rows, then the no-data batch a stateful query runs after it.
    query.progress += [_progress(1, 200), _progress(2, 0)]
    (line,) = report.lines(queries, {})
    assert "batch     1  rows       200" in line
    query.progress.append(_progress(3, 0))
    assert report.lines(queries, {}) == [], "batch 1 was shown already"


def test_a_restarted_query_is_reported_again_and_rows_are_counted_once_per_source_read() -> None:
    report = ProgressReport()
    query = _Query("device_windows", "run-1", [_progress(3, 800)])
    queries = {"device_windows": query}
    (line,) = report.lines(queries, {"device_windows": 2})
    assert "rows       400" in line

    query.runId, query.progress = "run-2", []
    assert report.lines(queries, {"device_windows": 2}) == ["device_windows starting"]
    query.progress.append(_progress(3, 800))  # the same batch id, replayed by the new run
    assert len(report.lines(queries, {"device_windows": 2})) == 1


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
