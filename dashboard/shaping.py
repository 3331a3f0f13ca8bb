"""What the dashboard shows, computed from what it read: pandas (or plain records) in, pandas or dicts out.

Pure on purpose: no I/O, no clock, no Dash. Every function accepts the empty frame a missing or empty table
reads as, and returns an empty result rather than failing, so the page shows "waiting for data" in the
first minutes of a demo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd

from iotmon.schema import (
    DEGRADED,
    DEVICE_ID,
    DEVICE_STATES,
    EVENT_TIME,
    LATENESS_LEVELS,
    OFFLINE,
    OPEN,
    SEQ,
)

NOT_REPORTED = "not reported"
"""A device of the registry without a status yet: it has not sent a valid reading (or the stream is behind)."""
FLEET_STATES: tuple[str, ...] = (*DEVICE_STATES, NOT_REPORTED)
TOTAL = "total"
FLEET_COLUMNS: tuple[str, ...] = (DEVICE_ID, "site", "device_type", "status", "since", "last_seen", "reason")


# --- fleet -------------------------------------------------------------------------------------------------


def fleet(status: pd.DataFrame, devices: pd.DataFrame) -> pd.DataFrame:
    """One row per device: the registry's devices with their current status, and devices that report but
    are not (yet) in the registry. Site and type come from the registry, else from the status row."""
    registry = devices.reindex(columns=[DEVICE_ID, "site", "device_type"]).drop_duplicates(DEVICE_ID)
    current = status.reindex(columns=list(FLEET_COLUMNS)).drop_duplicates(DEVICE_ID, keep="last")
    merged = registry.merge(current, on=DEVICE_ID, how="outer", suffixes=("", "_status"))
    for column in ("site", "device_type"):
        merged[column] = merged[column].where(merged[column].notna(), merged[f"{column}_status"])
        merged[column] = merged[column].fillna("unknown")
    merged["status"] = merged["status"].where(merged["status"].isin(DEVICE_STATES), NOT_REPORTED)
    return merged.reindex(columns=list(FLEET_COLUMNS)).sort_values(DEVICE_ID, ignore_index=True)


def fleet_counts(devices: pd.DataFrame) -> dict[str, int]:
    """Devices per state (every state present, zero included) and the total."""
    counts = devices["status"].value_counts() if len(devices) else pd.Series(dtype="int64")
    result = {state: int(counts.get(state, 0)) for state in FLEET_STATES}
    result[TOTAL] = len(devices)
    return result


def fleet_breakdown(devices: pd.DataFrame, by: str) -> pd.DataFrame:
    """Devices per ``by`` (site or device_type) and state, with a total column; the worst groups first."""
    columns = [by, *FLEET_STATES, TOTAL]
    if devices.empty:
        return pd.DataFrame(columns=columns)
    table = pd.crosstab(devices[by], devices["status"]).reindex(columns=list(FLEET_STATES), fill_value=0)
    table[TOTAL] = table.sum(axis=1)
    table = table.reset_index().rename(columns={"index": by})
    return table.sort_values([OFFLINE, DEGRADED, by], ascending=[False, False, True], ignore_index=True)[columns]


# --- one device ----------------------------------------------------------------------------------------------


def device_choices(devices: pd.DataFrame, anomalies: pd.DataFrame) -> tuple[list[str], str | None]:
    """The devices to pick from, and the one to show first: the device of the latest anomaly, else the first
    device that is not online (something to look at), else the first device."""
    ids = sorted(set(devices[DEVICE_ID].dropna()) | set(anomalies.get(DEVICE_ID, pd.Series(dtype=str)).dropna()))
    if not ids:
        return [], None
    if not anomalies.empty:
        return ids, str(anomalies.sort_values(EVENT_TIME).iloc[-1][DEVICE_ID])
    troubled = devices[devices["status"].isin((OFFLINE, DEGRADED))] if "status" in devices else devices.iloc[:0]
    return ids, str(troubled[DEVICE_ID].iloc[0]) if not troubled.empty else ids[0]


def keep_choice(choices: Sequence[str], current: str | None, default: str | None) -> str | None:
    """Keep the operator's pick across refreshes while it still exists."""
    return current if current in choices else default


@dataclass(frozen=True)
class DeviceSeries:
    readings: pd.DataFrame
    """``event_time``, ``value``: the metric of every reading, oldest first."""
    tumbling: pd.DataFrame
    """``window_start``, ``window_end``, ``value``: live tumbling-window averages."""
    sliding: pd.DataFrame
    """``window_start``, ``window_end``, ``value``: final sliding-window averages."""
    anomalies: pd.DataFrame
    """``event_time``, ``value``, ``score``, ``threshold``, ``top_metric``, ``model_version``: flagged readings."""

    @property
    def empty(self) -> bool:
        return self.readings.empty and self.tumbling.empty and self.sliding.empty


