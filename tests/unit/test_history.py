"""The scorer's history between batches: features from it equal the features over the whole archive, and
silver is read only for what it does not hold (a cold start, a reading older than it keeps), and no more."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from iotmon.schema import DEVICE_ID, EVENT_TIME, LATENESS, METRIC_NAMES, SEQ
from ml.features import DeviceReadings, FeatureSpec, Judgements, device_features, featured_table
from streaming.history import FEATURE_INPUTS, DeviceHistory, SilverRanges

SPEC = FeatureSpec(history_s=10.0, settle_s=1.0)
T0_US = 1_800_000_000_000_000


def _archive(seed: int = 3) -> pa.Table:
    """Two devices reporting about every 0.5 s for 120 s, in the order the readings reach Kafka: some late
    (within the watermark), one far beyond it (it arrives at the very end), a spike and a stuck stretch."""
    rng = np.random.default_rng(seed)
    rows = []
    for d, device in enumerate(("dev-a", "dev-b")):
        for i in range(240):
            event_us = T0_US + i * 500_000 + d * 123_000
            values = [20 + rng.normal(0, 0.3), 40 + rng.normal(0, 1), 2 + rng.normal(0, 0.1), 101.0, 90.0]
            values = [round(v, 2) for v in values]
            if device == "dev-a" and i == 150:
                values[0] = 35.0
            if device == "dev-b" and 100 <= i < 110:
                values[0] = 21.0
            delay_s = 0.2
            if rng.random() < 0.05:
                delay_s = float(rng.uniform(2, 20))  # late, within a 30 s watermark
            if device == "dev-b" and i == 60:
                delay_s = 200.0  # far beyond the watermark: it arrives after everything else
            rows.append((device, i, event_us, values, delay_s))
    rows.sort(key=lambda r: r[2] + r[4] * 1_000_000)  # arrival order
    return pa.table(
        {
            DEVICE_ID: [r[0] for r in rows],
            SEQ: pa.array([r[1] for r in rows], pa.int64()),
            EVENT_TIME: pa.array([r[2] for r in rows], pa.timestamp("us", tz="UTC")),
            **{m: [r[3][k] for r in rows] for k, m in enumerate(METRIC_NAMES)},
            LATENESS: ["on_time" if r[4] <= SPEC.settle_s else "late" for r in rows],
        }
    ).select(list(FEATURE_INPUTS))


def _in_ranges(silver: pa.Table, ranges: SilverRanges) -> pa.Table:
    """What ``streaming.scoring.silver_reader`` reads: each device's rows in its range, no more."""
    event_us = silver.column(EVENT_TIME).cast(pa.int64()).to_numpy()
    devices = silver.column(DEVICE_ID).to_numpy(zero_copy_only=False)
    wanted = np.zeros(silver.num_rows, dtype=bool)
    for device, (start, through) in ranges.items():
        wanted |= (devices == device) & (event_us >= start) & (event_us <= (through if through is not None else np.inf))
    return silver.filter(pa.array(wanted))


def _by_key(table: pa.Table) -> dict[tuple[str, int], list[float]]:
    features = {m: table.column(f"f_{m}").combine_chunks().flatten() for m in METRIC_NAMES}
    keys = zip(table.column(DEVICE_ID).to_pylist(), table.column(SEQ).to_pylist(), strict=True)
    return {key: [float(f[i]) for m in METRIC_NAMES for f in features[m]] for i, key in enumerate(keys)}


def _whole_archive(archive: pa.Table) -> dict[tuple[str, int], list[float]]:
    devices = archive.column(DEVICE_ID).to_numpy(zero_copy_only=False)
    expected = {}
    for device in np.unique(devices):
        expected |= _by_key(featured_table(archive.filter(pa.array(devices == device)), SPEC))
    return expected


def _whole_judgements(archive: pa.Table, device: str) -> tuple[np.ndarray, Judgements]:
    """A device's event times over the whole archive, sorted, and every reading's jump and suspicion."""
    readings = DeviceReadings.of(archive.filter(pc.equal(archive.column(DEVICE_ID), device)))
    judgements = Judgements.none(len(readings.order), len(METRIC_NAMES))
    device_features(readings.event_us, readings.values, readings.on_time, SPEC, judgements=judgements)
    return readings.event_us, judgements


