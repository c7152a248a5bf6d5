"""Streams for the tar-shard source: shard bytes from anywhere, round-robin merging, a shuffle buffer.

`open_shard` yields a shard's bytes in chunks from a local file, an http(s), s3://, gs:// or az:// URL.
A remote stream that breaks part-way is resumed with a Range request from the byte it stopped at (up to
the source's `attempts`), so a reset costs a reconnect, not a re-read of the whole shard.

`interleave` merges the shards of an epoch round-robin, `parallel` at a time, and reads the next ones
ahead (`ahead` shards, within `max_bytes_ahead`) so that their first bytes are on their way while the
current ones are read; `shuffled` mixes the merged stream through a buffer that starts small and grows.

The streams carry their samples in chunks (lists: the samples parsed from the bytes at hand), so
that each layer of the pipeline costs a step per chunk, not per sample; the order of the samples does
not depend on how they are chunked.

`ReadMeter` counts what the readers of `interleave` do as a pipeline stage: each chunk read is timed
from when its reader asked for it to when it had it (its samples counted as items), so the time a
reader waits for room ahead of the merge (the consumer is slower) is not reading time; samples read
ahead count, untimed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import random
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from ..._exceptions import FetchError
from ..._observe.stats import StageCounters, nbytes
from ..cache.disk import Cache, ReadFile
from ..cache.handles import Held
from ..stores.files import Opening
from ..transport.client import Transport, keep_version
from ..transport.redact import redact_url
from ..transport.remote import Remote

__all__ = [
    "INITIAL_FILL",
    "SCHEMES",
    "ReadMeter",
    "cached_name",
    "initial_fill",
    "interleave",
    "open_shard",
    "shuffled",
]

log = logging.getLogger("aioloader")

T = TypeVar("T")
CHUNK = 1 << 20
# Samples each shard reader may run ahead of the merge (a chunk more while it holds fewer).
_READ_AHEAD = 32
# Samples a reader read ahead of its turn holds at most, beyond its first chunk (its request is out,
# its first bytes in: the wait it is there to hide is over; reading further would only take the
# cores and the wire from the readers the merge takes from).
_AHEAD_OF_TURN = 4
# Samples the merge hands on at once at most (fewer where it would wait on a stream first).
_MERGED = 64
# The samples a shuffle buffer holds before its first one goes out, by default (at most the buffer).
INITIAL_FILL = 100


# a scheme's kind ("http", "s3", "gcs", "az") -> its source's options
StoreOptions = Callable[[str], dict[str, Any]]


# (the source that reads a shard, the shard's URL there, what names it in a cache)
Reach = tuple["Remote", str, str]


def _http(shard: str, remotes: dict[str, Any], options: StoreOptions) -> Reach:
    if "http" not in remotes:
        from ..stores.http import Http

        remotes["http"] = Http([], **options("http"))
    return remotes["http"], shard, shard


def _bucketed(kind: str) -> Callable[[str, dict[str, Any], StoreOptions], Reach]:
    """How a scheme of bucket stores ("s3", "gs", "az") finds its shards: one source per bucket
    (or container), made on first use with `options(kind)`; the shard's URL and cache name are
    that source's (the store, bucket and key: not the endpoint)."""

    def find(shard: str, remotes: dict[str, Any], options: StoreOptions) -> Reach:
        scheme, _, rest = shard.partition("://")
        bucket, _, key = rest.partition("/")
        name = f"{scheme}:{bucket}"
        if name not in remotes:
            remotes[name] = _store(kind)(f"{scheme}://{bucket}/", **options(kind))
        src = remotes[name]
        return src, src.url(key), src.cache_name(key)

    return find


def _store(kind: str) -> Callable[..., Remote]:
    """The source class of a bucket store (imported on first use: each brings its signer)."""
    if kind == "s3":
        from ..stores.s3 import S3

        return S3
    if kind == "gcs":
        from ..stores.gcs import GCS

        return GCS
    from ..stores.azure import Azure

    return Azure


# URL scheme -> (the remote source that reads such shards, made once and kept in `remotes`; the
# shard's URL there; its cache name). A shard of another scheme, or a bare path, is a local file.
SCHEMES: dict[str, Callable[[str, dict[str, Any], StoreOptions], Reach]] = {
    "http": _http,
    "https": _http,
    "s3": _bucketed("s3"),
    "gs": _bucketed("gcs"),
    "az": _bucketed("az"),
}


