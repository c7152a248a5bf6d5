"""Streams for the tar-shard source: shard bytes from anywhere, round-robin merging, a shuffle buffer.

`open_shard` yields a shard's bytes in chunks from a local file, an http(s), s3://, gs:// or az:// URL.
A remote stream that breaks part-way is resumed with a Range request from the byte it stopped at (up to
the source's `attempts`), so a reset costs a reconnect, not a re-read of the whole shard.

`ReadMeter` counts what the readers of `interleave` do as a pipeline stage: each sample read is an
item, timed from when its reader asked for it to when it had it, so the time a reader waits for room
ahead of the merge (the consumer is slower) is not reading time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp

from ..._exceptions import FetchError
from ..._observe.stats import StageCounters, nbytes
from ..cache.disk import Cache
from ..stores.files import Opening
from ..transport.client import Transport, keep_version
from ..transport.redact import redact_url
from ..transport.remote import Remote

__all__ = ["SCHEMES", "ReadMeter", "cached_name", "interleave", "open_shard", "shuffled"]

log = logging.getLogger("aioloader")

T = TypeVar("T")
CHUNK = 1 << 20
# Samples each shard reader may run ahead of the merge.
_READ_AHEAD = 32


# a scheme's kind ("http", "s3", "gcs", "az") -> its source's options
StoreOptions = Callable[[str], dict[str, Any]]


def _http(shard: str, remotes: dict[str, Any], options: StoreOptions) -> tuple[Remote, str]:
    if "http" not in remotes:
        from ..stores.http import Http

        remotes["http"] = Http([], **options("http"))
    return remotes["http"], shard


def _bucketed(kind: str) -> Callable[[str, dict[str, Any], StoreOptions], tuple[Remote, str]]:
    """How a scheme of bucket stores ("s3", "gs", "az") finds its shards: one source per bucket
    (or container), made on first use with `options(kind)`; the shard's URL is that source's."""

    def find(shard: str, remotes: dict[str, Any], options: StoreOptions) -> tuple[Remote, str]:
        scheme, _, rest = shard.partition("://")
        bucket, _, key = rest.partition("/")
        name = f"{scheme}:{bucket}"
        if name not in remotes:
            remotes[name] = _store(kind)(f"{scheme}://{bucket}/", **options(kind))
        src = remotes[name]
        return src, src.url(key)

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
# shard's URL there). A shard of another scheme, or a bare path, is a local file.
SCHEMES: dict[str, Callable[[str, dict[str, Any], StoreOptions], tuple[Remote, str]]] = {
    "http": _http,
    "https": _http,
    "s3": _bucketed("s3"),
    "gs": _bucketed("gcs"),
    "az": _bucketed("az"),
}


def cached_name(shard: str, remotes: dict[str, Any], options: StoreOptions) -> str | None:
    """What names a remote shard in a cache (its URL); None for a local one."""
    scheme, sep, _ = shard.partition("://")
    reach = SCHEMES.get(scheme) if sep else None
    return None if reach is None else reach(shard, remotes, options)[1]


async def open_shard(
    shard: str, remotes: dict[str, Any], options: StoreOptions, cache: Cache | None = None
) -> AsyncGenerator[bytes | bytearray | memoryview, None]:
    """The bytes of `shard`, chunk by chunk. `remotes` caches one source per scheme (and bucket);
    a remote shard is read from `cache` when it holds it, else kept there as it streams."""
    scheme, sep, _ = shard.partition("://")
    reach = SCHEMES.get(scheme) if sep else None
    if reach is not None:
        src, url = reach(shard, remotes, options)
        stream: AsyncGenerator[bytes | bytearray | memoryview, None]
        if cache is None:
            stream = _remote(src.transport, url, shard)
        else:
            stream = cache.stream(
                url, redact_url(url), lambda version: _remote(src.transport, url, shard, version)
            )
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                yield chunk
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
            while chunk := await resp.content.readany():
                pos += len(chunk)
                yield chunk
            return
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

    def stop(self, t0: float, item: Any = None) -> None:
        """The read begun at `t0` ended: with `item` read, or (None) without one."""
        now = time.perf_counter()
        s = self.stage
        s.leave(now, t0)
        if item is not None:
            s.items += 1
            s.bytes += nbytes(item)
            s.latencies.append(now - t0)

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


class _Reader:
    """Runs one stream ahead into a bounded queue, on its own task."""

    def __init__(self, stream: AsyncGenerator[Any, None], meter: ReadMeter | None = None) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(_READ_AHEAD)
        self.meter = meter
        self.task = asyncio.get_running_loop().create_task(self._run(stream))

    async def _run(self, stream: AsyncGenerator[Any, None]) -> None:
        try:
            while (item := await self._read(stream)) is not _END:
                await self.queue.put(item)
        except Exception as exc:
            await self.queue.put(exc)
            return
        finally:
            await stream.aclose()
        await self.queue.put(_END)

    async def _read(self, stream: AsyncGenerator[Any, None]) -> Any:
        """The stream's next item (`_END` after its last), timed by the meter."""
        t0 = self.meter.start() if self.meter is not None else 0.0
        item: Any = None
        try:
            item = await anext(stream, _END)
            return item
        finally:
            if self.meter is not None:
                self.meter.stop(t0, None if item is _END else item)

    async def get(self) -> Any:
        item = await self.queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


async def interleave(
    streams: list[AsyncGenerator[T, None]], parallel: int, meter: ReadMeter | None = None
) -> AsyncGenerator[T, None]:
    """Items of `streams`, `parallel` read at once, taken round-robin (a fixed order); `meter`
    counts the reads."""
    pending = iter(streams)
    readers = [_Reader(s, meter) for s in itertools.islice(pending, parallel)]
    try:
        turn = 0
        while readers:
            turn %= len(readers)
            item = await readers[turn].get()
            if item is _END:
                nxt = next(pending, None)
                if nxt is None:
                    readers.pop(turn)
                else:
                    readers[turn] = _Reader(nxt, meter)
                continue
            yield item
            turn += 1
    finally:
        for reader in readers:
            await reader.aclose()
        for stream in pending:
            await stream.aclose()


async def shuffled(
    stream: AsyncGenerator[T, None], size: int, rng: random.Random
) -> AsyncGenerator[T, None]:
    """`stream` mixed through a buffer of `size` items: each item out is a random one held."""
    held: list[T] = []
    try:
        async for item in stream:
            if len(held) < size:
                held.append(item)
                continue
            i = rng.randrange(size)
            held[i], item = item, held[i]
            yield item
        rng.shuffle(held)
        for item in held:
            yield item
    finally:
        await stream.aclose()
