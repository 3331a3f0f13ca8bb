"""The Spark JVM's class-data archive: Spark's classes, loaded, parsed and verified once by ``iotmon setup``,
then mapped into every JVM the project starts (the JDK's application class-data sharing, CDS).

A cold JVM is most of what a start costs here: the stream after a crash, each command, each test that starts
Spark. Of a start's classes, about 15,000 come from the jars Spark itself ships; the archive holds those, so a
start maps them instead of reading and verifying them again (docs/cost-model.md: a session and its first
Delta read 10.1 s -> 7.6 s). Delta's and the Kafka connector's classes are not in it: Spark loads ``spark.jars``
with a class loader of its own, which the JDK 17 archive does not cover.

An archive is only valid for the JDK and the jars that wrote it; the JVM checks and ignores one that does not
match, so a stale archive costs the speed-up, never a start. Its name carries a digest of both, so a new JDK
or Spark gets an archive of its own at the next ``iotmon setup``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from iotmon import local_fs
from iotmon.config import Settings
from iotmon.jars import java_home, pyspark_jars_dir
from iotmon.logs import say

ARCHIVE_OPTIONS = ("-XX:SharedArchiveFile", "-XX:ArchiveClassesAtExit", "-Xshare")
"""Flags an operator may set in ``IOTMON_SPARK_DRIVER_JAVA_OPTIONS`` to manage class sharing themselves."""
BUILD_TIMEOUT_S = 900.0


def archive_path(settings: Settings) -> Path | None:
    """Where this JDK's and this Spark's archive is kept (None without a JDK)."""
    home = java_home()
    if home is None:
        return None
    release = home / "release"
    jdk = release.read_text() if release.exists() else str(home.resolve())
    # The local file system's jar goes first on the class path (``iotmon.local_fs``), so it is part of the match.
    jars = [*local_fs.class_path(settings), *sorted(jar.name for jar in pyspark_jars_dir().glob("*.jar"))]
    digest = hashlib.sha256("\n".join([jdk, *jars]).encode()).hexdigest()[:12]
    return settings.cache / "jvm" / f"spark-classes-{digest}.jsa"


def java_options(settings: Settings) -> str:
    """The driver JVM's flag that maps the archive, if ``iotmon setup`` built one and the operator's own
    options do not manage class sharing."""
    if any(option in settings.spark_driver_java_options for option in ARCHIVE_OPTIONS):
        return ""
    path = archive_path(settings)
    return f"-XX:SharedArchiveFile={path}" if path is not None and path.exists() else ""


class ClassArchiveError(RuntimeError):
    """The archive could not be built; Spark starts without it, only slower."""


def build(settings: Settings, out: TextIO = sys.stderr) -> tuple[Path, float] | None:
    """Build the archive if it is missing: a child process starts Spark with ``-XX:ArchiveClassesAtExit``, runs
    a small batch and streaming workload, and exits; its JVM writes the classes it loaded as it exits. Returns
    the archive and the seconds the build took (0 if it was there already), or None without a JDK. Archives
    of another JDK or Spark are removed."""
    path = archive_path(settings)
    if path is None:
        return None
    if path.exists():
        return path, 0.0
    say("JVM class archive: building it, once (about a minute)", out)
    path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="class-archive-", dir=path.parent) as scratch:
        partial, home = Path(scratch) / path.name, Path(scratch) / "home"
        workload = dataclasses.replace(
            settings,
            home=home,  # its logs, warehouse and tables stay in the scratch directory
            cache_dir=settings.cache,
            lake=None,
            checkpoints=None,
            spark_ui=False,
            spark_driver_java_options=f"-XX:ArchiveClassesAtExit={partial}",
        )
        command = [sys.executable, "-m", "iotmon.class_archive", scratch]
        try:
            done = subprocess.run(
                command, env=workload.child_env(), capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise ClassArchiveError(f"its workload took more than {BUILD_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0 or not partial.exists():
            logs = "".join(log.read_text(errors="replace")[-2000:] for log in sorted(home.glob("logs/*")))
            raise ClassArchiveError(
                f"its workload ended with code {done.returncode}; its output ends:\n"
                f"{(done.stdout + done.stderr)[-2000:]}{logs}"
            )
        partial.replace(path)
    for stale in path.parent.glob("spark-classes-*.jsa"):
        if stale != path:
            stale.unlink()
    return path, time.monotonic() - started


def set_up(settings: Settings, out: TextIO = sys.stdout) -> None:
    """``iotmon setup``'s part: build the archive if it is missing and say where it is. A failed build is a line
    on stderr, not a failed setup: Spark starts without the archive, only slower."""
    try:
        built = build(settings, out)
    except ClassArchiveError as exc:
        say(f"JVM class archive: not built, Spark starts without it (only slower): {exc}", sys.stderr)
        return
    if built is None:
        say("JVM class archive: skipped, no JDK found (JAVA_HOME or java on the PATH)", sys.stderr)
        return
    path, seconds = built
    took = f", built in {seconds:.0f}s" if seconds else ""
    say(f"JVM class archive: {path} ({path.stat().st_size / 2**20:,.0f} MB{took})", out)


def _workload(scratch: Path) -> None:
    """What a start of the project's commands loads: a session, Delta reads, writes and a MERGE, stateful
    streaming queries with a watermark (RocksDB state) and ``foreachBatch``, a pandas function (Arrow, Python
    workers)."""
    from delta.tables import DeltaTable
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from iotmon.spark import spark_session

    spark = spark_session(Settings.from_env(), "iotmon-class-archive")
    source, windows, latest = (str(scratch / name) for name in ("source", "windows", "latest"))
    readings = spark.range(2_000).select(
        (F.col("id") % 20).cast("string").alias("device_id"),
        (F.timestamp_seconds(F.lit(1_800_000_000) + F.col("id"))).alias("event_time"),
        (F.col("id") / 7).alias("value"),
    )
    readings.write.format("delta").save(source)
    readings.limit(0).write.format("delta").save(latest)

    def upsert(batch: DataFrame, batch_id: int) -> None:
        newest = batch.groupBy("device_id").agg(F.max("event_time").alias("event_time"), F.avg("value").alias("value"))
        target = DeltaTable.forPath(spark, latest).alias("t")
        condition = "t.device_id = s.device_id"
        target.merge(newest.alias("s"), condition).whenMatchedUpdateAll().whenNotMatchedInsertAll().execute()

    stream = spark.readStream.format("delta").load(source).withWatermark("event_time", "30 seconds")
    queries = [
        stream.writeStream.foreachBatch(upsert)
        .option("checkpointLocation", str(scratch / "checkpoints" / "latest"))
        .trigger(availableNow=True)
        .start(),
        stream.groupBy(F.window("event_time", "1 minute"), "device_id")
        .agg(F.avg("value").alias("value"), F.count("*").alias("readings"))
        .writeStream.format("delta")
        .outputMode("append")
        .option("checkpointLocation", str(scratch / "checkpoints" / "windows"))
        .trigger(availableNow=True)
        .start(windows),
    ]
    for query in queries:
        query.awaitTermination()
    window_rows = spark.read.format("delta").load(windows)
    as_pandas = window_rows.groupBy("device_id").applyInPandas(lambda frame: frame, window_rows.schema)
    as_pandas.write.format("delta").mode("append").save(windows)
    spark.read.format("delta").load(latest).join(spark.read.format("delta").load(windows), "device_id").count()


def main() -> None:
    """In the child: the workload, then a JVM that exits and writes the archive before this process does."""
    from pyspark import SparkContext

    _workload(Path(sys.argv[1]))
    gateway = SparkContext._gateway
    SparkContext.getOrCreate().stop()
    if gateway is not None:
        gateway.proc.stdin.close()  # the JVM exits once its stdin closes, writing the archive first
        gateway.proc.wait(BUILD_TIMEOUT_S)


if __name__ == "__main__":
    main()
