"""Event loops and coroutine functions: the loop every aioloader thread runs, and which calls need one."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["is_async_callable", "new_event_loop", "run_to_end"]

T = TypeVar("T")


_uvloop: Any
try:  # loaded with the package: a first loader's first batch would wait for it (~7 ms)
    import uvloop as _uvloop
except ImportError:
    _uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default."""
    if _uvloop is None:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = _uvloop.new_event_loop()
    return loop


def is_async_callable(fn: object) -> bool:
    """True for coroutine functions and for objects whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )


def run_to_end(coro: Coroutine[Any, Any, T], name: str) -> T:
    """Run `coro` to its end from sync code, on a loop of its own: in this thread, or (when this
    thread already runs a loop) in a thread called `name`, which this call waits for."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    out: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(asyncio.run(coro))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return out[0]
