"""Alerts: each device's anomaly incidents, opened by the scorer's anomalous readings and cleared by silence.

Rules, all in event time so that a replayed micro-batch writes exactly what it wrote before:

* An incident opens at a device's first anomalous reading (``is_anomaly``) while the device has no open
  incident. Its ``alert_id`` is ``"<device_id>@<opened_at>"``, ``opened_at`` in UTC ISO-8601 with
  milliseconds (``dev-000042@2026-11-22T01:02:03.456Z``): deterministic, so a replay finds the same row.
  ``model_version`` is the opening reading's; ``max_score``/``top_metric`` come from the incident's
  highest-scoring reading (the earliest one among equal scores); ``anomalies`` counts its readings.
* Further anomalous readings extend the open incident and move ``last_anomaly_at`` on.
* It clears once the device has had no anomalous reading for ``IOTMON_ALERT_CLEAR_AFTER``: every anomalous
  reading arms an event-time timer at ``last_anomaly_at + clear_after`` (deleting the previous one); when the
  watermark reaches it, the incident becomes ``cleared`` with ``cleared_at`` = that deadline, never a
  wall-clock time. Spark hands a batch's rows to the operator before it fires the batch's timers, and a
  backlog comes in one batch, so an anomalous reading at or after the deadline also clears the incident
  (at the deadline) and opens a new one: a device's rows are applied in the order they reached Kafka
  (``partition``, ``offset``) and give the same incidents however they are batched, which is what lets
  ``iotmon verify`` recompute them from ``anomalies`` (``alert_history``).
* An anomalous reading older than the deadline of the device's latest incident is counted into it
  (``anomalies``, ``max_score``) even when it is older than ``opened_at``; it never moves ``opened_at``, and
  moves ``last_anomaly_at`` only forwards and only while the incident is open, so ``cleared_at`` stays
  ``last_anomaly_at + clear_after``.
* Only readings that reached Kafka within the watermark count (``lateness`` not ``too_late``): a later one
  is scored and kept in ``anomalies``, but an incident is news, and it would be behind the watermark anyway.
* Times have millisecond precision (the operator speaks epoch milliseconds, as readings' times do).

Only anomalous readings reach the operator (Python), but the watermark is taken over every scored reading
and the stream clock's ticks, so a device that reports normally, or a silent fleet, still clears its
alerts. The filter sits above an observation, which keeps Spark from pushing it below the watermark
(see ``streaming.sources``). The operator emits each incident it changed, ``version`` numbering a device's
updates; the ``foreachBatch`` sink MERGEs the latest of each incident into ``alerts`` on ``alert_id``, exactly
once, its commit tagged with the batch (``iotmon.lake.BatchLedger``). State (one value per device, RocksDB)
keeps each device's latest incident, for every device that ever had one: only devices with anomalous readings
or an open incident cost the operator a call in a batch, unlike device status (``SHARDS`` there).
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace

import pandas as pd
import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle, StreamingQuery
from pyspark.sql.streaming.stateful_processor import ExpiredTimerInfo, TimerValues
from pyspark.sql.types import BooleanType, DoubleType, IntegerType, LongType, StringType, StructField, StructType

from iotmon.config import Settings, interval_seconds
from iotmon.lake import BatchLedger, create_table, merge_once, newest_per_key
from iotmon.queries import QuerySpec, Trigger
from iotmon.schema import (
    ALERTS,
    ALERTS_SCHEMA,
    ANOMALIES,
    CLEARED,
    DEVICE_ID,
    EVENT_TIME,
    LATENESS,
    OPEN,
    SEQ,
    TOO_LATE,
)
from streaming.sources import ensure_anomalies_table, ensure_clock_table, with_ticks

SCORES = "scores"
"""Name of the observed metric: the batch's scored ``readings``, how many were ``anomalous``, and ``ticks``."""

_TIMES = ("opened_at", "last_anomaly_at", "cleared_at")

ALERT_UPDATE_SCHEMA = StructType([*ALERTS_SCHEMA.fields, StructField("version", LongType())])
"""What ``alert_updates`` returns: an incident's state after a change; the highest ``version`` is the latest."""

