"""The lake's edges shared by every stage: creating tables, exactly-once batch writes, the SQL catalogue.

Exactly-once sinks in ``foreachBatch`` rest on a tag in each commit. A write of micro-batch ``n`` by a query
carries ``{"app": <query id>, "batch": n}`` as the commit's ``userMetadata``; a batch replayed after a crash
looks its table's newest commits up for its own tag and skips a table that already holds it. Delta's own
transaction identifiers (``txnAppId``/``txnVersion``) give the same guarantee, but with delta-spark 4.4 each
such write rebuilds the table's snapshot state to find them: three extra Spark jobs per table and batch
(docs/cost-model.md). The tag costs nothing while a query runs: its ledger (``BatchLedger``) remembers what
it committed, and reads the log only when the query (re)starts, when a replay can happen.

The app id is the query's persistent id, taken from its checkpoint, so a new checkpoint (after ``iotmon
reset`` or ``iotmon backfill``) starts a new sequence instead of being skipped forever.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from delta.tables import DeltaTable
from deltalake import CommitProperties
from deltalake import DeltaTable as RustDeltaTable
from deltalake.exceptions import CommitFailedError, TableNotFoundError
from deltalake.transaction import AddAction, RemoveAction
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

from iotmon.config import Settings
from iotmon.schema import LAKE_TABLES

CHECKPOINT_INTERVAL = 100
"""Commits between two Delta checkpoints of a table the streams write (Delta's default is 10). A checkpoint
rewrites the table's whole state; every tenth micro-batch paying for it cost 0.2-0.4 s per append on
average here, for readers that replay at most this many small JSON commits instead."""
COMMIT_ID = "iotmonCommitId"
"""Field of the ``commitInfo`` of each commit made on the driver: a random id by which the writer finds the
version it just committed, tagged or not (a write without a ledger has no tag)."""
CLOCK_MARGIN_S = 600.0
"""How far before a writer's creation a ledger still looks for the writer's commits: commit timestamps come
from the writing machine's clock and file times from the storage's, which may disagree by this much."""


def create_table(
    spark: SparkSession,
    path: str,
    schema: StructType | Callable[[], StructType],
    comment: str,
    *,
    append_only: bool = False,
) -> None:
    """Create a Delta table if it is missing. Unpartitioned on purpose: at this size Delta's file
    statistics prune as well as partitions would, without a small-file problem per partition.

    ``schema`` may be the function that derives it (a gold table's comes from planning the query that fills
    it), called only for a missing table: Delta's ``createIfNotExists`` leaves an existing table as it is, so
    a stream or drain starting on an existing lake only looks at each table's log (docs/cost-model.md)."""
    if DeltaTable.isDeltaTable(spark, path):
        return
    remove_unfinished_creation(spark, path)
    columns = schema if isinstance(schema, StructType) else schema()
    builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(columns).comment(comment)
    builder = builder.property("delta.checkpointInterval", str(CHECKPOINT_INTERVAL))
    if append_only:
        builder = builder.property("delta.appendOnly", "true")
    builder.execute()


def checkpoint_app_id(spark: SparkSession, checkpoint: str) -> str:
    """The app id of the query using ``checkpoint``: its persistent query id.

    Spark writes ``<checkpoint>/metadata`` (``{"id": ...}``) when a query first starts; the id survives
    restarts and changes only with a new checkpoint, exactly the lifetime of its batch ids.
    """
    text = read_text(spark, f"{checkpoint.rstrip('/')}/metadata")
    if text is None:
        raise FileNotFoundError(f"{checkpoint}/metadata: the query has not started yet")
    return f"iotmon-{json.loads(text)['id']}"


def commit_tag(app_id: str, batch_id: int) -> str:
    """The ``userMetadata`` of a commit that writes batch ``batch_id`` of ``app_id``."""
    return json.dumps({"app": app_id, "batch": batch_id}, separators=(",", ":"))


def tagged_batch(user_metadata: str | None, app_id: str) -> int | None:
    """The batch id a commit's ``userMetadata`` says it wrote for ``app_id``; None for anyone else's commit."""
    if not user_metadata:
        return None
    try:
        tag = json.loads(user_metadata)
    except ValueError:
        return None
    if isinstance(tag, dict) and tag.get("app") == app_id and isinstance(tag.get("batch"), int):
        return tag["batch"]
    return None


def last_tagged_batch(
    spark: SparkSession, path: str, app_id: str, not_before_ms: int, through_version: int | None = None
) -> int:
    """The highest batch of ``app_id`` that the table at ``path`` holds (at ``through_version``, by default its
    newest), from its newest commits; -1 if none.

    Commits are read newest first until one carries the app's tag (a writer's batches are committed in
    order, so its newest tagged commit holds its last batch) or until commits older than ``not_before_ms``,
    before which the writer did not exist. Only JSON commit files are read: no snapshot state is built.
    """
    commits = sorted(
        (int(name.removesuffix(".json")), name)
        for name in (p.rsplit("/", 1)[-1] for p in list_files(spark, f"{path.rstrip('/')}/_delta_log", ".json"))
        if name.removesuffix(".json").isdigit()
    )
    for version, name in reversed(commits):
        if through_version is not None and version > through_version:
            continue
        text = read_text(spark, f"{path.rstrip('/')}/_delta_log/{name}") or ""
        info = _commit_info(text)
        batch = tagged_batch(info.get("userMetadata"), app_id)
        if batch is not None:
            return batch
        if info.get("timestamp", not_before_ms) < not_before_ms:
            break
    return -1


@dataclass
class BatchLedger:
    """One writer's exactly-once bookkeeping: its app id and, per table, the last batch it committed there.

    Created when a query starts, so what it knows is read from the tables once per run: a batch replayed
    after a crash (the only kind of replay) is always the first batch of a run. A write that fails leaves
    its table unknown again, to be read back before the next attempt.
    """

    checkpoint: str | None = None
    app_id: str | None = None
    """Given for a writer without a checkpoint (the progress recorder); else read from the checkpoint."""
    not_before_ms: int = 0
    committed: dict[str, int] = field(default_factory=dict)

    def identify(self, spark: SparkSession) -> str:
        if self.app_id is None:
            assert self.checkpoint is not None, "a ledger needs an app id or a checkpoint"
            self.app_id = checkpoint_app_id(spark, self.checkpoint)
            created = _modification_ms(spark, f"{self.checkpoint.rstrip('/')}/metadata")
            self.not_before_ms = created - round(CLOCK_MARGIN_S * 1000)
        return self.app_id

    def holds(self, spark: SparkSession, path: str, batch_id: int) -> bool:
        """Whether the table at ``path`` already holds batch ``batch_id`` of this writer."""
        app_id = self.identify(spark)
        if path not in self.committed:
            self.committed[path] = last_tagged_batch(spark, path, app_id, self.not_before_ms)
        return batch_id <= self.committed[path]

    def write(self, spark: SparkSession, path: str, batch_id: int, commit: Callable[[str], None]) -> bool:
        """Run ``commit(tag)`` unless the table holds the batch; True if it wrote."""
        if self.holds(spark, path, batch_id):
            return False
        try:
            commit(commit_tag(self.identify(spark), batch_id))
        except BaseException:
            self.committed.pop(path, None)  # committed or not: read it back before trying again
            raise
        self.committed[path] = batch_id
        return True


def ledger_for(app_id: str) -> BatchLedger:
    """A ledger for a writer with a fixed, fresh app id (none of its commits can predate now)."""
    return BatchLedger(app_id=app_id, not_before_ms=round((time.time() - CLOCK_MARGIN_S) * 1000))


class StaleRead(Exception):
    """A write that read its table at a version found another commit after that version: what it read may
    lack rows that commit added. Read again and write again."""


def table_id(path: str) -> str | None:
    """The id of the Delta table at ``path``, which a streaming query's checkpoint records for each Delta table
    it streams (``iotmon.queries.streamed_table_ids``); None where there is no table."""
    try:
        return RustDeltaTable(path).metadata().id
    except TableNotFoundError:
        return None


def table_version(path: str) -> int:
    """The newest version of the Delta table at ``path``."""
    return RustDeltaTable(path).version()


def _batch_rows(rows: DataFrame | pa.Table, spark: SparkSession | None) -> tuple[SparkSession, Callable[[], pa.Table]]:
    """The session of a ledger's files, and a batch's rows as Arrow, collected only if a commit needs them (a
    batch the table already holds costs no Spark job)."""
    if isinstance(rows, DataFrame):
        return rows.sparkSession, rows.toArrow
    assert spark is not None, "Arrow rows need the session of the ledger's files"
    return spark, lambda: rows


def append_once(
    rows: DataFrame | pa.Table,
    path: str,
    ledger: BatchLedger,
    batch_id: int,
    spark: SparkSession | None = None,
    *,
    read_version: int | None = None,
) -> bool:
    """Append ``rows`` unless batch ``batch_id`` of the ledger's writer is already in the table; ``spark`` is
    the session of the ledger's files, given for Arrow rows. Rows computed from the table itself name the
    version they read (``read_version``): they are committed right after it or not at all (``StaleRead``), as
    a Delta transaction that read the table is refused when another commit came first.

    Written on the driver, where a ``foreachBatch`` function runs, like ``merge_once``: the rows collected as
    Arrow into one Parquet file, committed through delta-rs. A Spark append costs a Delta transaction in the
    JVM (the snapshot brought up to date before and after, the commit's own bookkeeping) and a task that
    builds a statistics tracker, code generated for the table's columns, per file: more than a micro-batch's
    rows cost (docs/cost-model.md, "The appends on the driver"). One file: readers of a table a stream appends
    to every few seconds pay per file, and a stream reading the table gets each commit whole (a Delta source
    splits its rate-limited batches between files, never inside one, which the scorer's history relies on,
    ``streaming.history``). Every writer of a table the stream writes commits through delta-rs, so on an
    object store they coordinate through one mechanism (docs/configuration.md)."""
    session, arrow_rows = _batch_rows(rows, spark)

    def commit(tag: str) -> None:
        table = RustDeltaTable(path) if read_version is None else RustDeltaTable(path, version=read_version)
        arrow = conformed(arrow_rows(), _arrow_schema(table))
        try:
            _commit_file(table, arrow, [], tag, after_read=read_version is not None)
        except CommitFailedError as exc:
            if read_version is None:
                raise
            raise StaleRead(f"{path}: a commit after version {read_version}, which this write read") from exc

    return ledger.write(session, path, batch_id, commit)


def append_rows(rows: pa.Table, path: str) -> None:
    """Append Arrow ``rows`` to the table at ``path`` on the driver, without a ledger: for a writer whose rows
    are not a micro-batch's and may be written twice (the event clock's ticks: a second copy of a tick moves
    nothing). Committed as ``append_once`` commits, with its checksum, so Spark's readers plan without
    replaying the log."""
    table = RustDeltaTable(path)
    _commit_file(table, conformed(rows, _arrow_schema(table)), [], None)


def newest_per_key(rows: pa.Table, key: str, order: str) -> pa.Table:
    """Each ``key``'s row of the greatest ``order`` among ``rows`` (a null key is a key like any other): a
    MERGE's source holds one row per key. Spark's form is a window's ``row_number`` over the batch, a shuffle of
    its own; a writer that collects its batch anyway picks them on the driver."""
    newest_first = rows.take(pc.sort_indices(rows, [(order, "descending")]))
    position = pa.array(range(newest_first.num_rows), pa.int64())
    first = (
        newest_first.select([key]).append_column("_position", position).group_by(key).aggregate([("_position", "min")])
    )
    return newest_first.take(first.column("_position_min"))


def merge_once(
    source: DataFrame | pa.Table,
    path: str,
    keys: Sequence[str],
    ledger: BatchLedger,
    batch_id: int,
    spark: SparkSession | None = None,
) -> bool:
    """MERGE ``source`` into the table at ``path`` on the columns ``keys`` unless the ledger's writer already did
    for ``batch_id``: a row of the table with a key ``source`` has is replaced by the source's row, the others
    are kept, new keys are inserted. One Delta commit, tagged like every other. ``spark`` as for
    ``append_once``.

    The stream MERGEs small tables (a row per device, window or incident), and delta-spark 4.4 finds the files a
    MERGE touches by rebuilding the target's snapshot state in three Spark jobs every time, about 1.3 s of CPU
    for 500 rows here (docs/cost-model.md, "The MERGE tax"). So the MERGE is done here, on the driver (where a
    ``foreachBatch`` function runs), as Delta's copy-on-write MERGE is defined: the batch is collected as
    Arrow, the files whose key statistics overlap its keys are read and those that hold one of its keys
    are rewritten, with the batch, into one new file; delta-rs reads the log's newest commits and commits the
    removes and the add at once. About 0.05 s for 500 rows. Not delta-rs' own MERGE, which writes strings as
    Arrow ``string_view`` in the files' Arrow schema, which pyarrow's filters cannot compare (delta-rs
    issue 4579): every reader of the tables through pyarrow, the dashboard and delta-rs' own
    ``to_pyarrow_table(filters=...)`` included, would fail on them. For the tables ``create_table`` makes:
    unpartitioned, without deletion vectors (a file's rows are all its rows).
    """

    session, source_rows = _batch_rows(source, spark)

    def commit(tag: str) -> None:
        table = RustDeltaTable(path)
        schema = _arrow_schema(table)
        rows = conformed(source_rows(), schema)
        files, root = table_files(table)
        sought = rows.select(list(keys))
        touched, kept = [], []
        for file, size in _overlapping(table, _key_ranges(sought)):
            old = ds.dataset(f"{root}/{unquote(file)}", schema=schema, format="parquet", filesystem=files)
            if old.to_table(columns=list(keys)).join(sought, list(keys), join_type="left semi").num_rows == 0:
                continue  # none of the batch's keys: the file stays as it is
            touched.append((file, size))
            kept.append(
                old.to_table().join(sought, list(keys), join_type="left anti").select(schema.names).cast(schema)
            )
        _commit_file(table, pa.concat_tables([*kept, rows]), touched, tag)

    return ledger.write(session, path, batch_id, commit)


def _arrow_schema(table: RustDeltaTable) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


def conformed(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """``rows`` as the table of ``schema`` stores them, or ``TypeError`` for rows it cannot take, as Delta's
    schema enforcement refuses them: a column missing, unknown or of another kind, a null in a column that allows
    none. What differs only in representation is cast (Arrow's string kinds, timestamps' zone and unit, a
    narrower number, a column of nulls alone)."""
    problems = [f"{name} is not a column of the table" for name in rows.column_names if name not in schema.names]
    for column in schema:
        if column.name not in rows.column_names:
            problems.append(f"{column.name} is missing")
            continue
        given = rows.schema.field(column.name).type
        if not _same_kind(given, column.type):
            problems.append(f"{column.name} is {given}, the table's {column.type}")
        elif not column.nullable and rows.column(column.name).null_count:
            problems.append(f"{column.name} holds nulls, which the table does not allow")
    if problems:
        raise TypeError(f"schema mismatch: {'; '.join(problems)}")
    return rows.select(schema.names).cast(schema)


def _same_kind(given: pa.DataType, stored: pa.DataType) -> bool:
    if given == stored or pa.types.is_null(given):
        return True
    for numbers in (pa.types.is_integer, pa.types.is_floating):
        if numbers(given) and numbers(stored):
            return given.bit_width <= stored.bit_width
    return any(kind(given) and kind(stored) for kind in (pa.types.is_timestamp, _is_text, _is_bytes))


def _is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)


def _is_bytes(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)


def _commit_file(
    table: RustDeltaTable,
    rows: pa.Table,
    removed: Sequence[tuple[str, int]],
    tag: str | None,
    *,
    after_read: bool = False,
) -> None:
    """Write ``rows`` as one new data file of ``table`` and commit it, with the removal of the data files
    ``removed`` (paths as the log has them, and sizes), in one transaction tagged ``tag`` (a micro-batch's;
    None for a write without a ledger): right after the version ``table`` was loaded at when the rows were
    read from it (``after_read``), else after whatever is newest then; then its checksum
    (``_write_checksum``). No rows, no file: the commit still records the batch, as a Spark append of nothing
    does."""
    files, root = table_files(table)
    now = round(time.time() * 1000)
    actions: list[AddAction | RemoveAction] = [RemoveAction(file, True, now, size) for file, size in removed]
    added = []
    if rows.num_rows:
        name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
        pq.write_table(rows, f"{root}/{name}", filesystem=files, compression="snappy")
        added.append(files.get_file_info(f"{root}/{name}").size)
        actions.append(AddAction(name, added[0], {}, now, True, file_statistics(rows)))
    commit_id = uuid.uuid4().hex
    metadata = {COMMIT_ID: commit_id} | ({"userMetadata": tag} if tag is not None else {})
    properties = CommitProperties(custom_metadata=metadata, max_commit_retries=0 if after_read else None)
    table.create_write_transaction(actions, "append", _arrow_schema(table), commit_properties=properties)
    version = _committed_version(files, root, commit_id, after=table.version())
    if version is not None:
        _write_checksum(table, version, added, [size for _, size in removed])


def _committed_version(files: pafs.FileSystem, root: str, commit_id: str, after: int) -> int | None:
    """The version after ``after`` whose commit carries ``commit_id``: the version a writer that loaded the
    table at ``after`` just committed (the next one, unless others committed in between); None if none does
    (delta-rs returns nothing and leaves its table object at the version it was loaded at)."""
    version = after + 1
    while True:
        try:
            with files.open_input_stream(f"{root}/_delta_log/{version:020d}.json") as commit:
                if _commit_info(commit.read().decode()).get(COMMIT_ID) == commit_id:
                    return version
        except FileNotFoundError:
            return None
        version += 1


def _write_checksum(table: RustDeltaTable, version: int, added: Sequence[int], removed: Sequence[int]) -> None:
    """Delta's checksum of ``version`` (``<version>.crc``): the table's file count and bytes, its protocol and
    metadata.

    A Spark reader takes a table's protocol and metadata from its newest version's checksum; without one it
    replays the log in Spark jobs, 0.25-0.4 s instead of 0.02 s each time a query plans against a version it
    has not seen, which for a table the driver writes is every batch of every query reading it
    (docs/cost-model.md, "The appends on the driver"). Spark writes a checksum for its own commits; delta-rs
    writes none. Counted on from the checksum of the version before, with this commit's files; when that one
    is missing (a kill between a commit and its checksum, or a concurrent writer's not written yet), counted
    from the table's files at ``version``, with the protocol and metadata of the newest checksum before it
    (the driver's commits never change them; Spark's, which do, write their own). Written whole under another
    name, then renamed: a reader never sees half of one."""
    files, root = table_files(table)
    log = f"{root}/_delta_log"
    previous = _checksum(files, log, version - 1)
    if previous is not None:
        size = previous["tableSizeBytes"] + sum(added) - sum(removed)
        count = previous["numFiles"] + len(added) - len(removed)
    else:
        previous = next(
            (
                c
                for v in range(version - 2, max(-1, version - 2 - CHECKPOINT_INTERVAL), -1)
                if (c := _checksum(files, log, v))
            ),
            None,
        )
        if previous is None:
            return
        state = pa.table(RustDeltaTable(table.table_uri, version=version).get_add_actions(flatten=False))
        size, count = pc.sum(state.column("size_bytes")).as_py() or 0, state.num_rows
    kept = ("metadata", "protocol", "numMetadata", "numProtocol", "setTransactions", "domainMetadata")
    checksum = {key: previous[key] for key in kept if key in previous}
    checksum |= {"txnId": str(uuid.uuid4()), "tableSizeBytes": size, "numFiles": count}
    staged = f"{log}/.{version:020d}.crc.{uuid.uuid4().hex}.tmp"
    with files.open_output_stream(staged) as out:
        out.write(json.dumps(checksum, separators=(",", ":")).encode())
    files.move(staged, f"{log}/{version:020d}.crc")


def _checksum(files: pafs.FileSystem, log: str, version: int) -> dict[str, Any] | None:
    """The checksum of ``version``, if it has a whole one with the table's counts."""
    try:
        with files.open_input_stream(f"{log}/{version:020d}.crc") as stored:
            checksum = json.loads(stored.read())
    except (OSError, ValueError):
        return None
    return checksum if {"tableSizeBytes", "numFiles", "metadata", "protocol"} <= checksum.keys() else None


def table_files(table: RustDeltaTable) -> tuple[pafs.FileSystem, str]:
    """The file system and root directory of a delta-rs table's data files, for pyarrow."""
    uri = table.table_uri.rstrip("/")
    if uri.startswith("file://"):
        return pafs.LocalFileSystem(), unquote(uri.removeprefix("file://"))  # a URI: "a b" is "a%20b"
    files, root = pafs.FileSystem.from_uri(uri.replace("s3a://", "s3://", 1))  # Hadoop's name for S3
    return files, root


def ruled_out(actions: pa.Table, column: str, least: Any, most: Any = None) -> pa.ChunkedArray:
    """Per data file of ``actions`` (delta-rs' flattened add actions): whether its statistics prove that
    ``column`` holds no value from ``least`` to ``most`` (no upper end when None). False for a file without
    statistics. Delta's statistics of a timestamp are cut to the millisecond: a file's true newest value may be
    up to 1 ms past its statistic; its true oldest value is at or past its own."""
    low, high = f"min.{column}", f"max.{column}"
    if low not in actions.column_names or high not in actions.column_names:
        return pa.chunked_array([pa.array([False] * actions.num_rows, pa.bool_())])
    kind = actions.column(high).type
    out = pc.less(actions.column(high), pa.scalar(_floor_ms(least), kind))
    if most is not None:
        out = pc.or_(out, pc.greater(actions.column(low), pa.scalar(most, kind)))
    return pc.fill_null(out, False)


def _key_ranges(sought: pa.Table) -> dict[str, tuple[Any, Any]]:
    """Each of ``sought``'s columns' least and greatest value."""
    ranges = {}
    for key in sought.column_names:
        least, most = pc.min_max(sought.column(key)).values()
        ranges[key] = (least.as_py(), most.as_py())
    return ranges


def _overlapping(table: RustDeltaTable, ranges: Mapping[str, tuple[Any, Any]]) -> list[tuple[str, int]]:
    """The data files (paths as the log has them, and sizes) whose statistics do not rule out each key column's
    range (``_key_ranges``): a window's MERGE reads the files of recent windows, not all of them."""
    actions = pa.table(table.get_add_actions(flatten=True))
    out = pa.chunked_array([pa.array([False] * actions.num_rows, pa.bool_())])
    for key, (least, most) in ranges.items():
        out = pc.or_(out, ruled_out(actions, key, least, most))
    files = zip(actions.column("path").to_pylist(), actions.column("size_bytes").to_pylist(), strict=True)
    return [file for file, gone in zip(files, out.to_pylist(), strict=True) if not gone]


def absent(rows: pa.Table, path: str, keys: Sequence[str], version: int) -> pa.Table:
    """The ``rows`` whose ``keys`` the table at ``path`` does not hold at ``version``: a lookup on the driver.

    Only the files whose statistics do not rule out the rows' key ranges are opened, and only their key
    columns read, the row groups outside those ranges skipped. Silver's writers look a batch's late readings up
    where those readings already are: Spark scanned and shuffled every key of the minutes they span, 12-16 s of
    CPU for a minute of late arrivals at 5,000 events/s against 0.5 s here (docs/cost-model.md, "Silver looked
    up on the driver")."""
    if rows.num_rows == 0:
        return rows
    table = RustDeltaTable(path, version=version)
    schema = _arrow_schema(table)
    sought = rows.select(list(keys))
    ranges = _key_ranges(sought)
    overlapping = _overlapping(table, ranges)
    if not overlapping:
        return rows
    within = None
    for key, (least, most) in ranges.items():
        kind = schema.field(key).type
        bounds = (ds.field(key) >= pa.scalar(least, kind)) & (ds.field(key) <= pa.scalar(most, kind))
        within = bounds if within is None else within & bounds
    stored = _data_files(table, schema, [file for file, _ in overlapping])
    held = stored.to_table(columns=list(keys), filter=within).cast(sought.schema)
    return rows.join(held, list(keys), join_type="left anti").select(rows.column_names)


def rows_after(path: str, columns: Sequence[str], time_column: str, after: datetime | None) -> pa.Table:
    """The ``columns`` of the rows of the table at ``path`` whose ``time_column`` is after ``after`` (naive
    UTC; every row when None), read on the driver like ``absent``: only the files whose statistics do not rule
    such rows out, the row groups before it skipped."""
    table = RustDeltaTable(path)
    schema = _arrow_schema(table)
    actions = pa.table(table.get_add_actions(flatten=True))
    bound = None if after is None else pa.scalar(after.replace(tzinfo=UTC), schema.field(time_column).type)
    paths = actions.column("path").to_pylist()
    if bound is not None:
        gone = ruled_out(actions, time_column, bound.as_py()).to_pylist()
        paths = [file for file, out in zip(paths, gone, strict=True) if not out]
    if not paths:
        return schema.empty_table().select(list(columns))
    stored = _data_files(table, schema, paths)
    return stored.to_table(columns=list(columns), filter=None if bound is None else ds.field(time_column) > bound)


def _data_files(table: RustDeltaTable, schema: pa.Schema, paths: Sequence[str]) -> ds.Dataset:
    """Some of a delta-rs table's data files (paths as its log has them) as one pyarrow dataset of ``schema``."""
    files, root = table_files(table)
    return ds.dataset([f"{root}/{unquote(file)}" for file in paths], schema=schema, filesystem=files)


def _floor_ms(value: Any) -> Any:
    """A timestamp cut to the millisecond, as Delta's statistics may have it; anything else as it is."""
    return value.replace(microsecond=value.microsecond // 1000 * 1000) if isinstance(value, datetime) else value


def file_statistics(rows: pa.Table) -> str:
    """A data file's Delta statistics: its row count, each column's null count, and the bounds of its integer,
    string and timestamp columns (timestamps to the millisecond, widened outwards, as readers expect of
    Delta's; floating-point bounds are left out: NaN has no place in them; nested columns have none)."""
    low, high, nulls = {}, {}, {}
    for name, column in zip(rows.column_names, rows.columns, strict=True):
        kind = column.type
        if pa.types.is_nested(kind):
            continue  # Delta's statistics of a nested column are nested; none is better than a wrong shape
        nulls[name] = column.null_count
        if column.null_count == len(column):
            continue
        if pa.types.is_timestamp(kind):
            least, most = pc.min_max(column).values()
            low[name], high[name] = _stat_time(least.as_py(), up=False), _stat_time(most.as_py(), up=True)
        elif pa.types.is_integer(kind) or _is_text(kind):
            least, most = pc.min_max(column).values()
            try:
                low[name], high[name] = least.as_py(), most.as_py()
            except UnicodeDecodeError:
                continue  # a Spark string may hold any bytes (a Kafka key); JSON statistics cannot
    stats = {"numRecords": rows.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls}
    return json.dumps(stats, separators=(",", ":"))


def _stat_time(value: datetime, *, up: bool) -> str:
    """A timestamp bound as Delta's statistics write it (UTC, milliseconds), rounded away from the data."""
    value = value.astimezone(UTC) if value.tzinfo else value
    cut = _floor_ms(value)
    if up and cut < value:
        cut += timedelta(milliseconds=1)
    return cut.strftime("%Y-%m-%dT%H:%M:%S.") + f"{cut.microsecond // 1000:03d}Z"


def _commit_info(commit: str) -> dict:
    """The ``commitInfo`` action of a Delta commit file's text (an empty dict if it has none)."""
    for line in commit.splitlines():
        action = json.loads(line) if line.strip() else {}
        if "commitInfo" in action:
            return action["commitInfo"]
    return {}


def _modification_ms(spark: SparkSession, path: str) -> int:
    fs, hadoop_path = _file_system(spark, path)
    return int(fs.getFileStatus(hadoop_path).getModificationTime())


def table_property(spark: SparkSession, path: str, key: str) -> str | None:
    """A property of the Delta table at ``path`` (``TBLPROPERTIES``), or None."""
    return DeltaTable.forPath(spark, path).detail().first().properties.get(key)


def planned_watermark(spark: SparkSession, checkpoint: str, batch_id: int) -> datetime | None:
    """The event-time watermark batch ``batch_id`` of the query at ``checkpoint`` runs with (its offset log
    entry's ``batchWatermarkMs``); None before the query has one. Its stateful operators took rows at or
    before it for late, so it bounds what they may have dropped."""
    text = read_text(spark, f"{checkpoint.rstrip('/')}/offsets/{batch_id}")
    lines = (text or "").splitlines()
    epoch_ms = json.loads(lines[1]).get("batchWatermarkMs", 0) if len(lines) > 1 else 0
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).replace(tzinfo=None) if epoch_ms else None


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


def _is_temp_file(name: str) -> bool:
    """A file Hadoop's writers (Spark's checkpoint files, Delta's log store) write before renaming it into place,
    or its checksum: ``.<name>.<uuid>.tmp``, ``..<name>.<uuid>.tmp.crc``."""
    return name.startswith(".") and (name.endswith(".tmp") or name.endswith(".tmp.crc"))


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
    names = [name for name in names if _is_temp_file(name)]
    for name in names:
        fs.delete(spark.sparkContext._jvm.org.apache.hadoop.fs.Path(offsets, name), False)
    return names


def remove_unfinished_creation(spark: SparkSession, path: str) -> list[str]:
    """Delete what a crash while Delta created the table at ``path`` left in its log, which holds no commit.

    Delta makes the log's directories first (``_delta_log``, ``_delta_log/_staged_commits``), then writes the
    first commit as a hidden temp file and renames it. Killed in between, the log holds no version, and
    ``createIfNotExists`` then fails on every start (``DELTA_TABLE_NOT_FOUND``: the directory says there is a
    table, its log has none). With no commit there is nothing to lose: the table is created again. Only what such
    a crash leaves is removed (hidden temp files, empty directories), and nothing if the log holds anything else.
    Returns the names removed.
    """
    fs, log = _file_system(spark, f"{path.rstrip('/')}/_delta_log")
    if not fs.exists(log):
        return []

    def leftover(status) -> bool:
        """An empty directory Delta made, or the hidden temp file of a commit never renamed."""
        if status.isDirectory():
            return not fs.listStatus(status.getPath())
        return _is_temp_file(status.getPath().getName())

    statuses = list(fs.listStatus(log))
    if not all(leftover(status) for status in statuses):
        return []  # a commit, a checkpoint or anything else: not what a first commit's crash leaves
    for status in statuses:
        fs.delete(status.getPath(), False)
    fs.delete(log, False)
    return [status.getPath().getName() for status in statuses]


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
