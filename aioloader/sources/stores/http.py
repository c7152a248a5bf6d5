"""HTTP(S): keys are paths under a base URL, or whole URLs; each GET is retried, timed and redacted.

Two ways to name objects:
- a base URL and relative keys: `http("https://host/data/", ["a.jpg", "b.jpg"])`; each key is quoted
  and appended to the base path, and the base URL's query (a SAS token, say) is added to every URL;
- a list of whole URLs: `http(["https://host/a.jpg?sig=...", ...])`; the keys are then the URLs with
  their secrets redacted (so a key can appear in a log or an error note), mapped back to the real URLs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

from ..._exceptions import InvalidKeyError
from ..transport.client import Transport
from ..transport.redact import redact_url
from ..transport.remote import Remote, RemoteOptions

__all__ = ["Http", "http"]

log = logging.getLogger("aioloader")

# Characters left as they are when a key is put into a URL path (RFC 3986 pchar, plus "/").
_PATH_SAFE = "/~!$&'()*+,;=:@"


class Http(Remote):
    """Objects served over HTTP(S), as a source. See `http()` for the arguments.

    `fetch(key)` returns the object's bytes in a `bytearray` (writable, so `torch.frombuffer` and
    `numpy.frombuffer` view it without a copy); `fetch_range(key, offset, length)` returns part of it.
    Both are coroutines, safe to cancel, and raise `FetchError` (naming the redacted URL, the status
    and the attempts) when the object cannot be read. Connections live in one pool per source, made on
    the loop of the first fetch and closed by `aclose()` (which the loader calls when it closes).

    Example:
        >>> src = http("https://example.com/data/", ["a.bin", "b.bin"], concurrency=32)
        >>> src.keys(), src.url("a.bin")
        (['a.bin', 'b.bin'], 'https://example.com/data/a.bin')
    """

    def __init__(
        self,
        urls_or_base: str | Sequence[str],
        keys: Iterable[str] | None = None,
        *,
        headers: Mapping[str, str] | None = None,
        remote: RemoteOptions | None = None,
        **options: Any,
    ) -> None:
        """`options`: the arguments every remote source takes (`RemoteOptions`: concurrency,
        timeouts, retries, TLS, engine), one by one or together as `remote`."""
        shared = RemoteOptions.of(remote, options, "http")
        self._urls: dict[str, str] = {}
        if isinstance(urls_or_base, str):
            self._base, self._query = _split_base(urls_or_base)
            self._keys = list(keys) if keys is not None else []
        else:
            if keys is not None:
                raise TypeError("keys: give either a base URL and keys, or a list of whole URLs")
            self._base, self._query = "", ""
            self._keys = self._map_urls(urls_or_base)
        self.transport = Transport(
            limit=shared.concurrency, headers=headers, **shared.transport_options()
        )

    def _map_urls(self, urls: Sequence[str]) -> list[str]:
        keys = []
        for url in urls:
            _check_http_url(url)
            key = redact_url(url)
            if self._urls.setdefault(key, url) != url:
                raise ValueError(f"two URLs differ only in their secrets: {key}")
            keys.append(key)
        return keys

    def __repr__(self) -> str:
        where = redact_url(self._base) if self._base else "[URLs]"
        return f"http({where!r}) [{len(self._keys)} keys, concurrency={self.transport.limit}]"

    def keys(self) -> list[str]:
        """The keys, in the order given."""
        return list(self._keys)

    def url(self, key: str) -> str:
        """The URL `key` names (it may hold secrets: do not log it). Raises `InvalidKeyError`."""
        if not self._base:
            url = self._urls.get(key, key)
            _check_http_url(url)
            return url
        rel = key.lstrip("/") if isinstance(key, str) else None
        if not rel or "\x00" in rel or ".." in rel.split("/"):
            raise InvalidKeyError(f"key {key!r} is not a path under {redact_url(self._base)!r}")
        return self._base + quote(rel, safe=_PATH_SAFE) + self._query


def _check_http_url(url: str) -> None:
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
        raise InvalidKeyError(f"not an http(s) URL: {redact_url(url)!r}")


def _split_base(base: str) -> tuple[str, str]:
    _check_http_url(base)
    path, _, query = base.partition("?")
    return (path if path.endswith("/") else path + "/"), (f"?{query}" if query else "")


def http(
    urls_or_base: str | Sequence[str], keys: Iterable[str] | None = None, **options: Any
) -> Http:
    """A source of objects over HTTP(S).

    Args:
        urls_or_base: a base URL (with `keys` relative to it) or a sequence of whole URLs.
        keys: paths relative to the base URL.
        concurrency: connections in the pool; give the loader's `concurrency` (default 64).
        connect_timeout, read_timeout: seconds per attempt to connect, and without a byte arriving.
        deadline: seconds for one sample in all, retries included (None: no limit).
        attempts, backoff, max_backoff: retries (see `Retry`); `Retry-After` is honoured.
        ssl: True (verify certificates, the default), False, or an `ssl.SSLContext`.
        headers: sent with every request (e.g. {"Authorization": ...}; never logged).
        engine: "aiohttp" (the default) or "fast": a lean keep-alive HTTP/1.1 client that receives
            each body straight into its buffer (several times less CPU per request; falls back to
            aiohttp for responses without Content-Length).
    """
    return Http(urls_or_base, keys, **options)
