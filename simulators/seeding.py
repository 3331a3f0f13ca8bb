"""One independent random stream per concern, all derived from the run's seed.

Each concern draws from its own ``PCG64`` stream in a fixed order, so a run is reproducible and changing
one knob (say the duplicate fraction) leaves every other draw, and thus the signals, unchanged.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Stream(IntEnum):
    FLEET = 0
    SIGNAL_PARAMS = 1
    NOISE = 2
    DROPOUTS = 3
    ANOMALIES = 4
    FAULTS = 5
    CLOCK = 6


def stream_rng(seed: int, stream: Stream) -> np.random.Generator:
    """The generator of one concern: child ``stream`` of ``SeedSequence(seed)``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(int(stream),))))
