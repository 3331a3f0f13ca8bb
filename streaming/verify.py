"""Reconcile silver and gold: what the stream wrote must equal what a batch job computes from bronze.

This is the exactly-once check of the analytics stage, used by ``iotmon verify``, the tests and chaos runs:

* silver holds exactly the distinct accepted readings of bronze, each once, with the same lateness a
  batch classification gives (and, with ground truth, the simulator's own lateness);
* every final table equals its batch recomputation from silver for everything the stream has finalised
  (windows and sessions the windows query's committed watermark has passed), with no key twice;
* the live table equals the batch tumbling windows for every window the stream has seen;
* ``anomalies`` holds each silver reading once, scored as the model version it names scores it in a batch
  job over all of silver (no training/serving skew, no duplicate), and every reading is scored once a
  champion exists;
* ``device_status``, ``device_status_changes`` and ``alerts`` equal their rules run once over all of silver
  and ``anomalies`` (``status_history``, ``alert_history``): the stateful operators give the same results
  however their input was batched, up to the last change the stream's watermark may not have reached;
* the ``champion`` alias points at a complete model version (tags, loadable artifacts), or at nothing yet.

Float statistics are compared with a relative tolerance: summation order differs between a stream and a
batch job.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from ingest.silver import READING_KEY, LatenessRules, lateness, silver_from_bronze
from ingest.verify import bronze_identity, resolve_unknown_offsets, truth_sends
from iotmon.config import Settings
from iotmon.schema import (
    ALERTS,
    ANOMALIES,
    BRONZE,
    DEVICE_ID,
    DEVICE_STATUS,
    DEVICE_STATUS_CHANGES,
    DEVICE_WINDOWS,
    DEVICES,
    LATENESS,
    LIVE_WINDOWS,
    SILVER,
)
from ml import registry
from ml.features import FeatureSpec, reading_features
from streaming.alerts import CLEAR_UNSETTLED, alert_history, latest_alerts
from streaming.device_status import OFFLINE_UNSETTLED, changes_of, latest_status, status_history
from streaming.jobs import final_through
from streaming.scoring import anomalies_of
from streaming.windows import END_COLUMN, FINAL_TABLES, STAT_COLUMNS, WindowSpec, tumbling_device_windows

RELATIVE_TOLERANCE = 1e-9
COMPARISONS_AT_ONCE = 3
"""How many of the reconciliation's comparisons run together (``reconcile_analytics``)."""
Outcome = tuple[dict[str, int], list[str]]
"""A comparison's rows checked per table, and its problems."""
_EXPECTED, _ACTUAL = "_in_expected", "_in_actual"
"""Marker columns: which side of a comparison a joined row has."""
KEYS: dict[str, tuple[str, ...]] = {
    "device_windows": ("window_kind", "window_start", "device_id"),
    "site_windows": ("window_start", "site", "device_type"),
    "device_sessions": ("device_id", "session_start"),
    LIVE_WINDOWS: ("window_start", "device_id"),
}


@dataclass
class AnalyticsCheck:
    silver_rows: int = 0
    watermark: datetime | None = None
    rows_checked: dict[str, int] = field(default_factory=dict)
    alerts: int = 0
    champion: registry.ModelRef | None = None
    problems: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"silver       {self.silver_rows:,} readings"]
        lines.append(f"watermark    {self.watermark.isoformat() if self.watermark else 'none yet (no window final)'}")
        lines += [
            f"{table:<20} {count:,} rows equal their batch recomputation" for table, count in self.rows_checked.items()
        ]
        lines.append(f"{ALERTS:<20} {self.alerts:,} incidents")
        if self.champion is not None:
            lines.append(f"champion     {self.champion.name} v{self.champion.version}: tagged, artifacts load")
        lines += [f"MISMATCH     {problem}" for problem in self.problems]
        lines.append("analytics    OK" if not self.problems else f"analytics    {len(self.problems)} problem(s)")
        return "\n".join(lines)


