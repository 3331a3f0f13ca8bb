"""The lake's edges shared by every stage: creating tables, idempotent batch writes, the SQL catalogue.

Exactly-once sinks in ``foreachBatch`` rest on Delta transaction identifiers: a write tagged with
``(app_id, batch_id)`` is committed at most once per table, so a micro-batch replayed after a crash is
skipped where it already landed. The app id is taken from the query's checkpoint, so a new checkpoint
(after ``iotmon reset`` or ``iotmon backfill``) starts a new sequence instead of being skipped forever.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql.types import StructType

from iotmon.config import Settings
from iotmon.schema import LAKE_TABLES

_TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
_TXN_VERSION = "spark.databricks.delta.write.txnVersion"


def create_table(
    spark: SparkSession, path: str, schema: StructType, comment: str, *, append_only: bool = False
) -> None:
    """Create a Delta table if it is missing. Unpartitioned on purpose: at this size Delta's file
    statistics prune as well as partitions would, without a small-file problem per partition."""
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(schema).comment(comment)
    if append_only:
        builder = builder.property("delta.appendOnly", "true")
    builder.execute()


def checkpoint_app_id(spark: SparkSession, checkpoint: str) -> str:
    """The transaction app id of the query using ``checkpoint``: its persistent query id.

    Spark writes ``<checkpoint>/metadata`` (``{"id": ...}``) when a query first starts; the id survives
    restarts and changes only with a new checkpoint, exactly the lifetime of its batch ids.
    """
    text = "".join(row.value for row in spark.read.text(f"{checkpoint.rstrip('/')}/metadata").collect())
    return f"iotmon-{json.loads(text)['id']}"


class TransactionId:
    """A query's Delta transaction app id, read from its checkpoint once, at the query's first batch
    (the checkpoint's metadata exists only once the query has started)."""

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        self.value: str | None = None

    def __call__(self, batch: DataFrame) -> str:
        if self.value is None:
            self.value = checkpoint_app_id(batch.sparkSession, self.checkpoint)
        return self.value


def append_once(frame: DataFrame, path: str, app_id: str, batch_id: int) -> None:
    """Append ``frame`` unless batch ``batch_id`` of ``app_id`` is already in the table."""
    writer = frame.write.format("delta").mode("append")
    writer.option("txnAppId", app_id).option("txnVersion", batch_id).save(path)


def merge_once(source: DataFrame, path: str, condition: Column, app_id: str, batch_id: int, *, update: bool) -> None:
    """MERGE ``source`` (alias ``s``) into the table at ``path`` (alias ``t``) unless batch ``batch_id`` of
    ``app_id`` already did: insert the unmatched rows and, with ``update``, overwrite the matched ones."""
    session = source.sparkSession
    merge = DeltaTable.forPath(session, path).alias("t").merge(source.alias("s"), condition)
    if update:
        merge = merge.whenMatchedUpdateAll()
    with _transaction_id(session, app_id, batch_id):
        merge.whenNotMatchedInsertAll().execute()


@contextmanager
def _transaction_id(spark: SparkSession, app_id: str, batch_id: int) -> Iterator[None]:
    """Tag the next Delta command of ``spark`` (MERGE takes no write options) with ``(app_id, batch_id)``.

    ``spark`` is the micro-batch's own session (``batch.sparkSession``): each streaming query runs in a
    clone of the session, so concurrent queries never see each other's tags.
    """
    spark.conf.set(_TXN_APP_ID, app_id)
    spark.conf.set(_TXN_VERSION, str(batch_id))
    try:
        yield
    finally:
        spark.conf.unset(_TXN_APP_ID)
        spark.conf.unset(_TXN_VERSION)


def _file_system(spark: SparkSession, path: str):
    """Hadoop's file system for ``path``: the one Spark uses, so checkpoints on object stores work too."""
    jvm = spark.sparkContext._jvm
    hadoop_path = jvm.org.apache.hadoop.fs.Path(path)
    return hadoop_path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hadoop_path


def read_text(spark: SparkSession, path: str) -> str | None:
    """A small file's text, or None if it does not exist."""
    fs, hadoop_path = _file_system(spark, path)
    if not fs.exists(hadoop_path):
        return None
    stream = fs.open(hadoop_path)
    try:
        return spark.sparkContext._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8")
    finally:
        stream.close()


def list_files(spark: SparkSession, directory: str, suffix: str) -> list[str]:
    """The paths of the files in ``directory`` whose names end with ``suffix`` (none if it is missing)."""
    fs, hadoop_path = _file_system(spark, directory)
    if not fs.exists(hadoop_path):
        return []
    return [
        str(status.getPath()) for status in fs.listStatus(hadoop_path) if status.getPath().getName().endswith(suffix)
    ]


def write_text(spark: SparkSession, path: str, text: str | None) -> None:
    """Write a small file (overwriting), or delete it when ``text`` is None."""
    fs, hadoop_path = _file_system(spark, path)
    if text is None:
        fs.delete(hadoop_path, False)
        return
    stream = fs.create(hadoop_path, True)
    try:
        stream.write(bytearray(text.encode()))
    finally:
        stream.close()


def remove_unfinished_first_batch(spark: SparkSession, checkpoint: str) -> list[str]:
    """Delete what a crash during a query's very first offset write left in ``<checkpoint>/offsets``.

    Spark writes an offset file as a hidden temp file and renames it. Killed in between, the log holds no
    batch, only the temp file; Spark 4.2 then refuses batch 0 because the offset log is not empty
    (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY, SPARK-53103), on every restart. With no batch in the log
    there is nothing to lose: the batch is planned again. Returns the names removed.
    """
    fs, offsets = _file_system(spark, f"{checkpoint.rstrip('/')}/offsets")
    if not fs.exists(offsets):
        return []
    names = [status.getPath().getName() for status in fs.listStatus(offsets)]
    if any(name.isdigit() for name in names):
        return []
    names = [name for name in names if name.startswith(".") and (name.endswith(".tmp") or name.endswith(".tmp.crc"))]
    for name in names:
        fs.delete(spark.sparkContext._jvm.org.apache.hadoop.fs.Path(offsets, name), False)
    return names


def register_tables(spark: SparkSession, settings: Settings) -> list[str]:
    """Register each existing lake table as a temporary view named after it; return the names."""
    registered = []
    for table in LAKE_TABLES:
        path = settings.table_path(table)
        if DeltaTable.isDeltaTable(spark, path):
            spark.read.format("delta").load(path).createOrReplaceTempView(table)
            registered.append(table)
    return registered


def run_sql(spark: SparkSession, settings: Settings, statement: str) -> DataFrame:
    register_tables(spark, settings)
    return spark.sql(statement)
