"""When a running stream has drained: every query has read all its source holds.

A demo or a bench that stops its fleet wants the queries it has running, warm, to finish what is upstream
rather than to stop them and start them again. This module answers the question that needs: which queries
still have input they have not read? A query has caught up when its last batch read its source to the end:

- Kafka: the bronze query's end offset of every partition is the partition's high watermark;
- a Delta table: the query's end offset is past the table's current version (Delta's offset after reading
  version v whole is ``(v + 1, index -1)``), or the table has no data files yet (a query that never saw data
  reports no offset).

Only each query's streamed source counts (``Node.source``): the tables it joins are read whole every batch.
Ticks of the event clock do not count either: the clock is stopped before a drain, and a tick not yet read
only leaves windows open, which is what a stop does anyway. Answers are stable once every query has caught
up: no query then has input, so none writes to a table another query streams from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from iotmon.config import Settings
from iotmon.ops import source_offsets
from pipeline.clock import kafka_end
from pipeline.topology import KAFKA, TOPOLOGY

DELTA_SOURCE = "DeltaSource["


def delta_source_end(progress: Mapping[str, Any] | None, table_path: str) -> tuple[int, int] | None:
    """``(reservoirVersion, index)`` that a query's last batch read the Delta table at ``table_path`` up to."""
    wanted = table_path.rstrip("/").removeprefix("file:")
    for source in (progress or {}).get("sources") or []:
        description = str(source.get("description", ""))
        if not description.startswith(DELTA_SOURCE):
            continue
        path = description[len(DELTA_SOURCE) : -1].rstrip("/").removeprefix("file:")
        end = source_offsets(source.get("endOffset"))
        if path == wanted and end is not None and "reservoirVersion" in end:
            return int(end["reservoirVersion"]), int(end.get("index", -1))
    return None


def table_read(end: tuple[int, int] | None, version: int, has_files: bool) -> bool:
    """Whether a query whose last batch ended at ``end`` has read a table now at ``version``; pure."""
    if end is None:
        return not has_files
    read_to, index = end
    return index == -1 and read_to > version


def kafka_read(end: Mapping[int, int], high: Mapping[int, int]) -> bool:
    """Whether the bronze query has read every partition up to its high watermark; pure."""
    return all(end.get(partition, 0) >= offset for partition, offset in high.items())


def unread(
    progress_of: Callable[[str], Mapping[str, Any] | None],
    settings: Settings,
    kafka_high: Callable[[], Mapping[int, int]],
    table_state: Callable[[str], tuple[int, bool]],
    running: set[str],
) -> list[str]:
    """The ``running`` queries that have not read all their source holds, upstream first.

    ``progress_of(query)`` is its last progress, ``kafka_high()`` the topic's high watermarks and
    ``table_state(table)`` a table's current version and whether it has data files."""
    behind = []
    for node in TOPOLOGY:
        if node.name not in running:
            continue
        progress = progress_of(node.name)
        if node.source == KAFKA:
            caught_up = kafka_read(kafka_end(progress), kafka_high())
        else:
            version, has_files = table_state(node.source)
            caught_up = table_read(delta_source_end(progress, settings.table_path(node.source)), version, has_files)
        if not caught_up:
            behind.append(node.name)
    return behind


def unread_now(spark: Any, settings: Settings) -> list[str]:
    """``unread`` for the queries active in ``spark``, asking Kafka and the Delta logs (no Spark job)."""
    from deltalake import DeltaTable

    from iotmon.kafka import partition_offsets

    active = {query.name: query for query in spark.streams.active}

    def kafka_high() -> dict[int, int]:
        return {partition: high for partition, (_, high) in partition_offsets(settings, timeout=10).items()}

    def table_state(table: str) -> tuple[int, bool]:
        delta = DeltaTable(settings.table_path(table))
        return delta.version(), bool(delta.file_uris())

    return unread(lambda name: active[name].lastProgress, settings, kafka_high, table_state, set(active))