def committed_watermarks(spark: SparkSession, checkpoint: str) -> tuple[datetime | None, datetime | None]:
    """The watermark the last committed batch of the query at ``checkpoint`` started with, and the one it
    ended with. Rows ending at or before the first are surely final; rows ending after the second are surely
    not; in between, Spark's operators may already have emitted them."""
    commits = _batch_files(spark, f"{checkpoint}/commits")
    if not commits:
        return None, None
    last = max(commits)
    planned = [row.value for row in spark.read.text(f"{checkpoint}/offsets/{last}").collect()]
    committed = [row.value for row in spark.read.text(f"{checkpoint}/commits/{last}").collect()]
    start_ms = json.loads(planned[1]).get("batchWatermarkMs", 0)
    end_ms = json.loads(committed[1]).get("nextBatchWatermarkMs", start_ms) if len(committed) > 1 else start_ms
    return _timestamp(start_ms), _timestamp(max(start_ms, end_ms))


def final_watermarks(spark: SparkSession, settings: Settings) -> tuple[datetime | None, datetime | None]:
    """How far the final tables are complete (``committed_watermarks`` of the final windows query): surely up
    to the first time, perhaps up to the second. After a backfill they hold rows up to its mark even before the
    stream finalised any."""
    backfilled = final_through(spark, settings)
    marks = committed_watermarks(spark, settings.checkpoint_path(DEVICE_WINDOWS))
    lower, upper = (max((m for m in (mark, backfilled) if m is not None), default=None) for mark in marks)
    return lower, upper


def _timestamp(epoch_ms: int) -> datetime | None:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).replace(tzinfo=None) if epoch_ms else None


def _ran(spark: SparkSession, checkpoint: str) -> bool:
    """Whether the query at ``checkpoint`` has committed a batch."""
    return bool(_batch_files(spark, f"{checkpoint}/commits"))


def _batch_files(spark: SparkSession, folder: str) -> list[int]:
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(folder)
    fs = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(path):
        return []
    return [int(s.getPath().getName()) for s in fs.listStatus(path) if s.getPath().getName().isdigit()]


def compare_tables(
    expected: DataFrame,
    actual: DataFrame,
    keys: tuple[str, ...],
    name: str,
    optional: Column | None = None,
    close: tuple[str, ...] = STAT_COLUMNS,
    ignored: tuple[str, ...] = (),
) -> tuple[int, list[str]]:
    """Rows of ``actual`` and ``expected`` matched by ``keys``; problems when either side differs. Expected
    rows matching ``optional`` (a condition on the expected side, ``e.<column>``) may be absent, but must be
    equal when present."""
    values = [c for c in expected.columns if c not in keys and c not in ignored]
    joined, in_expected, in_actual = _joined(expected, actual, keys)
    differs = F.lit(False)
    for column in values:
        e, a = F.col(f"e.{column}"), F.col(f"a.{column}")
        if column in close and column != "readings":
            near = F.abs(e - a) <= F.greatest(F.abs(e), F.abs(a)) * RELATIVE_TOLERANCE + 1e-12
            differs = differs | ~F.coalesce(near, e.isNull() & a.isNull())
        else:
            differs = differs | ~e.eqNullSafe(a)
    absent = in_expected & ~in_actual
    if optional is not None:
        absent = absent & ~optional
    return _differences(joined, keys, name, in_expected, in_actual, absent, in_expected & in_actual & differs)


def _joined(expected: DataFrame, actual: DataFrame, keys: tuple[str, ...]) -> tuple[DataFrame, Column, Column]:
    """``expected`` (as ``e``) and ``actual`` (as ``a``) joined on ``keys``, every row of either kept; and
    whether a joined row has each side."""
    sides = (expected.withColumn(_EXPECTED, F.lit(True)), actual.withColumn(_ACTUAL, F.lit(True)))
    joined = sides[0].alias("e").join(sides[1].alias("a"), list(keys), "full_outer")
    return joined, F.col(f"e.{_EXPECTED}").isNotNull(), F.col(f"a.{_ACTUAL}").isNotNull()


