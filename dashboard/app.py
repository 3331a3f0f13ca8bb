"""The dashboard page: Dash layout and callbacks, at the edge. Reads come from ``dashboard.lake`` and
``dashboard.models``, numbers from ``dashboard.shaping``; this module only lays them out.

The page re-reads the lake every ``IOTMON_DASHBOARD_REFRESH`` (a ``dcc.Interval``). Each section is its own
callback and catches its own errors, so an unreadable table blanks one section with a message, not the page.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, TextIO

import pandas as pd
import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.dataset as ds
from dash import Dash, Input, Output, State, dcc, html, no_update
from plotly.subplots import make_subplots

from dashboard import shaping
from dashboard.lake import LakeReader, is_true
from dashboard.models import read_model_history
from iotmon.config import Settings, interval_seconds
from iotmon.logs import say
from iotmon.schema import (
    ALERTS,
    ANOMALIES,
    DEGRADED,
    DEVICE_ID,
    DEVICE_STATUS,
    DEVICE_WINDOWS,
    DEVICES,
    EVENT_TIME,
    FRESHNESS_COLUMNS,
    LATE,
    LATENESS,
    LIVE_WINDOWS,
    METRICS,
    OFFLINE,
    ONLINE,
    OPEN,
    QUARANTINE,
    QUERY_PROGRESS,
    SEQ,
    SILVER,
    TOO_LATE,
)
from iotmon.status import kafka_newest_event, stream_process
from ml.registry import import_mlflow
from streaming.windows import SLIDING

ANOMALY_ROWS = 50
ALERT_ROWS = 50
QUARANTINE_ROWS = 10
ANOMALY_READ_ROWS = 5_000
"""Flagged readings read per refresh (the latest ones); the page lists ``ANOMALY_ROWS`` of them."""
MODEL_CACHE_SECONDS = 30.0
"""Registered versions change when the trainer runs (minutes apart); MLflow is asked at most this often."""
TIMESTAMP = pa.timestamp("us", tz="UTC")
"""How delta-rs reads every Delta ``timestamp`` column."""
GRAPH_CONFIG = {"displayModeBar": False}
HIDDEN, SHOWN = {"display": "none"}, {"display": "block"}
STATE_COLOURS = {ONLINE: "#2e7d32", DEGRADED: "#ef6c00", OFFLINE: "#c62828", shaping.NOT_REPORTED: "#757575"}

CSS = """
body { font-family: system-ui, sans-serif; margin: 0; background: #f4f5f7; color: #1d2630; }
header { background: #1d2630; color: #fff; padding: 10px 20px; display: flex; gap: 24px; align-items: baseline; }
header h1 { font-size: 20px; margin: 0; }
header span { font-size: 13px; opacity: 0.85; }
main { padding: 12px 20px; }
section { background: #fff; border-radius: 6px; padding: 12px 16px; margin-bottom: 14px; }
section h2 { font-size: 16px; margin: 0 0 8px 0; }
.cards { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 8px; }
.card { border-left: 5px solid #888; padding: 6px 12px; min-width: 110px; background: #fafafa; }
.card .value { font-size: 26px; font-weight: 600; }
.card .label { font-size: 12px; color: #555; }
.row { display: flex; gap: 20px; flex-wrap: wrap; align-items: flex-start; }
table { border-collapse: collapse; font-size: 12px; }
th, td { padding: 3px 8px; border-bottom: 1px solid #e3e3e3; text-align: right; white-space: nowrap; }
th { background: #eef0f3; } td:first-child, th:first-child { text-align: left; }
.waiting { color: #8a6d00; background: #fff8e1; padding: 6px 10px; border-radius: 4px; margin: 4px 0; }
.error { color: #b71c1c; background: #ffebee; padding: 6px 10px; border-radius: 4px; margin: 4px 0; }
.scroll { max-height: 320px; overflow-y: auto; }
"""


# --- small rendering helpers -------------------------------------------------------------------------------


def slug(text: str) -> str:
    return text.replace(" ", "-").replace("_", "-")


def waiting(what: str) -> html.Div:
    return html.Div(f"waiting for data: {what}", className="waiting")


def _cell(value: Any) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return "–"
    if isinstance(value, datetime | pd.Timestamp):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float) and value.is_integer():
        return f"{int(value):,}"  # a count that became float because another row had none
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def table(frame: pd.DataFrame, element_id: str, columns: Sequence[tuple[str, str]]) -> html.Table:
    """An HTML table of ``frame``'s ``columns`` ((column, heading) pairs), values formatted for reading."""
    head = html.Thead(html.Tr([html.Th(heading) for _, heading in columns]))
    body = html.Tbody(
        [html.Tr([html.Td(_cell(row.get(column))) for column, _ in columns]) for row in frame.to_dict("records")]
    )
    return html.Table([head, body], id=element_id)


def cards(counts: dict[str, Any], prefix: str, colours: dict[str, str] | None = None) -> html.Div:
    return html.Div(
        [
            html.Div(
                [
                    html.Div(str(value), id=f"{prefix}-{slug(name)}", className="value"),
                    html.Div(name, className="label"),
                ],
                className="card",
                style={"borderLeftColor": (colours or {}).get(name, "#607d8b")},
            )
            for name, value in counts.items()
        ],
        className="cards",
    )


def failed(section: str, exc: BaseException) -> html.Div:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return html.Div(f"could not read {section}: {first}", className="error")


class Cached:
    """A value recomputed at most every ``seconds`` (shared by all browser tabs)."""

    def __init__(self, compute: Callable[[], Any], seconds: float) -> None:
        self.compute, self.seconds = compute, seconds
        self._value: Any = None
        self._at = -float("inf")
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if time.monotonic() - self._at >= self.seconds:
                self._value, self._at = self.compute(), time.monotonic()
            return self._value


# --- layout ------------------------------------------------------------------------------------------------


def layout(settings: Settings) -> html.Div:
    metrics = [{"label": f"{m.name} ({m.unit})", "value": m.name} for m in METRICS]
    refresh_ms = int(interval_seconds(settings.dashboard_refresh) * 1000)
    return html.Div(
        [
            dcc.Interval(id="tick", interval=refresh_ms, n_intervals=0),
            html.Header(
                [
                    html.H1("iotmon fleet"),
                    html.Span(id="stream-state"),
                    html.Span(f"lake {settings.lake_root}"),
                    html.Span(id="refreshed"),
                ]
            ),
            html.Main(
                [
                    html.Section([html.H2("Fleet"), html.Div(id="fleet")], id="fleet-section"),
                    html.Section(
                        [
                            html.H2("Device"),
                            html.Div(
                                [
                                    dcc.Dropdown(id="device", clearable=False, style={"width": "260px"}),
                                    dcc.Dropdown(
                                        id="metric",
                                        options=metrics,
                                        value=METRICS[0].name,
                                        clearable=False,
                                        style={"width": "260px"},
                                    ),
                                ],
                                className="row",
                            ),
                            html.Div(id="device-view"),
                            # Graphs stay in the page and get new figures: re-creating a graph on every refresh
                            # makes a slow browser start over before it has drawn anything.
                            dcc.Graph(id="device-graph", config=GRAPH_CONFIG, style=HIDDEN),
                        ],
                        id="device-section",
                    ),
                    html.Section([html.H2("Anomalies and alerts"), html.Div(id="events")], id="events-section"),
                    html.Section(
                        [
                            html.H2("Pipeline health"),
                            html.Div(id="pipeline"),
                            dcc.Graph(id="pipeline-graph", config=GRAPH_CONFIG, style=HIDDEN),
                        ],
                        id="pipeline-section",
                    ),
                    html.Section([html.H2("Models"), html.Div(id="models")], id="models-section"),
                ]
            ),
        ]
    )


# --- sections ----------------------------------------------------------------------------------------------


class Views:
    """Each section's content from the lake; one instance per app, shared by all browser tabs."""

    def __init__(
        self, settings: Settings, reader: LakeReader, kafka_newest: Callable[[], datetime | None] | None = None
    ) -> None:
        self.settings = settings
        self.reader = reader
        self.lookback = timedelta(seconds=interval_seconds(settings.dashboard_lookback))
        self.model_history = Cached(lambda: read_model_history(settings), MODEL_CACHE_SECONDS)
        refresh = interval_seconds(settings.dashboard_refresh)
        self.kafka_newest = kafka_newest or Cached(lambda: kafka_newest_event(settings), refresh).get
        """The newest event in Kafka, what each table's freshness is measured against (None: no answer)."""

    def since(self) -> datetime | None:
        """Where "recent" starts: the lookback before silver's newest reading (event time, not wall time)."""
        newest = self.reader.newest(SILVER, EVENT_TIME)
        return None if newest is None else newest - self.lookback

    def fleet(self) -> pd.DataFrame:
        status = self.reader.read(DEVICE_STATUS, list(shaping.FLEET_COLUMNS))
        devices = self.reader.read(DEVICES, [DEVICE_ID, "site", "device_type"])
        return shaping.fleet(status, devices)

    def anomalies(self, since: datetime | None, device: str | None = None) -> pd.DataFrame:
        where = is_true("is_anomaly")
        if device is not None:
            where = where & (ds.field(DEVICE_ID) == device)
        return self.reader.read(
            ANOMALIES,
            [*shaping.ANOMALY_COLUMNS, SEQ, "is_anomaly"],
            since=None if since is None else (EVENT_TIME, since),
            where=where,
            newest_first=EVENT_TIME,
            limit=ANOMALY_READ_ROWS,
        )

    def alerts(self, since: datetime | None) -> pd.DataFrame:
        where = ds.field("status") == OPEN
        if since is not None:
            where = where | (ds.field("last_anomaly_at") >= pa.scalar(since, TIMESTAMP))
        return self.reader.read(ALERTS, list(shaping.ALERT_COLUMNS), where=where, newest_first="last_anomaly_at")

    def overview(self) -> tuple[Any, Any, list[str], str | None]:
        """The fleet and events sections, and the devices to choose from (with the default choice)."""
        since = self.since()
        try:
            fleet = self.fleet()
            counts = shaping.fleet_counts(fleet)
            fleet_view: list[Any] = [cards(counts, "fleet", STATE_COLOURS)]
            if counts[shaping.TOTAL] == 0:
                fleet_view.append(waiting("no devices yet (registry from `iotmon simulate`, status from the stream)"))
            else:
                columns = [(state, state) for state in (*shaping.FLEET_STATES, shaping.TOTAL)]
                by_site = shaping.fleet_breakdown(fleet, "site")
                by_type = shaping.fleet_breakdown(fleet, "device_type")
                fleet_view.append(
                    html.Div(
                        [
                            html.Div(table(by_site, "fleet-by-site", [("site", "site"), *columns]), className="scroll"),
                            html.Div(table(by_type, "fleet-by-type", [("device_type", "type"), *columns])),
                        ],
                        className="row",
                    )
                )
        except Exception as exc:
            fleet, fleet_view = shaping.fleet(pd.DataFrame(), pd.DataFrame()), [failed("the fleet", exc)]
        try:
            flagged = self.anomalies(since)
            alerts = self.alerts(since)
            scored = self.reader.counts(ANOMALIES, "is_anomaly", since=None if since is None else (EVENT_TIME, since))
            events = self._events(flagged, alerts, int(scored.get(True, 0)))
        except Exception as exc:
            flagged, events = pd.DataFrame(columns=[DEVICE_ID, EVENT_TIME]), [failed("anomalies and alerts", exc)]
        choices, default = shaping.device_choices(fleet, flagged)
        return fleet_view, events, choices, default

    def _events(self, flagged: pd.DataFrame, alerts: pd.DataFrame, recent: int) -> list[Any]:
        latest = shaping.latest_anomalies(flagged, ANOMALY_ROWS)
        board = shaping.alert_board(alerts, ALERT_ROWS)
        counts = {"open alerts": shaping.open_alert_count(alerts), "recent anomalies": recent}

        def scrolling(frame: pd.DataFrame, table_id: str, columns: tuple[str, ...], empty: str) -> Any:
            if frame.empty:
                return waiting(empty)
            return html.Div(table(frame, table_id, [(c, c.replace("_", " ")) for c in columns]), className="scroll")

        anomaly_view = scrolling(
            latest,
            "anomalies-table",
            shaping.ANOMALY_COLUMNS,
            "no anomalies flagged yet (the scorer needs a champion model: `iotmon train`)",
        )
        alert_view = scrolling(board, "alerts-table", shaping.ALERT_COLUMNS, "no alerts yet")
        return [
            cards(counts, "events"),
            html.Div(
                [html.Div([html.H3("Latest anomalies"), anomaly_view]), html.Div([html.H3("Alerts"), alert_view])],
                className="row",
            ),
        ]

    def device(self, device: str | None, metric: str) -> tuple[Any, go.Figure | None]:
        """A waiting message, or None and the device's figure."""
        if device is None:
            return waiting("no devices yet"), None
        since = self.since()
        if since is None:
            return waiting(f"no readings yet for {device}"), None
        only = ds.field(DEVICE_ID) == device
        avg = f"{metric}_avg"
        readings = self.reader.read(
            SILVER, [SEQ, EVENT_TIME, metric], since=(EVENT_TIME, since), where=only, newest_first=EVENT_TIME
        )
        live = self.reader.read(
            LIVE_WINDOWS, ["window_start", "window_end", avg], since=("window_start", since), where=only
        )
        final = self.reader.read(
            DEVICE_WINDOWS,
            ["window_start", "window_end", avg],
            since=("window_end", since),
            where=only & (ds.field("window_kind") == SLIDING),
        )
        series = shaping.device_series(readings, live, final, self.anomalies(since, device), metric)
        if series.empty:
            return waiting(f"no readings of {device} in the last {self.settings.dashboard_lookback}"), None
        figure = go.Figure()
        figure.add_scatter(
            x=series.readings[EVENT_TIME], y=series.readings["value"], name="readings", line={"color": "#90a4ae"}
        )
        figure.add_scatter(
            x=series.tumbling["window_start"],
            y=series.tumbling["value"],
            name=f"{self.settings.window} average (live)",
            line={"shape": "hv", "color": "#1565c0", "width": 2},
        )
        figure.add_scatter(
            x=series.sliding["window_end"],
            y=series.sliding["value"],
            name=f"{self.settings.sliding_window} sliding average",
            line={"color": "#6a1b9a", "dash": "dot"},
        )
        figure.add_scatter(
            x=series.anomalies[EVENT_TIME],
            y=series.anomalies["value"],
            name="anomaly",
            mode="markers",
            marker={"color": "#d32f2f", "size": 11, "symbol": "x"},
            customdata=series.anomalies[["score", "model_version", "top_metric"]].to_numpy(),
            hovertemplate="score %{customdata[0]:.2f}, model v%{customdata[1]}, %{customdata[2]}<extra></extra>",
        )
        figure.update_layout(
            height=340, margin={"l": 40, "r": 10, "t": 30, "b": 30}, title=f"{device}: {metric}", legend_orientation="h"
        )
        return None, figure

    def pipeline(self) -> tuple[list[Any], go.Figure | None]:
        """The section's counters and tables, and its charts (None before the first recorded batch)."""
        newest = self.reader.newest(QUERY_PROGRESS, "timestamp")
        progress = pd.DataFrame()
        if newest is not None:
            progress = self.reader.read(
                QUERY_PROGRESS,
                list(shaping.PROGRESS_COLUMNS),
                since=("timestamp", newest - self.lookback),
                newest_first="timestamp",
            )
        series = shaping.progress_series(progress)
        latest = shaping.latest_per_query(series)
        since = self.since()
        lateness = shaping.lateness_counts(
            self.reader.counts(SILVER, LATENESS, since=None if since is None else (EVENT_TIME, since))
        )
        newest_quarantined = self.reader.newest(QUARANTINE, "ingest_time")
        quarantined = self.reader.read(
            QUARANTINE,
            ["stage", "reason"],
            since=None if newest_quarantined is None else ("ingest_time", newest_quarantined - self.lookback),
        )
        reasons = shaping.quarantine_reasons(quarantined)
        fresh = shaping.freshness(
            {name: self.reader.newest(name, column) for name, column in FRESHNESS_COLUMNS.items()}, self.kafka_newest()
        )
        slowest = fresh.dropna(subset=["behind_kafka_s"]).head(1)
        lag = latest["kafka_lag"].max() if not latest.empty else None
        counts = {
            "kafka lag (records)": "–" if lag is None or pd.isna(lag) else f"{int(lag):,}",
            "slowest table behind Kafka": (
                "–" if slowest.empty else f"{slowest['table'].iat[0]} {slowest['behind_kafka_s'].iat[0]:,.0f} s"
            ),
            "late readings": f"{lateness[LATE]:,}",
            "too late readings": f"{lateness[TOO_LATE]:,}",
            "dropped by watermark": f"{int(latest['rows_dropped_by_watermark'].fillna(0).sum()):,}",
            "quarantined records": f"{int(reasons['records'].sum()) if not reasons.empty else 0:,}",
        }
        view: list[Any] = [cards(counts, "pipeline")]
        if latest.empty:
            view.append(waiting("no micro-batch recorded yet (`iotmon stream` writes query_progress)"))
            return view, None
        query_columns = [
            ("query_name", "query"),
            ("batch_id", "batch"),
            ("timestamp", "at"),
            ("input_rows_per_second", "input rows/s"),
            ("processed_rows_per_second", "processed rows/s"),
            ("batch_duration_s", "batch s"),
            ("kafka_lag", "kafka lag"),
            ("watermark_delay_s", "watermark delay s"),
            ("state_rows", "state rows"),
            ("rows_dropped_by_watermark", "dropped (watermark)"),
        ]
        view.append(
            html.Div(
                [
                    table(latest, "queries-table", query_columns),
                    table(
                        fresh,
                        "freshness-table",
                        [("table", "table"), ("newest_event", "newest event"), ("behind_kafka_s", "behind Kafka s")],
                    ),
                    table(
                        reasons.head(QUARANTINE_ROWS),
                        "quarantine-table",
                        [("stage", "stage"), ("reason", "quarantine reason"), ("records", "records")],
                    )
                    if not reasons.empty
                    else html.Div("nothing quarantined", id="quarantine-table"),
                ],
                className="row",
            )
        )
        return view, _progress_figure(series)

    def models(self) -> list[Any]:
        history = self.model_history.get()
        if history is None:
            return [waiting(f"no registered versions of {self.settings.model_name} yet (`iotmon train`)")]
        if history.champion is None:
            headline = "no champion: the scorer waits until a version is promoted"
        else:
            since = "unknown (alias moved by hand)" if history.champion_since is None else _cell(history.champion_since)
            headline = f"champion: {self.settings.model_name} v{history.champion} since {since}"
        columns = [
            ("version", "version"),
            ("champion", "champion"),
            ("created", "registered"),
            ("promoted_at", "promoted"),
            *[(name, name) for name in shaping.MODEL_METRICS],
            ("decision", "trainer's decision"),
        ]
        return [html.Div(headline, id="champion"), table(history.versions, "models-table", columns)]


def _progress_figure(series: pd.DataFrame) -> go.Figure:
    panels = [
        ("input_rows_per_second", "input rows/s"),
        ("processed_rows_per_second", "processed rows/s"),
        ("batch_duration_s", "batch duration (s)"),
        ("kafka_lag", "Kafka lag (records)"),
        ("watermark_delay_s", "watermark delay (s)"),
        ("state_rows", "state rows"),
    ]
    figure = make_subplots(rows=2, cols=3, subplot_titles=[title for _, title in panels], shared_xaxes=True)
    palette = ["#1565c0", "#2e7d32", "#ef6c00", "#6a1b9a", "#c62828", "#00838f", "#5d4037", "#ad1457", "#455a64"]
    for index, (name, rows) in enumerate(series.groupby("query_name", sort=True)):
        in_legend = False
        for panel, (column, _) in enumerate(panels):
            values = pd.to_numeric(rows[column], errors="coerce")
            if values.isna().all():
                continue
            figure.add_scatter(
                x=rows["timestamp"],
                y=values,
                name=str(name),
                legendgroup=str(name),
                showlegend=not in_legend,
                line={"color": palette[index % len(palette)]},
                row=panel // 3 + 1,
                col=panel % 3 + 1,
            )
            in_legend = True
    figure.update_layout(height=460, margin={"l": 40, "r": 10, "t": 40, "b": 30})
    return figure


# --- the app -----------------------------------------------------------------------------------------------


def create_app(settings: Settings, reader: LakeReader | None = None) -> Dash:
    # The model history reads MLflow from the server's request threads, which may run at once: MLflow's first
    # import is not thread-safe, so it is made here, before any server starts (``ml.registry.import_mlflow``).
    import_mlflow()
    views = Views(settings, reader or LakeReader(settings))
    app = Dash(__name__, title="iotmon dashboard", update_title=None, add_log_handler=False)
    app.index_string = app.index_string.replace("{%css%}", "{%css%}<style>" + CSS + "</style>")
    app.layout = layout(settings)

    @app.callback(
        Output("fleet", "children"),
        Output("events", "children"),
        Output("device", "options"),
        Output("device", "value"),
        Output("refreshed", "children"),
        Output("stream-state", "children"),
        Input("tick", "n_intervals"),
        State("device", "options"),
        State("device", "value"),
    )
    def refresh_overview(_: int, offered: list[str] | None, current: str | None) -> tuple[Any, ...]:
        fleet, events, choices, default = views.overview()
        process, _ = stream_process(settings)
        state = f"stream running (pid {process.pid})" if process.running else "stream not running"
        refreshed = f"refreshed {datetime.now().astimezone():%H:%M:%S}"
        chosen = shaping.keep_choice(choices, current, default)
        # Setting options or value, even to what they are, re-runs the device callback: only changes are sent.
        options = no_update if choices == offered else choices
        return fleet, events, options, no_update if chosen == current else chosen, refreshed, state

    def with_graph(message: Any, figure: go.Figure | None) -> tuple[Any, Any, dict[str, str]]:
        """A section's content and its graph: the graph keeps its last figure while hidden."""
        return message, no_update if figure is None else figure, HIDDEN if figure is None else SHOWN

    @app.callback(
        Output("device-view", "children"),
        Output("device-graph", "figure"),
        Output("device-graph", "style"),
        Input("tick", "n_intervals"),
        Input("device", "value"),
        Input("metric", "value"),
    )
    def refresh_device(_: int, device: str | None, metric: str) -> tuple[Any, ...]:
        try:
            return with_graph(*views.device(device, metric))
        except Exception as exc:
            return with_graph(failed(f"device {device}", exc), None)

    @app.callback(
        Output("pipeline", "children"),
        Output("pipeline-graph", "figure"),
        Output("pipeline-graph", "style"),
        Input("tick", "n_intervals"),
    )
    def refresh_pipeline(_: int) -> tuple[Any, ...]:
        try:
            return with_graph(*views.pipeline())
        except Exception as exc:
            return with_graph(failed("the ops tables", exc), None)

    @app.callback(Output("models", "children"), Input("tick", "n_intervals"))
    def refresh_models(_: int) -> Any:
        try:
            return views.models()
        except Exception as exc:
            return failed("the model registry", exc)

    return app


def serve(settings: Settings, out: TextIO = sys.stdout) -> None:
    """Serve the dashboard until Ctrl-C or SIGTERM (Flask's threaded server: one operator's page, on loopback
    by default; put a WSGI server in front of ``create_app(...).server`` to share it wider)."""
    app = create_app(settings)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per refresh of every open page
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    host = f"[{settings.dashboard_host}]" if ":" in settings.dashboard_host else settings.dashboard_host
    say(
        f"dashboard: http://{host}:{settings.dashboard_port}/ (lake {settings.lake_root}, "
        f"refresh every {settings.dashboard_refresh}); Ctrl-C stops",
        out,
    )
    # Its WSGI app served as a production server would, rather than through ``app.run``: no development
    # banners on the console, and the requests' log lines go where ``iotmon.logs`` sends them.
    from werkzeug.serving import run_simple

    run_simple(settings.dashboard_host, settings.dashboard_port, app.server, threaded=True)
