"""Lifecycle: close/aclose, context managers, and the ways an iteration can end early.

After each way out (break, an error in the consumer, KeyboardInterrupt, garbage collection; a real
SIGINT and interpreter exit are in pipeline/test_loop_thread.py) the epoch's fetches are cancelled and
its tasks end within the 2 s the loader promises; its threads live on until the loader is closed,
then stop within 2 s too (the autouse fixture in conftest.py checks that last part after every test).
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
from support.fakes import STOP_DEADLINE_S, WAIT_S, Boom, Gate, consume

from aioloader import Loader, LoaderClosedError

MODES = ["sync", "async", "caller"]


def plain(key: int) -> int:
    return key


def make(mode: str, keys: Any, fetch: Any, **kwargs: Any) -> Loader[Any]:
    return Loader(keys, fetch, use_caller_loop=mode == "caller", **kwargs)


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


@pytest.mark.in_process
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


def stop_iteration(how: str) -> None:
    if how == "error":
        raise Boom("consumer failed")
    if how == "KeyboardInterrupt":
        raise KeyboardInterrupt


EXPECTED = {"break": None, "error": Boom, "KeyboardInterrupt": KeyboardInterrupt}


@pytest.mark.parametrize("how", ["break", "error", "KeyboardInterrupt"])
@pytest.mark.in_process
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
@pytest.mark.in_process
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


# -- garbage collection ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_loader_held_by_its_iteration_alone_lives_until_the_epoch_ends(
    mode: str, threads_stopped: Callable[[], list[str]]
) -> None:
    def unnamed() -> Loader[Any]:  # held by nothing but the `for` below
        return make(mode, range(6), plain, batch_size=2, collate=None)

    async def batches() -> list[Any]:
        return [batch async for batch in unnamed()]

    got = [batch for batch in unnamed()] if mode == "sync" else asyncio.run(batches())
    assert got == [[0, 1], [2, 3], [4, 5]]
    gc.collect()
    assert threads_stopped() == []  # then dropped, and so closed


@pytest.mark.in_process
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


@pytest.mark.in_process
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
@pytest.mark.in_process
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
