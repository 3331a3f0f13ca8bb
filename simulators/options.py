"""What a simulation run is asked to do, and the concrete stream plan derived from it and the settings."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from iotmon.config import Settings, interval_seconds
from iotmon.kafka import producer_config

from .faults import (
    DUPLICATE_DELAY_S,
    LATE_DELAY_OF_WATERMARK,
    VERY_LATE_DELAY_OF_WATERMARK,
    FaultRates,
    oversized_bytes,
)
from .timefmt import to_ms


@dataclass(frozen=True)
class SimulationOptions:
    """Knobs of ``iotmon simulate``. Without ``rate`` the run is a backlog (simulated time, as fast as
    possible); with ``rate`` it is real time (event time is the wall clock)."""

    devices: int = 100
    seed: int = 42
    events: int | None = None
    """Stop after this many sends (records published, duplicates included)."""
    duration: float | None = None
    """Seconds: simulated time in backlog mode, wall time in real-time mode."""
    rate: float | None = None
    """Events per second; when set, real-time pacing with event_time = wall clock."""
    past: float = 0.0
    """Real-time mode: seconds of history before now, published at once before pacing starts (one simulation,
    so the past and the live readings continue each other): a demo's first model can train immediately."""
    interval: float = 1.0
    """Backlog mode: seconds of simulated time between two readings of a device."""
    start: datetime | None = None
    """Backlog mode: first event time (default: now - simulated span, floored to the second, UTC; the span
    includes the time held-back records may still be due, so that nothing is sent with a future time)."""
    late_fraction: float = 0.02
    very_late_fraction: float = 0.005
    duplicate_fraction: float = 0.01
    malformed_fraction: float = 0.005
    anomaly_fraction: float = 0.01
    dropout_fraction: float = 0.01
    truth_path: Path | None = None
    """Default: ``<settings.home>/truth/run-<seed>.parquet``."""
    progress: bool = True

    @property
    def realtime(self) -> bool:
        return self.rate is not None

    @property
    def fault_rates(self) -> FaultRates:
        return FaultRates(
            late=self.late_fraction,
            very_late=self.very_late_fraction,
            duplicate=self.duplicate_fraction,
            malformed=self.malformed_fraction,
            dropout=self.dropout_fraction,
        )

    def validate(self) -> None:
        """Raise ``ValueError`` with a message fit for the terminal if the options cannot run."""
        if self.devices < 1:
            raise ValueError(f"devices must be at least 1, not {self.devices}")
        if self.events is not None and self.events < 1:
            raise ValueError(f"events must be at least 1, not {self.events}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be positive, not {self.duration}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be a positive number of events per second, not {self.rate}")
        if not (self.interval > 0 and math.isfinite(self.interval)):
            raise ValueError(f"interval must be a positive number of seconds, not {self.interval}")
        if not 0.0 <= self.anomaly_fraction < 1.0:
            raise ValueError(f"anomaly fraction must be in [0, 1), not {self.anomaly_fraction}")
        _ = self.fault_rates  # building FaultRates validates the fault fractions
        if not (self.past >= 0 and math.isfinite(self.past)):
            raise ValueError(f"past must be a non-negative number of seconds, not {self.past}")
        if self.realtime:
            if self.start is not None:
                raise ValueError("start applies to backlog mode only: real-time event times are the wall clock")
        elif self.past:
            raise ValueError("past applies to real-time mode only: a backlog's history is set by start and duration")
        elif self.events is None and self.duration is None:
            raise ValueError(
                "backlog mode needs events or duration to know when to stop; "
                "or set rate for real-time mode, which runs until interrupted"
            )

    def truth_file(self, settings: Settings) -> Path:
        return self.truth_path or settings.truth_dir / f"run-{self.seed}.parquet"


@dataclass(frozen=True)
class StreamPlan:
    """Everything the record stream depends on, resolved to numbers: same plan, same bytes."""

    devices: int
    seed: int
    start_ms: int
    interval_s: float
    end_ms: int | None
    """Readings stop before this event time."""
    max_sends: int | None
    rates: FaultRates
    anomaly_fraction: float
    watermark_s: float
    max_payload_bytes: int
    max_message_bytes: int
    max_clock_skew_s: float


def expected_span_s(options: SimulationOptions) -> float:
    """Simulated seconds a backlog run covers: its duration, or what its event count needs."""
    spans = []
    if options.duration is not None:
        spans.append(options.duration)
    if options.events is not None:
        sends_per_tick = options.devices * (1.0 + options.duplicate_fraction) * (1.0 - options.dropout_fraction)
        spans.append(math.ceil(options.events / sends_per_tick) * options.interval)
    return min(spans) if spans else 0.0


def flush_tail_s(options: SimulationOptions, watermark_s: float) -> float:
    """How long after the last reading the held-back records may still be due."""
    if options.very_late_fraction > 0:
        return VERY_LATE_DELAY_OF_WATERMARK[1] * watermark_s
    late = LATE_DELAY_OF_WATERMARK * watermark_s if options.late_fraction > 0 else 0.0
    return late + DUPLICATE_DELAY_S[1]


def plan_stream(settings: Settings, options: SimulationOptions, now_ms: int) -> StreamPlan:
    """Resolve the options against the settings and the current time."""
    options.validate()
    watermark_s = interval_seconds(settings.watermark)
    max_message_bytes = int(producer_config(settings)["message.max.bytes"])
    if options.malformed_fraction > 0 and (
        oversized_bytes(settings.max_payload_bytes, max_message_bytes) <= settings.max_payload_bytes
    ):
        raise ValueError(
            f"IOTMON_MAX_PAYLOAD_BYTES={settings.max_payload_bytes} leaves no room for an oversized payload "
            f"under Kafka's {max_message_bytes}-byte message limit"
        )
    if options.realtime:
        assert options.rate is not None
        start_ms = now_ms - round(options.past * 1000)
        interval = options.devices / options.rate
        end_ms = None if options.duration is None else now_ms + round(options.duration * 1000)
    else:
        interval = options.interval
        if options.start is not None:
            start_ms = to_ms(options.start)
        else:  # end by now, held-back records included: a backlog has no future send times
            span_s = expected_span_s(options) + flush_tail_s(options, watermark_s)
            start_ms = (now_ms - round(span_s * 1000)) // 1000 * 1000
        end_ms = None if options.duration is None else start_ms + round(options.duration * 1000)
    return StreamPlan(
        devices=options.devices,
        seed=options.seed,
        start_ms=start_ms,
        interval_s=interval,
        end_ms=end_ms,
        max_sends=options.events,
        rates=options.fault_rates,
        anomaly_fraction=options.anomaly_fraction,
        watermark_s=watermark_s,
        max_payload_bytes=settings.max_payload_bytes,
        max_message_bytes=max_message_bytes,
        max_clock_skew_s=settings.max_clock_skew_seconds,
    )
