"""Races between the threads of the thread paths, made likely: the interpreter switches threads every
microsecond (`sys.setswitchinterval`), so that even the GIL build interleaves finely, and on a
free-threaded build (`make test-ft`) the threads also run at once.

What these caught: the growth check of a thread crew (`_Crew._grow`, on the event loop) sorted the
crew's recent call times while a thread appended to them (free-threaded builds: "deque mutated during
iteration", which the loop logs and the crew stops growing); `stats()` from another thread sorted a
stage's latencies as the loop appended (the same error, raised to the caller); and a call that came
while its pool closed was queued on the closed crew and waited forever (both builds).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from torch.utils.data import Dataset

from aioloader import DataLoader, Loader
from aioloader._util.threads import LazyThreadPool, gil_enabled

SWITCH_S = 1e-6  # switch threads this often (the default is 5 ms)
HANG_S = 10.0  # a call that has not ended after this long never will: the test fails at once
GROW_CHECK_S = 2e-5  # how often a crew with calls queued checks whether to grow (5 ms by default)
# crews grown from one thread to `size`, each after a burst of quick calls; the growth check's race is
# one that only a free-threaded build can lose (with the GIL, copying a deque is one step)
ROUNDS = 6 if gil_enabled() else 24
# calls made while another thread closes their pool again and again: the GIL build meets the window
# less often (a thread runs only when the other one is switched out)
CALLS = 6000 if gil_enabled() else 3000


@pytest.fixture
def fine_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _loop_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What event loops logged as raised in their callbacks (a `_grow` that died, for one)."""
    return [r.getMessage() for r in caplog.records if r.name == "asyncio" and r.levelno >= 40]


def _blocks_now_and_then(i: int) -> int:
    if i % 4:  # blocked, most of the time: the median call is slow enough for the crew to grow
        time.sleep(0.0012)
    return i


@pytest.mark.parametrize("size", [2, 8])
def test_a_crew_that_grows_keeps_its_books_while_its_threads_end_calls(
    size: int, fine_switching: None
) -> None:
    # grow_after tiny: the growth check runs on the loop again and again while threads end calls
    pool = LazyThreadPool(size, f"t-race{size}", grow_after=GROW_CHECK_S)
    errors: list[dict[str, Any]] = []
    grown = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        for round_ in range(ROUNDS):
            # a burst of quick calls: each check finds them queued (it looks again) and short (the
            # crew keeps one thread), while that thread ends one after another
            quick = range(round_ * 2048, round_ * 2048 + 2048)
            got = await asyncio.wait_for(
                asyncio.gather(*(pool.run(abs, -i) for i in quick)), HANG_S
            )
            assert got == list(quick)
            # then calls that block: the crew grows, its new threads ending calls too
            keys = range(round_ * 64, round_ * 64 + 64)
            got = await asyncio.wait_for(
                asyncio.gather(*(pool.run(_blocks_now_and_then, i) for i in keys)), HANG_S
            )
            assert got == list(keys)
            grown.append(pool.threads)
            pool.close()  # the next round's crew starts with one thread

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert errors == []
    assert max(grown) == size  # the growth check ran, and decided, while calls ended


def _fetch(i: int) -> int:
    return _blocks_now_and_then(i)


def _decode(i: int) -> np.ndarray[Any, Any]:
    x = np.arange(64, dtype=np.int64)  # small numpy steps, as a decode that holds the GIL takes
    return np.full(4, int((x * 0 + i).max()), dtype=np.int64)


@pytest.mark.parametrize("workers", [2, 8])
def test_the_thread_paths_over_many_short_epochs_with_stats_read_meanwhile(
    workers: int, fine_switching: None, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncio")
    keys, epochs = 48, 12
    reader_errors: list[BaseException] = []
    reads = 0
    stop = threading.Event()

    def read_stats(loader: Loader[Any]) -> None:  # a monitor thread, as a training script runs
        nonlocal reads
        try:
            while not stop.is_set():
                loader.stats()
                reads += 1
        except BaseException as exc:
            reader_errors.append(exc)

    loader = Loader(
        range(keys), _fetch, decode=_decode, executor="thread", workers=workers,
        concurrency=8, batch_size=6, stats=True,
    )  # fmt: skip
    reader = threading.Thread(target=read_stats, args=(loader,), name="t-stats-reader")
    with loader:
        reader.start()
        try:
            for _ in range(epochs):
                got = [int(row[0]) for batch in loader for row in batch]
                assert got == list(range(keys))
        finally:
            stop.set()
            reader.join()
        st = loader.stats()
    assert reader_errors == []
    assert reads > 0
    assert _loop_errors(caplog) == []
    for stage in ("fetch", "decode", "collate"):  # every call counted once, none left in flight
        assert st.stages[stage].busy == 0, stage
        assert st.stages[stage].errors == 0, stage
    assert st.stages["fetch"].items == st.stages["decode"].items == keys * epochs
    assert st.samples == keys * epochs
    assert (st.held_samples, st.held_bytes, st.ready_batches) == (0, 0, 0)


class _Decoded(Dataset[Any]):
    """A map-style dataset whose `__getitem__` computes (`_decode`), as a torch user writes it."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> np.ndarray[Any, Any]:
        return _decode(i)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # torch's, for 8 > cores
@pytest.mark.parametrize("workers", [2, 8])
def test_the_front_door_in_threads_over_many_short_epochs(
    workers: int, fine_switching: None, caplog: pytest.LogCaptureFixture
) -> None:
    """`DataLoader(num_workers=N)` in threads (a free-threaded build's "auto"): N fetch threads
    from the start (the pool's floor), each epoch's samples once and in order."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    epochs = 12
    with DataLoader(_Decoded(), batch_size=6, num_workers=workers, worker_mode="thread") as loader:
        for _ in range(epochs):
            got = [int(row[0]) for batch in loader for row in batch]
            assert got == list(range(48))
    assert _loop_errors(caplog) == []


def test_a_call_that_comes_as_its_pool_closes_runs_or_is_cancelled_and_never_hangs(
    fine_switching: None,
) -> None:
    pool = LazyThreadPool(2, "t-close-race")
    stop = threading.Event()

    def close_again_and_again() -> None:
        while not stop.is_set():
            pool.close()

    async def main() -> tuple[int, int]:
        ran = cancelled = 0
        for i in range(CALLS):
            call = asyncio.ensure_future(pool.run(abs, -i))
            done, _ = await asyncio.wait({call}, timeout=HANG_S)
            assert done, f"call {i} came as the pool closed and never ended"
            if call.cancelled():  # queued when close() came: close cancels such calls
                cancelled += 1
            else:
                assert call.result() == i
                ran += 1
        return ran, cancelled

    closer = threading.Thread(target=close_again_and_again, name="t-closer")
    closer.start()
    try:
        ran, cancelled = asyncio.run(main())
    finally:
        stop.set()
        closer.join()
        pool.close()
    assert ran + cancelled == CALLS
    assert ran > 0
