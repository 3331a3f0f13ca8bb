"""What goes wrong between a sensor and Kafka: late and duplicated sends, malformed payloads, dropouts.

Every fault is drawn per reading from the run's fault stream in a fixed order, and each corrupted payload
is a pure function of the reading and one drawn integer (``variant``), so the bytes are reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from iotmon.schema import (
    DEVICE_ID,
    EVENT_TIME,
    LATE_KINDS,
    MALFORMED_KINDS,
    METRIC_NAMES,
    REQUIRED_FIELDS,
    SEQ,
)

from .timefmt import format_timestamp

# Codes index LATE_KINDS, which is ordered by delay: on time, within the watermark, beyond it.
ON_TIME, LATE, VERY_LATE = range(len(LATE_KINDS))
NOT_MALFORMED = -1
LATE_DELAY_S = 1.0
LATE_DELAY_OF_WATERMARK = 0.75
VERY_LATE_DELAY_OF_WATERMARK = (3.0, 10.0)
DUPLICATE_DELAY_S = (0.0, 5.0)
DROPOUT_SECONDS = (120.0, 600.0)


@dataclass(frozen=True)
class FaultRates:
    """Fractions of readings (or of device time, for dropouts) that each fault affects."""

    late: float = 0.0
    very_late: float = 0.0
    duplicate: float = 0.0
    malformed: float = 0.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("late", "very_late", "duplicate", "malformed", "dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} fraction must be in [0, 1), not {value}")
        if self.late + self.very_late >= 1.0:
            raise ValueError("late + very_late fractions must stay below 1")


@dataclass(frozen=True)
class FaultDraws:
    """The faults of a block of readings, one entry per reading (in reading order)."""

    late_kind: np.ndarray
    """int8 code into ``LATE_KINDS``."""
    delay_ms: np.ndarray
    """Send delay of the first send, 0 when on time."""
    duplicate: np.ndarray
    duplicate_delay_ms: np.ndarray
    """Delay of the second send after the first one."""
    malformed: np.ndarray
    """int8 code into ``MALFORMED_KINDS`` or ``NOT_MALFORMED``."""
    variant: np.ndarray
    """A non-negative integer that picks how a malformed payload is broken."""


def draw_faults(n: int, rates: FaultRates, watermark_s: float, rng: np.random.Generator) -> FaultDraws:
    """Draw the faults of ``n`` readings; every array is drawn whole, so the draw order is fixed."""
    u_late = rng.random(n)
    late_delay = rng.uniform(LATE_DELAY_S, max(LATE_DELAY_S, LATE_DELAY_OF_WATERMARK * watermark_s), n)
    very_late_delay = rng.uniform(*VERY_LATE_DELAY_OF_WATERMARK, n) * watermark_s
    duplicate = rng.random(n) < rates.duplicate
    duplicate_delay = rng.uniform(*DUPLICATE_DELAY_S, n)
    malformed = rng.random(n) < rates.malformed
    malformed_kind = rng.integers(0, len(MALFORMED_KINDS), n)
    variant = rng.integers(0, 1 << 30, n)

    late_kind = np.full(n, ON_TIME, dtype=np.int8)
    late_kind[u_late < rates.late + rates.very_late] = VERY_LATE
    late_kind[u_late < rates.late] = LATE
    delay_s = np.where(late_kind == LATE, late_delay, np.where(late_kind == VERY_LATE, very_late_delay, 0.0))
    return FaultDraws(
        late_kind=late_kind,
        delay_ms=np.rint(delay_s * 1000.0).astype(np.int64),
        duplicate=duplicate,
        duplicate_delay_ms=np.rint(duplicate_delay * 1000.0).astype(np.int64),
        malformed=np.where(malformed, malformed_kind, NOT_MALFORMED).astype(np.int8),
        variant=variant,
    )


def late_kind_for_delay(delay_s: np.ndarray, watermark_s: float) -> np.ndarray:
    """Classify actual delays: what a record sent earlier than planned (at shutdown) really was."""
    kinds = np.where(delay_s <= 0.0, ON_TIME, np.where(delay_s < watermark_s, LATE, VERY_LATE))
    return kinds.astype(np.int8)


# ---------------------------------------------------------------------------------------------------------
# Malformed payloads. Each builder gets the reading as a dict (required fields in order), the send time
# and the variant, and returns bytes that violate the contract in its own way.

ABSURD_SKEW_DAYS = 30
ABSURD_YEAR = "2999"
LEAP_DAY, LEAP_DAY_FALLBACK = "-02-29T", "-02-28T"
PADDING_FIELD = "padding"
MESSAGE_OVERHEAD = 1024
"""Room left for the key and record headers under Kafka's message size limit."""
NON_FINITE_TOKENS = (b"NaN", b"Infinity", b"-Infinity")
MISTYPED_TEXT = ("abc", "hot")
NOT_UTF8 = b"\xff\xfe"


