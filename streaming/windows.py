"""Silver -> gold: event-time windowed statistics per device, per site and type, and activity sessions.

Pure ``DataFrame -> DataFrame`` functions. On the silver stream (watermarked by the caller) they run
incrementally, on a silver snapshot they run as a plain batch job, and the rows agree: only readings
silver marks ``on_time`` or ``late`` count, so what the stream leaves out is decided by the data, not by
when a micro-batch happened to run. Float statistics can differ in the last bits between the two
(summation order), never more.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from iotmon.config import Settings
from iotmon.schema import (
    DEVICE_ID,
    DEVICE_SESSIONS,
    DEVICE_WINDOWS,
    EVENT_TIME,
    LATE,
    LATENESS,
    METRIC_NAMES,
    ON_TIME,
    SITE_WINDOWS,
)

TUMBLING, SLIDING = "tumbling", "sliding"
DEVICE_ATTRIBUTES: tuple[str, ...] = ("device_type", "site")
"""Registry columns carried into per-device rows. Taken with ``max`` rather than grouped by, so a device the
registry moves mid-window still has one row per window: the key of a per-device table is the device."""
END_COLUMN: dict[str, str] = {DEVICE_WINDOWS: "window_end", SITE_WINDOWS: "window_end", DEVICE_SESSIONS: "session_end"}
"""The column saying when a row of each final table became final (its window or session closed)."""


@dataclass(frozen=True)
class WindowSpec:
    window: str = "1 minute"
    sliding_window: str = "5 minutes"
    slide: str = "1 minute"
    session_gap: str = "1 minute"

    @classmethod
    def from_settings(cls, settings: Settings) -> WindowSpec:
        return cls(settings.window, settings.sliding_window, settings.slide, settings.session_gap)


def metric_stats() -> list[Column]:
    """``readings`` and, per metric, avg/min/max/stddev (sample stddev: null for a single reading)."""
    stats = [F.count(F.lit(1)).alias("readings")]
    for name in METRIC_NAMES:
        column = F.col(name)
        stats += [
            F.avg(column).alias(f"{name}_avg"),
            F.min(column).alias(f"{name}_min"),
            F.max(column).alias(f"{name}_max"),
            F.stddev_samp(column).alias(f"{name}_stddev"),
        ]
    return stats


STAT_COLUMNS: tuple[str, ...] = (
    "readings",
    *[f"{name}_{stat}" for name in METRIC_NAMES for stat in ("avg", "min", "max", "stddev")],
)


def countable(readings: DataFrame) -> DataFrame:
    """Readings the aggregates count: everything but ``too_late`` (and the event-time clock's ticks)."""
    return readings.where(F.col(LATENESS).isin(ON_TIME, LATE))


def _windowed(readings: DataFrame, window: Column, group: tuple[str, ...], carried: tuple[str, ...] = ()) -> DataFrame:
    return (
        countable(readings)
        .groupBy(window.alias("window"), *group)
        .agg(*[F.max(name).alias(name) for name in carried], *metric_stats())
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            *group,
            *carried,
            *STAT_COLUMNS,
        )
    )


def tumbling_device_windows(readings: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per device and tumbling window: the live table's rows, and the final table's ``tumbling`` rows."""
    return _windowed(readings, F.window(EVENT_TIME, spec.window), (DEVICE_ID,), DEVICE_ATTRIBUTES)


def device_windows(readings: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per device: tumbling and sliding windows, told apart by ``window_kind``."""
    tumbling = tumbling_device_windows(readings, spec).withColumn("window_kind", F.lit(TUMBLING))
    sliding_window = F.window(EVENT_TIME, spec.sliding_window, spec.slide)
    sliding = _windowed(readings, sliding_window, (DEVICE_ID,), DEVICE_ATTRIBUTES)
    both = tumbling.unionByName(sliding.withColumn("window_kind", F.lit(SLIDING)))
    return both.select("window_kind", *[c for c in both.columns if c != "window_kind"])


def site_windows(readings: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per site and device type, tumbling windows; ``devices`` is how many devices reported (HyperLogLog)."""
    group = ("site", "device_type")
    return (
        countable(readings)
        .groupBy(F.window(EVENT_TIME, spec.window).alias("window"), *group)
        .agg(F.approx_count_distinct(DEVICE_ID, 0.01).alias("devices"), *metric_stats())
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            *group,
            "devices",
            *STAT_COLUMNS,
        )
    )


def device_sessions(readings: DataFrame, spec: WindowSpec) -> DataFrame:
    """Activity sessions per device: readings closer than the gap belong together; ``session_end`` is the
    last reading plus the gap, Spark's definition."""
    return (
        countable(readings)
        .groupBy(F.session_window(EVENT_TIME, spec.session_gap).alias("session"), DEVICE_ID)
        .agg(*[F.max(name).alias(name) for name in DEVICE_ATTRIBUTES], *metric_stats())
        .select(
            DEVICE_ID,
            *DEVICE_ATTRIBUTES,
            F.col("session.start").alias("session_start"),
            F.col("session.end").alias("session_end"),
            *STAT_COLUMNS,
        )
    )


FINAL_TABLES = {DEVICE_WINDOWS: device_windows, SITE_WINDOWS: site_windows, DEVICE_SESSIONS: device_sessions}
"""Each final (append-once) gold table and the function that computes it."""
