"""The dashboard's sections on a lake that is missing, or whose tables exist but are still empty (the first
minutes of a demo): every section says what it waits for, none fails. Also the page's layout and command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import plotly.utils
import pyarrow as pa
import pytest
from deltalake import write_deltalake

from dashboard.app import Views, create_app
from dashboard.lake import LakeReader
from iotmon.cli import build_parser
from iotmon.config import Settings
from iotmon.schema import ALERTS, ANOMALIES, DEVICE_STATUS, DEVICES, QUARANTINE, QUERY_PROGRESS, SILVER

UTC_TIME = pa.timestamp("us", tz="UTC")
EMPTY_TABLES: dict[str, pa.Schema] = {
    DEVICES: pa.schema([("device_id", pa.string()), ("device_type", pa.string()), ("site", pa.string())]),
    DEVICE_STATUS: pa.schema([("device_id", pa.string()), ("status", pa.string()), ("last_seen", UTC_TIME)]),
    SILVER: pa.schema(
        [("device_id", pa.string()), ("seq", pa.int64()), ("event_time", UTC_TIME), ("lateness", pa.string())]
    ),
    ANOMALIES: pa.schema([("device_id", pa.string()), ("event_time", UTC_TIME), ("is_anomaly", pa.bool_())]),
    ALERTS: pa.schema([("device_id", pa.string()), ("status", pa.string()), ("last_anomaly_at", UTC_TIME)]),
    QUERY_PROGRESS: pa.schema([("query_name", pa.string()), ("timestamp", UTC_TIME)]),
    QUARANTINE: pa.schema([("stage", pa.string()), ("reason", pa.string()), ("ingest_time", UTC_TIME)]),
}


def rendered(component: Any) -> str:
    return json.dumps(component, cls=plotly.utils.PlotlyJSONEncoder)


@pytest.mark.parametrize("tables", ["missing", "empty"])
def test_every_section_waits_without_errors_on_a_new_lake(tmp_path: Path, tables: str) -> None:
    settings = Settings.from_env({}, home=tmp_path)
    if tables == "empty":
        for name, schema in EMPTY_TABLES.items():
            write_deltalake(settings.table_path(name), schema.empty_table())
    views = Views(settings, LakeReader(settings), kafka_newest=lambda: None)

    fleet, events, choices, default = views.overview()
    device, figure = views.device(default, "temperature")
    pipeline, charts = views.pipeline()
    page = rendered([fleet, events, device, pipeline, views.models()])
    assert "could not read" not in page
    assert page.count("waiting for data") == 6  # fleet, device, anomalies, alerts, pipeline, models
    assert (choices, default, figure, charts) == ([], None, None, None)
    assert '"children": "0", "id": "fleet-total"' in page


def test_the_page_has_every_section_and_refreshes_itself(tmp_path: Path) -> None:
    settings = Settings.from_env({"IOTMON_DASHBOARD_REFRESH": "3 seconds"}, home=tmp_path)
    page = rendered(create_app(settings).layout)
    for section in ("fleet", "device-view", "events", "pipeline", "models"):
        assert f'"id": "{section}"' in page
    assert '"interval": 3000' in page


def test_the_command_takes_host_and_port_over_the_settings() -> None:
    args = build_parser().parse_args(["dashboard", "--host", "0.0.0.0", "--port", "9001"])
    assert (args.command, args.host, args.port) == ("dashboard", "0.0.0.0", 9001)
    assert build_parser().parse_args(["dashboard"]).port is None  # then IOTMON_DASHBOARD_PORT decides