@pytest.mark.parametrize("ahead", [False, True], ids=["silver-as-of-the-batch", "silver-ahead-of-the-batch"])
def test_batch_by_batch_features_equal_those_over_the_whole_archive(ahead: bool) -> None:
    """Silver may hold readings the scorer has not had yet when it is read (a scorer catching up): they must
    change nothing."""
    archive = _archive()
    history = DeviceHistory(late_s=30.0)
    reads: list[SilverRanges] = []
    scored: dict[tuple[str, int], list[float]] = {}
    batch_rows = 37  # about 2 s of this fleet

    for start in range(0, archive.num_rows, batch_rows):
        # Silver holds this batch and everything before it, and perhaps more; a reader may return more than it is
        # asked for.
        committed = archive if ahead else archive.slice(0, start + batch_rows)

        def read_silver(ranges: SilverRanges, committed: pa.Table = committed) -> pa.Table:
            reads.append(dict(ranges))
            return committed

        scored |= _by_key(history.featured(archive.slice(start, batch_rows), SPEC, read_silver))

    assert scored == _whole_archive(archive)  # identical, not close
    # Each reading's jump and suspicion, judged once and kept, are the whole computation's.
    for device, kept in history.devices.items():
        whole = _whole_judgements(archive, device)
        at = np.searchsorted(whole[0], kept.event_us)
        judged, jumped = kept.judgements.judged & kept.on_time, kept.judgements.jumped
        assert judged.sum() > 100
        assert np.array_equal(kept.judgements.suspect[judged], whole[1].suspect[at[judged]])
        assert np.array_equal(kept.judgements.jumps[jumped], whole[1].jumps[at[jumped]], equal_nan=True)
    # Silver was read at the start, to its end, when dev-b first showed up in a batch of its own (at most), and
    # for the reading Kafka delivered far beyond the watermark: not for every batch. That one's read reaches from
    # its own lookback to itself, not to silver's end.
    assert 1 <= len(reads) <= 3
    assert all(through is None for read in reads[:-1] for _, through in read.values())
    straggler_us = T0_US + 60 * 500_000 + 123_000
    assert reads[-1] == {"dev-b": (SPEC.lookback_start_us(straggler_us), straggler_us)}
    # What is kept is bounded by the lookback and the lateness, not by the archive.
    kept = max(len(d.event_us) for d in history.devices.values())
    assert kept < (4 * SPEC.history_s + 30.0 + SPEC.history_s) / 0.5


def test_a_fresh_history_reads_the_lookback_of_the_first_batch_once() -> None:
    archive = _archive()
    history = DeviceHistory(late_s=30.0)
    reads: list[SilverRanges] = []

    def read_silver(ranges: SilverRanges) -> pa.Table:
        reads.append(dict(ranges))
        return archive  # more than asked for, ahead of the batch too: it must not matter

    last = archive.slice(archive.num_rows - 50)
    history.featured(last, SPEC, read_silver)
    assert len(reads) == 1 and set(reads[0]) == set(last.column(DEVICE_ID).to_pylist())
    starts = [start for start, _ in reads[0].values()]
    first_us = min(last.column(EVENT_TIME).cast(pa.int64()).to_pylist())
    assert min(starts) == SPEC.lookback_start_us(first_us)
    assert dt.timedelta(microseconds=first_us - min(starts)) >= dt.timedelta(seconds=SPEC.lookback_s)
    assert all(through is None for _, through in reads[0].values())  # to silver's end


def test_a_silver_read_that_finds_nothing_leaves_the_batch_its_own_lookback() -> None:
    """A first batch that holds its devices' whole lookback needs nothing from silver: features from a read
    that finds no row (it used to fail on an empty table) equal those from one that finds the batch itself."""
    archive = _archive()
    first = archive.slice(0, 120)
    nothing = DeviceHistory(late_s=30.0).featured(first, SPEC, lambda _: archive.slice(0, 0))
    itself = DeviceHistory(late_s=30.0).featured(first, SPEC, lambda _: first)
    assert _by_key(nothing) == _by_key(itself)
    assert any(value != 0.0 for values in _by_key(nothing).values() for value in values)