def cached_name(shard: str, remotes: dict[str, Any], options: StoreOptions) -> str | None:
    """What names a remote shard in a cache (its store, bucket and key; an http(s) shard: its
    URL); None for a local one."""
    scheme, sep, _ = shard.partition("://")
    reach = SCHEMES.get(scheme) if sep else None
    return None if reach is None else reach(shard, remotes, options)[2]


async def open_shard(
    shard: str, remotes: dict[str, Any], options: StoreOptions, cache: Cache | None = None,
    read_file: ReadFile | None = None,
) -> AsyncGenerator[Any, None]:  # fmt: skip
    """The bytes of `shard`, chunk by chunk. `remotes` caches one source per scheme (and bucket);
    a remote shard is read from `cache` when it holds it, else kept there as it streams. With
    `read_file`, a file on this machine (a local shard, a cached copy) is read by it instead
    (`read_file(run, fd, size)`, `run` a thread for its blocking calls), and what it yields is
    yielded."""
    scheme, sep, _ = shard.partition("://")
    reach = SCHEMES.get(scheme) if sep else None
    if reach is not None:
        src, url, name = reach(shard, remotes, options)
        stream: AsyncGenerator[Any, None]
        if cache is None:
            stream = _remote(src.transport, url, shard)
        else:
            stream = cache.stream(
                name, redact_url(url), lambda version: _remote(src.transport, url, shard, version),
                read_file,
            )  # fmt: skip
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                yield chunk
    elif read_file is not None:
        async with contextlib.aclosing(_local_file(shard, read_file)) as items:
            async for item in items:
                yield item
    else:
        path = Path(shard.removeprefix("file://"))
        opening = Opening()  # a read given up on (the epoch ended) leaves no open file behind
        try:
            try:
                f = await asyncio.to_thread(opening.open, path)
            except asyncio.CancelledError:
                opening.cancel()
                raise
            try:
                while chunk := await asyncio.to_thread(f.read, CHUNK):
                    yield chunk
            finally:
                f.close()
        except OSError as exc:
            raise FetchError(
                f"tar shard {shard}: {exc.strerror or exc}", key=redact_url(shard)
            ) from exc


async def _local_file(shard: str, read_file: ReadFile) -> AsyncGenerator[Any, None]:
    """What `read_file` makes of the local file `shard` (its descriptor is closed once no thread
    uses it any more, however the read ends)."""
    held = Held()
    try:
        fd, size = await held.run(_open_held, held, Path(shard.removeprefix("file://")))
        async with contextlib.aclosing(read_file(held.run, fd, size)) as items:
            async for item in items:
                yield item
    except OSError as exc:
        raise FetchError(
            f"tar shard {shard}: {exc.strerror or exc}", key=redact_url(shard)
        ) from exc
    finally:
        held.release()


def _open_held(held: Held, path: Path) -> tuple[int, int]:
    """(descriptor, size) of the file at `path`, opened for `held` to close (blocks)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    held.fds.append(fd)
    return fd, os.fstat(fd).st_size


async def _remote(
    transport: Transport, url: str, shard: str, version: dict[str, str] | None = None
) -> AsyncGenerator[bytes, None]:
    """The body of `url`, resumed where it broke; `version` receives the first response's."""
    pos, breaks = 0, 0
    while True:
        resp = await transport.open(url, key=redact_url(shard), offset=pos)
        if pos == 0:
            keep_version(resp.headers, version)
        try:
            while True:  # a chunk as it came (readany joins those waiting: a copy of each byte)
                chunk, end_of_chunk = await resp.content.readchunk()
                if not chunk:
                    if end_of_chunk:  # an HTTP chunk's end: the body goes on
                        continue
                    return
                pos += len(chunk)
                yield chunk
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ClientConnectionError,
            OSError,
            TimeoutError,
        ) as e:
            breaks += 1
            if breaks >= transport.retry.attempts:
                message = (
                    f"tar shard {redact_url(url)}: stream broke {breaks} times, last at byte {pos}"
                )
                raise FetchError(f"{message} ({type(e).__name__})", key=redact_url(shard)) from None
            log.debug("tar shard %s: stream broke at byte %d; resuming", redact_url(url), pos)
        finally:
            resp.close()