@dataclass(frozen=True)
class CorruptionContext:
    """What a corruption may depend on besides the reading itself."""

    send_ms: int
    max_payload_bytes: int
    max_message_bytes: int
    """Kafka's limit: an oversized payload must still get through Kafka to be quarantined."""
    max_clock_skew_s: float


def _invalid_json(reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    valid = orjson.dumps(reading)
    choice = variant % 3
    if choice == 0:  # cut off mid-object, as by a lost packet
        return valid[: len(valid) // 2 + (variant // 3) % (len(valid) // 3)]
    if choice == 1:  # a JSON array where an object is expected
        return orjson.dumps(list(reading.values()))
    device = reading[DEVICE_ID].encode()  # bytes that are not UTF-8 inside a string
    return valid.replace(device, device + NOT_UTF8, 1)


def _missing_field(reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    missing = REQUIRED_FIELDS[variant % len(REQUIRED_FIELDS)]
    return orjson.dumps({name: value for name, value in reading.items() if name != missing})


def _mistyped_field(reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    choice = variant % 3
    broken = dict(reading)
    if choice == 0:
        broken[SEQ] = MISTYPED_TEXT[0]
    elif choice == 1:
        broken[METRIC_NAMES[(variant // 3) % len(METRIC_NAMES)]] = MISTYPED_TEXT[1]
    else:  # epoch milliseconds instead of an ISO string
        broken[EVENT_TIME] = ctx.send_ms
    return orjson.dumps(broken)


def _non_finite(reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    broken = dict(reading)
    token = NON_FINITE_TOKENS[variant % len(NON_FINITE_TOKENS)]
    broken[METRIC_NAMES[(variant // 3) % len(METRIC_NAMES)]] = orjson.Fragment(token)
    return orjson.dumps(broken)


def _absurd_timestamp(reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    choice = variant % 3
    valid_time: str = reading[EVENT_TIME]
    if choice == 0:  # a clock reset to the epoch: seconds of uptime since 1970-01-01
        absurd = format_timestamp(variant % 86_400_000)
    elif choice == 1:  # a corrupted millennium; 2999 has no 29 February
        absurd = ABSURD_YEAR + valid_time[4:].replace(LEAP_DAY, LEAP_DAY_FALLBACK, 1)
    else:  # far ahead of the clock that sent it, whatever skew the pipeline tolerates
        ahead_s = max(ABSURD_SKEW_DAYS * 86_400, 2 * ctx.max_clock_skew_s)
        absurd = format_timestamp(ctx.send_ms + round(ahead_s * 1000))
    return orjson.dumps({**reading, EVENT_TIME: absurd})


def oversized_bytes(max_payload_bytes: int, max_message_bytes: int) -> int:
    """Size of an oversized payload: twice the pipeline's limit, within Kafka's."""
    return min(2 * max_payload_bytes, max_message_bytes - MESSAGE_OVERHEAD)


def _oversized(reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    target = oversized_bytes(ctx.max_payload_bytes, ctx.max_message_bytes)
    base = len(orjson.dumps({**reading, PADDING_FIELD: ""}))
    return orjson.dumps({**reading, PADDING_FIELD: "x" * max(0, target - base)})


Corruption = Callable[[dict[str, Any], CorruptionContext, int], bytes]
CORRUPTIONS: dict[str, Corruption] = {
    "invalid_json": _invalid_json,
    "missing_field": _missing_field,
    "mistyped_field": _mistyped_field,
    "non_finite": _non_finite,
    "absurd_timestamp": _absurd_timestamp,
    "oversized": _oversized,
}
if set(CORRUPTIONS) != set(MALFORMED_KINDS):
    raise ImportError(f"CORRUPTIONS must cover exactly {MALFORMED_KINDS}")
_CORRUPTIONS_BY_CODE = tuple(CORRUPTIONS[name] for name in MALFORMED_KINDS)


def corrupt(kind: int, reading: dict[str, Any], ctx: CorruptionContext, variant: int) -> bytes:
    """The payload of a malformed reading of ``MALFORMED_KINDS[kind]``."""
    return _CORRUPTIONS_BY_CODE[kind](reading, ctx, variant)


# ---------------------------------------------------------------------------------------------------------
# Dropouts


@dataclass(frozen=True)
class DropoutEpisode:
    """A device sent nothing in ``[start_ms, end_ms)`` of its clock."""

    device: int
    start_ms: int
    end_ms: int


@dataclass
class DropoutSchedule:
    """Per-device alternation of healthy stretches and silences, in event time (ms).

    Silences last ``DROPOUT_SECONDS``; healthy gaps are exponential with the mean that makes silences
    ``fraction`` of device time. A device starts silent with probability ``fraction``.
    """

    devices: int
    fraction: float
    start_ms: int
    rng: np.random.Generator
    next_start: np.ndarray = field(init=False)
    next_end: np.ndarray = field(init=False)
    reported: np.ndarray = field(init=False)
    episodes: list[DropoutEpisode] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        n = self.devices
        durations = self._durations(n)
        silent_now = self.rng.random(n) < self.fraction
        into = self.rng.random(n) * durations
        first = np.where(silent_now, self.start_ms - into, self.start_ms + self._gaps(n))
        self.next_start = np.rint(first).astype(np.int64)
        self.next_end = self.next_start + np.rint(durations).astype(np.int64)
        self.reported = np.zeros(n, dtype=bool)

    def _durations(self, n: int) -> np.ndarray:
        return self.rng.uniform(*DROPOUT_SECONDS, n) * 1000.0

    def _gaps(self, n: int) -> np.ndarray:
        if self.fraction <= 0.0:
            return np.full(n, 1e18)
        mean_silence_ms = 1000.0 * sum(DROPOUT_SECONDS) / 2.0
        return self.rng.exponential(mean_silence_ms * (1.0 - self.fraction) / self.fraction, n)

    def silent(self, event_ms: np.ndarray) -> np.ndarray:
        """Which readings of a ``(ticks, devices)`` block of event times fall into a silence."""
        mask = np.zeros(event_ms.shape, dtype=bool)
        horizon = int(event_ms.max()) + 1
        while True:
            due = np.flatnonzero(self.next_start < horizon)
            if len(due) == 0:
                break
            starts, ends = self.next_start[due], self.next_end[due]
            for device, start, end in zip(
                due[~self.reported[due]].tolist(),
                starts[~self.reported[due]].tolist(),
                ends[~self.reported[due]].tolist(),
                strict=True,
            ):
                self.episodes.append(DropoutEpisode(device, start, end))
            self.reported[due] = True
            block = event_ms[:, due]
            mask[:, due] |= (block >= starts) & (block < ends)
            finished = due[ends <= horizon]
            if len(finished) == 0:
                break
            gaps = np.rint(self._gaps(len(finished))).astype(np.int64)
            durations = np.rint(self._durations(len(finished))).astype(np.int64)
            self.next_start[finished] = self.next_end[finished] + gaps
            self.next_end[finished] = self.next_start[finished] + durations
            self.reported[finished] = False
        return mask
