"""Event loops and coroutine functions: the loop every aioloader thread runs, and which calls need one."""

from __future__ import annotations

import asyncio
import inspect

__all__ = ["is_async_callable", "new_event_loop"]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def is_async_callable(fn: object) -> bool:
    """True for coroutine functions and for objects whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004
    )
