"""The memory budget: `max_bytes_in_flight` bounds what the loader holds, measured as process RSS."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from aioloader._limits import ByteBudget

SCRIPT = Path(__file__).parent / "scripts" / "budget_rss.py"
BUDGET_MB = 200
# Beyond the budget: the first wave of fetches, launched before any sample's size is known
# (concurrency 16 x 10 MB), the batch the consumer holds (40 MB), and allocator slack (freed 10 MB
# samples that glibc keeps mapped for a while).
OVERHEAD_MB = 250


def peak(budget: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), budget],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_budget_bounds_peak_rss_growth() -> None:
    bounded = peak(str(BUDGET_MB))
    assert bounded["max_held_mb"] <= BUDGET_MB
    assert bounded["peak_growth_mb"] <= BUDGET_MB + OVERHEAD_MB, bounded
    unbounded = peak("none")  # the same run without the budget holds far more
    assert unbounded["peak_growth_mb"] > BUDGET_MB + OVERHEAD_MB, unbounded


@pytest.mark.asyncio
async def test_budget_reserves_the_mean_size_for_launches() -> None:
    budget = ByteBudget(100)
    for _ in range(3):
        await budget.room(oldest=False)  # nothing measured yet: the first wave is not held back
        budget.launched()
    budget.measured(40)
    budget.add(40)
    budget.measured(0)  # failed
    waiter = asyncio.ensure_future(budget.room(oldest=False))
    await asyncio.sleep(0)
    assert not waiter.done()  # 40 held + (1 pending + 1) x 40 reserved > 100
    budget.measured(0)
    await waiter  # 40 held + 1 x 40 reserved <= 100
    budget.launched()
    blocked = asyncio.ensure_future(budget.room(oldest=False))
    await asyncio.sleep(0)
    assert not blocked.done()  # 40 held + 2 x 40 > 100
    await budget.room(oldest=True)  # the oldest batch is never held back
    budget.release(40)
    await blocked
