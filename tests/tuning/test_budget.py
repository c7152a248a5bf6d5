"""The memory budget: `max_bytes_in_flight` bounds what the loader holds, measured as process RSS."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from aioloader import Loader, sources
from aioloader._tuning.bounds import ByteBudget
from aioloader._util.threads import gil_enabled

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "budget_rss.py"
BUDGET_MB = 200
# Beyond the budget: the batch the consumer holds (4 x 10 MB), and up to a batch's worth of pages the
# allocator has not handed back yet (quiet machine: 20-30 MB; with other work on both cores: up to
# 55). Without the budget the same run grows ~800 MB; before the budget gave freed memory back,
# glibc's per-thread heaps kept 80-130 MB more than the budget and the batch.
OVERHEAD_MB = 40 + 40
# On a free-threaded build the fetch threads fill their samples at once, not in turn, and peaks
# spread more widely (216-267 MB seen at a budget of 200, against 221 every time on the GIL build;
# 667-796 without the budget): a batch more of pages in motion there.
if not gil_enabled():
    OVERHEAD_MB += 40


def peak(budget: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), budget],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.in_process
def test_budget_bounds_peak_rss_growth() -> None:
    bounded = peak(str(BUDGET_MB))
    assert bounded["max_held_mb"] <= BUDGET_MB
    assert bounded["peak_growth_mb"] <= BUDGET_MB + OVERHEAD_MB, bounded
    unbounded = peak("none")  # the same run without the budget holds far more
    assert unbounded["peak_growth_mb"] > BUDGET_MB + OVERHEAD_MB, unbounded


def test_budget_bounds_the_memory_of_a_process_pool() -> None:
    # Decoded in worker processes, samples land in the pool's shared memory, which the same budget
    # bounds (its arena is the in-flight share of max_bytes_in_flight: tests/executors/test_shm.py
    # checks that share exactly). Beyond the budget: the batch the consumer holds, and a batch of
    # the workers' heap and slab pages in motion (60-160 MB of growth seen on a quiet machine when
    # all PSS was counted; 33-45 MB since only memory is, not mapped files, whose shares move as the
    # workers start); the same run without a budget grows 235-260 MB.
    script = Path(__file__).resolve().parents[1] / "scripts" / "budget_pss.py"
    budget_mb, sample_mb, batch = 100, 10, 4
    bound = budget_mb + 2 * sample_mb * batch

    def run(budget: int, *fill: str) -> dict[str, float]:
        done = subprocess.run(
            [sys.executable, str(script), str(budget), str(sample_mb), str(batch), *fill],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]

    bounded = run(budget_mb)
    assert bounded["peak_growth_mb"] <= bound, bounded
    # no budget to speak of, and a consumer that lets the loader fill up (8 batches ready): the
    # tree's peak is higher than the budgeted run's by more than two batches. (Compared whole, not
    # by growth after the first batch: the unbudgeted loader may have filled up by then, and on a
    # free-threaded build its growth after it was 103-268 MB, under twice the budgeted run's once.)
    unbounded = run(100 * budget_mb, "fill")
    more = unbounded["peak_mb"] - bounded["peak_mb"]
    assert more > 2 * sample_mb * batch, (unbounded, bounded)


def _no() -> bool:
    return False


def _yes() -> bool:
    return True


@pytest.mark.asyncio
async def test_budget_reserves_the_mean_size_for_launches() -> None:
    budget = ByteBudget(100)
    await budget.room(_no)
    budget.launched()
    first_wave = asyncio.ensure_future(budget.room(_no))
    await asyncio.sleep(0)
    assert not first_wave.done()  # no size known yet: one sample at a time
    budget.measured(40)
    budget.add(40)
    await first_wave
    budget.launched()
    budget.measured(None)  # failed
    budget.launched()
    waiter = asyncio.ensure_future(budget.room(_no))
    await asyncio.sleep(0)
    assert not waiter.done()  # 40 held + (1 pending + 1) x 40 reserved > 100
    assert budget.reserved == 40
    budget.measured(None)
    await waiter  # 40 held + 1 x 40 reserved <= 100
    budget.launched()
    blocked = asyncio.ensure_future(budget.room(_no))
    await asyncio.sleep(0)
    assert not blocked.done()  # 40 held + 2 x 40 > 100
    await budget.room(_yes)  # the oldest batch is never held back
    budget.release(40)
    await blocked


@pytest.mark.asyncio
async def test_a_launch_waiting_for_room_goes_when_its_batch_becomes_the_oldest() -> None:
    budget = ByteBudget(100)
    budget.launched()
    budget.measured(80)
    budget.add(80)
    oldest = [False]
    waiter = asyncio.ensure_future(budget.room(lambda: oldest[0]))
    await asyncio.sleep(0)
    assert not waiter.done()  # 80 held + 80 > 100, and another batch is older
    oldest[0] = True
    budget.poke()  # the older batch was handed over: this one is the oldest now
    await asyncio.wait_for(waiter, 1)


def fetch_mib(key: int) -> np.ndarray:
    return np.full(1 << 20, key % 256, dtype=np.uint8)


@pytest.mark.parametrize("in_order", [True, False])
def test_batches_larger_than_the_budget_all_come_with_a_warning(in_order: bool) -> None:
    loader = Loader(
        range(24), fetch_mib, batch_size=8, max_bytes_in_flight=3 << 20, timeout=20,
        in_order=in_order,
    )  # fmt: skip
    with loader, pytest.warns(ResourceWarning, match=r"one batch holds 8,388,608 bytes"):
        batches = list(loader)
    assert sorted(int(b[0, 0]) for b in batches) == [0, 8, 16]
    stats = loader.stats()
    assert stats.peak_held_bytes >= 8 << 20  # one batch at a time, over the budget
    assert stats.peak_held_bytes <= (8 << 20) + (1 << 20) * 2


def test_the_first_wave_waits_for_a_first_size() -> None:
    # 16 fetches at once would hold 16 MiB before any size is known; the budget is 4 MiB
    with Loader(range(32), fetch_mib, batch_size=2, max_bytes_in_flight=8 << 20) as loader:
        assert len(list(loader)) == 16
        peak = loader.stats().peak_held_bytes
    assert peak <= (4 << 20) + (2 << 20), peak  # the budget for samples + one batch


@pytest.mark.asyncio
async def test_the_size_estimate_outlives_the_epoch() -> None:
    first = ByteBudget(100)
    first.launched()
    first.measured(10)
    later = ByteBudget(100, first.sizes)  # the next epoch's, sharing the loader's sizes
    for _ in range(5):  # launched at once: 5 x 10 reserved fit in 100
        await asyncio.wait_for(later.room(_no), 1)
        later.launched()
    assert later.reserved == 50


def test_a_launch_reserves_what_decode_adds_too() -> None:
    def small(key: int) -> bytes:
        return bytes(1 << 10)

    def large(raw: bytes) -> np.ndarray:
        return np.zeros(1 << 20, dtype=np.uint8)  # decoded: a thousand times the fetched size

    loader = Loader(
        range(24), small, decode=large, executor="inline", batch_size=2,
        max_bytes_in_flight=8 << 20,
    )  # fmt: skip
    with loader:
        assert len(list(loader)) == 12
        peak = loader.stats().peak_held_bytes
    assert peak <= (4 << 20) + (2 << 20) + (2 << 20), peak  # samples' half + one batch + slack


@pytest.mark.asyncio
async def test_a_known_size_is_reserved_before_the_fetch() -> None:
    budget = ByteBudget(100)
    budget.launched()
    budget.measured(10)  # the mean: 10
    budget.add(10)
    expected = budget.expect(70)
    await budget.room(_no, expected)  # 10 held + 70 fits
    budget.launched(expected)
    assert budget.reserved == 70
    big = asyncio.ensure_future(budget.room(_no, budget.expect(30)))
    await asyncio.sleep(0)
    assert not big.done()  # 10 + 70 + 30 > 100, though the mean (10) would fit
    budget.measured(70, expected)
    budget.add(70)
    budget.release(80)
    await asyncio.wait_for(big, 1)
    budget.grew(80, 80)  # decode made the 80 bytes fetched hold 80 more: samples grow 2x
    assert budget.expect(30) == 60


@pytest.mark.asyncio
async def test_a_sample_in_decode_reserves_what_decode_adds() -> None:
    # fetched as a few bytes (a key, a path), decoded to many: without this, every launch would fit
    # while its decode (queued in a process pool, say) had not made it large yet
    budget = ByteBudget(100)
    budget.launched()
    budget.measured(1)
    budget.add(1)
    budget.decode_started()
    second = asyncio.ensure_future(budget.room(_no))
    await asyncio.sleep(0)
    assert not second.done()  # what decode adds is unknown yet: one decode at a time
    budget.decode_ended()
    budget.grew(39, 1)  # it came back holding 40
    budget.add(39)
    await asyncio.wait_for(second, 1)  # 40 held + 40 expected fits
    budget.launched()
    budget.measured(1)
    budget.add(1)
    budget.decode_started()
    assert budget.reserved == 39  # the one in decode: what decode adds on average
    third = asyncio.ensure_future(budget.room(_no))
    await asyncio.sleep(0)
    assert not third.done()  # 41 held + 39 reserved + 40 expected > 100
    budget.decode_ended()
    budget.grew(39, 1)
    budget.add(39)
    budget.release(80)
    await asyncio.wait_for(third, 1)


def test_a_files_source_reserves_each_files_size() -> None:
    # Ten small files, then four of 3 MiB: after the small ones the mean is 1 KiB, so an estimate
    # would let all four large ones start at once (12 MiB against a budget of 8); their listed sizes
    # keep them within it.
    with tempfile.TemporaryDirectory() as root:
        for i in range(10):
            Path(root, f"a{i:02}").write_bytes(bytes(1 << 10))
        for i in range(4):
            Path(root, f"b{i:02}").write_bytes(bytes(3 << 20))
        source = sources.files(root)
        assert source.size("b00") == 3 << 20
        assert source.size("nope") is None

        def slowly(raw: bytes) -> bytes:
            return raw

        loader = Loader(
            source, decode=slowly, executor="inline", batch_size=1, collate=None,
            concurrency=8, prefetch=8, max_bytes_in_flight=8 << 20,
        )  # fmt: skip
        with loader:
            sizes = []
            for sample in loader:
                sizes += [len(raw) for raw in sample]  # (collate=None: a list of one)
                time.sleep(0.05)  # a slow consumer: made samples wait, holding bytes
            peak = loader.stats().peak_held_bytes
    assert sorted(sizes) == [1 << 10] * 10 + [3 << 20] * 4
    assert peak <= 8 << 20, peak
