"""The one Spark session builder: Delta and the Kafka connector from cached jars, sizes fit for the machine."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from xml.sax.saxutils import escape

from pyspark.sql import SparkSession

from iotmon import class_archive, local_fs, logs
from iotmon.config import Settings
from iotmon.jars import resolve, spark_extras_bundle
from iotmon.preflight import local_directory

LOOPBACK_IP = "127.0.0.1"
# Spark's default ``(?i)url`` plus the Kafka client's secret-bearing options (``spark.redaction.regex``,
# ``(?i)secret|password|token|access[.]?key``, applies on top).
SPARK_OPTIONS_REDACTION = r"(?i)url|sasl\.jaas\.config|sasl\.password|ssl\.key\.password|ssl\.keystore\.password"


def fair_pools_file(settings: Settings, weights: Mapping[str, int]) -> Path:
    """A fair-scheduler allocation file giving each named pool its weight (FAIR within the pool too)."""
    pools = "".join(
        f'  <pool name="{escape(name)}"><schedulingMode>FAIR</schedulingMode><weight>{weight}</weight>'
        f"<minShare>0</minShare></pool>\n"
        for name, weight in sorted(weights.items())
    )
    path = (settings.home / "run" / "fairscheduler.xml").absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'<?xml version="1.0"?>\n<allocations>\n{pools}</allocations>\n')
    return path


GARBAGE_COLLECTOR = "-XX:+UseParallelGC"
"""The driver JVM's collector. A batch's garbage dies young; the JDK's default (G1) spent about 0.2 core of the
stream's 1.25 at the demo's rate, much of it marking concurrently, the throughput collector 0.1 in short pauses
(docs/cost-model.md, the collector and the checkpoint files)."""
HOTSPOT_HUGE_METHOD_BYTES = 8000
"""The largest method HotSpot compiles by default; Spark's whole-stage code generation is held under it."""
_NAMES_A_COLLECTOR = re.compile(r"-XX:\+Use\w+GC\b")


def collector_option(settings: Settings) -> str:
    """The project's collector, unless the operator's own flags name one (two collectors will not start)."""
    return "" if _NAMES_A_COLLECTOR.search(settings.spark_driver_java_options) else GARBAGE_COLLECTOR


LOCAL_CHECKPOINT_FILE_MANAGER = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)
"""How the stream writes its offset, commit and state files on a local disk. Spark's default goes through
Hadoop's ``FileContext``, whose local file system (without Hadoop's native library, which Maven Central does
not ship) runs a ``readlink`` process for every rename; renaming through ``FileSystem`` is the same atomic
rename without the process (docs/cost-model.md, the collector and the checkpoint files)."""


def checkpoint_file_manager(settings: Settings) -> str | None:
    """The checkpoint file manager for the configured checkpoint root: the rename without a process on a local
    disk; Spark's own choice elsewhere (HDFS, object stores), where it knows the store's guarantees."""
    return LOCAL_CHECKPOINT_FILE_MANAGER if local_directory(settings.checkpoint_root) is not None else None


def driver_java_options(settings: Settings) -> str:
    """The driver JVM's flags: the project's log configuration, class archive (``iotmon.class_archive``) and
    collector, then the operator's own (GC, JIT, diagnostics)."""
    options = (
        f"-Dlog4j2.configurationFile={logs.spark_log_config(settings)}",
        class_archive.java_options(settings),
        collector_option(settings),
        settings.spark_driver_java_options,
    )
    return " ".join(option for option in options if option)