def device_series(
    readings: pd.DataFrame,
    live_windows: pd.DataFrame,
    final_windows: pd.DataFrame,
    anomalies: pd.DataFrame,
    metric: str,
) -> DeviceSeries:
    """One device's ``metric``: readings, window averages, and its anomalous readings placed on the readings'
    line (an anomaly whose reading is outside what was read is left out: it has no value to plot at)."""
    avg = f"{metric}_avg"
    values = readings.reindex(columns=[SEQ, EVENT_TIME, metric]).dropna(subset=[EVENT_TIME])
    values = values.sort_values(EVENT_TIME, ignore_index=True).rename(columns={metric: "value"})

    def windows(frame: pd.DataFrame) -> pd.DataFrame:
        shaped = frame.reindex(columns=["window_start", "window_end", avg]).rename(columns={avg: "value"})
        return shaped.sort_values("window_start", ignore_index=True)

    flagged = anomalies.reindex(columns=[SEQ, "is_anomaly", "score", "threshold", "top_metric", "model_version"])
    flagged = flagged[flagged["is_anomaly"].fillna(False).astype(bool)].drop(columns="is_anomaly")
    marked = flagged.merge(values, on=SEQ, how="inner").sort_values(EVENT_TIME, ignore_index=True)
    columns = [EVENT_TIME, "value", "score", "threshold", "top_metric", "model_version"]
    return DeviceSeries(values[[EVENT_TIME, "value"]], windows(live_windows), windows(final_windows), marked[columns])


# --- anomalies and alerts ----------------------------------------------------------------------------------

ANOMALY_COLUMNS: tuple[str, ...] = (
    EVENT_TIME,
    DEVICE_ID,
    "site",
    "device_type",
    "top_metric",
    "score",
    "threshold",
    "model_version",
)
ALERT_COLUMNS: tuple[str, ...] = (
    "status",
    DEVICE_ID,
    "site",
    "device_type",
    "opened_at",
    "last_anomaly_at",
    "cleared_at",
    "anomalies",
    "max_score",
    "top_metric",
    "model_version",
)


def latest_anomalies(anomalies: pd.DataFrame, limit: int) -> pd.DataFrame:
    """The ``limit`` latest flagged readings, newest first, with the model version that flagged each."""
    flagged = anomalies.reindex(columns=[*ANOMALY_COLUMNS, "is_anomaly", SEQ])
    flagged = flagged[flagged["is_anomaly"].fillna(False).astype(bool)]
    flagged = flagged.sort_values([EVENT_TIME, DEVICE_ID, SEQ], ascending=[False, True, False])
    return flagged.head(limit).reset_index(drop=True)[list(ANOMALY_COLUMNS)]


def alert_board(alerts: pd.DataFrame, limit: int) -> pd.DataFrame:
    """Open alerts first (latest anomaly first), then the latest cleared ones, at most ``limit`` rows."""
    board = alerts.reindex(columns=list(ALERT_COLUMNS)).copy()
    board["_closed"] = board["status"] != OPEN
    board = board.sort_values(["_closed", "last_anomaly_at", DEVICE_ID], ascending=[True, False, True])
    return board.head(limit).drop(columns="_closed").reset_index(drop=True)


def open_alert_count(alerts: pd.DataFrame) -> int:
    return int((alerts["status"] == OPEN).sum()) if "status" in alerts else 0


# --- pipeline health ---------------------------------------------------------------------------------------

QUERY_COLUMNS: tuple[str, ...] = (
    "query_name",
    "batch_id",
    "timestamp",
    "input_rows_per_second",
    "processed_rows_per_second",
    "batch_duration_s",
    "kafka_lag",
    "watermark_delay_s",
    "state_rows",
    "rows_dropped_by_watermark",
)


PROGRESS_COLUMNS: tuple[str, ...] = (
    "query_name",
    "query_id",
    "batch_id",
    "timestamp",
    "input_rows_per_second",
    "processed_rows_per_second",
    "batch_duration_ms",
    "kafka_lag",
    "watermark",
    "state_rows",
    "rows_dropped_by_watermark",
)
"""The ``query_progress`` columns the pipeline section reads."""


