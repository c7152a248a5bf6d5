"""The event-loop thread behind `for batch in loader`: what reaches a consumer blocked on it.

A real SIGINT interrupts a consumer waiting for a batch; a loader closed from elsewhere (or from the
loop body) ends the waiting consumer with LoaderClosedError; and at interpreter exit a loader left
open mid-iteration never keeps the process alive.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.fakes import POLL_INTERVAL_S, STOP_DEADLINE_S, WAIT_S, Gate, consume

from aioloader import Loader, LoaderClosedError


def plain(key: int) -> int:
    return key


# -- SIGINT -----------------------------------------------------------------------------------------


def main_thread_waits_for_aioloader() -> bool:
    """The main thread is blocked on a lock or condition, called from inside aioloader (the loop
    thread's `run` waits on its lock directly: that frame is the innermost)."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None:
        return False
    if frame.f_code.co_name == "run" and frame.f_code.co_filename.endswith("loop_thread.py"):
        return True
    if frame.f_code.co_name not in {"wait", "acquire"}:
        return False
    while frame is not None:
        if "aioloader" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in the main thread (Python's default) during the test."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def send_sigint_when(ready: Callable[[], bool]) -> threading.Thread:
    """Start a thread that polls `ready` (nothing signals a thread blocked in a lock), then sends
    SIGINT to the main thread."""

    def interrupt() -> None:
        deadline = time.monotonic() + WAIT_S
        while not ready() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)
        signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    thread = threading.Thread(target=interrupt, name="test-sigint")
    thread.start()
    return thread


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.in_process
def test_sigint_while_blocked_in_next_interrupts_and_stops_the_epoch(
    loop_tasks_left: Callable[..., set[Any]],
) -> None:
    assert threading.current_thread() is threading.main_thread()
    gate = Gate(count=2, free={0})
    with Loader(range(20), gate, concurrency=2) as loader:
        it = iter(loader)
        assert next(it) == 0
        sender = send_sigint_when(
            lambda: gate.started.is_set() and main_thread_waits_for_aioloader()
        )
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            next(it)  # blocks: every fetch in flight is stuck
        elapsed = time.monotonic() - start
        sender.join()
        assert gate.idle(STOP_DEADLINE_S)
        (loop,) = gate.tracker.loops
        assert loop_tasks_left(loop) == set()
        with pytest.raises(StopIteration):
            next(it)  # the interrupted iteration is over
    assert elapsed < WAIT_S


@pytest.mark.usefixtures("sigint_raises")
@pytest.mark.parametrize("use_caller_loop", [False, True])
def test_sigint_while_awaiting_a_batch_interrupts_asyncio_run(use_caller_loop: bool) -> None:
    gate = Gate(count=2, free={0})
    got: list[int] = []

    async def main(loader: Loader[int]) -> None:
        async for batch in loader:
            got.append(batch)

    with Loader(range(20), gate, concurrency=2, use_caller_loop=use_caller_loop) as loader:
        sender = send_sigint_when(lambda: gate.started.is_set() and got == [0])
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(main(loader))
        sender.join()
        assert gate.idle(STOP_DEADLINE_S)
    assert got == [0]


# -- closed from elsewhere while a consumer waits --------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.in_process
async def test_aclose_from_another_task_ends_a_waiting_caller_loop_consumer() -> None:
    gate = Gate(count=2, free={0})
    loader = Loader(range(20), gate, concurrency=2, use_caller_loop=True)
    got: list[int] = []

    async def consume() -> None:
        async for batch in loader:
            got.append(batch)

    consumer = asyncio.create_task(consume())
    assert await asyncio.to_thread(gate.started.wait, WAIT_S)
    await loader.aclose()
    with pytest.raises(LoaderClosedError):
        await asyncio.wait_for(consumer, STOP_DEADLINE_S)
    assert got == [0]
    assert gate.idle(0)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.in_process
def test_close_from_another_thread_ends_a_waiting_consumer(mode: str) -> None:
    gate = Gate(count=2, free={0})
    loader = Loader(range(20), gate, concurrency=2)
    closer = threading.Thread(target=lambda: (gate.started.wait(WAIT_S), loader.close()))
    closer.start()
    start = time.monotonic()
    # LoaderClosedError as a rule; the consumer's pending hand-over may instead be cancelled when
    # the close wins the race against it (see the report on _loader.py).
    closed = (LoaderClosedError, concurrent.futures.CancelledError, asyncio.CancelledError)
    with pytest.raises(closed):
        consume(loader, mode)
    closer.join()
    assert time.monotonic() - start < WAIT_S
    assert gate.idle(0)


async def async_plain(key: int) -> int:
    return key


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fetch", [plain, async_plain], ids=["plain", "async"])
def test_close_inside_the_for_body_ends_the_iteration(mode: str, fetch: Any) -> None:
    """Also where the batches after it had already come over to the consumer's thread (an async
    fetch makes all five at once): none is handed over after the close."""
    loader = Loader(range(5), fetch)
    got: list[int] = []

    def step(batch: int) -> None:
        got.append(batch)
        loader.close()

    with pytest.raises(LoaderClosedError):
        consume(loader, mode, step)
    assert got == [0]


# -- interpreter exit -----------------------------------------------------------------------------

# Exit with a live loader may add the 2 s that close promises to the interpreter's own teardown
# (about 1.5 s with torch loaded, 5 s and more on a machine whose cores are all busy). A stuck
# fetch that kept the process alive would take an hour.
EXIT_DEADLINE_S = 8.0

SCRIPTS = {
    "sync, async fetch stuck": """
        async def fetch(key):
            if key:
                await asyncio.sleep(3600)
            return key
        loader = aioloader.Loader(range(100), fetch, concurrency=4)
        it = iter(loader)
        print(next(it), flush=True)
    """,
    "sync, plain fetch and thread decode busy": """
        def fetch(key):
            time.sleep(0.2 if key else 0)
            return key
        loader = aioloader.Loader(range(100), fetch, concurrency=4, decode=str, executor="thread",
                                  batch_size=2)
        it = iter(loader)
        print(next(it), flush=True)
    """,
    "async, own loop, sys.exit in the body": """
        async def fetch(key):
            if key:
                await asyncio.sleep(3600)
            return key
        loader = aioloader.Loader(range(100), fetch, concurrency=4)
        async def main():
            async for batch in loader:
                print(batch, flush=True)
                sys.exit(0)
        asyncio.run(main())
    """,
    "async, caller loop, loop left mid-iteration": """
        async def fetch(key):
            if key:
                await asyncio.sleep(3600)
            return key
        loader = aioloader.Loader(range(100), fetch, concurrency=4, use_caller_loop=True)
        async def main():
            batches = aiter(loader)
            print(await anext(batches), flush=True)
            globals()["kept"] = batches
        asyncio.run(main())
    """,
}


@pytest.mark.parametrize("body", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_interpreter_exits_promptly_with_a_live_loader(body: str) -> None:
    script = "import asyncio, sys, time\nimport aioloader\n" + textwrap.dedent(body)
    proc = subprocess.Popen(
        [sys.executable, "-X", "dev", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed mid-iteration
        start = time.monotonic()
        rc = proc.wait(timeout=EXIT_DEADLINE_S + 10)
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        _out, err = proc.communicate()
    assert first.strip() in {"0", "['0', '1']"}, (first, err)
    assert rc == 0, err
    assert elapsed < EXIT_DEADLINE_S, f"exit took {elapsed:.1f} s"
    assert "Traceback" not in err, err
    assert "Warning" not in err, err


# -- a batch already waiting --------------------------------------------------------------------------


def test_a_result_ready_on_the_loop_is_handed_over_without_running_the_coroutine() -> None:
    from aioloader._pipeline.loop_thread import LoopThread

    ran: list[str] = []
    tasks: list[int] = []

    async def slow(name: str) -> str:
        ran.append(name)
        return name

    def counted(value: str | None) -> Callable[[], str | None]:
        def now() -> str | None:
            tasks.append(len(asyncio.all_tasks()))  # on the loop: no task of ours is running
            return value

        return now

    def fails() -> str | None:
        raise KeyError("the epoch's error")

    runner = LoopThread()
    try:
        coro = slow("never")
        assert runner.run(coro, now=counted("ready")) == "ready"
        assert coro.cr_frame is None  # closed, never started: no "never awaited" warning
        assert runner.run(slow("ran"), now=counted(None)) == "ran"  # nothing ready: it runs
        assert ran == ["ran"]
        assert tasks == [0, 0]
        coro = slow("not either")
        with pytest.raises(KeyError, match="the epoch's error"):
            runner.run(coro, now=fails)
        assert coro.cr_frame is None
        assert ran == ["ran"]
    finally:
        runner.stop()