def _differences(
    joined: DataFrame,
    keys: tuple[str, ...],
    name: str,
    in_expected: Column,
    in_actual: Column,
    absent: Column,
    different: Column,
) -> tuple[int, list[str]]:
    """Expected rows and the problems of a join of expected and actual rows by ``keys`` (``_joined``): keys
    ``actual`` holds more than once, expected rows ``absent``, actual rows without an expected one, and rows
    ``different`` from theirs.

    One Spark action counts them all, per key and then over the keys: each action is a few Spark jobs whose
    fixed cost (planning, scheduling) outweighs the few rows most tables hold (docs/cost-model.md, "The demo's
    first minute, and its stop").
    """
    per_key = joined.groupBy(*keys).agg(
        F.count(F.when(in_actual, True)).alias("copies"),
        F.max(in_expected).alias("expected"),
        F.max(absent).alias("absent"),
        F.count(F.when(different, True)).alias("different"),
    )
    counts = per_key.agg(
        F.count(F.when(F.col("copies") > 1, True)).alias("repeated"),
        F.count(F.when(F.col("expected"), True)).alias("expected"),
        F.count(F.when(F.col("absent"), True)).alias("missing"),
        F.sum(F.when(~F.col("expected"), F.col("copies")).otherwise(0)).alias("extra"),
        F.sum("different").alias("different"),
        F.first(F.when(F.col("different") > 0, F.struct(*keys)), ignorenulls=True).alias("sample"),
    ).first()
    assert counts is not None
    problems = []
    if counts["repeated"]:
        problems.append(f"{name}: {counts['repeated']} keys written more than once")
    if counts["missing"]:
        problems.append(f"{name}: {counts['missing']} rows of the batch recomputation are missing")
    if counts["extra"]:
        problems.append(f"{name}: {counts['extra']} rows have no counterpart in the batch recomputation")
    if counts["different"]:
        problems.append(
            f"{name}: {counts['different']} rows differ from the batch recomputation, e.g. {counts['sample']}"
        )
    return counts["expected"], problems


