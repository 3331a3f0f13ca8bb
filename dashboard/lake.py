"""The dashboard's reads of the lake: delta-rs and pyarrow, no Spark, recent rows only.

Tables are opened once and brought up to date incrementally on each refresh (only new log entries are
read). Big tables are read through a lower bound on their time column, which delta-rs turns into file
pruning by the files' min/max statistics, so a refresh costs the same on day one and day one hundred;
every read is capped in rows as well. A missing table (the stream has not created it yet) reads as an
empty frame with the requested columns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import pandas as pd

from iotmon.config import Settings
from iotmon.status import newest


def is_true(column: str) -> Any:
    """A pyarrow filter for rows where boolean ``column`` is true, safe on columns without Delta statistics.

    Spark writes no min/max statistics for booleans, and delta-rs (1.x) then gives each file the guarantee
    ``column >= null``, from which pyarrow concludes that ``column == true`` matches no row of any file: the
    plain predicate silently returns nothing. Comparing a cast of the column is not simplified against the
    guarantee, so it is evaluated on the rows, as it should be.
    """
    import pyarrow as pa
    import pyarrow.dataset as ds

    return ds.field(column).cast(pa.int8()) == 1


class LakeReader:
    """Reads the lake's tables for the dashboard; safe to share between Dash's request threads."""

    def __init__(self, settings: Settings, max_rows: int = 200_000) -> None:
        self.settings = settings
        self.max_rows = max_rows
        self._tables: dict[str, Any] = {}
        self._lock = threading.Lock()

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
        import pyarrow as pa
        import pyarrow.dataset as ds

        if since is None:
            return where
        column, start = since
        bound = ds.field(column) >= pa.scalar(start, dataset.schema.field(column).type)
        return bound if where is None else bound & where

    def counts(self, name: str, column: str, *, since: tuple[str, datetime] | None = None) -> pd.Series:
        """Rows per value of ``column`` (uncapped: counted in Arrow, only the one column is read)."""
        table = self.table(name)
        if table is None:
            return pd.Series(dtype="int64")
        dataset = table.to_pyarrow_dataset()
        values = dataset.to_table(columns=[column], filter=self._filter(dataset, since, None)).column(column)
        counted = values.value_counts().to_pylist()
        return pd.Series({entry["values"]: entry["counts"] for entry in counted}, dtype="int64")

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
        by ``newest_first`` when there are more."""
        table = self.table(name)
        if table is None:
            return pd.DataFrame(columns=list(columns))
        dataset = table.to_pyarrow_dataset()
        condition = self._filter(dataset, since, where)
        present = [c for c in columns if c in dataset.schema.names]
        rows = dataset.to_table(columns=present, filter=condition)
        cap = self.max_rows if limit is None else limit
        if rows.num_rows > cap:
            if newest_first is not None:
                rows = rows.sort_by([(newest_first, "descending")])
            rows = rows.slice(0, cap)
        frame = rows.to_pandas()
        return frame.reindex(columns=list(columns))  # a column the table lacks (older schema) reads as null
