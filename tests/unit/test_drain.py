"""When a running stream has drained (``pipeline.drain``): each query against what its source holds."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from iotmon.config import Settings
from iotmon.schema import ANOMALIES, SILVER, TOO_LATE_READINGS
from pipeline.drain import delta_source_end, kafka_read, table_read, unread
from pipeline.topology import TOPOLOGY


def delta_source(path: str, version: int, index: int = -1, as_json: bool = False) -> dict[str, Any]:
    end = {"sourceVersion": 1, "reservoirVersion": version, "index": index, "isStartingVersion": False}
    return {"description": f"DeltaSource[file:{path}]", "endOffset": json.dumps(end) if as_json else end}


def test_a_delta_source_is_found_by_its_table_path_among_the_sources() -> None:
    progress = {"sources": [delta_source("/lake/silver", 7), delta_source("/lake/stream_clock", 3, as_json=True)]}
    assert delta_source_end(progress, "/lake/silver") == (7, -1)
    assert delta_source_end(progress, "/lake/stream_clock/") == (3, -1)
    assert delta_source_end(progress, "/lake/bronze") is None
    assert delta_source_end(None, "/lake/silver") is None


def test_a_table_is_read_once_the_offset_is_past_its_version_or_it_has_no_data() -> None:
    assert table_read((8, -1), version=7, has_files=True)
    assert not table_read((7, -1), version=7, has_files=True)  # version 7 itself is not read yet
    assert not table_read((8, 3), version=7, has_files=True)  # in the middle of a version
    assert table_read(None, version=0, has_files=False)  # a query that never saw data, of a table with none
    assert not table_read(None, version=2, has_files=True)


def test_kafka_is_read_when_every_partition_is_at_its_high_watermark() -> None:
    assert kafka_read({0: 10, 1: 5}, {0: 10, 1: 5})
    assert not kafka_read({0: 10, 1: 4}, {0: 10, 1: 5})
    assert not kafka_read({}, {0: 1})
    assert kafka_read({}, {0: 0, 1: 0})  # an empty topic


def test_unread_lists_the_running_queries_behind_their_source_upstream_first() -> None:
    settings = Settings(home=Path("/home"))
    versions = {TOO_LATE_READINGS: 4, SILVER: 6, ANOMALIES: 0}
    files = {TOO_LATE_READINGS: True, SILVER: True, ANOMALIES: False}
    progress: dict[str, Mapping[str, Any] | None] = {
        "ingest": {"sources": [{"description": "KafkaV2[Subscribe[t]]", "endOffset": {"t": {"0": 9}}}]},
        "late_arrivals": {"sources": [delta_source(settings.table_path(TOO_LATE_READINGS), 5)]},
        "device_windows": {"sources": [delta_source(settings.table_path(SILVER), 6)]},  # version 6 unread
        "alerts": None,  # anomalies has no data yet
    }
    running = set(progress)

    def behind(high: int) -> list[str]:
        return unread(progress.get, settings, lambda: {0: high}, lambda table: (versions[table], files[table]), running)

    assert behind(high=9) == ["device_windows"]
    assert behind(high=12) == ["ingest", "device_windows"]
    progress["device_windows"] = {"sources": [delta_source(settings.table_path(SILVER), 7)]}
    assert behind(high=9) == []
    assert {n.name for n in TOPOLOGY} >= running
