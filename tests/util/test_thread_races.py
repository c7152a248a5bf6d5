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

from aioloader import Loader
from aioloader._util.threads import LazyThreadPool

SWITCH_S = 1e-6  # switch threads this often (the default is 5 ms)
HANG_S = 10.0  # a call that has not ended after this long never will: the test fails at once
CALLS = 8000  # calls made while another thread closes their pool again and again


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
    # grow_after small: the growth check runs on the loop many times while threads end calls
    pool = LazyThreadPool(size, f"t-race{size}", grow_after=0.0002)
    errors: list[dict[str, Any]] = []
    grown = 0

    async def main() -> None:
        nonlocal grown
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(context))
        for round_ in range(40):
            # quick calls end many times per growth check (and keep the crew from growing), then
            # calls that block make it grow
            quick = range(round_ * 256, round_ * 256 + 256)
            got = await asyncio.wait_for(
                asyncio.gather(*(pool.run(abs, -i) for i in quick)), HANG_S
            )
            assert got == list(quick)
            keys = range(round_ * 64, round_ * 64 + 64)
            got = await asyncio.wait_for(
                asyncio.gather(*(pool.run(_blocks_now_and_then, i) for i in keys)), HANG_S
            )
            assert got == list(keys)
            grown = max(grown, pool.threads)
            if round_ % 8 == 7:
                pool.close()  # a new crew starts with one thread and grows again

    try:
        asyncio.run(main())
    finally:
        pool.close()
    assert errors == []
    assert grown == size  # the growth check ran, and decided, while calls ended


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
