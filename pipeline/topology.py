"""The topology: every streaming query of the pipeline, what it reads and writes, how often it runs and why.

One declaration, used by ``iotmon stream`` (which queries to start, with which trigger), ``iotmon stream
--until-idle`` and the backfill (which queries to drain or reset, in order), the bench (what each query
reads, to tell when it has caught up) and the docs' picture (docs/topology.md)::

    Kafka ──ingest──▶ bronze, quarantine, silver   (parse, registry join, dedup within the watermark on the driver)
               └────▶ too_late_readings ──late_arrivals──▶ silver   (readings later than the watermark, looked up)
    silver ──device_windows──▶ device_windows, site_windows, device_sessions
           ├─device_windows_live──▶ device_windows_live
           ├─device_status──▶ device_status, device_status_changes
           └─anomalies──▶ anomalies ──alerts──▶ alerts

Queries are listed upstream first: draining them in this order, each sees everything its sources got.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

from pyspark.sql import SparkSession

from ingest.landing import INGEST_QUERY, LATE_ARRIVALS_QUERY, early_batches, ensure_landing_tables
from iotmon.config import Settings, interval_seconds
from iotmon.lake import table_id
from iotmon.preflight import local_directory
from iotmon.queries import (
    QuerySpec,
    Trigger,
    recorded_state_operators,
    recorded_state_variables,
    streamed_table_ids,
)
from iotmon.schema import (
    ALERTS,
    ANOMALIES,
    BRONZE,
    DEVICE_SESSIONS,
    DEVICE_STATUS,
    DEVICE_STATUS_CHANGES,
    DEVICE_WINDOWS,
    DEVICES,
    LIVE_WINDOWS,
    QUARANTINE,
    SILVER,
    SITE_WINDOWS,
    STREAM_CLOCK,
    TOO_LATE_READINGS,
)
from streaming.alerts import ALERTS_QUERY
from streaming.device_status import DEVICE_STATUS_QUERY
from streaming.jobs import FINAL_WINDOWS_QUERY, LIVE_WINDOWS_QUERY, ensure_analytics_tables
from streaming.scoring import SCORING_QUERY

KAFKA = "kafka"
"""What the ingest query reads: the readings topic."""


class Budget(Enum):
    """How soon a query's tables are due, which sets how often it runs: every batch pays fixed costs
    (planning, the source's offsets, state commits, a Delta commit per table; docs/cost-model.md), so a query
    runs no more often than its tables need."""

    ARRIVAL = "trigger_interval"
    """Every record in the archive within seconds of reaching Kafka (``IOTMON_TRIGGER_INTERVAL``)."""
    SECONDS = "gold_trigger_interval"
    """Scores, alerts, device status and live windows within seconds of silver (``IOTMON_GOLD_TRIGGER_INTERVAL``):
    each batch takes what several ingest batches landed."""
    WATERMARK = "final_trigger_interval"
    """Only due once the watermark has moved on (``IOTMON_FINAL_TRIGGER_INTERVAL``): final windows and sessions,
    readings later than the watermark."""

    def interval(self, settings: Settings) -> str:
        return getattr(settings, self.value)


@dataclass(frozen=True)
class Node:
    """One streaming query in the pipeline."""

    query: QuerySpec
    reads: tuple[str, ...]
    """Its sources: the first is the one it streams from (``KAFKA`` or a table), the rest are joined in."""
    writes: tuple[str, ...]
    purpose: str
    budget: Budget
    """How soon what it writes is due: its trigger."""
    weight: int = 1
    """Its fair-scheduler pool's weight: the share of the cores it gets while several queries want them."""

    @property
    def name(self) -> str:
        return self.query.name

    @property
    def source(self) -> str:
        return self.reads[0]


TOPOLOGY: tuple[Node, ...] = (
    Node(
        INGEST_QUERY,
        reads=(KAFKA, DEVICES),
        writes=(BRONZE, QUARANTINE, SILVER, TOO_LATE_READINGS),
        purpose="every record once into bronze; each distinct reading once into silver (deduplicated on the "
        "driver), enriched; what failed parsing or names an unregistered device quarantined with the reason; "
        "readings later than the watermark handed on",
        budget=Budget.ARRIVAL,
        weight=4,
    ),
    Node(
        LATE_ARRIVALS_QUERY,
        reads=(TOO_LATE_READINGS, SILVER),
        writes=(SILVER,),
        purpose="readings Kafka delivered later than the watermark, looked up in silver",
        budget=Budget.WATERMARK,
    ),
    Node(
        FINAL_WINDOWS_QUERY,
        reads=(SILVER, STREAM_CLOCK),
        writes=(DEVICE_WINDOWS, SITE_WINDOWS, DEVICE_SESSIONS),
        purpose="final tumbling, sliding and session windows, each written once the watermark passed it",
        budget=Budget.WATERMARK,
    ),
    Node(
        LIVE_WINDOWS_QUERY,
        reads=(SILVER, STREAM_CLOCK),
        writes=(LIVE_WINDOWS,),
        purpose="the current windows, updated in place as readings arrive",
        budget=Budget.SECONDS,
        weight=2,
    ),
    Node(
        DEVICE_STATUS_QUERY,
        reads=(SILVER, STREAM_CLOCK),
        writes=(DEVICE_STATUS, DEVICE_STATUS_CHANGES),
        purpose="online / degraded / offline per device, with event-time timers",
        budget=Budget.SECONDS,
        weight=2,
    ),
    Node(
        SCORING_QUERY,
        reads=(SILVER,),
        writes=(ANOMALIES,),
        purpose="every reading scored by the champion model",
        budget=Budget.SECONDS,
        weight=4,
    ),
    Node(
        ALERTS_QUERY,
        reads=(ANOMALIES, STREAM_CLOCK),
        writes=(ALERTS,),
        purpose="anomaly incidents per device, opened and cleared in event time",
        budget=Budget.SECONDS,
        weight=2,
    ),
)


RETIRED_QUERIES: tuple[str, ...] = ("bronze", "silver")
"""Queries of earlier versions that the ingest query replaced (a bronze query reading Kafka, a silver query
reading bronze)."""


def retired_checkpoints(settings: Settings) -> list[str]:
    """The retired queries whose local checkpoints a lake without an ingest checkpoint still has. Started on
    such a lake, the ingest query would read Kafka from its first offset and archive every record again."""
    root = local_directory(settings.checkpoint_root)
    if root is None or (root / INGEST_QUERY.name).exists():
        return []
    return [name for name in RETIRED_QUERIES if (root / name / "commits").is_dir()]


def outdated_checkpoints(settings: Settings) -> list[str]:
    """The queries whose local checkpoints an earlier version planned otherwise: other stateful operators, or
    other state variables, than the query declares (``QuerySpec.state_operators``, ``state_variables``). Spark
    would fail such a query at its first batch, and again at every restart."""
    root = local_directory(settings.checkpoint_root)
    if root is None:
        return []
    outdated = []
    for n in TOPOLOGY:
        query, checkpoint = n.query, root / n.name
        variables = recorded_state_variables(checkpoint) if query.state_variables else None
        operators = recorded_state_operators(checkpoint) if query.state_operators is not None else None
        if (variables is not None and variables != set(query.state_variables)) or (
            operators is not None and operators != set(query.state_operators or ())
        ):
            outdated.append(n.name)
    return outdated


def moved_sources(settings: Settings) -> list[str]:
    """The queries whose local checkpoints streamed another Delta table than the one they stream in this version
    (the late arrivals streamed bronze before ``too_late_readings``). Spark refuses such a checkpoint at every
    start, and what the query had not yet read of its old source would be in no table: a backfill rebuilds what
    these queries write and starts them anew (``pipeline.backfill``)."""
    root = local_directory(settings.checkpoint_root)
    if root is None:
        return []
    ids: dict[str, str | None] = {}
    moved = []
    for n in TOPOLOGY:
        streamed = streamed_table_ids(root / n.name) if n.source != KAFKA else []
        if not streamed:
            continue
        if n.source not in ids:  # silver feeds five queries: its log is read once
            ids[n.source] = table_id(settings.table_path(n.source))
        if ids[n.source] not in streamed:
            moved.append(n.name)
    return moved


def ensure_tables(spark: SparkSession, settings: Settings) -> None:
    """Create every table the queries read or write, so readers and streams find them from the start."""
    ensure_landing_tables(spark, settings)
    ensure_analytics_tables(spark, settings)


def lead_queries() -> tuple[str, ...]:
    """The queries that read Kafka: everything else reads what they write, so a stream starts them first
    (``iotmon.queries.run_continuously``)."""
    return tuple(n.name for n in TOPOLOGY if n.source == KAFKA)


def upstream_of(name: str) -> tuple[str, ...]:
    """The queries that write what query ``name`` streams from, directly or through other queries, upstream
    first: a drain starts ``name`` again once each of them has read all its source holds
    (``iotmon.queries.run_continuously``), so that it reads what is left once."""
    return tuple(spec.name for spec in queries(producing=(node(name).source,)))


def node(name: str) -> Node:
    return next(n for n in TOPOLOGY if n.name == name)


def queries(producing: Iterable[str] | None = None) -> tuple[QuerySpec, ...]:
    """Every query, or the ones the tables ``producing`` need (those writing them and everything upstream),
    upstream first."""
    if producing is None:
        return tuple(n.query for n in TOPOLOGY)
    wanted: set[str] = set()
    tables = set(producing)
    for n in reversed(TOPOLOGY):
        if tables & set(n.writes):
            wanted.add(n.name)
            tables |= set(n.reads)
    return tuple(n.query for n in TOPOLOGY if n.name in wanted)


def downstream_of(table: str) -> tuple[str, ...]:
    """The queries that read ``table`` directly or through other queries, upstream first."""
    reached, names = {table}, []
    for n in TOPOLOGY:
        if reached & set(n.reads):
            names.append(n.name)
            reached |= set(n.writes)
    return tuple(names)


def trigger_of(settings: Settings) -> Callable[[QuerySpec], Trigger]:
    """Each query's processing-time trigger (``Node.budget``)."""

    def trigger(spec: QuerySpec) -> Trigger:
        return {"processingTime": node(spec.name).budget.interval(settings)}

    return trigger


def busy_trigger(settings: Settings) -> Trigger | None:
    """The trigger of the queries due within seconds while their input is busy; None when it is no sooner than
    their calm one (then nothing moves)."""
    busy = settings.busy_trigger_interval
    if interval_seconds(busy) < interval_seconds(Budget.SECONDS.interval(settings)):
        return {"processingTime": busy}
    return None


def trigger_at(settings: Settings) -> Callable[[QuerySpec, float], Trigger]:
    """Each query's trigger for an input arriving at ``rows_per_second``: the queries due within seconds run
    every ``IOTMON_BUSY_TRIGGER_INTERVAL`` from ``IOTMON_BUSY_ROWS_PER_SECOND`` on, when that is sooner than
    their budget's; the others always on their budget's (``trigger_of``).

    Every batch has its fixed cost whatever its rows (docs/cost-model.md, "Triggers that follow the rate", "A
    calm trigger for the demo's rate"): a calm input keeps the long trigger, which keeps the CPU within its
    budget at the demo's rate, and a busy one gets the short trigger, which cuts what a reading waits for the
    next batch."""
    calm, busy = trigger_of(settings), busy_trigger(settings)

    def trigger(spec: QuerySpec, rows_per_second: float) -> Trigger:
        if busy and node(spec.name).budget is Budget.SECONDS and rows_per_second >= settings.busy_rows_per_second:
            return busy
        return calm(spec)

    return trigger


def triggers_line(settings: Settings) -> str:
    """The triggers, for a stream's first line: which queries run how often (the ingest query sooner once
    enough records wait: ``ingest.landing.early_batches``)."""
    by_budget = {b: [n.name for n in TOPOLOGY if n.budget is b] for b in Budget}

    def every(budget: Budget) -> str:
        interval = budget.interval(settings)
        if budget is Budget.ARRIVAL and early_batches({"processingTime": interval}, settings):
            return f"every {interval} or {settings.ingest_batch_records:,} records"
        if budget is Budget.SECONDS and (busy := busy_trigger(settings)):
            return f"every {interval} (every {busy['processingTime']} from {settings.busy_rows_per_second:,} rows/s)"
        return f"every {interval}"

    return "; ".join(f"{', '.join(names)} {every(b)}" for b, names in by_budget.items() if names)


def pool_weights() -> dict[str, int]:
    """Each query's fair-scheduler pool and its weight (``Node.weight``), for ``iotmon.spark.spark_session``.

    A query's jobs run in a pool named after it; with every core busy, a pool gets its weight's share. The
    queries whose tables are due within seconds weigh most; the final windows and late arrivals, whose work
    can wait a trigger, least."""
    return {n.name: n.weight for n in TOPOLOGY}
