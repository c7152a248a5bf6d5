"""A local disk cache for remote objects and tar shards: written once, checked, LRU-evicted, shared.

`Cache(directory, limit)` keeps each object it is given whole in `directory` (see `entries.py` for
the files and `index.py` for the index). Reading an object that is cached costs no request: its
size and sidecar are checked (and its ETag against the source's listing, when it has one) and the
file is read in a thread into a recycled buffer. A miss takes the object's lock (an open file
description lock), so that of several processes sharing the directory (the ranks of a torchrun
job) one downloads while the others wait for it and then read its file. A waiter looks for the
file at every try, and a download lets go of the lock when it ends, not when its reader is done:
two processes reading shards round-robin may each wait for the other's next shard while holding
their own. The download is written to a temporary name and renamed into place, then the least
recently used objects are evicted while the total is over `limit`.

Files are not fsync'd: a file cut short by a crash fails the size check and is fetched again.
Cancelling a read at any point leaves no temporary file behind once its thread has finished (and
one left by a process that died is deleted when the next process opens the cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from ..._util.bytearrays import Bytearrays
from ..._util.validate import check_int
from .entries import (
    Expect,
    Paths,
    has_xattrs,
    label,
    leftovers,
    metadata,
    publish,
    read_range,
    remove_if_free,
    try_lock,
    write_all,
)
from .handles import Fill, Held
from .index import Index

__all__ = ["Cache", "Expect", "check_cache_args"]

T = TypeVar("T")
# Waits between tries of a lock another process (or task) holds: the first, and the longest.
_LOCK_POLL_S = 0.002
_LOCK_POLL_MAX_S = 0.05
# Uses (and, without a limit, additions) kept in memory before they are written to the index, or
# seconds between two writes.
_RECORD_EVERY = 512
_RECORD_S = 2.0
_BUFFER_BYTES = 64 << 20  # recycled read buffers kept
_WAIT, _LOCKED = object(), object()  # what one try for an object's lock found
CHUNK = 1 << 20  # bytes per read of a cached shard, and per write of a downloading one

Download = Callable[[dict[str, str]], Awaitable[bytearray]]  # fills the version, returns the body
Opener = Callable[
    [dict[str, str]], AsyncGenerator[bytes, None]
]  # fills the version, streams the body
# reads a cached file itself: (a thread to run its blocking calls in, the descriptor, the size)
ReadFile = Callable[[Callable[..., Awaitable[Any]], int, int], AsyncGenerator[Any, None]]


def check_cache_args(cache_dir: Any, cache_limit: Any) -> None:
    """TypeError / ValueError naming `cache_dir` or `cache_limit` when they are not usable."""
    if cache_limit is not None:
        check_int("cache_limit", cache_limit, minimum=0)
        if cache_dir is None:
            raise ValueError("cache_limit is given without cache_dir: give both, or neither")
    if cache_dir is None:
        return
    if not isinstance(cache_dir, str | os.PathLike):
        raise TypeError(f"cache_dir must be a path (str or os.PathLike), got {cache_dir!r}")
    path = Path(cache_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"cache_dir {str(path)!r} is not a directory")
    if not hasattr(fcntl, "F_OFD_SETLK"):
        raise ValueError("cache_dir: the cache locks its objects with Linux's F_OFD_SETLK")


class Cache:
    """Objects kept whole in `directory`, at most `limit` bytes of them (None: no limit).

    Coroutines, safe to cancel. See the module's docstring for what is checked and shared.
    """

    def __init__(self, directory: str | os.PathLike[str], limit: int | None = None) -> None:
        check_cache_args(directory, limit)
        self.root = Path(directory).expanduser()
        self.limit = limit
        self.counts = dict.fromkeys(("cache_hits", "cache_misses", "cache_waits",
                                     "cache_evictions", "cache_bytes_read"), 0)  # fmt: skip
        self._setup()

    def _setup(self) -> None:
        self._index = Index(self.root)
        self._bodies = Bytearrays(_BUFFER_BYTES)
        self._used: dict[str, float] = {}  # id -> last use, not yet in the index
        self._added: dict[str, int] = {}  # id -> size, kept but not yet in the index
        self._pending = threading.Lock()
        self._recorded = time.monotonic()
        self._opened = False
        self._opening = threading.Lock()
        self._xattr = False

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (for a process worker) as its directory and limit; the copy counts from zero."""
        return {"root": self.root, "limit": self.limit, "counts": dict.fromkeys(self.counts, 0)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r}, limit={self.limit})"

    def _open(self) -> None:
        """Make the directory; delete what dead downloads left; make the index agree with it."""
        with self._opening:
            if self._opened:
                return
            data = self.root / "data"
            try:
                data.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"cache_dir {str(self.root)!r}: {exc.strerror}") from None
            self._xattr = has_xattrs(data)
            found = list(leftovers(self.root))
            self._index.reconcile(found, lambda i: os.path.exists(Paths.of_id(self.root, i).data))
            self._opened = True

    async def _ready(self, name: str) -> Paths:
        if not self._opened:
            await asyncio.to_thread(self._open)
        return Paths.of(self.root, name)

    async def fetch(self, name: str, label: str, expect: Expect, download: Download) -> bytearray:
        """The object `name` from the cache, else from `download` (then kept). `label` (no
        secrets) is kept in its metadata."""
        paths = await self._ready(name)
        held = Held()
        try:
            found = await self._claim(held, paths, lambda: self._read(paths, expect))
            if found is not None:
                await self._hit(paths, len(found))
                return found
            version: dict[str, str] = {}
            data = await download(version)
            self.counts["cache_misses"] += 1
            if self.limit is None or len(data) <= self.limit:
                meta = metadata(label, len(data), version, expect)
                self.counts["cache_evictions"] += await held.run(
                    self._write, held, paths, data, meta
                )
                await self._record_later()
            return data
        finally:
            held.release()

    def _read(self, paths: Paths, expect: Expect) -> bytearray | None:
        return read_range(paths, expect, self._xattr, self._bodies.take)

    async def fetch_range(
        self, name: str, expect: Expect, offset: int, length: int | None
    ) -> bytearray | None:
        """Bytes of the cached object `name` (see `read_range`); None when it is not cached."""
        paths = await self._ready(name)
        take = self._bodies.take
        data = await asyncio.to_thread(read_range, paths, expect, self._xattr, take, offset, length)
        if data is not None:
            await self._hit(paths, len(data))
        return data

    async def stream(
        self, name: str, label: str, opener: Opener, read_file: ReadFile | None = None
    ) -> AsyncGenerator[Any, None]:
        """The object `name` chunk by chunk: from its cached file, else from `opener` while it is
        written to the cache. Close the generator (`aclose`) to stop early: a download given up
        leaves no file. With `read_file`, a cached file is read by it instead, and what it
        yields is yielded: `read_file(run, fd, size)`, `run` a thread for its blocking calls."""
        paths = await self._ready(name)
        held, reader = Held(), Held()
        try:
            try:
                opened = await self._claim(
                    held, paths, lambda: held.open_valid(paths, Expect(), self._xattr)
                )
                if opened is None:
                    download = self._download(held, reader, paths, label, opener)
                    async with contextlib.aclosing(download):
                        async for chunk in download:
                            yield chunk
                    return
                held.fds.remove(opened[0])  # the reader's now: the lock is let go at once
                reader.fds.append(opened[0])
            finally:
                held.release()
            pieces = (
                self._chunks(reader, paths, *opened)
                if read_file is None
                else self._read_file(read_file, reader, paths, *opened)
            )
            async with contextlib.aclosing(pieces):
                async for piece in pieces:
                    yield piece
        finally:
            reader.release()

    async def _chunks(
        self, reader: Held, paths: Paths, fd: int, size: int
    ) -> AsyncGenerator[bytearray | memoryview, None]:
        """The file in recycled chunks of `CHUNK` bytes (the last one a view of its first bytes:
        a buffer of its own length would be made for it alone)."""
        pos = 0
        while pos < size:
            view = await self._piece(reader, paths, fd, pos, size)
            pos += len(view)
            yield view
        await self._hit(paths, size)

    async def _piece(
        self, reader: Held, paths: Paths, fd: int, pos: int, end: int
    ) -> bytearray | memoryview:
        """The file's bytes from `pos`, up to `CHUNK` of them and not past `end`, in a recycled
        buffer (a view of its first bytes when fewer)."""
        buf = self._bodies.take(CHUNK)
        want = min(CHUNK, end - pos)
        view = memoryview(buf)[:want] if want < CHUNK else buf
        n = await reader.run(os.preadv, fd, [view], pos)
        if n < want:
            raise OSError(f"cached file {paths.data} was cut short at byte {pos + n}")
        return view

    async def _read_file(
        self, read_file: ReadFile, reader: Held, paths: Paths, fd: int, size: int
    ) -> AsyncGenerator[Any, None]:
        async with contextlib.aclosing(read_file(reader.run, fd, size)) as items:
            async for item in items:
                yield item
        await self._hit(paths, size)

    async def _download(
        self, held: Held, reader: Held, paths: Paths, label: str, opener: Opener
    ) -> AsyncGenerator[bytes | bytearray | memoryview, None]:
        """The object from `opener`, while a task of its own writes it to the cache at the wire's
        pace, whether or not this generator is read. The lock's holder then never waits for its
        reader: two processes reading shards round-robin through one cache could otherwise each
        hold a shard's lock while their readers wait for the other's. Chunks come from memory
        while the reader keeps up (`FRESH_BYTES` waiting at most), then from the file as written.
        Closed early, the download is given up (no file is kept)."""
        fd = await held.run(held.create_temp, paths)
        reader.fds.append(os.dup(fd))  # the reader's own: the task closes `fd` as it seals it
        fill = Fill()
        task = asyncio.get_running_loop().create_task(
            self._fill(held, fd, paths, label, opener, fill)
        )
        task.add_done_callback(fill.ended)
        try:
            pos = 0
            chunk: bytes | bytearray | memoryview
            while True:
                if fill.fresh:
                    chunk = fill.take()
                elif pos < fill.written:
                    chunk = await self._piece(reader, paths, reader.fds[0], pos, fill.written)
                elif task.done():
                    task.result()  # its error, if it failed
                    return
                else:
                    await fill.wait()
                    continue
                pos += len(chunk)
                yield chunk
        finally:
            task.cancel()  # nothing once it is done; `held` is let go once its thread returns

    async def _fill(
        self, held: Held, fd: int, paths: Paths, label: str, opener: Opener, fill: Fill
    ) -> None:
        """Write the object from `opener` to the temporary file `fd`, handing each chunk to `fill`
        as it comes; then, if it came whole and fits, put the file in place. The lock goes when
        this ends, however it ends, not when the reader is done: another process waiting for it
        then goes on (to the file, or to a download of its own where none was kept) even while
        its reader waits for that process."""
        try:
            version: dict[str, str] = {}
            pending: list[bytes] = []
            waiting = 0
            async with contextlib.aclosing(opener(version)) as chunks:
                async for chunk in chunks:
                    fill.offer(chunk)
                    pending.append(chunk)
                    waiting += len(chunk)
                    if waiting >= CHUNK:
                        fill.wrote(await held.run(write_all, fd, pending))
                        pending, waiting = [], 0
            fill.wrote(await held.run(write_all, fd, pending))
            self.counts["cache_misses"] += 1
            whole = version.get("content-length")
            fits = self.limit is None or fill.written <= self.limit
            if fits and (whole is None or int(whole) == fill.written):
                meta = metadata(label, fill.written, version, Expect())
                self.counts["cache_evictions"] += await held.run(self._seal, held, fd, paths, meta)
                await self._record_later()
        finally:
            held.release()  # (the reader reads on from its own descriptor of the file)

    async def _claim(self, held: Held, paths: Paths, read: Callable[[], T | None]) -> T | None:
        """What `read` finds cached; else None, with the object's lock in `held` (taken once no
        one else holds it: polled, since another process may)."""
        delay = _LOCK_POLL_S
        while (step := await held.run(self._step, held, paths, read)) is _WAIT:
            if delay == _LOCK_POLL_S:
                self.counts["cache_waits"] += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, _LOCK_POLL_MAX_S)
        return None if step is _LOCKED else step  # type: ignore[return-value]

    @staticmethod
    def _step(held: Held, paths: Paths, read: Callable[[], T | None]) -> T | object:
        """One try, in a thread: what `read` finds cached, else `_LOCKED` with the lock taken,
        else `_WAIT` (another holds it)."""
        # the file first, at every try: it is in place before its download lets go of the lock,
        # and that download's process may be waiting for this one (two processes reading shards
        # round-robin): once the file is there, nothing here waits for the lock
        found = read()
        if found is not None:
            return found
        if not held.fds:
            held.open_lock(paths)
        if not try_lock(held.fds[0], paths):
            return _WAIT
        found = read()  # another process may have downloaded it between the two tries
        return _LOCKED if found is None else found

    def _write(self, held: Held, paths: Paths, data: bytearray, meta: dict[str, Any]) -> int:
        fd = held.create_temp(paths)
        write_all(fd, [data])
        return self._seal(held, fd, paths, meta)

    def _seal(self, held: Held, fd: int, paths: Paths, meta: dict[str, Any]) -> int:
        """Label the complete temporary file `fd`, close it and put it in place; then, with a
        limit, in the index at once, evicting (how many: the result) while over the limit (without
        one, the index learns of it in the next batch). In a thread."""
        assert held.temp is not None
        label(fd, meta, self._xattr)
        held.fds.remove(fd)
        os.close(fd)
        publish(paths, held.temp, meta, self._xattr)
        held.temp = None
        with self._pending:
            self._added[paths.id] = meta["size"]
        return self._record() if self.limit is not None else 0

    def _evict(self, id: str) -> bool:
        return remove_if_free(Paths.of_id(self.root, id))

    async def _hit(self, paths: Paths, nbytes: int) -> None:
        """Count a read of `nbytes` from the cached object, and record its use."""
        self.counts["cache_hits"] += 1
        self.counts["cache_bytes_read"] += nbytes
        with self._pending:
            self._used[paths.id] = time.time()
        await self._record_later()

    async def _record_later(self) -> None:
        """Write what the index has not learnt yet, once enough of it waits or has waited long."""
        waiting = len(self._used) + len(self._added)
        if waiting >= _RECORD_EVERY or time.monotonic() - self._recorded > _RECORD_S:
            self.counts["cache_evictions"] += await asyncio.to_thread(self._record)

    def _record(self) -> int:
        """Write the uses and additions not yet in the index; the number evicted. In a thread."""
        with self._pending:
            used, added, self._used, self._added = self._used, self._added, {}, {}
            self._recorded = time.monotonic()
        return self._index.record(added, used, self.limit, self._evict)

    async def forget(self, name: str) -> None:
        """Delete the cached copy of `name` (found unusable by its reader) unless a download of it
        is under way; the next read fetches it again."""
        paths = await self._ready(name)
        await asyncio.to_thread(self._forget, paths)

    def _forget(self, paths: Paths) -> None:
        if not remove_if_free(paths):
            return
        with self._pending:
            self._added.pop(paths.id, None)
            self._used.pop(paths.id, None)
        self._index.drop(paths.id)

    async def aclose(self) -> None:
        """Write what the index has not learnt yet and close it. Idempotent."""
        self.counts["cache_evictions"] += await asyncio.to_thread(self._record)
        await asyncio.to_thread(self._index.close)