# The operator speaks epoch milliseconds (no timezone conversion between Arrow, pandas and the state store);
# alert_updates turns them into timestamps.
_OPERATOR_OUTPUT = StructType(
    [
        StructField("alert_id", StringType()),
        StructField(DEVICE_ID, StringType()),
        StructField("device_type", StringType()),
        StructField("site", StringType()),
        StructField("status", StringType()),
        StructField("opened_ms", LongType()),
        StructField("last_anomaly_ms", LongType()),
        StructField("cleared_ms", LongType()),
        StructField("anomalies", LongType()),
        StructField("max_score", DoubleType()),
        StructField("top_metric", StringType()),
        StructField("model_version", IntegerType()),
        StructField("version", LongType()),
    ]
)

_STATE_SCHEMA = StructType(
    [
        *(f for f in _OPERATOR_OUTPUT.fields if f.name != DEVICE_ID),
        StructField("timer_ms", LongType()),
    ]
)

STATE_VARIABLES = ("incident",)
"""The operator's state variables, recorded in its checkpoint (``pipeline.topology.outdated_checkpoints``)."""

_INPUT_COLUMNS = (
    DEVICE_ID,
    EVENT_TIME,
    "event_ms",
    SEQ,
    "score",
    "top_metric",
    "model_version",
    "device_type",
    "site",
    "partition",
    "offset",
)
ARRIVAL_ORDER: tuple[str, ...] = ("partition", "offset")
"""The order readings reached Kafka in; a device's readings are all in one partition (keyed by device)."""


# -- The rules, plain Python ------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlertRules:
    clear_after_ms: int

    @classmethod
    def from_settings(cls, settings: Settings) -> AlertRules:
        return cls(round(interval_seconds(settings.alert_clear_after) * 1000))


@dataclass(frozen=True)
class Anomaly:
    """An anomalous scored reading; normal readings never reach the rules."""

    event_ms: int
    seq: int | None
    score: float | None
    top_metric: str | None
    model_version: int | None
    device_type: str | None = None
    site: str | None = None


@dataclass(frozen=True)
class Incident:
    alert_id: str
    device_type: str | None
    site: str | None
    status: str
    opened_ms: int
    last_anomaly_ms: int
    cleared_ms: int | None
    anomalies: int
    max_score: float | None
    top_metric: str | None
    model_version: int | None
    version: int
    """The device's update count when this incident was last emitted; a later update has a higher one."""


_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def alert_id(device_id: str, opened_ms: int) -> str:
    """``<device_id>@<opened_at as UTC ISO-8601 with milliseconds>``, e.g. ``dev-1@2026-11-22T00:00:00.000Z``."""
    opened = _EPOCH + dt.timedelta(milliseconds=opened_ms)
    return f"{device_id}@{opened.strftime('%Y-%m-%dT%H:%M:%S')}.{opened_ms % 1000:03d}Z"


def deadline(incident: Incident, rules: AlertRules) -> int:
    """When the incident clears if no anomalous reading comes first (its ``cleared_at`` once cleared)."""
    return incident.last_anomaly_ms + rules.clear_after_ms


def open_incident(device_id: str, anomaly: Anomaly) -> Incident:
    """A new incident of one reading; ``advance`` numbers it (``version``)."""
    return Incident(
        alert_id=alert_id(device_id, anomaly.event_ms),
        device_type=anomaly.device_type,
        site=anomaly.site,
        status=OPEN,
        opened_ms=anomaly.event_ms,
        last_anomaly_ms=anomaly.event_ms,
        cleared_ms=None,
        anomalies=1,
        max_score=anomaly.score,
        top_metric=anomaly.top_metric,
        model_version=anomaly.model_version,
        version=0,
    )


def count_in(incident: Incident, anomaly: Anomaly) -> Incident:
    """Add an anomalous reading to the incident (see the module docstring for late ones)."""
    higher = anomaly.score is not None and (incident.max_score is None or anomaly.score > incident.max_score)
    moves_on = incident.status == OPEN and anomaly.event_ms > incident.last_anomaly_ms
    return replace(
        incident,
        device_type=incident.device_type if incident.device_type is not None else anomaly.device_type,
        site=incident.site if incident.site is not None else anomaly.site,
        last_anomaly_ms=anomaly.event_ms if moves_on else incident.last_anomaly_ms,
        anomalies=incident.anomalies + 1,
        max_score=anomaly.score if higher else incident.max_score,
        top_metric=anomaly.top_metric if higher else incident.top_metric,
    )


