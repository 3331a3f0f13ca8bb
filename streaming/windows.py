"""Silver -> gold: event-time windowed statistics per device, per site and type, and activity sessions.

Pure ``DataFrame -> DataFrame`` functions. On the silver stream (watermarked by the caller) they run
incrementally, on a silver snapshot they run as a plain batch job, and the rows agree: only readings
silver marks ``on_time`` or ``late`` count, so what the stream leaves out is decided by the data, not by
when a micro-batch happened to run. Float statistics can differ in the last bits between the two
(summation order), never more.

Readings are aggregated twice only: into per-device tumbling windows, and into sessions. Sliding windows
and the per-site roll-ups are combined from the tumbling windows' statistics (``combined``): a sliding
window holds exactly the tumbling windows inside it, a site window its devices' tumbling windows. Each
reading in five sliding windows and a site window would otherwise be aggregated seven times over.

The combinations have a second form over Arrow rows (``combined_rows``; tested equal): the final windows'
writer combines a batch's few thousand tumbling windows on the driver, where a Spark job for them would cost
more than their rows (docs/cost-model.md, "The final windows combined on the driver").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from iotmon.config import ConfigError, Settings, interval_seconds
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

    def __post_init__(self) -> None:
        tumble = interval_seconds(self.window)
        if any(interval_seconds(length) % tumble for length in (self.sliding_window, self.slide)):
            raise ValueError(
                f"the sliding window ({self.sliding_window}) and its slide ({self.slide}) must be whole multiples "
                f"of the tumbling window ({self.window}): sliding windows are combined from tumbling ones"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> WindowSpec:
        try:
            return cls(settings.window, settings.sliding_window, settings.slide, settings.session_gap)
        except ValueError as exc:
            raise ConfigError(f"IOTMON_SLIDING_WINDOW, IOTMON_SLIDE, IOTMON_WINDOW: {exc}") from None


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


TUMBLING_COLUMNS: tuple[str, ...] = ("window_start", "window_end", DEVICE_ID, *DEVICE_ATTRIBUTES, *STAT_COLUMNS)
"""The columns of ``tumbling_device_windows``."""
SESSION_COLUMNS: tuple[str, ...] = (DEVICE_ID, *DEVICE_ATTRIBUTES, "session_start", "session_end", *STAT_COLUMNS)
"""The columns of ``device_sessions``."""


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


def combined(windows: DataFrame, window: Column, group: tuple[str, ...], carried: tuple[str, ...] = ()) -> DataFrame:
    """Statistics of wider windows from those of the windows inside them (rows with ``STAT_COLUMNS``).

    Counts, minima and maxima combine directly, means weighted by count; the spread is the within-window
    spread plus each window's distance from the combined mean (Chan et al.), taken in a second pass so that
    no large sums of squares cancel. ``devices`` counts the rows combined (one per device and window)."""
    keys = (window.alias("window"), *group)
    framed = windows.select(*keys, *carried, *STAT_COLUMNS)
    by_group = Window.partitionBy("window", *group)
    n = F.col("readings")
    with_means = framed.withColumns(
        {f"_{m}_mean": F.sum(F.col(f"{m}_avg") * n).over(by_group) / F.sum(n).over(by_group) for m in METRIC_NAMES}
    )
    stats = [F.count(F.lit(1)).alias("devices"), F.sum(n).alias("readings")]
    for m in METRIC_NAMES:
        avg, sd, mean = F.col(f"{m}_avg"), F.col(f"{m}_stddev"), F.col(f"_{m}_mean")
        within = F.coalesce(sd * sd * (n - 1), F.lit(0.0))
        spread = F.sum(within + n * (avg - mean) * (avg - mean))
        stats += [
            (F.sum(avg * n) / F.sum(n)).alias(f"{m}_avg"),
            F.min(f"{m}_min").alias(f"{m}_min"),
            F.max(f"{m}_max").alias(f"{m}_max"),
            F.when(F.sum(n) > 1, F.sqrt(spread / (F.sum(n) - 1))).alias(f"{m}_stddev"),
        ]
    return (
        with_means.groupBy("window", *group)
        .agg(*[F.max(name).alias(name) for name in carried], *stats)
        .select(
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            *group,
            *carried,
            "devices",
            *STAT_COLUMNS,
        )
    )


def sliding_device_windows(tumbling: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per device, the sliding windows of the tumbling windows ``tumbling`` holds (``tumbling_device_windows``
    rows): each sliding window combines the tumbling windows inside it (``WindowSpec`` keeps them aligned)."""
    sliding = F.window(F.col("window_start"), spec.sliding_window, spec.slide)
    return combined(tumbling, sliding, (DEVICE_ID,), DEVICE_ATTRIBUTES).drop("devices")