class ReadMeter:
    """Samples read by the shard readers, their bytes and the time spent reading them, as a stage
    whose limit is the number of readers (`parallel`)."""

    def __init__(self, readers: int) -> None:
        self.stage = StageCounters(time.perf_counter())
        self.stage.cap = readers

    def start(self) -> float:
        now = time.perf_counter()
        self.stage.enter(now)
        return now

    def stop(self, t0: float, size: int | None = None, items: int = 1) -> None:
        """The read begun at `t0` ended: with `items` of `size` bytes read, or (None) without one."""
        now = time.perf_counter()
        s = self.stage
        s.leave(now, t0)
        if size is not None:
            s.items += items
            s.bytes += size
            s.latencies.append(now - t0)

    def count(self, size: int, items: int = 1) -> None:
        """`items` of `size` bytes were read, untimed (by a reader read ahead)."""
        self.stage.items += items
        self.stage.bytes += size

    def stats(self) -> dict[str, float | None]:
        """The counters as `TarShards.stats()` gives them (`shard_*`; seconds, bytes, samples)."""
        s, now = self.stage, time.perf_counter()
        lat = s.latencies.sorted()  # stats() runs on any thread
        at = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]) if lat else (lambda q: None)
        return {
            "shard_readers": s.cap, "shard_reading": s.busy, "shard_samples": s.items,
            "shard_bytes": s.bytes, "shard_read_s": s.area,
            "shard_all_reading_s": s.full + (now - s.full_since if s.full_since >= 0 else 0.0),
            "shard_read_p50_s": at(0.50), "shard_read_p95_s": at(0.95), "shard_read_p99_s": at(0.99),
        }  # fmt: skip


class _End:
    pass


_END = _End()


