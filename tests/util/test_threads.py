"""The thread pool behind fetch and thread decode: it grows only while calls wait for a thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aioloader import Loader
from aioloader._util.threads import TICKS_PER_S, LazyThreadPool


def test_quick_calls_keep_one_thread_even_when_the_gil_stretches_some() -> None:
    pool = LazyThreadPool(16, "t-quick")
    stop = threading.Event()

    def hog() -> None:  # holds the GIL in turns with the pool's thread, as a busy loop thread does
        while not stop.is_set():
            sum(range(20_000))

    async def main() -> None:
        for start in range(0, 640, 16):  # bursts, as a pipeline launches fetches
            got = await asyncio.gather(*(pool.run(abs, -i) for i in range(start, start + 16)))
            assert got == list(range(start, start + 16))

    hogs = [threading.Thread(target=hog) for _ in range(2)]
    for t in hogs:
        t.start()
    try:
        asyncio.run(main())
        assert pool.threads == 1
    finally:
        stop.set()
        for t in hogs:
            t.join()
        pool.close()


def test_calls_that_sleep_a_few_milliseconds_get_more_threads() -> None:
    pool = LazyThreadPool(16, "t-sleep")

    async def main() -> None:
        for _ in range(10):
            await asyncio.gather(*(pool.run(time.sleep, 0.003) for _ in range(16)))

    try:
        asyncio.run(main())
        assert pool.threads >= 8
    finally:
        pool.close()


@pytest.mark.parametrize("grow_after", [0.0, 0.005])
def test_calls_that_block_start_threads_up_to_size(grow_after: float) -> None:
    size = 8
    pool = LazyThreadPool(size, "t-block", grow_after=grow_after)
    together = threading.Barrier(size, timeout=10)  # passes only if `size` calls run at once
    names: set[str] = set()

    def meet(i: int) -> int:
        together.wait()
        names.add(threading.current_thread().name)
        return i

    async def main() -> list[int]:
        return await asyncio.gather(*(pool.run(meet, i) for i in range(size)))

    try:
        assert asyncio.run(main()) == list(range(size))
        assert pool.threads == size
        assert names == {f"t-block_{i}" for i in range(size)}
    finally:
        pool.close()


def test_a_call_cancelled_while_it_waits_never_runs() -> None:
    pool = LazyThreadPool(1, "t-cancel")
    release = threading.Event()
    ran: list[str] = []

    def hold() -> None:
        release.wait(10)
        ran.append("hold")

    async def main() -> None:
        first = asyncio.create_task(pool.run(hold))
        second = asyncio.create_task(pool.run(ran.append, "second"))
        await asyncio.sleep(0.05)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        release.set()
        await first

    try:
        asyncio.run(main())
        assert ran == ["hold"]
    finally:
        pool.close()


def test_errors_keep_their_type_and_close_joins_then_a_later_call_starts_afresh() -> None:
    pool = LazyThreadPool(2, "t-close")

    def fail() -> None:
        raise KeyError("sample-7")

    async def main() -> None:
        with pytest.raises(KeyError, match="sample-7"):
            await pool.run(fail)

    asyncio.run(main())
    threads = [t for t in threading.enumerate() if t.name.startswith("t-close")]
    assert threads
    pool.close()
    assert not any(t.is_alive() for t in threads)
    assert pool.threads == 0
    assert asyncio.run(pool.run(abs, -3)) == 3  # reusable after close
    pool.close()


def test_close_cancels_calls_still_queued() -> None:
    pool = LazyThreadPool(1, "t-queued", grow_after=60.0)
    release = threading.Event()

    async def main() -> None:
        blocker = asyncio.create_task(pool.run(release.wait, 10))
        queued = asyncio.create_task(pool.run(abs, -1))
        await asyncio.sleep(0.05)
        closer = threading.Thread(target=pool.close)
        closer.start()
        with pytest.raises(asyncio.CancelledError):
            await queued
        release.set()
        assert await blocker is True
        await asyncio.to_thread(closer.join)

    asyncio.run(main())
    assert pool.threads == 0


def test_an_initializer_that_raises_fails_the_calls_naming_the_pool() -> None:
    def broken() -> None:
        raise OSError("no credentials")

    pool = LazyThreadPool(2, "t-init", initializer=broken)
    try:
        with pytest.raises(RuntimeError, match="t-init") as info:
            asyncio.run(pool.run(abs, -1))
        assert isinstance(info.value.__cause__, OSError)
    finally:
        pool.close()


def test_a_loader_reading_quick_files_keeps_few_fetch_threads() -> None:
    # Sixteen fetch threads would each keep a malloc arena; quick reads need one or two.
    def read(key: int) -> bytes:
        return bytes(1000)

    with Loader(range(2000), read, batch_size=50, concurrency=16) as loader:
        for _ in loader:
            time.sleep(0.0005)
        fetch_threads = [t for t in threading.enumerate() if t.name.startswith("aioloader-fetch")]
    assert 1 <= len(fetch_threads) < 16


@pytest.mark.parametrize("idle", [True, False])
def test_spare_cores_grows_only_while_the_machine_has_cores_idle(
    monkeypatch: pytest.MonkeyPatch, idle: bool
) -> None:
    """Sleeping calls grow a `spare_cores` pool while cores sit idle, not while every core is busy.
    The idle counter is the test's, not the machine's (which other work on it moves): it counts one
    whole core idle, or is held still, as if other processes used every core."""
    from aioloader._util import threads as _threads

    if idle:
        monkeypatch.setattr(_threads, "idle_ticks", lambda: int(time.monotonic() * TICKS_PER_S))
    else:
        monkeypatch.setattr(_threads, "idle_ticks", lambda: 0)
    pool = LazyThreadPool(8, "t-spare", spare_cores=True)

    async def main() -> None:
        for _ in range(4):
            await asyncio.gather(*(pool.run(time.sleep, 0.005) for _ in range(32)))

    try:
        asyncio.run(main())
        if idle:
            assert pool.threads >= 4
        else:
            assert pool.threads == 1
    finally:
        pool.close()
