"""What one read or download of the cache holds: descriptors, a temporary file, its thread; and
what a download hands its reader (`Fill`).

Blocking file work runs in threads; a task cancelled while its thread runs must not close a
descriptor that thread still uses (the number may be reused at once). `Held.run` runs one call at
a time in a thread and `Held.release` closes and deletes what is held once that call has returned.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from collections.abc import Callable
from typing import Any, TypeVar

from .entries import Expect, Paths, create_temp, open_lock, open_valid

__all__ = ["FRESH_BYTES", "Fill", "Held"]

T = TypeVar("T")
FRESH_BYTES = 4 << 20  # chunks of a download kept in memory for a reader that is behind


class Held:
    """Descriptors a read or download holds (the lock, a file) and the temporary file it writes;
    `release` closes and deletes them, once no thread of theirs is running any more."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.temp: str | None = None
        self._busy: asyncio.Future[Any] | None = None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a thread. Cancelling the caller does not cut the thread short."""
        busy = self._busy = asyncio.get_running_loop().run_in_executor(None, fn, *args)
        # a caller cancelled while the thread runs leaves `busy` to nobody (the shield drops its
        # callback on it): a failure it ends with later is seen here, not logged at its collection
        busy.add_done_callback(_seen)
        return await asyncio.shield(busy)

    def release(self) -> None:
        busy = self._busy
        if busy is not None and not busy.done():
            busy.add_done_callback(self._release_after)
        else:
            self._release_now()

    def _release_after(self, fut: asyncio.Future[Any]) -> None:
        self._release_now()

    def _release_now(self) -> None:
        fds, self.fds = self.fds, []
        temp, self.temp = self.temp, None
        if temp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
        for fd in fds:
            os.close(fd)

    def open_lock(self, paths: Paths) -> int:
        fd = open_lock(paths)
        self.fds.append(fd)
        return fd

    def open_valid(self, paths: Paths, expect: Expect, xattr: bool) -> tuple[int, int] | None:
        opened = open_valid(paths, expect, xattr)
        if opened is not None:
            self.fds.append(opened[0])
        return opened

    def create_temp(self, paths: Paths) -> int:
        fd, self.temp = create_temp(paths)
        self.fds.append(fd)
        return fd


def _seen(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # marks it retrieved


class Fill:
    """What a download has got so far, for its reader: the chunks not yet read, in memory while
    they come to `FRESH_BYTES` at most (after one that does not fit, none: the reader goes on from
    the file), and how many bytes are in the file."""

    def __init__(self) -> None:
        self.fresh: collections.deque[bytes] = collections.deque()
        self.fresh_bytes = 0
        self.spilled = False
        self.written = 0
        self._changed = asyncio.Event()

    def offer(self, chunk: bytes) -> None:
        if not self.spilled and self.fresh_bytes + len(chunk) <= FRESH_BYTES:
            self.fresh.append(chunk)
            self.fresh_bytes += len(chunk)
            self._changed.set()
        else:
            self.spilled = True

    def take(self) -> bytes:
        chunk = self.fresh.popleft()
        self.fresh_bytes -= len(chunk)
        return chunk

    def wrote(self, n: int) -> None:
        self.written += n
        self._changed.set()

    def ended(self, _task: asyncio.Future[Any]) -> None:
        if not _task.cancelled():
            _task.exception()  # seen: a failure after its reader left is not logged as unretrieved
        self._changed.set()

    async def wait(self) -> None:
        """Until a chunk comes, bytes are written, or the download ends."""
        self._changed.clear()
        await self._changed.wait()