def reconcile_analytics(
    spark: SparkSession,
    settings: Settings,
    truth: list[Path] | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> AnalyticsCheck:
    """Every silver and gold table against its batch recomputation (the module's list); ``progress`` hears what
    is being checked, since a large lake takes minutes.

    The comparisons are independent, so ``COMPARISONS_AT_ONCE`` of them run together: each is a Spark action
    or two whose driver's side (planning many small plans, the anomalies' scoring in Python) is most of its
    time, and another's tasks can use the cores meanwhile. Problems are reported in the list's order."""
    check = AnalyticsCheck()
    read = spark.read.format("delta").load
    bronze, devices = read(settings.table_path(BRONZE)), read(settings.table_path(DEVICES))
    silver = read(settings.table_path(SILVER))
    check.silver_rows = silver.count()
    spec = WindowSpec.from_settings(settings)
    lower, upper = final_watermarks(spark, settings)
    check.watermark = lower

    def silver_against_bronze() -> Outcome:
        progress(f"{SILVER} ({check.silver_rows:,} readings) against bronze")
        expected = silver_from_bronze(bronze, devices, LatenessRules.from_settings(settings))
        columns = [*READING_KEY, "partition", "offset", LATENESS, "out_of_range", "device_type", "site"]
        count, problems = compare_tables(expected.select(columns), silver.select(columns), READING_KEY, SILVER)
        if problems:
            problems.append("silver: if the device registry or the silver logic changed since, run `iotmon backfill`")
        return {SILVER: count}, problems

    def silver_against_truth() -> Outcome:
        progress(f"{SILVER} against the ground truth of {len(truth or [])} simulator run(s)")
        rules = LatenessRules.from_settings(settings)
        return {}, _silver_against_truth(spark, silver, bronze_identity(bronze), truth or [], rules)

    def final_table(table: str) -> Callable[[], Outcome]:
        def compare() -> Outcome:
            progress(f"{table} against its batch recomputation")
            actual = read(settings.table_path(table))
            # Materialised before filtering: Spark pushes a filter on a session window's end below the
            # aggregation that merges the sessions, which truncates them (seen with Spark 4.2).
            expected = FINAL_TABLES[table](silver, spec).localCheckpoint()
            end = F.col(END_COLUMN[table])
            expected = expected.where(end <= F.lit(upper)) if upper is not None else expected.limit(0)
            # Rows past the last committed watermark belong to a batch still in flight (or interrupted): it may
            # have written some tables and not others yet. Before any committed watermark, every row is such a row.
            optional = F.col(f"e.{END_COLUMN[table]}") > F.lit(lower) if lower is not None else F.lit(True)
            count, problems = compare_tables(expected, actual.select(*expected.columns), KEYS[table], table, optional)
            return {table: count}, problems

        return compare

    def live_windows() -> Outcome:
        progress(f"{LIVE_WINDOWS} against its batch recomputation")
        live = read(settings.table_path(LIVE_WINDOWS))
        expected = tumbling_device_windows(silver, spec)
        count, problems = compare_tables(expected, live.select(*expected.columns), KEYS[LIVE_WINDOWS], LIVE_WINDOWS)
        return {LIVE_WINDOWS: count}, problems

    def anomalies() -> Outcome:
        progress(f"{ANOMALIES} against silver scored again by each model version they name")
        count, problems = anomalies_against_silver(spark, settings, silver)
        return ({} if count is None else {ANOMALIES: count}), problems

    def device_status() -> Outcome:
        progress(f"{DEVICE_STATUS} and {DEVICE_STATUS_CHANGES} against the status rules run once over silver")
        outcomes = _status_against_silver(spark, settings, silver)
        return {table: count for table, count, _ in outcomes}, [p for _, _, problems in outcomes for p in problems]

    def alerts() -> Outcome:
        progress(f"{ALERTS} against the alert rules run once over {ANOMALIES}")
        table = read(settings.table_path(ALERTS))
        check.alerts = table.count()
        return {}, _alerts_against_anomalies(spark, settings, table)[1]

    steps = [silver_against_bronze, *([silver_against_truth] if truth else [])]
    steps += [final_table(table) for table in FINAL_TABLES]
    steps += [live_windows, anomalies, device_status, alerts]
    with ThreadPoolExecutor(COMPARISONS_AT_ONCE, thread_name_prefix="iotmon-reconcile") as pool:
        outcomes = list(pool.map(lambda step: step(), steps))
    for counts, problems in outcomes:
        check.rows_checked |= counts
        check.problems += problems
    check.champion, problems = registry.champion_problems(settings)
    check.problems += problems
    return check


def _status_against_silver(
    spark: SparkSession, settings: Settings, silver: DataFrame
) -> list[tuple[str, int, list[str]]]:
    """Device status and its changes against the status rules run once over all of silver (``status_history``):
    every change the stream made, and only those; each device's current row. Nothing to check before the
    status query has committed a batch."""
    if not _ran(spark, settings.checkpoint_path(DEVICE_STATUS)):
        return []
    settled, reached = committed_watermarks(spark, settings.checkpoint_path(DEVICE_STATUS))
    history = status_history(silver, settings, settled, reached).localCheckpoint()
    read = spark.read.format("delta").load
    unsettled = F.col(OFFLINE_UNSETTLED)
    expected_changes = changes_of(history, OFFLINE_UNSETTLED)
    changes = read(settings.table_path(DEVICE_STATUS_CHANGES)).withColumn(
        OFFLINE_UNSETTLED, F.lit(None).cast("boolean")
    )
    changes_count, changes_problems = compare_tables(
        expected_changes,
        changes.select(*expected_changes.columns),
        (DEVICE_ID, "changed_at", "status"),
        DEVICE_STATUS_CHANGES,
        optional=F.col(f"e.{OFFLINE_UNSETTLED}"),
        close=(),
        ignored=(OFFLINE_UNSETTLED,),
    )
    current = read(settings.table_path(DEVICE_STATUS))
    expected = latest_status(history)
    before_unsettled = latest_status(history.where(~unsettled)).join(
        history.where(unsettled).select(DEVICE_ID), DEVICE_ID, "left_semi"
    )
    count, problems = _compare_latest_rows(DEVICE_STATUS, expected, before_unsettled, current, (DEVICE_ID,))
    return [(DEVICE_STATUS_CHANGES, changes_count, changes_problems), (DEVICE_STATUS, count, problems)]


def _alerts_against_anomalies(spark: SparkSession, settings: Settings, alerts: DataFrame) -> tuple[int, list[str]]:
    """Alerts against the alert rules run once over all of ``anomalies`` (``alert_history``): each incident
    once, as the stream left it (an incident whose clearing the stream's watermark may not have reached yet
    may still be open)."""
    if not _ran(spark, settings.checkpoint_path(ALERTS)):
        return 0, []
    settled, reached = committed_watermarks(spark, settings.checkpoint_path(ALERTS))
    anomalies = spark.read.format("delta").load(settings.table_path(ANOMALIES))
    history = alert_history(anomalies, settings, settled, reached).localCheckpoint()
    unsettled = F.col(CLEAR_UNSETTLED)
    expected = latest_alerts(history)
    before_unsettled = latest_alerts(history.where(~unsettled)).join(
        history.where(unsettled).select("alert_id"), "alert_id", "left_semi"
    )
    return _compare_latest_rows(ALERTS, expected, before_unsettled, alerts, ("alert_id",))


def _compare_latest_rows(
    name: str, expected: DataFrame, alternative: DataFrame, actual: DataFrame, keys: tuple[str, ...]
) -> tuple[int, list[str]]:
    """Expected rows, and problems unless ``actual`` holds each key once, equal to its ``expected`` row or
    (where the stream may not have got that far) its ``alternative`` row, and no other key."""
    values = [c for c in expected.columns if c not in keys]
    joined, in_expected, in_actual = _joined(expected, actual.select(*expected.columns), keys)
    joined = joined.join(alternative.withColumn(_EXPECTED, F.lit(True)).alias("alt"), list(keys), "left")

    def equal_to(side: str) -> Column:
        equal = F.col(f"{side}.{_EXPECTED}").isNotNull()
        for column in values:
            equal = equal & F.col(f"a.{column}").eqNullSafe(F.col(f"{side}.{column}"))
        return equal

    different = in_expected & in_actual & ~(equal_to("e") | equal_to("alt"))
    return _differences(joined, keys, name, in_expected, in_actual, in_expected & ~in_actual, different)


def anomalies_against_silver(
    spark: SparkSession, settings: Settings, silver: DataFrame
) -> tuple[int | None, list[str]]:
    """Rows checked (None when there is no model yet, so nothing to check) and problems."""
    anomalies = spark.read.format("delta").load(settings.table_path(ANOMALIES))
    versions = [row[0] for row in anomalies.select("model_version").distinct().collect()]
    if not versions and registry.champion(settings) is None:
        return None, []  # no model yet: nothing could be scored
    features: dict[float, DataFrame] = {}
    """Silver featurised (per device, in Python workers) once per feature history the versions use, not once
    per version: a long run's anomalies name several versions, usually of one history."""
    expected: DataFrame | None = None
    count, problems = 0, []
    try:
        for version in versions:
            ref = registry.model_ref(settings, version)
            history = ref.feature_history_s
            if history not in features:
                features[history] = reading_features(silver, FeatureSpec(history)).persist()
            scored_keys = anomalies.where(F.col("model_version") == version).select(*READING_KEY)
            featured = features[history].join(scored_keys, list(READING_KEY), "left_semi")
            scored = anomalies_of(featured, registry.load_pipeline(settings, ref), ref)
            expected = scored if expected is None else expected.unionByName(scored)
        if expected is not None:
            count, problems = compare_tables(expected, anomalies, READING_KEY, ANOMALIES, close=("score",))
    finally:
        for cached in features.values():
            cached.unpersist()
    unscored = silver.select(*READING_KEY).exceptAll(anomalies.select(*READING_KEY)).count()
    if unscored:
        problems.append(f"{ANOMALIES}: {unscored} silver readings not scored (was the scorer drained?)")
    return count, problems


def _silver_against_truth(
    spark: SparkSession, silver: DataFrame, bronze: DataFrame, truth: list[Path], rules: LatenessRules
) -> list[str]:
    """Every valid delivered reading is in silver once, at its first copy's offset, late by the simulator's
    own send delay; nothing else is in silver. Offsets the broker did not report are looked up in ``bronze``
    (``bronze_identity``)."""
    columns = [*READING_KEY, "delay_s", "malformed_kind", "partition", "offset", "delivered"]
    columns += ["send_index", "topic", "payload_bytes"]
    sends = truth_sends(spark, truth).select(*columns)
    valid = resolve_unknown_offsets(sends, bronze).where("delivered AND malformed_kind IS NULL")
    first_copy = F.min_by(F.struct("partition", "offset", "delay_s"), F.struct("partition", "offset")).alias("f")
    expected = (
        valid.groupBy(*READING_KEY)
        .agg(first_copy)
        .select(
            *READING_KEY,
            F.col("f.partition").cast("int").alias("partition"),
            F.col("f.offset").alias("offset"),
            lateness(F.col("f.delay_s"), rules).alias(LATENESS),
        )
    )
    actual = silver.select(*READING_KEY, "partition", "offset", LATENESS)
    _, problems = compare_tables(expected, actual, READING_KEY, "silver vs ground truth")
    return problems