def site_rollups(tumbling: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per site and device type, tumbling windows from the devices' (``tumbling_device_windows`` rows);
    ``devices`` is how many devices reported in the window."""
    window = F.window(F.col("window_start"), spec.window)
    return combined(tumbling, window, ("site", "device_type"))


def with_kinds(tumbling: DataFrame, sliding: DataFrame) -> DataFrame:
    """The ``device_windows`` table's rows: tumbling and sliding windows, told apart by ``window_kind``."""
    both = tumbling.withColumn("window_kind", F.lit(TUMBLING)).unionByName(
        sliding.withColumn("window_kind", F.lit(SLIDING))
    )
    return both.select("window_kind", *[c for c in both.columns if c != "window_kind"])


def device_windows(readings: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per device: tumbling and sliding windows, told apart by ``window_kind``."""
    tumbling = tumbling_device_windows(readings, spec)
    return with_kinds(tumbling, sliding_device_windows(tumbling, spec))


def site_windows(readings: DataFrame, spec: WindowSpec) -> DataFrame:
    """Per site and device type, tumbling windows; ``devices`` is how many devices reported."""
    return site_rollups(tumbling_device_windows(readings, spec), spec)


# --- the same combinations over Arrow rows ---------------------------------------------------------------


def _windows_of(rows: pa.Table, length: str, slide: str) -> pa.Table:
    """``rows`` once for each window of ``length`` every ``slide`` that holds its ``window_start``, with that
    window's ``window_start`` and ``window_end`` in their place: what ``F.window`` and its grouping do."""
    length_us, slide_us = (int(interval_seconds(text) * 1_000_000) for text in (length, slide))
    kind = rows.schema.field("window_start").type
    starts = pc.cast(rows.column("window_start"), pa.int64()).to_numpy()
    latest = starts - starts % slide_us
    index, window = [], []
    for back in range(-(-length_us // slide_us)):
        candidate = latest - back * slide_us
        holds = np.flatnonzero(starts < candidate + length_us)
        index.append(holds)
        window.append(candidate[holds])
    index_all, start = np.concatenate(index), np.concatenate(window)
    out = rows.drop_columns(["window_start", "window_end"]).take(pa.array(index_all, pa.int64()))
    return out.add_column(0, "window_end", pa.array(start + length_us, pa.int64()).cast(kind)).add_column(
        0, "window_start", pa.array(start, pa.int64()).cast(kind)
    )


def _groups(rows: pa.Table, keys: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Each row's group by ``keys`` (0, 1, ...; a null is a value like any other, as in Spark's grouping), and
    the first row of each group."""
    group = np.zeros(rows.num_rows, np.int64)
    for key in keys:
        codes = pc.dictionary_encode(rows.column(key).combine_chunks(), null_encoding="encode")
        group = np.unique(
            group * len(codes.dictionary) + codes.indices.to_numpy(zero_copy_only=False), return_inverse=True
        )[1]
    _, first = np.unique(group, return_index=True)
    return group.astype(np.int64), first


def combined_rows(
    windows: pa.Table, length: str, slide: str, group: tuple[str, ...], carried: tuple[str, ...] = ()
) -> pa.Table:
    """``combined`` over Arrow rows of ``STAT_COLUMNS``: the windows of ``length`` every ``slide``, from the
    narrower windows inside them, with the same arithmetic, nulls included (a mean and a spread skip the
    windows whose mean is null; the spread's second pass takes its group's combined mean)."""
    keys = ["window_start", "window_end", *group]
    rows = _windows_of(windows.select([*keys, *carried, *STAT_COLUMNS]), length, slide)
    index, first = _groups(rows, keys)
    rows = rows.append_column("_group", pa.array(index))
    n = pc.cast(rows.column("readings"), pa.float64())
    for m in METRIC_NAMES:
        rows = rows.append_column(f"_{m}_weighted", pc.multiply(rows.column(f"{m}_avg"), n))
    sums = (
        rows.group_by("_group")
        .aggregate([("readings", "sum"), *[(f"_{m}_weighted", "sum") for m in METRIC_NAMES]])
        .sort_by("_group")
    )
    total = pc.cast(sums.column("readings_sum"), pa.float64())
    for m in METRIC_NAMES:
        mean = pc.take(pc.divide(sums.column(f"_{m}_weighted_sum"), total), index)
        avg, sd = rows.column(f"{m}_avg"), rows.column(f"{m}_stddev")
        within = pc.coalesce(pc.multiply(pc.multiply(sd, sd), pc.subtract(n, 1.0)), 0.0)
        apart = pc.subtract(avg, mean)
        rows = rows.append_column(f"_{m}_spread", pc.add(within, pc.multiply(n, pc.multiply(apart, apart))))
    stats = [
        *[(name, "max") for name in carried],
        ([], "count_all"),
        ("readings", "sum"),
        *[(f"_{m}_weighted", "sum") for m in METRIC_NAMES],
        *[(f"{m}_min", "min") for m in METRIC_NAMES],
        *[(f"{m}_max", "max") for m in METRIC_NAMES],
        *[(f"_{m}_spread", "sum") for m in METRIC_NAMES],
    ]
    out = rows.group_by("_group").aggregate(stats).sort_by("_group")
    readings = out.column("readings_sum")
    total = pc.cast(readings, pa.float64())
    firsts = rows.take(pa.array(first))
    columns = {name: firsts.column(name) for name in keys}
    columns |= {name: out.column(f"{name}_max") for name in carried}
    columns |= {"devices": out.column("count_all"), "readings": readings}
    for m in METRIC_NAMES:
        spread = pc.sqrt(pc.divide(out.column(f"_{m}_spread_sum"), pc.subtract(total, 1.0)))
        columns[f"{m}_avg"] = pc.divide(out.column(f"_{m}_weighted_sum"), total)
        columns[f"{m}_min"] = out.column(f"{m}_min_min")
        columns[f"{m}_max"] = out.column(f"{m}_max_max")
        columns[f"{m}_stddev"] = pc.if_else(pc.greater(readings, 1), spread, pa.scalar(None, pa.float64()))
    return pa.table(columns)


def sliding_device_window_rows(tumbling: pa.Table, spec: WindowSpec) -> pa.Table:
    """``sliding_device_windows`` over Arrow rows of ``tumbling_device_windows``."""
    return combined_rows(tumbling, spec.sliding_window, spec.slide, (DEVICE_ID,), DEVICE_ATTRIBUTES).drop_columns(
        ["devices"]
    )


def site_rollup_rows(tumbling: pa.Table, spec: WindowSpec) -> pa.Table:
    """``site_rollups`` over Arrow rows of ``tumbling_device_windows``."""
    return combined_rows(tumbling, spec.window, spec.window, ("site", "device_type"))


def with_kind_rows(tumbling: pa.Table, sliding: pa.Table) -> pa.Table:
    """``with_kinds`` over Arrow rows: the ``device_windows`` table's rows."""
    schema = tumbling.select(list(TUMBLING_COLUMNS)).schema
    parts = [
        rows.select(list(TUMBLING_COLUMNS))
        .cast(schema)
        .add_column(0, "window_kind", pa.array([kind] * rows.num_rows, pa.string()))
        for kind, rows in ((TUMBLING, tumbling), (SLIDING, sliding))
    ]
    return pa.concat_tables(parts)


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