def clear(incident: Incident, rules: AlertRules) -> Incident:
    """The incident cleared at its deadline (event time, so a replay clears it at the same instant)."""
    return replace(incident, status=CLEARED, cleared_ms=deadline(incident, rules), version=incident.version + 1)


def advance(device_id: str, latest: Incident | None, anomalies: Iterable[Anomaly], rules: AlertRules) -> list[Incident]:
    """Apply one batch of a device's anomalous readings to its latest incident.

    Returns each incident the batch changed, once, in its state after the batch and numbered in the order
    they were first changed; the last one is the device's latest incident. An empty list means no change.
    """
    version = latest.version if latest is not None else 0
    changed: dict[str, Incident] = {}
    for anomaly in anomalies:
        if latest is None or anomaly.event_ms >= deadline(latest, rules):
            if latest is not None and latest.status == OPEN:
                changed[latest.alert_id] = clear(latest, rules)
            latest = open_incident(device_id, anomaly)
        else:
            latest = count_in(latest, anomaly)
        # An incident once replaced is never changed again, so the current one is always the last key.
        changed[latest.alert_id] = latest
    return [replace(incident, version=version + n) for n, incident in enumerate(changed.values(), 1)]


# -- The operator ---------------------------------------------------------------------------------------


def _state_of(stored: tuple | None) -> tuple[Incident | None, int | None]:
    if stored is None:
        return None, None
    *fields, timer_ms = stored
    return Incident(*fields), timer_ms


def _stored(incident: Incident, timer_ms: int | None) -> tuple:
    return (
        incident.alert_id,
        incident.device_type,
        incident.site,
        incident.status,
        incident.opened_ms,
        incident.last_anomaly_ms,
        incident.cleared_ms,
        incident.anomalies,
        incident.max_score,
        incident.top_metric,
        incident.model_version,
        incident.version,
        timer_ms,
    )


def _frame(device_id: str, incidents: list[Incident]) -> pd.DataFrame:
    rows = [(i.alert_id, device_id, *_stored(i, None)[1:-1]) for i in incidents]
    # object dtype keeps null integers null instead of turning their columns into floats
    return pd.DataFrame(rows, columns=_OPERATOR_OUTPUT.fieldNames()).astype(
        {"cleared_ms": "object", "model_version": "object"}
    )


def _optional(value: object) -> object:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA else value


def _anomalies(frames: Iterable[pd.DataFrame]) -> list[Anomaly]:
    """A device's anomalous readings in the order they reached Kafka."""
    anomalies = []
    for frame in [pd.concat(frames).sort_values(list(ARRIVAL_ORDER), kind="stable")]:
        for row in frame.itertuples(index=False):
            seq, score, version = _optional(row.seq), _optional(row.score), _optional(row.model_version)
            anomalies.append(
                Anomaly(
                    event_ms=int(row.event_ms),
                    seq=int(seq) if seq is not None else None,
                    score=float(score) if score is not None else None,
                    top_metric=_optional(row.top_metric),
                    model_version=int(version) if version is not None else None,
                    device_type=_optional(row.device_type),
                    site=_optional(row.site),
                )
            )
    return anomalies


