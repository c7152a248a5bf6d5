"""Leak checks shared by every test: no "aioloader*" thread may outlive the test that made it.

The autouse fixture joins whatever aioloader threads are left when a test ends, for at most
`STOP_DEADLINE_S` (what `close()` promises), and fails the test if any is still alive then. Under
`AIOLOADER_BESIDE=1` the tests marked `in_process` are skipped (`pytest_runtest_setup`).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from support.fakes import POLL_INTERVAL_S, STOP_DEADLINE_S
from support.remote_fixtures import *  # noqa: F403 - the remote-source fixtures (origin, proxy, seaweed)

from aioloader._pipeline.beside import BESIDE_ENV


def loader_threads(ignore: set[int | None] | None = None) -> list[threading.Thread]:
    """The live threads whose names start with "aioloader" (less those whose ident is in `ignore`)."""
    ignore = ignore or set()
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith("aioloader") and t.is_alive() and t.ident not in ignore
    ]


def join_loader_threads(
    deadline_s: float = STOP_DEADLINE_S, ignore: set[int | None] | None = None
) -> list[str]:
    """Join every aioloader thread within `deadline_s` in all; return the names still alive."""
    end = time.monotonic() + deadline_s
    for thread in loader_threads(ignore):
        thread.join(max(0.0, end - time.monotonic()))
    return sorted(t.name for t in loader_threads(ignore))


def poll_until(condition: Callable[[], bool], deadline_s: float = STOP_DEADLINE_S) -> bool:
    """Re-check `condition` every `POLL_INTERVAL_S` until it holds (True) or `deadline_s` passes."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            return condition()
        time.sleep(POLL_INTERVAL_S)
    return True


async def pending_tasks(
    before: set[asyncio.Task[Any]], deadline_s: float
) -> set[asyncio.Task[Any]]:
    """On a loop: wait up to `deadline_s` for its tasks not in `before` to end; return those left."""
    others = asyncio.all_tasks() - before - {asyncio.current_task()}  # type: ignore[operator]
    if others:
        await asyncio.wait(others, timeout=deadline_s)
    return {task for task in others if not task.done()}


def tasks_left_on(loop: asyncio.AbstractEventLoop, deadline_s: float) -> set[asyncio.Task[Any]]:
    """From another thread: wait up to `deadline_s` for every task on `loop` to end; those left.

    A loop that has stopped has no tasks left.
    """
    if loop.is_closed() or not loop.is_running():
        return set()
    future = asyncio.run_coroutine_threadsafe(pending_tasks(set(), deadline_s), loop)
    return future.result(deadline_s + STOP_DEADLINE_S)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under `AIOLOADER_BESIDE=1` (`make test-beside`: every Loader runs beside the test, in a
    process of its own), skip the tests that look inside a Loader from the test's process."""
    if os.environ.get(BESIDE_ENV) == "1" and item.get_closest_marker("in_process"):
        pytest.skip("looks inside the loader from the test's process; it runs beside it")


@pytest.fixture(autouse=True)
def no_thread_leaks() -> Iterator[None]:
    """Fail a test that leaves an aioloader thread running past the stop deadline."""
    before = {t.ident for t in loader_threads()}  # leaked by an earlier test, which failed for it
    yield
    left = join_loader_threads(ignore=before)
    assert not left, f"aioloader threads still alive {STOP_DEADLINE_S} s after the test: {left}"


@pytest.fixture
def threads_stopped() -> Callable[[], list[str]]:
    """`threads_stopped()` joins the aioloader threads (2 s at most) and returns those still alive."""
    return join_loader_threads


@pytest.fixture
def wait_until() -> Callable[..., bool]:
    """`wait_until(condition, deadline_s=2.0)`: poll a condition nothing signals; True if it held."""
    return poll_until


@pytest.fixture
def thread_names() -> Callable[[], list[str]]:
    """`thread_names()`: the names of the live aioloader threads, sorted."""
    return lambda: sorted(t.name for t in loader_threads())


@pytest.fixture
def loop_tasks_left() -> Callable[..., set[asyncio.Task[Any]]]:
    """`loop_tasks_left(loop, deadline_s=2.0)`: from another thread, the tasks on `loop` still
    running after waiting up to `deadline_s` for them to end."""
    return lambda loop, deadline_s=STOP_DEADLINE_S: tasks_left_on(loop, deadline_s)


@pytest.fixture
def caller_tasks_left() -> Callable[..., Awaitable[set[asyncio.Task[Any]]]]:
    """`await caller_tasks_left(before, deadline_s=2.0)`: on the running loop, the tasks not in
    `before` still running after waiting up to `deadline_s` for them to end."""
    return lambda before, deadline_s=STOP_DEADLINE_S: pending_tasks(before, deadline_s)
