"""Event times travel as ISO-8601 UTC strings with milliseconds and a ``Z``: ``2026-11-22T01:02:03.456Z``.

Times are int64 Unix milliseconds everywhere inside the simulator; formatting is the hot path of payload
building, so whole seconds are formatted once by numpy and only the millisecond suffix is per record.
"""

from __future__ import annotations

from datetime import UTC, datetime

import numpy as np

_MILLIS_SUFFIX = tuple(f".{ms:03d}Z" for ms in range(1000))


def format_timestamp(ms: int) -> str:
    return np.datetime_as_string(np.datetime64(int(ms), "ms"), unit="ms", timezone="UTC").item()


def format_timestamps(ms: np.ndarray) -> list[str]:
    """Vectorised ``format_timestamp``: the same strings, about five times faster."""
    if len(ms) == 0:
        return []
    seconds, millis = np.divmod(np.asarray(ms, dtype=np.int64), 1000)
    unique, inverse = np.unique(seconds, return_inverse=True)
    prefixes = np.datetime_as_string(unique.astype("datetime64[s]"), unit="s").tolist()
    suffix = _MILLIS_SUFFIX
    return [prefixes[i] + suffix[m] for i, m in zip(inverse.tolist(), millis.tolist(), strict=True)]


def to_ms(moment: datetime) -> int:
    """Unix milliseconds of an aware datetime; a naive one is taken as UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


def from_ms(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, tz=UTC)
