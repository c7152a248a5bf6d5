"""Async iteration that closes what it reads, in the task that reads it.

An async generator left unfinished is closed by the garbage collector's hook on a task of its own;
a chain of them left together (keys read through a listing, read through a stream of shards) is
then closed by as many tasks at once, and each may find the generator it closes still running in
another. `closing(items)` gives an iterator of `items` and closes it on the way out instead, so
that closing the outermost generator closes the chain in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator
from typing import TypeVar

__all__ = ["closing", "flattened"]

T = TypeVar("T")


@contextlib.asynccontextmanager
async def closing(items: AsyncIterable[T]) -> AsyncIterator[AsyncIterator[T]]:
    """An iterator of `items`, closed (when it has `aclose`) when the block is left."""
    it = aiter(items)
    try:
        yield it
    finally:
        close = getattr(it, "aclose", None)
        if close is not None:
            await close()


async def flattened(chunks: AsyncIterable[list[T]]) -> AsyncGenerator[T, None]:
    """The items of a stream of chunks (lists of items), one at a time; closes the stream."""
    async with closing(chunks) as each:
        async for chunk in each:
            for item in chunk:
                yield item
