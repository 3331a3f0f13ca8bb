"""The simulated fleet: registry rows, per-type signal profiles, anomaly episodes."""

from __future__ import annotations

from collections import Counter
from datetime import date
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from iotmon.config import Settings
from iotmon.schema import ANOMALY_TYPES, DEVICE_TYPES, DEVICES, DEVICES_SCHEMA, METRIC_NAMES, METRICS
from simulators.fleet import arrow_schema, build_fleet
from simulators.publish import write_device_registry
from simulators.seeding import Stream, stream_rng
from simulators.signals import NO_ANOMALY, AnomalySchedule, draw_signal_params, normal_values


def test_fleet_identity() -> None:
    fleet = build_fleet(110, seed=7)
    assert fleet.device_ids[0] == "dev-000001" and fleet.device_ids[-1] == "dev-000110"
    assert fleet.device_types[:5] == (*DEVICE_TYPES, DEVICE_TYPES[0])
    per_site = Counter(fleet.sites)
    assert sorted(per_site) == ["site-01", "site-02", "site-03", "site-04"]
    assert max(per_site.values()) - min(per_site.values()) <= 1
    assert all(model.startswith(f"{kind}-") for kind, model in zip(fleet.device_types, fleet.models, strict=True))
    assert all(date(2018, 1, 1) <= d <= date(2025, 12, 31) for d in fleet.install_dates)
    assert build_fleet(1, seed=7).sites == ("site-01",)


def test_fleet_depends_on_the_seed() -> None:
    a, b, c = build_fleet(50, seed=1), build_fleet(50, seed=1), build_fleet(50, seed=2)
    assert a.registry_table().equals(b.registry_table())
    assert not a.registry_table().equals(c.registry_table())


def test_registry_is_a_delta_table_with_the_contract_schema(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, lake=str(tmp_path / "lake"))
    path = write_device_registry(settings, 60, seed=3)
    assert path == settings.table_path(DEVICES)
    first = DeltaTable(path).to_pyarrow_table()
    assert first.schema.names == DEVICES_SCHEMA.names
    assert first.num_rows == 60
    write_device_registry(settings, 60, seed=3)
    again = DeltaTable(path).to_pyarrow_table()
    assert again.num_rows == 60, "overwrite, not append"
    assert again.sort_by("device_id").equals(first.sort_by("device_id"))
    assert first.cast(arrow_schema(DEVICES_SCHEMA)).column("install_date").type == pa.date32()


def _signals(devices: int, seconds: np.ndarray, seed: int = 5) -> np.ndarray:
    fleet = build_fleet(devices, seed)
    params = draw_signal_params(fleet.type_codes, stream_rng(seed, Stream.SIGNAL_PARAMS))
    time_s = np.broadcast_to(seconds[:, None], (len(seconds), devices))
    noise = stream_rng(seed, Stream.NOISE).standard_normal((len(seconds), devices, len(METRIC_NAMES)))
    return normal_values(params, time_s, noise)


def test_normal_readings_stay_in_range_without_clipping() -> None:
    """Over months (battery cycles included) values stay inside the plausible ranges by design."""
    seconds = 1.79e9 + np.linspace(0, 120 * 86_400, 3_000)
    values = _signals(200, seconds)
    for m, metric in enumerate(METRICS):
        column = values[:, :, m]
        assert np.isfinite(column).all()
        assert (metric.low <= column).all() and (column <= metric.high).all()
        if metric.name != "battery":  # a fresh battery reads 100 %
            assert ((column == metric.low) | (column == metric.high)).mean() < 1e-4, metric.name
    battery = values[:, :, METRIC_NAMES.index("battery")]
    assert battery.min() > 14.0
    assert (np.diff(battery, axis=0) > 1.0).any(), "batteries get replaced"


def test_device_types_differ() -> None:
    values = _signals(400, 1.79e9 + np.arange(100.0))
    fleet = build_fleet(400, 5)
    means = {kind: values[:, fleet.type_codes == code].mean(axis=(0, 1)) for code, kind in enumerate(DEVICE_TYPES)}
    temperature, vibration = METRIC_NAMES.index("temperature"), METRIC_NAMES.index("vibration")
    assert means["chiller"][temperature] < min(means[k][temperature] for k in DEVICE_TYPES if k != "chiller")
    assert means["motor"][vibration] > max(means[k][vibration] for k in DEVICE_TYPES if k != "motor")


@pytest.mark.parametrize("fraction", [0.01, 0.1])
def test_anomaly_episodes_cover_the_fraction_and_change_values(fraction: float) -> None:
    devices, ticks = 300, 2_000
    fleet = build_fleet(devices, 9)
    params = draw_signal_params(fleet.type_codes, stream_rng(9, Stream.SIGNAL_PARAMS))
    schedule = AnomalySchedule(params, fraction, stream_rng(9, Stream.ANOMALIES))
    seconds = 1.79e9 + np.arange(ticks, dtype=float)
    clean = _signals(devices, seconds, seed=9)
    kinds = np.empty((ticks, devices), dtype=np.int8)
    metrics = np.empty((ticks, devices), dtype=np.int8)
    anomalous = clean.copy()
    for lo in range(0, ticks, 300):  # blocks of ticks, as the generator applies them
        kinds[lo : lo + 300], metrics[lo : lo + 300] = schedule.apply(anomalous[lo : lo + 300], lo)
    inside = kinds != NO_ANOMALY
    assert inside.mean() == pytest.approx(fraction, rel=0.25)
    assert set(np.unique(kinds[inside]).tolist()) == set(range(len(ANOMALY_TYPES)))
    assert np.isfinite(anomalous).all()
    changed = (anomalous != clean).any(axis=2)
    assert not changed[~inside].any(), "values change only inside episodes"
    stuck = kinds == ANOMALY_TYPES.index("stuck")
    for device in np.flatnonzero(stuck.any(axis=0))[:20].tolist():
        ticks_stuck = np.flatnonzero(stuck[:, device])
        runs = np.split(ticks_stuck, np.flatnonzero(np.diff(ticks_stuck) > 1) + 1)
        for run in runs:
            frozen = anomalous[run, device, metrics[run[0], device]]
            assert len(run) >= 2 and (frozen == frozen[0]).all()
    spikes = kinds == ANOMALY_TYPES.index("spike")
    t, d = np.nonzero(spikes)
    jump = np.abs(anomalous[t, d, metrics[t, d]] - clean[t, d, metrics[t, d]])
    assert (jump >= 4 * params.anomaly_scale[d, metrics[t, d]] - 1e-9).all()
