"""Lifecycle: close/aclose, context managers, and every way an iteration can end early.

After each way out (break, an error in the consumer, KeyboardInterrupt, a real SIGINT, garbage
collection, interpreter exit) the epoch's fetches are cancelled and its tasks end within the 2 s the
loader promises; its threads live on until the loader is closed, then stop within 2 s too (the
autouse fixture in conftest.py checks that last part after every test).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import POLL_INTERVAL_S, STOP_DEADLINE_S
from fakes import WAIT_S, Boom, Gate

from aioloader import Loader, LoaderClosedError

MODES = ["sync", "async", "caller"]


def plain(key: int) -> int:
    return key


def make(mode: str, keys: Any, fetch: Any, **kwargs: Any) -> Loader[Any]:
    return Loader(keys, fetch, use_caller_loop=mode == "caller", **kwargs)


def consume(loader: Loader[Any], mode: str, step: Callable[[Any], None] = lambda _: None) -> None:
    """Iterate one epoch with the face `mode`, calling `step(batch)` on each batch."""
    if mode == "sync":
        for batch in loader:
            step(batch)
        return

    async def main() -> None:
        async for batch in loader:
            step(batch)

    asyncio.run(main())


def fail(_batch: Any) -> None:
    raise Boom("consumer failed")


def aioloader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("aioloader")]


# -- close, aclose and the context managers ---------------------------------------------------------


def test_close_is_idempotent_and_stops_the_threads(
    threads_stopped: Callable[[], list[str]],
) -> None:
    loader = Loader(range(6), plain, batch_size=2, decode=str, executor="thread")
    assert list(loader) == [["0", "1"], ["2", "3"], ["4", "5"]]
    assert aioloader_threads()
    assert not loader.closed
    loader.close()
    assert loader.closed
    assert threads_stopped() == []
    loader.close()
    assert loader.closed


def test_closing_an_unused_loader(threads_stopped: Callable[[], list[str]]) -> None:
    loader = Loader(range(3), plain)
    loader.close()
    loader.close()
    assert threads_stopped() == []


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
async def test_aclose_is_idempotent_and_mixes_with_close(use_caller_loop: bool) -> None:
    loader = Loader(range(4), plain, use_caller_loop=use_caller_loop)
    assert [b async for b in loader] == [0, 1, 2, 3]
    await loader.aclose()
    assert loader.closed
    assert [t for t in aioloader_threads() if t.name != "aioloader-close"] == []
    await loader.aclose()
    loader.close()
    assert loader.closed


def test_with_block_closes(threads_stopped: Callable[[], list[str]]) -> None:
    with Loader(range(3), plain) as loader:
        assert list(loader) == [0, 1, 2]
    assert loader.closed
    assert threads_stopped() == []


def test_with_block_closes_on_an_error(threads_stopped: Callable[[], list[str]]) -> None:
    with pytest.raises(Boom), Loader(range(3), plain) as loader:
        consume(loader, "sync", fail)
    assert loader.closed
    assert threads_stopped() == []


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
async def test_async_with_block_closes(use_caller_loop: bool) -> None:
    async with Loader(range(3), plain, use_caller_loop=use_caller_loop) as loader:
        assert [b async for b in loader] == [0, 1, 2]
    assert loader.closed


@pytest.mark.parametrize("mode", MODES)
def test_iterating_a_closed_loader_raises(mode: str) -> None:
    loader = make(mode, range(3), plain)
    loader.close()
    with pytest.raises(LoaderClosedError, match="closed"):
        consume(loader, mode)
    assert issubclass(LoaderClosedError, RuntimeError)


def test_threads_live_across_epochs_until_closed(threads_stopped: Callable[[], list[str]]) -> None:
    with Loader(
        range(8), plain, decode=str, executor="thread", workers=2, batch_size=2, collate=list,
        concurrency=2,
    ) as loader:  # fmt: skip
        assert list(loader) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
        first = aioloader_threads()
        assert list(loader) == [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]
        second = aioloader_threads()
    # the first epoch's threads live on into the next (a pool may start more, up to its size)
    assert {t.ident for t in first} <= {t.ident for t in second}
    assert len(second) <= 1 + 2 + 2 + 1  # loop, fetch pool, decode pool, collate thread
    kinds = {t.name.split("_")[0] for t in first}
    assert kinds == {"aioloader-loop", "aioloader-fetch", "aioloader-decode", "aioloader-collate"}
    assert threads_stopped() == []


# -- ending an iteration early --------------------------------------------------------------------


class Interrupt(BaseException):
    """Stands for KeyboardInterrupt where raising the real one would leave asyncio.run noisy."""


def stop_iteration(how: str) -> None:
    if how == "error":
        raise Boom("consumer failed")
    if how == "KeyboardInterrupt":
        raise KeyboardInterrupt


EXPECTED = {"break": None, "error": Boom, "KeyboardInterrupt": KeyboardInterrupt}


@pytest.mark.parametrize("how", ["break", "error", "KeyboardInterrupt"])
def test_sync_iteration_ended_early_cancels_its_fetches(
    how: str, loop_tasks_left: Callable[..., set[Any]], thread_names: Callable[[], list[str]]
) -> None:
    gate = Gate(count=3, free={0})
    with Loader(range(50), gate, concurrency=3) as loader:
        caught: BaseException | None = None
        try:
            for batch in loader:
                assert batch == 0
                assert gate.started.wait(WAIT_S)
                if how == "break":
                    break
                stop_iteration(how)
        except (Boom, KeyboardInterrupt) as exc:
            caught = exc
        assert type(caught) is EXPECTED[how] if caught else EXPECTED[how] is None
        assert gate.idle(STOP_DEADLINE_S), "in-flight fetches were not cancelled"
        assert gate.cancelled == 3
        (loop,) = gate.tracker.loops
        assert loop_tasks_left(loop) == set()
        assert "aioloader-loop" in thread_names()  # resources stay for the next epoch
        started = gate.tracker.started
    assert gate.tracker.started == started  # nothing started after the epoch was stopped


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
@pytest.mark.parametrize("how", ["break", "error", "KeyboardInterrupt"])
async def test_async_iteration_ended_early_cancels_its_fetches(
    how: str,
    use_caller_loop: bool,
    loop_tasks_left: Callable[..., set[Any]],
    caller_tasks_left: Callable[..., Any],
) -> None:
    gate = Gate(count=3, free={0})
    before = asyncio.all_tasks()
    async with Loader(range(50), gate, concurrency=3, use_caller_loop=use_caller_loop) as loader:
        caught: BaseException | None = None
        try:
            async for batch in loader:
                assert batch == 0
                assert await asyncio.to_thread(gate.started.wait, WAIT_S)
                if how == "break":
                    break
                stop_iteration(how)
        except (Boom, KeyboardInterrupt) as exc:
            caught = exc
        assert type(caught) is EXPECTED[how] if caught else EXPECTED[how] is None
        assert await asyncio.to_thread(gate.idle, STOP_DEADLINE_S), "fetches not cancelled"
        assert gate.cancelled == 3
        assert await caller_tasks_left(before) == set()
        (loop,) = gate.tracker.loops
        if use_caller_loop:
            assert loop is asyncio.get_running_loop()
        else:
            assert await asyncio.to_thread(loop_tasks_left, loop) == set()


def main_thread_waits_for_aioloader() -> bool:
    """The main thread is blocked on a lock or condition, called from inside aioloader."""
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    if frame is None or frame.f_code.co_name not in {"wait", "acquire"}:
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


# -- garbage collection ---------------------------------------------------------------------------


def test_dropping_a_half_consumed_iterator_stops_its_epoch(
    loop_tasks_left: Callable[..., set[Any]], thread_names: Callable[[], list[str]]
) -> None:
    gate = Gate(count=2, free={0})
    with Loader(range(20), gate, concurrency=2) as loader:
        it = iter(loader)
        assert next(it) == 0
        assert gate.started.wait(WAIT_S)
        del it
        gc.collect()
        assert gate.idle(STOP_DEADLINE_S)
        (loop,) = gate.tracker.loops
        assert loop_tasks_left(loop) == set()
        assert "aioloader-loop" in thread_names()


def test_dropping_an_unclosed_loader_mid_iteration_stops_everything(
    threads_stopped: Callable[[], list[str]],
) -> None:
    gate = Gate(count=2, free={0})
    loader = Loader(range(20), gate, concurrency=2, decode=str, executor="thread")
    it = iter(loader)
    assert next(it) == "0"
    assert gate.started.wait(WAIT_S)
    assert aioloader_threads()
    del loader, it
    gc.collect()
    assert threads_stopped() == []
    assert gate.idle(0)


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
async def test_dropping_a_half_consumed_async_iterator_stops_its_epoch(
    use_caller_loop: bool, caller_tasks_left: Callable[..., Any]
) -> None:
    gate = Gate(count=2, free={0})
    before = asyncio.all_tasks()
    async with Loader(range(20), gate, concurrency=2, use_caller_loop=use_caller_loop) as loader:
        batches = aiter(loader)
        assert await anext(batches) == 0
        assert await asyncio.to_thread(gate.started.wait, WAIT_S)
        del batches
        gc.collect()  # asyncio finalizes the async generator in a task of its own
        assert await asyncio.to_thread(gate.idle, STOP_DEADLINE_S)
        assert await caller_tasks_left(before) == set()


# -- closed from elsewhere while a consumer waits --------------------------------------------------


@pytest.mark.asyncio
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


def test_close_inside_the_for_body_ends_the_iteration() -> None:
    loader = Loader(range(5), plain)
    got: list[int] = []

    def step(batch: int) -> None:
        got.append(batch)
        loader.close()

    with pytest.raises(LoaderClosedError):
        consume(loader, "sync", step)
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