def progress_series(progress: pd.DataFrame) -> pd.DataFrame:
    """Progress rows, oldest first, with the batch duration in seconds and the watermark delay: how far the
    watermark (event time the query considers complete) trails the batch's wall-clock time, in seconds."""
    frame = progress.reindex(columns=list(PROGRESS_COLUMNS)).copy()
    frame["query_name"] = frame["query_name"].fillna(frame["query_id"])
    frame["batch_duration_s"] = pd.to_numeric(frame["batch_duration_ms"]) / 1000.0
    delay = pd.to_datetime(frame["timestamp"], utc=True) - pd.to_datetime(frame["watermark"], utc=True)
    frame["watermark_delay_s"] = delay.dt.total_seconds()
    return frame.sort_values(["timestamp", "query_name", "batch_id"], ignore_index=True)


def latest_per_query(series: pd.DataFrame) -> pd.DataFrame:
    """Each query's latest batch (as ``progress_series`` shaped it), with the rows its watermark dropped summed
    over everything read rather than the last batch's (a drop is an event, not a level)."""
    if series.empty:
        return pd.DataFrame(columns=list(QUERY_COLUMNS))
    dropped = series.groupby("query_name")["rows_dropped_by_watermark"].sum(min_count=1)
    latest = series.groupby("query_name", as_index=False).tail(1).set_index("query_name")
    latest["rows_dropped_by_watermark"] = dropped
    return latest.reset_index().sort_values("query_name", ignore_index=True)[list(QUERY_COLUMNS)]


def lateness_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """Readings per lateness level as silver classified them (every level present, zero included)."""
    return {level: int(counts.get(level, 0)) for level in LATENESS_LEVELS}


def quarantine_reasons(quarantine: pd.DataFrame) -> pd.DataFrame:
    """Quarantined records per stage and reason, the most frequent first."""
    if quarantine.empty:
        return pd.DataFrame(columns=["stage", "reason", "records"])
    frame = quarantine.reindex(columns=["stage", "reason"]).fillna("unknown")
    grouped = frame.groupby(["stage", "reason"]).size().reset_index(name="records")
    return grouped.sort_values(["records", "stage", "reason"], ascending=[False, True, True], ignore_index=True)


# --- models ------------------------------------------------------------------------------------------------

MODEL_METRICS: tuple[str, ...] = ("f1", "precision", "recall", "threshold")


@dataclass(frozen=True)
class ModelVersion:
    """A registered version as MLflow describes it; ``promoted_at`` is set when the trainer promoted it
    (the run's end: the trainer moves the alias as the run's last step)."""

    version: int
    created: datetime
    decision: str | None = None
    promoted_at: datetime | None = None
    metrics: Mapping[str, float] | None = None


@dataclass(frozen=True)
class ModelHistory:
    versions: pd.DataFrame
    champion: int | None
    champion_since: datetime | None
    """None when unknown: the alias was moved by hand (not by the trainer) to a version promoted earlier."""


def model_history(versions: Sequence[ModelVersion], champion: int | None) -> ModelHistory:
    """Versions newest first with their metrics, the champion, and since when it is champion: its promotion
    time, unless a later version was promoted after it (then someone moved the alias back, time unknown)."""
    rows: list[dict[str, Any]] = []
    for found in sorted(versions, key=lambda v: v.version, reverse=True):
        metrics = dict(found.metrics or {})
        rows.append(
            {
                "version": found.version,
                "champion": found.version == champion,
                "created": found.created,
                "promoted_at": found.promoted_at,
                **{name: metrics.get(name) for name in MODEL_METRICS},
                "decision": found.decision,
            }
        )
    frame = pd.DataFrame(rows, columns=["version", "champion", "created", "promoted_at", *MODEL_METRICS, "decision"])
    since = None
    current = next((v for v in versions if v.version == champion), None)
    if current is not None and current.promoted_at is not None:
        later = [v for v in versions if v.promoted_at is not None and v.promoted_at > current.promoted_at]
        since = None if later else current.promoted_at
    return ModelHistory(frame, champion, since)


def freshness(newest_events: Mapping[str, datetime | None], kafka_newest: datetime | None) -> pd.DataFrame:
    """``table``, ``newest_event``, ``behind_kafka_s``: each table's newest event time and how far it is behind
    the newest event in Kafka, the slowest table first (unknown ones last)."""
    from iotmon.status import freshness as behind

    rows = [
        {"table": name, "newest_event": newest, "behind_kafka_s": behind(newest, kafka_newest)}
        for name, newest in newest_events.items()
    ]
    frame = pd.DataFrame(rows, columns=["table", "newest_event", "behind_kafka_s"])
    return frame.sort_values("behind_kafka_s", ascending=False, na_position="last", ignore_index=True)
