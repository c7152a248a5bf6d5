"""What the remote sources share: how they reach their objects, and fetch / fetch_range / stats."""

from __future__ import annotations

import dataclasses
import os
import ssl as _ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..._exceptions import FetchError
from ..._protocol import HasEtag, HasSize
from ..._util.validate import check_int
from ..cache.disk import Cache, Expect, check_cache_args
from .client import Transport
from .redact import redact_url
from .retry import (
    ATTEMPTS,
    BACKOFF,
    CONNECT_TIMEOUT,
    DEADLINE,
    MAX_BACKOFF,
    READ_TIMEOUT,
    Retry,
    Timeouts,
)

__all__ = ["Remote", "RemoteOptions"]


@dataclass(frozen=True)
class RemoteOptions:
    """The arguments every remote source takes (see `http()`): its pool, timeouts, retries, TLS."""

    concurrency: int = 64
    connect_timeout: float | None = CONNECT_TIMEOUT
    read_timeout: float | None = READ_TIMEOUT
    deadline: float | None = DEADLINE
    attempts: int = ATTEMPTS
    backoff: float = BACKOFF
    max_backoff: float = MAX_BACKOFF
    ssl: _ssl.SSLContext | bool = True
    engine: str = "aiohttp"
    cache_dir: str | os.PathLike[str] | None = None
    cache_limit: int | None = None

    def __post_init__(self) -> None:
        check_int("concurrency", self.concurrency, minimum=1)
        check_cache_args(self.cache_dir, self.cache_limit)

    @classmethod
    def of(
        cls, remote: RemoteOptions | None, options: Mapping[str, Any], source: str
    ) -> RemoteOptions:
        """`remote` (None: the defaults) with `options`, keyword arguments named as its fields, in
        their place: how a source's constructor takes these, one by one or as one object."""
        unknown = sorted(options.keys() - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"{source}() got an unexpected keyword argument {unknown[0]!r}")
        return dataclasses.replace(remote or cls(), **options)

    def transport_options(self) -> dict[str, Any]:
        """What a `Transport` takes from these, besides its `limit`."""
        return {
            "timeouts": Timeouts(self.connect_timeout, self.read_timeout, self.deadline),
            "retry": Retry(self.attempts, self.backoff, self.max_backoff),
            "ssl": self.ssl,
            "engine": self.engine,
            "cache": None if self.cache_dir is None else Cache(self.cache_dir, self.cache_limit),
        }


class Remote:
    """A source whose objects are read by URL over one `Transport` (the base of `Http`, and of
    `Bucket`, which S3, GCS and Azure build on).

    A new remote source (another object store) gives `url(key)` and its authentication (the
    transport's `headers` or `sign`); fetching, ranges, retries, counters and closing are these,
    and so is the local cache (`cache_dir`, the transport's `cache`): `fetch` reads a cached copy
    and keeps what it downloads, `fetch_range` reads a cached copy (else the store, keeping
    nothing). A source whose listing gives sizes or ETags has `size(key)` / `etag(key)`: a cached
    copy that differs from them is fetched again.
    """

    transport: Transport

    def url(self, key: str) -> str:
        """The URL of the object `key` names; `InvalidKeyError` for a key that names none."""
        raise NotImplementedError

    def cache_name(self, key: str) -> str:
        """What names object `key` in the cache (hashed there; never written out): its URL here; a
        bucket store's source names the store, bucket and key instead (`stores/listing.py`)."""
        return self.url(key)

    def _expect(self, key: str) -> Expect:
        size = self.size(key) if isinstance(self, HasSize) else None
        etag = self.etag(key) if isinstance(self, HasEtag) else None
        return Expect(size, etag)

    async def fetch(self, key: str) -> bytearray:
        """The whole object named by `key` (from the cache, when it has a valid copy)."""
        url, cache = self.url(key), self.transport.cache
        if cache is None:
            return await self.transport.get(url, key=key)

        async def download(version: dict[str, str]) -> bytearray:
            return await self.transport.get(url, key=key, version=version)

        return await cache.fetch(self.cache_name(key), redact_url(url), self._expect(key), download)

    async def fetch_range(self, key: str, offset: int, length: int | None = None) -> bytearray:
        """`length` bytes of the object from byte `offset` (to its end when `length` is None)."""
        url, cache = self.url(key), self.transport.cache
        if cache is not None and offset >= 0 and (length is None or length > 0):
            try:
                name, expect = self.cache_name(key), self._expect(key)
                cached = await cache.fetch_range(name, expect, offset, length)
            except ValueError as exc:
                raise FetchError(f"{redact_url(url)}: {exc}", key=key, stage="fetch") from None
            if cached is not None:
                return cached
        return await self.transport.get(url, key=key, offset=offset, length=length)

    def stats(self) -> dict[str, float]:
        """Requests sent, retries, failed samples and body bytes read so far; with a cache, its
        hits, misses, waits for another process's download, evictions and bytes read."""
        cache = self.transport.cache
        return {**self.transport.counts, **(cache.counts if cache is not None else {})}

    async def aclose(self) -> None:
        """Close the connection pool (and the cache's index). Idempotent; a later fetch opens a
        new one."""
        await self.transport.aclose()
        if self.transport.cache is not None:
            await self.transport.cache.aclose()