class AlertProcessor(StatefulProcessor):
    """Keeps each device's latest ``Incident`` plus the one clear timer armed for it (``timer_ms``).

    Spark calls ``handleExpiredTimer`` with keyword arguments, so its parameter names are part of the API.
    """

    def __init__(self, rules: AlertRules) -> None:
        self._rules = rules

    def init(self, handle: StatefulProcessorHandle) -> None:
        self._handle = handle
        self._incident = handle.getValueState(STATE_VARIABLES[0], _STATE_SCHEMA)

    def handleInputRows(
        self, key: tuple[str], rows: Iterator[pd.DataFrame], timerValues: TimerValues
    ) -> Iterator[pd.DataFrame]:
        latest, timer_ms = _state_of(self._incident.get())
        changed = advance(key[0], latest, _anomalies(rows), self._rules)
        if not changed:
            return
        latest = changed[-1]
        # Only an open incident has a timer: at its deadline, which the batch may have moved.
        wanted = deadline(latest, self._rules) if latest.status == OPEN else None
        if timer_ms != wanted:
            if timer_ms is not None:
                self._handle.deleteTimer(timer_ms)
            if wanted is not None:
                self._handle.registerTimer(wanted)
        self._incident.update(_stored(latest, wanted))
        yield _frame(key[0], changed)

    def handleExpiredTimer(
        self, key: tuple[str], timerValues: TimerValues, expiredTimerInfo: ExpiredTimerInfo
    ) -> Iterator[pd.DataFrame]:
        latest, timer_ms = _state_of(self._incident.get())
        if latest is None or latest.status != OPEN or timer_ms != expiredTimerInfo.getExpiryTimeInMs():
            return  # a timer this state no longer armed; Spark deletes it after this call
        cleared = clear(latest, self._rules)
        self._incident.update(_stored(cleared, None))
        yield _frame(key[0], [cleared])

    def close(self) -> None:
        pass


def observe_scores(frame: DataFrame) -> DataFrame:
    """Count the batch's scored readings, anomalous ones and ticks; apply it right after the watermark."""
    device = F.col(DEVICE_ID)
    return frame.observe(
        SCORES,
        F.count(device).alias("readings"),
        F.count(F.when(F.col("is_anomaly"), 1)).alias("anomalous"),
        F.count(F.when(device.isNull(), 1)).alias("ticks"),
    )


def alert_updates(scored: DataFrame, settings: Settings) -> DataFrame:
    """Anomalies-shaped rows (ticks allowed) -> incident updates (``ALERT_UPDATE_SCHEMA``); pure, no I/O.

    Works on a streaming frame (state and timers across batches) and on a static one (one pass, no timers
    fire, for tests). Spark creates the state store coordinator only with the streaming query manager, so a
    static frame touches ``spark.streams`` first or its state store fails to load.
    """
    if not scored.isStreaming:
        _ = scored.sparkSession.streams
    rules = AlertRules.from_settings(settings)
    operator_input = (
        # Every row moves the watermark; the filter above the observation keeps only what the rules need.
        observe_scores(scored.withWatermark(EVENT_TIME, settings.watermark))
        .where(counted(F.col("is_anomaly") & F.col(DEVICE_ID).isNotNull()))
        .withColumn("event_ms", F.unix_millis(EVENT_TIME))
        .select(*_INPUT_COLUMNS)
    )
    updates = operator_input.groupBy(DEVICE_ID).transformWithStateInPandas(
        statefulProcessor=AlertProcessor(rules),
        outputStructType=_OPERATOR_OUTPUT,
        outputMode="Update",
        timeMode="EventTime",
    )
    return _with_timestamps(updates)


def counted(anomalous: Column) -> Column:
    """The rows incidents are made of: anomalous readings that reached Kafka within the watermark."""
    return anomalous & (F.col(LATENESS) != TOO_LATE)


def _with_timestamps(updates: DataFrame, *kept: str) -> DataFrame:
    """Operator rows (epoch milliseconds) as ``ALERT_UPDATE_SCHEMA`` rows."""
    return updates.select(
        *[
            F.timestamp_millis(f"{f.name.removesuffix('_at')}_ms").alias(f.name) if f.name in _TIMES else F.col(f.name)
            for f in ALERT_UPDATE_SCHEMA.fields
        ],
        *kept,
    )


CLEAR_UNSETTLED = "unsettled"
"""Column of ``alert_history``: the update is a clearing the stream may or may not have made yet."""