@pytest.mark.parametrize("ahead", [False, True], ids=["silver-as-of-the-batch", "silver-ahead-of-the-batch"])
def test_a_restart_whose_first_batch_is_an_old_reading_alone_misses_nothing_after_it(ahead: bool) -> None:
    """A scorer restarted from its checkpoint starts with an empty history. If its first batch holds only a
    reading Kafka delivered far beyond the watermark (a late-arrivals commit of its own), silver is read for
    that reading's lookback; the device's readings after it, which the previous run scored, are in silver
    too, and the next batches' features need them (seen in a demo whose drain restarted the scorer)."""
    archive = _archive()
    last = archive.num_rows - 1
    assert (archive.column(DEVICE_ID)[last].as_py(), archive.column(SEQ)[last].as_py()) == ("dev-b", 60)
    restart = 300  # the previous run scored the first 300 readings; then the far-late one arrives alone
    arrived = archive.take(pa.array([*range(restart), last, *range(restart, last)]))
    history = DeviceHistory(late_s=30.0)
    scored: dict[tuple[str, int], list[float]] = {}
    for start, end in [(restart, restart + 1), *((s, s + 37) for s in range(restart + 1, arrived.num_rows, 37))]:
        committed = arrived if ahead else arrived.slice(0, end)

        def read_silver(ranges: SilverRanges, committed: pa.Table = committed) -> pa.Table:
            return _in_ranges(committed, ranges)

        scored |= _by_key(history.featured(arrived.slice(start, end - start), SPEC, read_silver))

    expected = _whole_archive(archive)
    assert len(scored) == archive.num_rows - restart
    assert scored == {key: expected[key] for key in scored}  # identical, not close


def test_stragglers_are_featured_from_their_own_lookback_and_leave_the_history_as_it_was() -> None:
    """Readings Kafka delivered long after their devices' newer ones (a late-arrivals commit), in one batch with
    on-time readings: each straggler's features come from a read of its own lookback, through the newest
    straggler of its device and no further, equal to the whole archive's; the history does not reach back for
    them."""
    archive = _archive()
    devices = archive.column(DEVICE_ID).to_pylist()
    event_us = archive.column(EVENT_TIME).cast(pa.int64()).to_pylist()
    early = [i for i, us in enumerate(event_us) if T0_US + 15_000_000 <= us < T0_US + 40_000_000]
    stragglers = [
        *[i for i in early if devices[i] == "dev-a"][1:30:8],
        *[i for i in early if devices[i] == "dev-b"][3:20:7],
        archive.num_rows - 1,  # dev-b's reading that Kafka delivered far beyond the watermark
    ]
    rest = [i for i in range(archive.num_rows) if i not in stragglers]
    # The stragglers arrive late (not on time), in the last batch, beside the last on-time readings.
    late = archive.take(pa.array(stragglers))
    late = late.set_column(late.schema.get_field_index(LATENESS), LATENESS, pa.array(["late"] * late.num_rows))
    arrived = pa.concat_tables([archive.take(pa.array(rest)), late])
    history = DeviceHistory(late_s=30.0)
    reads: list[SilverRanges] = []
    scored: dict[tuple[str, int], list[float]] = {}
    last_batch = archive.num_rows - len(stragglers) - 20
    for start, end in [
        *((s, min(s + 37, last_batch)) for s in range(0, last_batch, 37)),
        (last_batch, arrived.num_rows),
    ]:
        committed = arrived.slice(0, end)

        def read_silver(ranges: SilverRanges, committed: pa.Table = committed) -> pa.Table:
            reads.append(dict(ranges))
            return _in_ranges(committed, ranges)

        scored |= _by_key(history.featured(arrived.slice(start, end - start), SPEC, read_silver))

    assert scored == _whole_archive(arrived)  # identical, not close
    seqs = archive.column(SEQ).to_pylist()
    assert all(any(value != 0.0 for value in scored[devices[i], seqs[i]]) for i in stragglers)
    straggling = {device: [event_us[i] for i in stragglers if devices[i] == device] for device in ("dev-a", "dev-b")}
    assert reads[-1] == {d: (SPEC.lookback_start_us(min(us)), max(us)) for d, us in straggling.items()}
    for device, us in straggling.items():
        assert history.devices[device].complete_from_us > max(us)