def spark_session(
    settings: Settings, app_name: str = "iotmon", pool_weights: Mapping[str, int] | None = None
) -> SparkSession:
    """Get or create the process's Spark session; ``pool_weights`` gives named fair-scheduler pools a weight
    (the stream's queries each run in a pool of their own, see ``iotmon.queries.start_query``).

    Jars come from the local cache as plain paths (``spark.jars``) rather than ``spark.jars.packages``,
    so a start needs no network and does not re-resolve. Shuffle partitions are set here because a
    stateful query fixes them into its checkpoint at first run.
    """
    jars = resolve(settings, spark_extras_bundle())
    local = settings.spark_is_local
    if local:
        local_fs.ensure(settings)  # before the class path and its class archive are chosen
        # Keep the driver and its UI on loopback (the UI binds to SPARK_LOCAL_IP, else to every address).
        os.environ.setdefault("SPARK_LOCAL_IP", LOOPBACK_IP)
        # Python workers (pandas UDFs, transformWithStateInPandas) default to `python3` on PATH, which
        # outside an activated venv lacks pandas and pyarrow; run them with this interpreter instead.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName(app_name)
        .master(settings.spark_master)
        .config("spark.jars", ",".join(str(jar) for jar in jars))
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        .config("spark.driver.memory", settings.spark_driver_memory)
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        # The Delta sink rebuilds the table's snapshot state (a shuffle job) at every batch to check its
        # idempotence; Delta's default of 50 partitions made that 4-5 s per micro-batch on 2 cores.
        .config("spark.databricks.delta.snapshotPartitions", str(settings.shuffle_partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.warehouse.dir", str((settings.home / "warehouse").absolute()))
        .config("spark.ui.enabled", str(settings.spark_ui).lower())
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.extraJavaOptions", driver_java_options(settings))
        # Spark masks options whose key or value matches these in plans, UIs and logs; the Kafka source's
        # JAAS line (it holds the SASL password) is named explicitly rather than left to a value match.
        .config("spark.sql.redaction.options.regex", SPARK_OPTIONS_REDACTION)
        .config("spark.sql.streaming.metricsEnabled", "true")
        # The queries share the cores by pool (one each, see ``iotmon.queries.start_query``), not first come,
        # first served.
        .config("spark.scheduler.mode", "FAIR")
        # RocksDB keeps state off the JVM heap (transformWithState requires it); the changelog makes a
        # state commit write only what changed. Both are fixed into a stateful query's checkpoint.
        .config(
            "spark.sql.streaming.stateStore.providerClass",
            "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
        )
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        # A streaming session window shuffles every reading by default, then sorts and merges them into sessions;
        # a device's readings of a batch all fall in one or two sessions, so merging them in each partition first
        # shuffles a row per session instead: the final windows' batches took a fifth less of the JVM's CPU in a
        # probe, their steady batch 8 % less time in the bench (docs/cost-model.md, "Sessions merged before the
        # shuffle"). Not part of the state: safe for existing checkpoints.
        .config("spark.sql.streaming.sessionWindow.merge.sessions.in.local.partition", "true")
        # Generated classes are cached by their source, 100 by default, fewer than the eight queries' plans
        # hold: an evicted class is compiled again (Janino) and JIT-compiled again, and compilation is the
        # JVM's largest consumer of CPU here. At 500 events/s this cut p95 latencies by a third to a half at the
        # same CPU (docs/cost-model.md).
        .config("spark.sql.codegen.cache.maxEntries", "2000")
        # HotSpot never JIT-compiles a method over 8,000 bytes of bytecode (-XX:+DontCompileHugeMethods), and
        # Spark's limit is 65,535: the ingest query's parse generated a 10 KB method that ran interpreted. Over
        # the limit Spark runs the subtree without whole-stage code generation, each expression in a compiled
        # method of its own: the ingest query drained 200,000 records a tenth faster (docs/cost-model.md).
        .config("spark.sql.codegen.hugeMethodLimit", str(HOTSPOT_HUGE_METHOD_BYTES))
        # Not optimizeWrite/autoCompact: measured to cost 3-4x the whole bronze batch here (an extra
        # shuffle and a compaction job per commit); compaction belongs in a maintenance job instead.
    )
    for key, value in local_fs.spark_options(settings).items():
        builder = builder.config(key, value)
    if file_manager := checkpoint_file_manager(settings):
        builder = builder.config("spark.sql.streaming.checkpointFileManagerClass", file_manager)
    if pool_weights:
        builder = builder.config("spark.scheduler.allocation.file", str(fair_pools_file(settings, pool_weights)))
    if local:
        # The driver's RPC endpoint and block manager: loopback, whatever the host name resolves to.
        builder = builder.config("spark.driver.bindAddress", LOOPBACK_IP).config("spark.driver.host", LOOPBACK_IP)
    # PySpark replaces the SIGINT handler with one that cancels every running job and raises
    # KeyboardInterrupt. A stream stops between batches instead (the handler its command installed), so
    # whatever handler was there before the session comes back.
    handler = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    with logs.output_to_log(settings):  # the JVM (and its Python workers) log to this command's file
        session = builder.getOrCreate()
    if handler is not None:
        signal.signal(signal.SIGINT, handler)
    return session
