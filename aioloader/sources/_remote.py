"""What the remote sources share: how they reach their objects, and fetch / fetch_range / stats."""

from __future__ import annotations

import dataclasses
import ssl as _ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._util.validate import check_int
from ._retry import (
    ATTEMPTS,
    BACKOFF,
    CONNECT_TIMEOUT,
    DEADLINE,
    MAX_BACKOFF,
    READ_TIMEOUT,
    Retry,
    Timeouts,
)
from ._transport import Transport

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

    def __post_init__(self) -> None:
        check_int("concurrency", self.concurrency, minimum=1)

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
        }


class Remote:
    """A source whose objects are read by URL over one `Transport` (a base of `Http` and `S3`).

    A new remote source (another object store) gives `url(key)` and its authentication (the
    transport's `headers` or `sign`); fetching, ranges, retries, counters and closing are these.
    """

    transport: Transport

    def url(self, key: str) -> str:
        """The URL of the object `key` names; `InvalidKeyError` for a key that names none."""
        raise NotImplementedError

    async def fetch(self, key: str) -> bytearray:
        """The whole object named by `key`."""
        return await self.transport.get(self.url(key), key=key)

    async def fetch_range(self, key: str, offset: int, length: int | None = None) -> bytearray:
        """`length` bytes of the object from byte `offset` (to its end when `length` is None)."""
        return await self.transport.get(self.url(key), key=key, offset=offset, length=length)

    def stats(self) -> dict[str, float]:
        """Requests sent, retries, failed samples and body bytes read so far."""
        return dict(self.transport.counts)

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent; a later fetch opens a new one."""
        await self.transport.aclose()
