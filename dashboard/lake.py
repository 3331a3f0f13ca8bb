"""The dashboard's reads of the lake: delta-rs and pyarrow, no Spark, recent rows only.

Tables are opened once and brought up to date incrementally on each refresh (only new log entries are
read). Big tables are read through a lower bound on their time column, which delta-rs turns into file
pruning by the files' min/max statistics, so a refresh costs the same on day one and day one hundred;
every read is capped in rows as well. On a local lake, what a read or a count over the lookback finds in each
data file is kept (a Delta data file never changes): a refresh reads only the files written since the last one
and those the lookback's start cuts through. A missing table (the stream has not created it yet) reads as an
empty frame with the requested columns.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import unquote

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from iotmon.config import Settings
from iotmon.lake import ruled_out, table_files
from iotmon.status import newest

REMEMBERED_QUESTIONS = 32
"""How many different reads (a table, its columns and filter: one per device an operator chose, say) keep their
per-file answers; the least recently asked is forgotten first."""


def is_true(column: str) -> Any:
    """A pyarrow filter for rows where boolean ``column`` is true, safe on columns without Delta statistics.

    Spark writes no min/max statistics for booleans, and delta-rs (1.x) then gives each file the guarantee
    ``column >= null``, from which pyarrow concludes that ``column == true`` matches no row of any file: the
    plain predicate silently returns nothing. Comparing a cast of the column is not simplified against the
    guarantee, so it is evaluated on the rows, as it should be.
    """
    return ds.field(column).cast(pa.int8()) == 1


class LakeReader:
    """Reads the lake's tables for the dashboard; safe to share between Dash's request threads."""

    def __init__(self, settings: Settings, max_rows: int = 200_000) -> None:
        self.settings = settings
        self.max_rows = max_rows
        self._tables: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._remembered: OrderedDict[tuple[str, tuple], dict[str, Any]] = OrderedDict()
        """Per (table, what was asked of it) and data file, the answer: ``_per_file``."""
        self._per_file_lock = threading.Lock()

    def table(self, name: str) -> Any:
        """The up-to-date ``DeltaTable`` of ``name``, or None while it does not exist."""
        from deltalake import DeltaTable

        path = self.settings.table_path(name)
        with self._lock:
            table = self._tables.get(name)
            if table is not None:
                try:
                    table.update_incremental()
                    return table
                except Exception:  # replaced or removed (iotmon reset, backfill): open it afresh
                    del self._tables[name]
            if not DeltaTable.is_deltatable(path):
                return None
            table = self._tables[name] = DeltaTable(path)
            return table

    def newest(self, name: str, column: str) -> Any:
        """The newest value of ``column`` by the table's file statistics (no data read); None if unknown."""
        table = self.table(name)
        return None if table is None else newest(table, column)

    def _filter(self, dataset: Any, since: tuple[str, datetime] | None, where: Any) -> Any:
        if since is None:
            return where
        column, start = since
        bound = ds.field(column) >= pa.scalar(start, dataset.schema.field(column).type)
        return bound if where is None else bound & where

    def _split(self, table: Any, since: tuple[str, datetime] | None) -> tuple[list[str], list[str]] | None:
        """The data files (absolute paths) a window ``since`` holds wholly, by their statistics, and those its start
        cuts through (or without statistics); None when the table is to be read whole through delta-rs: no
        window, a lake in an object store (delta-rs holds its credentials), or deletion vectors (a file's rows
        may go)."""
        if since is None or not table.table_uri.startswith("file://"):
            return None
        if "deletionVectors" in (table.protocol().reader_features or []):
            return None
        column, start = since
        actions = pa.table(table.get_add_actions(flatten=True))
        root = table_files(table)[1]
        files = [f"{root}/{unquote(path)}" for path in actions.column("path").to_pylist()]
        low = f"min.{column}"
        if low not in actions.column_names:
            return [], files
        # A file's true oldest value is at or past its statistic; its newest may be up to 1 ms past (ruled_out).
        kind = actions.column(low).type
        inside = pc.fill_null(pc.greater_equal(actions.column(low), pa.scalar(start, kind)), False).to_pylist()
        older = ruled_out(actions, column, start).to_pylist()
        wholly, cut = [], []
        for file, within, gone in zip(files, inside, older, strict=True):
            if not gone:
                (wholly if within else cut).append(file)
        return wholly, cut

    def _per_file(self, name: str, what: tuple, files: list[str], compute: Callable[[str], Any]) -> list[Any]:
        """``compute(file)`` for each of ``files``, each remembered under ``(name, what)`` (a Delta data file never
        changes); what was remembered for other files is forgotten (the window has left them)."""
        results = []
        with self._per_file_lock:
            remembered = self._remembered.setdefault((name, what), {})
            self._remembered.move_to_end((name, what))
            while len(self._remembered) > REMEMBERED_QUESTIONS:  # e.g. devices an operator looked at once
                self._remembered.popitem(last=False)
            for gone in set(remembered) - set(files):
                del remembered[gone]
        for file in files:
            if (result := remembered.get(file)) is None:
                result = compute(file)
                with self._per_file_lock:
                    remembered[file] = result
            results.append(result)
        return results

    def counts(self, name: str, column: str, *, since: tuple[str, datetime] | None = None) -> pd.Series:
        """Rows per value of ``column`` (uncapped: counted in Arrow, only the one column is read)."""
        table = self.table(name)
        if table is None:
            return pd.Series(dtype="int64")
        dataset = table.to_pyarrow_dataset()
        split = self._split(table, since)
        if split is None:
            values = dataset.to_table(columns=[column], filter=self._filter(dataset, since, None)).column(column)
            return _series(_value_counts(values))
        inside, cut = split
        parts = self._per_file(
            name, ("counts", column), inside, lambda f: _value_counts(_rows(f, dataset, [column])[column])
        )
        if cut:
            rows = _rows(cut, dataset, [column], self._filter(dataset, since, None))
            parts.append(_value_counts(rows[column]))
        total: dict[Any, int] = {}
        for counted in parts:
            for value, rows in counted.items():
                total[value] = total.get(value, 0) + rows
        return _series(total)

    def read(
        self,
        name: str,
        columns: Sequence[str],
        *,
        since: tuple[str, datetime] | None = None,
        where: Any = None,
        newest_first: str | None = None,
        limit: int | None = None,
    ) -> pd.DataFrame:
        """Rows of ``name``: ``since=(column, t)`` keeps rows with ``column >= t`` (and lets delta-rs skip older
        files), ``where`` is a further pyarrow filter; at most ``limit`` (default ``max_rows``) rows, the latest
        by ``newest_first`` when there are more. Within a window, each file it holds wholly is filtered once."""
        table = self.table(name)
        if table is None:
            return pd.DataFrame(columns=list(columns))
        dataset = table.to_pyarrow_dataset()
        present = [c for c in columns if c in dataset.schema.names]
        split = self._split(table, since)
        if split is None:
            rows = dataset.to_table(columns=present, filter=self._filter(dataset, since, where))
        else:
            inside, cut = split

            parts = self._per_file(
                name, ("rows", tuple(present), str(where)), inside, lambda f: _rows(f, dataset, present, where)
            )
            if cut:
                parts.append(_rows(cut, dataset, present, self._filter(dataset, since, where)))
            rows = pa.concat_tables(parts) if parts else dataset.schema.empty_table().select(present)
        cap = self.max_rows if limit is None else limit
        if rows.num_rows > cap:
            if newest_first is not None:
                rows = rows.sort_by([(newest_first, "descending")])
            rows = rows.slice(0, cap)
        frame = rows.to_pandas()
        return frame.reindex(columns=list(columns))  # a column the table lacks (older schema) reads as null


def _rows(files: str | list[str], dataset: Any, columns: list[str], where: Any = None) -> pa.Table:
    """``columns`` of the rows of a table's data ``files`` that match ``where``, read with the table's schema
    (``dataset``'s: a column a file predates reads as null)."""
    return ds.dataset(files, schema=dataset.schema, format="parquet").to_table(columns=columns, filter=where)


def _value_counts(values: Any) -> dict[Any, int]:
    return {entry["values"]: entry["counts"] for entry in values.value_counts().to_pylist()}


def _series(counts: dict[Any, int]) -> pd.Series:
    return pd.Series(counts, dtype="int64")
