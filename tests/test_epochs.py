"""A loader's epochs, iterated (`_epochs.py`): `async for` yields what `for` yields, on the loader's own
loop thread or the caller's loop, which fetches or not while the consumer blocks its loop; a timeout
ends either face in LoaderTimeout."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.fakes import AsyncFetch, Gate, TickingFetch, Tracker, plain_square

from aioloader import Loader, LoaderTimeout


async def alist(loader: Loader[Any]) -> list[Any]:
    return [batch async for batch in loader]


def test_timeout_raises_loader_timeout_in_sync_iteration() -> None:
    with Loader(range(3), Gate(), timeout=0.2) as loader:
        it = iter(loader)
        with pytest.raises(LoaderTimeout, match="timeout"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
async def test_timeout_raises_loader_timeout_in_async_iteration(use_caller_loop: bool) -> None:
    async with Loader(range(3), Gate(), timeout=0.2, use_caller_loop=use_caller_loop) as loader:
        with pytest.raises(LoaderTimeout) as info:
            await alist(loader)
    assert isinstance(info.value, TimeoutError)


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
@pytest.mark.in_process
async def test_async_for_yields_what_for_yields(use_caller_loop: bool) -> None:
    fetch = AsyncFetch(Tracker(), transform=lambda key: key * 2)
    async with Loader(
        range(9), fetch, batch_size=4, collate=None, use_caller_loop=use_caller_loop
    ) as loader:
        assert await alist(loader) == [[0, 2, 4, 6], [8, 10, 12, 14], [16]]
        assert await alist(loader) == [[0, 2, 4, 6], [8, 10, 12, 14], [16]]
        assert loader.epoch == 2
    here = asyncio.get_running_loop()
    assert (fetch.tracker.loops == {here}) is use_caller_loop
    assert len(fetch.tracker.loops) == 1


@pytest.mark.asyncio
async def test_async_for_with_plain_fetch_and_thread_decode() -> None:
    async with Loader(
        range(5), plain_square, decode=str, executor="thread", batch_size=2, collate=None
    ) as loader:
        assert await alist(loader) == [["0", "1"], ["4", "9"], ["16"]]


STEP_S = 0.05
BATCHES = 10


@dataclass
class Steps:
    batches: list[Any] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    overlapped: int = 0  # steps during which the fetch made progress
    elapsed: float = 0.0


async def blocking_steps(loader: Loader[Any], fetch: TickingFetch) -> Steps:
    """Consume with a step that blocks the caller's loop STEP_S per batch (a model step)."""
    steps = Steps()
    start = time.perf_counter()
    async for batch in loader:
        steps.batches.append(batch)
        ticks, began = fetch.ticks_done, time.perf_counter()
        fetch.busy.set()
        time.sleep(STEP_S)  # noqa: ASYNC251 - the point: a step that does not await
        fetch.busy.clear()
        steps.step_s.append(time.perf_counter() - began)
        steps.overlapped += fetch.ticks_done > ticks
    steps.elapsed = time.perf_counter() - start
    return steps


@pytest.mark.asyncio
@pytest.mark.in_process
async def test_own_loop_thread_fetches_while_the_consumer_blocks_its_loop() -> None:
    fetch = TickingFetch(threading.Event())  # ~50 ms a sample, one at a time
    async with Loader(range(BATCHES), fetch, concurrency=1, prefetch=1) as loader:
        steps = await blocking_steps(loader, fetch)
    assert steps.batches == list(range(BATCHES))
    assert len(fetch.loops) == 1
    assert asyncio.get_running_loop() not in fetch.loops
    # The next sample was fetched during every step but the last (one spare for a noisy machine).
    assert steps.overlapped >= BATCHES - 2, steps.overlapped
    # Serially, as measured in this run: every fetch, then every step (about 1.0 s). Overlapping
    # can save, per step, the step or the next fetch, whichever is shorter (about 0.45 s in all).
    serial = sum(fetch.fetch_s) + sum(steps.step_s)
    overlappable = sum(map(min, steps.step_s[:-1], fetch.fetch_s[1:]))
    saved = serial - steps.elapsed
    assert saved > overlappable / 2, f"saved {saved:.2f} s of {overlappable:.2f} s overlappable"


@pytest.mark.asyncio
@pytest.mark.in_process
async def test_caller_loop_does_not_fetch_while_the_consumer_blocks_its_loop() -> None:
    """The trade-off of use_caller_loop=True: a step that blocks the loop stalls fetching."""
    fetch = TickingFetch(threading.Event())
    async with Loader(
        range(BATCHES), fetch, concurrency=1, prefetch=1, use_caller_loop=True
    ) as loader:
        steps = await blocking_steps(loader, fetch)
    assert steps.batches == list(range(BATCHES))
    assert fetch.loops == {asyncio.get_running_loop()}
    assert steps.overlapped == 0
    assert fetch.ticks_while_busy == 0
    # At most one 5 ms tick of a fetch can elapse during a step: about the serial 1.0 s.
    assert steps.elapsed > BATCHES * (STEP_S + (fetch.ticks - 1) * fetch.tick_s) * 0.95
