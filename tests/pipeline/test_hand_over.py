"""`for` over a loader: the batches waiting come over to the consumer's thread together, in one call
on the loop, and each keeps its places until it is handed over.

Checked: one call for many waiting batches (`for` and `async for`); the prefetch bound and the
counts then; an error behind
batches waiting comes after them; an early break drops what came over and was not handed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from support.fakes import WAIT_S, Boom, Failing, SyncFetch, Tracker

from aioloader import Loader
from aioloader._pipeline.loop_thread import LoopThread

PREFETCH = 6


def until(predicate: Callable[[], bool]) -> bool:
    """Until `predicate()` holds (what the loader's stats say, read as it runs); False on timeout."""
    end = time.monotonic() + WAIT_S
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.002)
    return True


class Gated(SyncFetch):
    """A fetch that holds key 2 (the second batch's first) until `go` is set: the first batch is
    then the only one that can be waiting when the consumer first asks (in key order, the rest
    wait behind the second), so the first call hands over that one alone."""

    def __init__(self, tracker: Tracker) -> None:
        super().__init__(tracker)
        self.go = threading.Event()

    def __call__(self, key: Any) -> Any:
        if key == 2:
            assert self.go.wait(WAIT_S)
        return super().__call__(key)


class Calls:
    """Counts the consumer's calls on the loop: `LoopThread.run` (`for`), `.submit` (`async for`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("run", "submit"):
            monkeypatch.setattr(LoopThread, name, self._counted(getattr(LoopThread, name)))

    def _counted(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(thread: LoopThread, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return call(thread, *args, **kwargs)

        return counted


@pytest.mark.in_process
def test_batches_waiting_come_over_in_one_call_and_hold_their_places(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = Calls(monkeypatch)
    tracker = Tracker()
    fetch = Gated(tracker)
    with Loader(
        range(40), fetch, batch_size=2, prefetch=PREFETCH, concurrency=2, collate=None,
    ) as loader:  # fmt: skip
        batches = iter(loader)
        got = [next(batches)]
        fetch.go.set()
        assert until(lambda: loader.stats().ready_batches >= PREFETCH)
        before = calls.count
        got.append(next(batches))  # every batch waiting comes over now
        assert calls.count == before + 1
        # the others wait in this thread, still counted: the pipeline runs one batch further only
        # (the bound: 2 batches handed over, PREFETCH held, `concurrency` samples beyond)
        full = 2 * (2 + PREFETCH) + 2
        assert tracker.wait_for(lambda t: t.started >= full)
        time.sleep(0.05)  # (given the time to run further, it does not)
        assert tracker.started == full
        for _ in range(PREFETCH - 1):
            got.append(next(batches))
        assert calls.count == before + 1  # handed over with no call on the loop
        got += list(batches)
        stats = loader.stats()
    assert got == [[k, k + 1] for k in range(0, 40, 2)]
    assert (stats.batches, stats.samples, stats.ready_batches, stats.held_samples) == (20, 40, 0, 0)


@pytest.mark.in_process
def test_async_for_takes_the_batches_waiting_in_one_call_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = Calls(monkeypatch)
    tracker = Tracker()

    fetch = Gated(tracker)

    async def main() -> tuple[list[Any], int, Any]:
        async with Loader(
            range(40), fetch, batch_size=2, prefetch=PREFETCH, concurrency=2, collate=None,
        ) as loader:  # fmt: skip
            batches = aiter(loader)
            got = [await anext(batches)]
            fetch.go.set()
            # (the loader runs on its own thread: its stats are read from there)
            assert await asyncio.to_thread(until, lambda: loader.stats().ready_batches >= PREFETCH)
            before = calls.count
            for _ in range(PREFETCH):
                got.append(await anext(batches))
            after = calls.count - before
            got += [batch async for batch in batches]
            return got, after, loader.stats()

    got, after, stats = asyncio.run(asyncio.wait_for(main(), WAIT_S))
    assert after == 1
    assert got == [[k, k + 1] for k in range(0, 40, 2)]
    assert (stats.batches, stats.ready_batches, stats.held_samples) == (20, 0, 0)


@pytest.mark.in_process
def test_an_error_behind_waiting_batches_comes_after_them() -> None:
    threads = threading.active_count()
    with Loader(
        range(40), Failing({13}), batch_size=2, prefetch=PREFETCH,
        concurrency=2, collate=None,
    ) as loader:  # fmt: skip
        batches = iter(loader)
        got = [next(batches)]
        assert until(lambda: loader.stats().ready_batches >= PREFETCH - 1)
        with pytest.raises(Boom, match="13"):
            got.extend(batches)
    assert got == [[k, k + 1] for k in range(0, 12, 2)]  # every batch before the one of key 13
    assert until(lambda: threading.active_count() <= threads)


def test_a_break_drops_batches_that_came_over_and_were_not_handed() -> None:
    threads = threading.active_count()
    with Loader(
        range(40), SyncFetch(Tracker()), batch_size=2, prefetch=PREFETCH, concurrency=2,
        collate=None,
    ) as loader:  # fmt: skip
        batches = iter(loader)
        next(batches)
        assert until(lambda: loader.stats().ready_batches >= PREFETCH)
        next(batches)  # the others came over with it
        batches.close()  # type: ignore[attr-defined]
        # the next epoch runs whole, its places all its own
        assert list(loader) == [[k, k + 1] for k in range(0, 40, 2)]
    assert until(lambda: threading.active_count() <= threads)