class _Room:
    """The bytes the shard readers hold ahead of the merge (in their queues), and the readers read
    ahead that wait for room: a reader read ahead holds at least its first chunk, and more (up to
    `_AHEAD_OF_TURN` items) only while all of them together hold less than `limit` (None: no byte
    bound). The readers the merge takes from (`parallel` of them) never wait here; their bytes
    count all the same."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0
        self._waiters: list[asyncio.Future[None]] = []

    async def admit(self, reader: _Reader, size: int) -> None:
        """Wait until `reader` may queue `size` bytes more, then count them."""
        while reader.ahead and self._full(reader.queued, size):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
        self.held += size

    def _full(self, queued: int, size: int) -> bool:
        """Whether a reader read ahead that holds `queued` items must wait to queue `size` bytes."""
        if queued == 0:
            return False
        return queued >= _AHEAD_OF_TURN or (
            self.limit is not None and self.held + size > self.limit
        )

    def free(self, size: int) -> None:
        """`size` bytes left a queue (or a reader stopped waiting ahead): let the waiters look."""
        self.held -= size
        self.wake()

    def wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


class _Reader:
    """Runs one stream of chunks (lists of items) ahead into a queue, on its own task: a chunk
    more while it holds fewer than `_READ_AHEAD` items, and, while it is `ahead` (the merge does
    not take from it yet), what `room` allows. Each chunk is sized once (`nbytes`), as it is read,
    and queued with its size. The merge takes its items through `chunk` and `at` (the next one)."""

    def __init__(
        self,
        stream: AsyncGenerator[list[Any], None],
        meter: ReadMeter | None = None,
        room: _Room | None = None,
        ahead: bool = False,
    ) -> None:
        self.queue: asyncio.Queue[tuple[Any, int]] = asyncio.Queue()
        self.queued = 0  # items in `queue`
        self._taken = asyncio.Event()  # set when the merge takes a chunk
        self.meter = meter
        self.room = room or _Room(None)
        self.ahead = ahead
        self.chunk: list[Any] = []
        self.at = 0
        self.task = asyncio.get_running_loop().create_task(self._run(stream))

    async def _run(self, stream: AsyncGenerator[list[Any], None]) -> None:
        try:
            while (read := await self._read(stream))[0] is not _END:
                chunk, size = read
                if not chunk:
                    continue
                while self.queued >= _READ_AHEAD:
                    self._taken.clear()
                    await self._taken.wait()
                await self.room.admit(self, size)
                self.queued += len(chunk)
                self.queue.put_nowait(read)
        except Exception as exc:
            self.queue.put_nowait((exc, 0))
            return
        finally:
            await stream.aclose()
        self.queue.put_nowait((_END, 0))

    async def _read(self, stream: AsyncGenerator[list[Any], None]) -> tuple[Any, int]:
        """The stream's next chunk and its bytes (`_END` after its last), timed by the meter; read
        ahead, it is counted but not timed (the merge's `parallel` readers set the stage's pace)."""
        meter = self.meter
        if meter is None or self.ahead:
            chunk: list[Any] | _End = await anext(stream, _END)
            if isinstance(chunk, _End):
                return chunk, 0
            size = nbytes(chunk)
            if meter is not None:
                meter.count(size, len(chunk))
            return chunk, size
        t0 = meter.start()
        read: int | None = None
        items = 0
        try:
            chunk = await anext(stream, _END)
            if not isinstance(chunk, _End):
                read, items = nbytes(chunk), len(chunk)
            return chunk, read or 0
        finally:
            meter.stop(t0, read, items)

    def take_turns(self) -> None:
        """The merge takes from this reader now: it reads on without waiting for room."""
        self.ahead = False
        self.room.wake()

    async def get(self) -> Any:
        """The next chunk (`_END` after the last)."""
        chunk, size = await self.queue.get()
        if isinstance(chunk, Exception):
            raise chunk
        if chunk is not _END:
            self.queued -= len(chunk)
            self._taken.set()
            self.room.free(size)
        return chunk

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        while not self.queue.empty():  # what it held is dropped: its bytes are no longer held
            self.room.free(self.queue.get_nowait()[1])


async def interleave(
    streams: list[AsyncGenerator[list[T], None]],
    parallel: int,
    meter: ReadMeter | None = None,
    *,
    ahead: int = 0,
    max_bytes_ahead: int | None = None,
) -> AsyncGenerator[list[T], None]:
    """The items of `streams` (each a stream of chunks: lists of items), `parallel` taken from at
    once, round-robin one item at a time (a fixed order, whatever the timing and however the
    streams cut their items into chunks), handed on in chunks: the items merged until the merge
    next takes a chunk from a stream (which may wait, or raise). `meter` counts the reads.

    Besides those, the next `ahead` streams (in the order they will be taken from) are read
    already, so that their first bytes are on their way while the current ones are read; together
    the readers read ahead hold at most `max_bytes_ahead` bytes beyond their first chunks (None: no
    byte bound). A stream read ahead that fails raises at the point its items would have come."""
    pending = iter(streams)
    room = _Room(max_bytes_ahead)
    readers = [_Reader(s, meter, room) for s in itertools.islice(pending, parallel)]
    upcoming = collections.deque(
        _Reader(s, meter, room, ahead=True) for s in itertools.islice(pending, ahead)
    )
    out: list[T] = []
    try:
        turn = 0
        while readers:
            turn %= len(readers)
            reader = readers[turn]
            if reader.at == len(reader.chunk):
                if out:  # hand on what is merged before a wait, or an error at its place
                    yield out
                    out = []
                chunk = await reader.get()
                if chunk is _END:  # its place goes to the next stream, read ahead or not yet begun
                    nxt = next(pending, None)
                    if nxt is not None:
                        upcoming.append(_Reader(nxt, meter, room, ahead=True))
                    if upcoming:
                        readers[turn] = upcoming.popleft()
                        readers[turn].take_turns()
                    else:
                        readers.pop(turn)
                    continue
                reader.chunk, reader.at = chunk, 0
            out.append(reader.chunk[reader.at])
            reader.at += 1
            turn += 1
            if len(out) == _MERGED:
                yield out
                out = []
        if out:
            yield out
    finally:
        for reader in (*readers, *upcoming):
            await reader.aclose()
        for stream in pending:
            await stream.aclose()


def initial_fill(size: int) -> int:
    """The samples a shuffle buffer of `size` holds before its first one goes out, by default."""
    return min(size, INITIAL_FILL)


async def shuffled(
    stream: AsyncGenerator[list[T], None], size: int, rng: random.Random, initial: int | None = None
) -> AsyncGenerator[list[T], None]:
    """`stream` (chunks: lists of items) mixed through a buffer of up to `size` items: each item
    out is a random one held; out in chunks, one for each chunk in (once the buffer has filled).

    The first goes out once `initial` items are held (None: `initial_fill(size)`); from there the
    buffer grows by one item for each item out (two read per one out) until it holds `size`, so
    a first batch waits for a small fill, not the whole buffer. Which item goes out when depends
    only on the stream's order and `rng`, never on timing or on how the stream is chunked."""
    cap = initial_fill(size) if initial is None else max(1, min(size, initial))
    held: list[T] = []
    try:
        async for chunk in stream:
            out: list[T] = []
            for item in chunk:
                held.append(item)
                if len(held) < cap:
                    continue
                i = rng.randrange(len(held))
                held[i], held[-1] = held[-1], held[i]
                out.append(held.pop())
                if cap < size:
                    cap += 1
            if out:
                yield out
        rng.shuffle(held)
        if held:
            yield held
    finally:
        await stream.aclose()