def alert_history(
    scored: DataFrame, settings: Settings, settled: dt.datetime | None, reached: dt.datetime | None
) -> DataFrame:
    """What the alerts query emits over all of ``scored`` (``anomalies``, a batch frame), in one pass.

    The same rules on the same readings in the same (arrival) order, so the incidents are those of the
    stream however it was batched. A device's last open incident is cleared only where the stream's
    watermark reached its deadline: surely by ``settled`` (the watermark its last batch started with),
    perhaps by ``reached`` (the one it ended with; ``CLEAR_UNSETTLED`` marks those).
    """
    rules = AlertRules.from_settings(settings)
    settled_ms, reached_ms = (_epoch_ms(t) for t in (settled, reached))
    schema = StructType([*_OPERATOR_OUTPUT.fields, StructField(CLEAR_UNSETTLED, BooleanType())])

    def device(frame: pd.DataFrame) -> pd.DataFrame:
        device_id = frame[DEVICE_ID].iloc[0]
        incidents = advance(device_id, None, _anomalies([frame]), rules)
        latest = incidents[-1] if incidents else None
        unsettled = False
        if (
            latest is not None
            and latest.status == OPEN
            and reached_ms is not None
            and deadline(latest, rules) <= reached_ms
        ):
            incidents.append(clear(latest, rules))
            unsettled = settled_ms is None or deadline(latest, rules) > settled_ms
        rows = _frame(device_id, incidents)
        return rows.assign(**{CLEAR_UNSETTLED: [False] * (len(rows) - 1) + [unsettled]} if len(rows) else {})

    history = (
        scored.where(counted(F.col("is_anomaly")))
        .withColumn("event_ms", F.unix_millis(EVENT_TIME))
        .select(*_INPUT_COLUMNS)
        .groupBy(DEVICE_ID)
        .applyInPandas(device, schema)
    )
    return _with_timestamps(history, CLEAR_UNSETTLED)


def _epoch_ms(moment: dt.datetime | None) -> int | None:
    """A naive UTC time (as Spark returns them) in epoch milliseconds."""
    return round(moment.replace(tzinfo=dt.UTC).timestamp() * 1000) if moment is not None else None


def latest_alerts(updates: DataFrame) -> DataFrame:
    """Each incident's last update among ``updates``, shaped as ``ALERTS_SCHEMA``."""
    newest_first = Window.partitionBy("alert_id").orderBy(F.col("version").desc())
    return (
        updates.withColumn("_rank", F.row_number().over(newest_first))
        .where(F.col("_rank") == 1)
        .select(*ALERTS_SCHEMA.fieldNames())
    )


def latest_alert_rows(updates: pa.Table) -> pa.Table:
    """``latest_alerts`` over Arrow rows: the writer picks them from its collected batch (tested equal)."""
    return newest_per_key(updates, "alert_id", "version").select(ALERTS_SCHEMA.fieldNames())


# -- The query ------------------------------------------------------------------------------------------


def ensure_alerts_table(spark: SparkSession, settings: Settings) -> None:
    """Create ``alerts`` up front, so readers find it before the first incident."""
    create_table(
        spark,
        settings.table_path(ALERTS),
        ALERTS_SCHEMA,
        "One row per anomaly incident of a device, updated in place from open to cleared (event time).",
    )


def scores_and_ticks(spark: SparkSession, settings: Settings) -> DataFrame:
    """The scored readings plus the clock's ticks that follow them (null ``device_id``), not yet watermarked."""
    return with_ticks(spark, settings, ANOMALIES)


def alerts_batch_writer(settings: Settings) -> Callable[[DataFrame, int], None]:
    """The ``foreachBatch`` function: MERGE each changed incident's latest state, skipping a batch id it holds."""
    checkpoint = settings.checkpoint_path(ALERTS)
    path = settings.table_path(ALERTS)
    ledger = BatchLedger(checkpoint)

    def write(batch: DataFrame, batch_id: int) -> None:
        rows = latest_alert_rows(batch.toArrow())  # one Spark job: the batch is read once
        if rows.num_rows:
            merge_once(rows, path, ("alert_id",), ledger, batch_id, batch.sparkSession)

    return write


def start_alerts(spark: SparkSession, settings: Settings, trigger: Trigger) -> StreamingQuery:
    ensure_alerts_table(spark, settings)
    ensure_anomalies_table(spark, settings)
    ensure_clock_table(spark, settings)
    return (
        alert_updates(scores_and_ticks(spark, settings), settings)
        .writeStream.queryName(ALERTS)
        .outputMode("update")
        .option("checkpointLocation", settings.checkpoint_path(ALERTS))
        .foreachBatch(alerts_batch_writer(settings))
        .trigger(**trigger)
        .start()
    )


ALERTS_QUERY = QuerySpec(ALERTS, start_alerts, state_variables=STATE_VARIABLES)
