"""Tar members of a file on this machine (a local shard, or a cached copy of a remote one), read by
position in a thread: the event loop receives whole members, a batch at a time.

Off the loop go the reads, and the parsing of the headers. Each member of `DIRECT` bytes or more
is read by one `os.pread` into the bytes handed over (the kernel's copy, made without the GIL);
the headers and the small members between them come from one read of `REGION` bytes. So a
sample of a WebDataset shard (its headers, a large member and a few small ones) costs about two
reads, and no copy holds the GIL but a small member's. The next batch is read while the loop
hands the current one on.

The members, and the errors of a shard that is not a whole archive (`FetchError` naming the shard
and the byte offset), are those `tar_members` gives for the same bytes streamed.

A file read to its end leaves its members' names, offsets and sizes in `INDEXES` (by the file's
device, inode, size, modification and change times; the most recently used kept, up to `INDEXED_MEMBERS`
members in all): a later read of the same file (the next epoch of a cached or local shard) reads
each member at its offset and parses no header.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from ..._exceptions import FetchError
from .tar_members import BLOCK, Members, Names

__all__ = ["BATCH_BYTES", "DIRECT", "INDEXES", "REGION", "Indexes", "TarFile", "file_members"]

T = TypeVar("T")
REGION = 64 << 10  # bytes read at a header: the headers and small members that follow it
DIRECT = 32 << 10  # a member of at least this many bytes is read on its own, into its bytes
BATCH_BYTES = 2 << 20  # the members' bytes of one batch, about (one read in a thread each)
INDEXED_MEMBERS = 1 << 18  # members whose places `INDEXES` keeps at most (~25 MB at most)

# a file's identity: (device, inode, size, modification and change times in ns); a file rewritten in
# place that keeps all five (within the file system's time resolution) is not told apart
Identity = tuple[int, int, int, int, int]
# a file's regular members: their names, the offsets of their data, their sizes
Index = tuple[list[str], list[int], list[int]]


class Indexes:
    """The member indexes of files read to their end, by identity: the most recently used, up to
    `max_members` members in all. Thread-safe."""

    def __init__(self, max_members: int = INDEXED_MEMBERS) -> None:
        self.max_members = max_members
        self.members = 0
        self._by: collections.OrderedDict[Identity, Index] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, identity: Identity) -> Index | None:
        with self._lock:
            index = self._by.get(identity)
            if index is not None:
                self._by.move_to_end(identity)
            return index

    def put(self, identity: Identity, index: Index) -> None:
        n = len(index[0])
        if n > self.max_members:
            return
        with self._lock:
            old = self._by.pop(identity, None)
            self.members -= 0 if old is None else len(old[0])
            while self._by and self.members + n > self.max_members:
                self.members -= len(self._by.popitem(last=False)[1][0])
            self._by[identity] = index
            self.members += n


INDEXES = Indexes()

# runs a blocking call in a thread and returns its result (cancelling the caller leaves that
# thread to finish with the descriptor still open: `Held.run`)
Run = Callable[..., Awaitable[Any]]


class TarFile:
    """The members of the tar archive in file descriptor `fd` of `size` bytes, in batches.

    Blocking (each `read` makes a few `os.pread` calls): run it in a thread, one call at a time.
    The descriptor stays its caller's to close.
    """

    def __init__(
        self, fd: int, size: int, shard: str, region: int = REGION, direct: int = DIRECT,
        indexes: Indexes | None = INDEXES,
    ) -> None:  # fmt: skip
        self.fd, self.size = fd, size
        self.region, self.direct = region, direct
        self.pos = 0  # the next header's offset
        self.done = False
        self._names = Names(shard)
        self._region = b""  # the file's bytes from `_at`
        self._at = 0
        self._error: FetchError | None = None  # raised by the next `read`
        self._indexes = indexes
        self._identity: Identity | None = None  # found at the first `read`
        self._known: Index | None = None  # the file's index, from an earlier read
        self._made: Index | None = None  # the index this read makes
        self._member = 0  # the next member of `_known`

    def read(self, limit: int = BATCH_BYTES) -> Members:
        """The next members, until their data holds `limit` bytes or the archive ends (then
        `done`). Where the file is not a whole archive, the members before that point come first,
        then the next call raises FetchError."""
        if self._error is not None:
            raise self._error
        if self._identity is None and self._indexes is not None:
            st = os.fstat(self.fd)
            self._identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            self._known = self._indexes.get(self._identity)
            self._made = None if self._known is not None else ([], [], [])
        if self._known is not None:
            return self._read_known(self._known, limit)
        out: Members = Members()
        got = 0
        try:
            while got < limit and not self.done:
                member = self._next()
                if member is not None:
                    out.append(member)
                    got += len(member[1]) + BLOCK
        except FetchError as exc:
            if not out:
                raise
            self._error = exc
            self._made = None
        if self.done and self._made is not None and self._indexes is not None:
            assert self._identity is not None
            self._indexes.put(self._identity, self._made)
            self._made = None
        return out

    def _read_known(self, index: Index, limit: int) -> Members:
        """`read` by the file's index: each member at its offset, no header parsed."""
        names, starts, sizes = index
        out: Members = Members()
        got, i = 0, self._member
        while got < limit and i < len(names):
            at, size = starts[i], sizes[i]
            data = self._bytes(at, size)
            if len(data) < size:  # the file was cut while it was read
                self._error = self._names.broken(
                    f"stream ended inside a member of {size} bytes (truncated shard)", at - BLOCK
                )
                if not out:
                    raise self._error
                break
            out.append((names[i], data))
            got += size + BLOCK
            i += 1
        self._member = i
        self.done = i == len(names)
        return out

    def _next(self) -> tuple[str, bytes] | None:
        """The member whose header is at `pos` if it is a regular file, else None (and `done` at
        the end of the archive)."""
        at, names = self.pos, self._names
        header = self._bytes(at, BLOCK)
        if len(header) < BLOCK:
            raise names.broken(
                f"stream ended without the end-of-archive blocks ({len(header)} left)", at
            )
        head = names.header(header, at)
        if head is None:
            self.done = True
            return None
        kind, size = head
        end = at + BLOCK + -(-size // BLOCK) * BLOCK
        if end > self.size:
            raise names.broken(
                f"stream ended inside a member of {size} bytes (truncated shard)", at
            )
        data = self._bytes(at + BLOCK, size)
        if len(data) < size:  # the file was cut while it was read
            raise names.broken(
                f"stream ended inside a member of {size} bytes (truncated shard)", at
            )
        self.pos = end
        name = names.member(kind, header, data, at)
        if name is None:
            return None
        if self._made is not None:
            self._made[0].append(name)
            self._made[1].append(at + BLOCK)
            self._made[2].append(size)
        return name, data

    def _bytes(self, at: int, n: int) -> bytes:
        """The file's `n` bytes from `at` (fewer where it ends): from the region read last, by a
        read of their own (`direct` or more), or from a new region read at `at`."""
        start = at - self._at
        if start >= 0 and start + n <= len(self._region):
            return self._region[start : start + n]
        if n >= self.direct:
            return os.pread(self.fd, n, at)
        self._region, self._at = os.pread(self.fd, max(self.region, n), at), at
        return self._region[:n]


async def file_members(
    run: Run, fd: int, size: int, shard: str, limit: int = BATCH_BYTES
) -> AsyncGenerator[Members, None]:
    """The members of the tar file `fd` (`size` bytes), a batch at a time, read by `run` in a
    thread one batch ahead of the one handed over."""
    tar = TarFile(fd, size, shard)
    ahead: asyncio.Future[Members] = asyncio.ensure_future(run(tar.read, limit))
    try:
        while True:
            batch = await ahead
            if tar.done:
                if batch:
                    yield batch
                return
            ahead = asyncio.ensure_future(run(tar.read, limit))
            yield batch
    finally:
        if not ahead.done():
            ahead.cancel()
        await asyncio.gather(ahead, return_exceptions=True)
