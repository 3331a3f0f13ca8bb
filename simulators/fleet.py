"""The simulated fleet: which devices exist, what they are and where they stand.

The registry is static reference data that the streaming jobs join against, so it is a pure function of
``(devices, seed)``: a rerun with the same seed rewrites identical rows and old readings keep their meaning.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, timedelta

import numpy as np
import pyarrow as pa
from pyspark.sql.types import DataType, DateType, DoubleType, IntegerType, LongType, StringType, StructType

from iotmon.schema import DEVICE_TYPES, DEVICES_SCHEMA

from .seeding import Stream, stream_rng

DEVICE_ID_PREFIX = "dev-"
DEVICE_ID_DIGITS = 6
SITE_PREFIX = "site-"
DEVICES_PER_SITE = 25
FIRST_INSTALL = date(2018, 1, 1)
LAST_INSTALL = date(2025, 12, 31)

# Product lines per device type; a device gets one of its type's models.
MODELS: dict[str, tuple[str, ...]] = {
    "pump": ("P200", "P350"),
    "motor": ("M75", "M110"),
    "chiller": ("CH40", "CH90"),
    "compressor": ("C300", "C550"),
}
if set(MODELS) != set(DEVICE_TYPES):
    raise ImportError(f"MODELS must cover exactly {DEVICE_TYPES}, not {tuple(MODELS)}")


@dataclass(frozen=True)
class Fleet:
    """Identity and placement of every device; index ``i`` in each sequence is the same device."""

    device_ids: tuple[str, ...]
    type_codes: np.ndarray
    """Index into ``DEVICE_TYPES`` per device (int64)."""
    sites: tuple[str, ...]
    models: tuple[str, ...]
    install_dates: tuple[date, ...]

    def __len__(self) -> int:
        return len(self.device_ids)

    @property
    def device_types(self) -> tuple[str, ...]:
        return tuple(DEVICE_TYPES[code] for code in self.type_codes.tolist())

    @property
    def keys(self) -> list[bytes]:
        """Kafka record keys: the device id, so one device always lands on one partition."""
        return [device_id.encode() for device_id in self.device_ids]

    def registry_table(self) -> pa.Table:
        """The rows of the ``devices`` table, typed after ``DEVICES_SCHEMA``."""
        columns = (self.device_ids, self.device_types, self.sites, self.models, self.install_dates)
        schema = arrow_schema(DEVICES_SCHEMA)  # column order: device_id, device_type, site, model, install_date
        return pa.table([list(column) for column in columns], schema=schema)


def device_id(number: int) -> str:
    """Ids are numbered from 1 and zero-padded so that they sort like the numbers."""
    return f"{DEVICE_ID_PREFIX}{number:0{DEVICE_ID_DIGITS}d}"


def site_count(devices: int) -> int:
    return max(1, round(devices / DEVICES_PER_SITE))


def build_fleet(devices: int, seed: int) -> Fleet:
    """Types cycle over ``DEVICE_TYPES`` (an even mix); sites, models and install dates come from the seed."""
    if devices < 1:
        raise ValueError(f"a fleet needs at least one device, not {devices}")
    rng = stream_rng(seed, Stream.FLEET)
    type_codes = np.arange(devices, dtype=np.int64) % len(DEVICE_TYPES)
    sites_n = site_count(devices)
    width = max(2, len(str(sites_n)))
    site_numbers = rng.permutation(np.arange(devices) % sites_n) + 1
    model_choice = rng.integers(0, 1 << 30, size=devices)
    install_span = (LAST_INSTALL - FIRST_INSTALL).days + 1
    install_offsets = rng.integers(0, install_span, size=devices)
    types = [DEVICE_TYPES[code] for code in type_codes.tolist()]
    return Fleet(
        device_ids=tuple(device_id(i + 1) for i in range(devices)),
        type_codes=type_codes,
        sites=tuple(f"{SITE_PREFIX}{number:0{width}d}" for number in site_numbers.tolist()),
        models=tuple(
            f"{kind}-{MODELS[kind][choice % len(MODELS[kind])]}"
            for kind, choice in zip(types, model_choice.tolist(), strict=True)
        ),
        install_dates=tuple(FIRST_INSTALL + timedelta(days=days) for days in install_offsets.tolist()),
    )


_ARROW_TYPES: dict[type[DataType], pa.DataType] = {
    StringType: pa.string(),
    DateType: pa.date32(),
    DoubleType: pa.float64(),
    IntegerType: pa.int32(),
    LongType: pa.int64(),
}


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow twin of a Spark schema, so non-Spark writers produce the columns Spark expects."""
    return pa.schema([pa.field(f.name, _ARROW_TYPES[type(f.dataType)], nullable=f.nullable) for f in schema.fields])
