"""Reconcile the whole lake: the archive against Kafka (``ingest.verify``) and silver and gold against their
batch recomputation (``streaming.verify``), the check `iotmon verify`, the demo's stop and `iotmon chaos` end
with.

The two read different tables and share only the Spark session, so they run at once, the archive's on a thread
of its own. Each is a series of small Spark jobs whose driver-side work (planning, Delta logs, Kafka's offsets)
leaves a core idle, which the other's work then takes (docs/cost-model.md, "The demo's first minute, and its
stop").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import SparkSession

from ingest.verify import Reconciliation, reconcile
from iotmon.config import Settings
from iotmon.schema import BRONZE, QUARANTINE, SILVER
from streaming.verify import AnalyticsCheck, reconcile_analytics


@dataclass(frozen=True)
class LakeCheck:
    archive: Reconciliation
    analytics: AnalyticsCheck | None
    """None when there is no silver table yet (an archive-only lake)."""

    @property
    def problems(self) -> list[str]:
        return [*self.archive.problems, *(self.analytics.problems if self.analytics is not None else [])]


def reconcile_lake(
    spark: SparkSession,
    settings: Settings,
    truth: Sequence[Path] = (),
    progress: Callable[[str], None] = lambda _: None,
) -> LakeCheck:
    """Both reconciliations, at once; ``progress`` hears what is being checked."""
    from delta.tables import DeltaTable

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="iotmon-verify-archive") as pool:
        progress(f"{BRONZE} and {QUARANTINE} against Kafka{' and the ground truth' if truth else ''}")
        archive = pool.submit(reconcile, spark, settings, truth)
        analytics = None
        if DeltaTable.isDeltaTable(spark, settings.table_path(SILVER)):
            analytics = reconcile_analytics(spark, settings, list(truth), progress)
        return LakeCheck(archive.result(), analytics)
