"""GET over HTTP(S) for the remote sources: one aiohttp session per source, retries, deadlines, buffers.

The session is made lazily, inside the first request, on the event loop that runs it (the loader's), with
a keep-alive pool of `limit` connections; `aclose()` closes it there. Every attempt has its own connect
and read timeouts; the whole read of one sample (all attempts and the waits between them) has a
deadline. Failures that may pass (connection errors, resets, timeouts, short bodies and the statuses in
`Retry.statuses`) are retried with full-jitter backoff, up to `Retry.attempts` attempts; a throttled
answer (429, 503 and a store's throttle codes: S3's SlowDown, GCS's rateLimitExceeded, Azure's
ServerBusy) is retried until the deadline instead, its backoff ceiling doubling with each throttle
up to `Retry.max_throttle_backoff` (1 s), so that ranks throttled together spread out and wait
rather than fail, and ask again within a second of the store's recovery (with `attempts=1`
nothing is retried). Anything else ends the read at once, and so
does a host name that does not resolve and never has for this transport (a typo or a wrong endpoint
is not worth minutes of retries; a name that resolved before may fail for a moment, and is retried).
What finally fails is a `FetchError` naming the redacted URL, the last status and the attempts made.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as _ssl
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast, runtime_checkable
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from ..._exceptions import FetchError
from ..._tuning.aimd import Aimd
from .fasthttp import FastPool, Unsupported
from .redact import redact_url
from .responses import Failure, error_detail, error_text, failure_from, read_body
from .retry import Retry, Timeouts, parse_retry_after

if TYPE_CHECKING:
    from ..cache.disk import Cache

__all__ = ["VERSION_HEADERS", "Prepares", "Signer", "Transport", "keep_version"]

log = logging.getLogger("aioloader")

# (method, url, headers) -> the headers to send; called once per attempt (signatures carry the time).
Signer = Callable[[str, str, dict[str, str]], dict[str, str]]


@runtime_checkable
class Prepares(Protocol):
    """A signer whose credentials (a token, refreshable keys) must be made ready first: the
    transport awaits `ready()` before each attempt and only then signs, so a credential that is
    fetched or refreshed (an HTTP call, a file, a subprocess) is waited for off the event loop,
    never on it. What `ready()` returns names what it made ready (a token); after a 401 answer to
    an attempt, `refused(it)` says why a new one is asked for (the attempt is retried), or None
    where the credential is not the cause (the answer stands)."""

    async def ready(self) -> Any: ...

    def refused(self, made: Any) -> str | None: ...


_THROTTLE_STATUSES = frozenset({429, 503})
_SUFFIX = -1  # `_send`'s offset for a suffix Range ("the last n bytes"): 206, or 200 for all
# Response headers (lower case) that tell one version of an object from another.
VERSION_HEADERS = ("etag", "last-modified", "x-goog-generation", "content-length", "content-range")

T = TypeVar("T")


class Transport:
    """GETs with retries over one lazily made aiohttp session.

    Args:
        limit: connections in the pool (and so requests in flight at most).
        timeouts, retry: see `Timeouts` and `Retry`.
        ssl: True verifies certificates (the default), False does not, or an `ssl.SSLContext`.
        headers: sent with every request.
        sign: called per attempt to add authentication headers (S3's SigV4); one that
            `Prepares` its credentials is awaited first (see `Prepares`).
        limiter: an `Aimd` limit on requests in flight that 429/503 answers shrink.
        throttle_codes: error codes (from the XML error body) that count as throttling too, with
            any status (Azure's "OperationTimedOut" comes as a 500).
        redirects: follow redirects (never for signed requests).
        dns_hint: added to the error when a host that never resolved does not (where it came from).
        suffix_ranges: the store answers "Range: bytes=-n" (`tail`); Azure Blob does not.
        cache: where the remote source keeps the objects it read (`Remote.fetch`); None: nowhere.
    """

    def __init__(
        self,
        *,
        limit: int,
        timeouts: Timeouts,
        retry: Retry,
        ssl: _ssl.SSLContext | bool = True,
        headers: Mapping[str, str] | None = None,
        sign: Signer | None = None,
        limiter: Aimd | None = None,
        redirects: bool = True,
        engine: str = "aiohttp",
        dns_hint: str = "",
        throttle_codes: frozenset[str] = frozenset(),
        cache: Cache | None = None,
        suffix_ranges: bool = True,
    ) -> None:
        if engine not in ("aiohttp", "fast"):
            raise ValueError(f"engine must be 'aiohttp' or 'fast', got {engine!r}")
        if not isinstance(ssl, bool | _ssl.SSLContext):
            raise TypeError(f"ssl must be True, False or an ssl.SSLContext, got {ssl!r}")
        self.limit = limit
        self.timeouts = timeouts
        self.retry = retry
        self.ssl = ssl
        self.headers = dict(headers or {})
        self.sign = sign
        self.limiter = limiter
        self.redirects = redirects
        self.counts = {"requests": 0, "retries": 0, "failures": 0, "bytes": 0}
        self.engine = engine
        self.dns_hint = dns_hint
        self.throttle_codes = throttle_codes
        self.suffix_ranges = suffix_ranges
        self.cache = cache
        self._resolved: set[str] = set()  # hosts that answered once: a DNS failure may pass
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fast: FastPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (for a process worker, say) without its live connections: a copy opens its own,
        on the loop of its first request, and counts from zero."""
        state = self.__dict__.copy()
        state.update(_session=None, _loop=None, _fast=None, counts=dict.fromkeys(self.counts, 0))
        return state

    def session(self) -> aiohttp.ClientSession:
        """The session of the running loop, made on first use. Raises if bound to another loop."""
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if self._loop is not loop:
                raise RuntimeError(
                    "this source is in use on another event loop; use one per loader"
                )
            return self._session
        connector = aiohttp.TCPConnector(limit=self.limit, limit_per_host=0, ssl=self.ssl)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.timeouts.connect, sock_read=self.timeouts.read
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            cookie_jar=aiohttp.DummyCookieJar(),
            auto_decompress=False,
            read_bufsize=1 << 18,
            headers=self.headers,
        )
        self._loop = loop
        return self._session

    async def aclose(self) -> None:
        """Close the session and its connections. Idempotent; a later request makes a new one."""
        session, self._session = self._session, None
        fast, self._fast = self._fast, None
        if fast is not None:
            await fast.aclose()
        if session is not None and not session.closed:
            await session.close()

    async def get(
        self,
        url: str,
        *,
        key: Any,
        offset: int = 0,
        length: int | None = None,
        version: dict[str, str] | None = None,
    ) -> bytearray:
        """The body of `url` (bytes [offset, offset+length) of it when a range is given); `version`,
        when given, receives the response's ETag, Last-Modified and the like (`VERSION_HEADERS`).

        Raises:
            FetchError: after the last attempt, or at once for a failure that retrying cannot mend.
        """
        ranged = offset > 0 or length is not None
        if ranged and (offset < 0 or (length is not None and length < 0)):
            raise ValueError(f"bad range: offset={offset}, length={length}")
        if length == 0:
            return bytearray()
        headers = {"Range": _range_header(offset, length)} if ranged else {}

        async def attempt() -> bytearray:
            if self.engine == "fast":
                try:
                    return await self._fast_get(url, headers, offset if ranged else None, version)
                except Unsupported as exc:
                    log.info("%s; engine='fast' gives way to aiohttp for this source", exc)
                    self.engine = "aiohttp"
            body, answer = await self._read(url, headers, offset if ranged else None)
            keep_version(answer, version)
            return body

        return await self._with_retries(url, key, attempt)

    async def tail(self, url: str, *, key: Any, length: int) -> tuple[bytearray, int]:
        """The last `length` bytes of `url` (all of a shorter object) and the object's size, in one
        request (a suffix Range); retried as `get` is. A store that takes no suffix Range
        (`suffix_ranges` False: Azure Blob) is asked its size by a one-byte range first."""
        if not self.suffix_ranges:
            _, size = await self._with_total(url, key, "bytes=0-0")
            start = max(0, size - length)
            return await self.get(url, key=key, offset=start, length=size - start), size
        return await self._with_total(url, key, f"bytes=-{length}")

    async def _with_total(self, url: str, key: Any, spec: str) -> tuple[bytearray, int]:
        """GET `url` with Range `spec` (a suffix, or the first byte): the body and the object's
        size (Content-Range's total; the body's length when the whole object came)."""

        async def attempt() -> tuple[bytearray, int]:
            body, answer = await self._read(url, {"Range": spec}, _SUFFIX)
            total = (answer.get("Content-Range") or "").rpartition("/")[2]
            return body, int(total) if total.isdigit() else len(body)

        return await self._with_retries(url, key, attempt)

    async def _read(
        self, url: str, headers: dict[str, str], offset: int | None
    ) -> tuple[bytearray, Mapping[str, str]]:
        """One GET (aiohttp engine), its whole body read: (body, the response's headers)."""
        resp = await self._send(url, headers, offset)
        try:
            body = await read_body(resp)
        except BaseException:
            resp.close()
            raise
        resp.release()
        self.counts["bytes"] += len(body)
        return body, resp.headers

    async def open(self, url: str, *, key: Any, offset: int = 0) -> aiohttp.ClientResponse:
        """A response to GET `url` from byte `offset` whose body is not read yet (retries included).

        The caller reads `response.content` and must `close()` or `release()` the response.
        """
        headers = {"Range": _range_header(offset, None)} if offset else {}
        return await self._with_retries(
            url, key, lambda: self._send(url, headers, offset or None), limited=False
        )

    async def _with_retries(
        self, url: str, key: Any, attempt: Callable[[], Awaitable[T]], limited: bool = True
    ) -> T:
        made = 0
        failed = throttled = 0  # attempts that failed, and of them those that were throttled
        failure: Failure | None = None
        try:
            async with asyncio.timeout(self.timeouts.deadline):
                while True:
                    made += 1
                    try:
                        return await (self._limited(attempt) if limited else attempt())
                    except Failure as exc:
                        failure = exc
                    if failure.dns and urlsplit(url).hostname not in self._resolved:
                        failure = self._never_resolved(url, failure)
                    throttle = failure.retryable and self._throttled(failure)
                    throttled += throttle
                    failed += not throttle
                    if (
                        not failure.retryable
                        or failed >= self.retry.attempts
                        or self.retry.attempts == 1  # never retried, not even when throttled
                    ):
                        break
                    delay = self.retry.delay(
                        throttled if throttle else failed, failure.retry_after, throttle
                    )
                    self.counts["retries"] += 1
                    log.debug(
                        "GET %s: %s (attempt %d of %d); retrying in %.3f s",
                        redact_url(url), failure.reason, made, self.retry.attempts, delay,
                    )  # fmt: skip
                    await asyncio.sleep(delay)
        except TimeoutError:
            last = f"; last error: {failure.reason}" if failure is not None else ""
            reason = f"deadline of {self.timeouts.deadline:g} s passed{last}"
            failure = Failure(reason, retryable=False, status=failure.status if failure else None)
        assert failure is not None
        self.counts["failures"] += 1
        status = f"status {failure.status}" if failure.status is not None else "no HTTP status"
        message = (
            f"GET {redact_url(url)} failed after {made} attempt(s) ({status}): {failure.reason}"
        )
        log.warning("%s", message)
        raise FetchError(message, key=key, stage="fetch") from None

    def _never_resolved(self, url: str, failure: Failure) -> Failure:
        host = urlsplit(url).hostname
        hint = f" ({self.dns_hint})" if self.dns_hint else ""
        reason = f"{failure.reason}; not retried: {host!r} has never resolved{hint}"
        return Failure(reason, retryable=False)

    async def _limited(self, attempt: Callable[[], Awaitable[T]]) -> T:
        if self.limiter is None:
            return await attempt()
        ticket = await self.limiter.acquire()
        throttled = False
        try:
            return await attempt()
        except Failure as failure:
            throttled = self._throttled(failure)
            raise
        finally:
            self.limiter.release(ticket, throttled=throttled)

    def _throttled(self, failure: Failure) -> bool:
        """Whether `failure` is the store asking for fewer requests (a status or an error code)."""
        return failure.status in _THROTTLE_STATUSES or self._throttle_code(failure)

    def _throttle_code(self, failure: Failure) -> bool:
        """Whether `failure` is an error answer whose code is one of `throttle_codes`."""
        return failure.status is not None and any(
            f": {code}:" in failure.reason + ":" for code in self.throttle_codes
        )

    async def _signed(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` once the signer's credentials are ready (where it `Prepares` them); a 401
        answer that they caused is retried with new ones."""
        sign = self.sign
        if not isinstance(sign, Prepares):
            return await attempt()
        made = await sign.ready()
        try:
            return await attempt()
        except Failure as failure:
            why = sign.refused(made) if failure.status == 401 else None
            if why is None:
                raise
            reason = f"{failure.reason}; {why}" if why else failure.reason
            raise Failure(reason, retryable=True, status=401) from None

    async def _send(
        self, url: str, headers: dict[str, str], offset: int | None
    ) -> aiohttp.ClientResponse:
        return await self._signed(lambda: self._send_now(url, headers, offset))

    async def _send_now(
        self, url: str, headers: dict[str, str], offset: int | None
    ) -> aiohttp.ClientResponse:
        session = self.session()
        if self.sign is not None:
            headers = self.sign("GET", url, {**self.headers, **headers})
        self.counts["requests"] += 1
        try:
            resp = await session.get(
                URL(url, encoded=True), headers=headers, allow_redirects=self.redirects
            )
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise failure_from(exc, url) from None
        self._resolved.add(urlsplit(url).hostname or "")
        try:
            answered = _answered(resp.status, resp.headers.get("Content-Range"), offset)
        except Failure:
            resp.close()
            raise
        if answered:
            return resp
        try:
            detail = await error_detail(resp)
        finally:
            resp.close()
        raise self._status_failure(
            resp.status, resp.reason, resp.headers.get("Retry-After"), detail
        )

    async def _fast_get(
        self, url: str, headers: dict[str, str], offset: int | None, version: dict[str, str] | None
    ) -> bytearray:
        return await self._signed(lambda: self._fast_get_now(url, headers, offset, version))

    async def _fast_get_now(
        self, url: str, headers: dict[str, str], offset: int | None, version: dict[str, str] | None
    ) -> bytearray:
        if self._fast is None:
            t = self.timeouts
            self._fast = FastPool(self.limit, self.ssl, t.connect, t.read)
        headers = {**self.headers, **headers}
        if self.sign is not None:
            headers = self.sign("GET", url, headers)
        self.counts["requests"] += 1
        try:
            resp = await self._fast.get(url, headers)
        except ValueError as exc:
            raise failure_from(exc, url) from None
        self._resolved.add(urlsplit(url).hostname or "")
        if _answered(resp.status, resp.headers.get("content-range"), offset):
            self.counts["bytes"] += len(resp.body)
            keep_version(resp.headers, version)
            # a memoryview only where `_util/bytearrays.landing` is set: by `FetchDecode` without a decode,
            # which hands the body to no user code, only to the worker's answer
            return cast(bytearray, resp.body)
        detail = error_text(resp.body, url)
        raise self._status_failure(
            resp.status, resp.reason, resp.headers.get("retry-after"), detail
        )

    def _status_failure(
        self, status: int, reason: str | None, retry_after_header: str | None, detail: str
    ) -> Failure:
        text = f"HTTP {status} {reason or ''}".rstrip() + detail
        if status == 200:
            return Failure(f"{text}: the server ignored the Range header", retryable=False)
        retry_after = parse_retry_after(retry_after_header)
        if retry_after is not None:
            text += f" (Retry-After: {retry_after:g} s)"
        retryable = status in self.retry.statuses
        return Failure(text, status=status, retryable=retryable, retry_after=retry_after)


def keep_version(headers: Mapping[str, str], version: dict[str, str] | None) -> None:
    """Copy what identifies the object's version (`VERSION_HEADERS`) from `headers` into `version`."""
    if version is None:
        return
    for name in VERSION_HEADERS:
        value = headers.get(name)
        if value is not None:
            version[name] = value


def _answered(status: int, content_range: str | None, offset: int | None) -> bool:
    """Whether an answer of `status` is the body asked for (both engines check it here): 200 for
    a whole object, 206 for a range starting at `offset` (its Content-Range checked: else a
    `Failure` that retrying cannot mend), 206 or 200 for a suffix; False: an error's answer."""
    if status == (200 if offset is None else 206) or (offset == _SUFFIX and status == 200):
        if offset is not None and offset >= 0 and not _range_ok(content_range, offset):
            raise Failure(f"bad Content-Range for offset {offset}", retryable=False)
        return True
    return False


def _range_ok(content_range: str | None, offset: int) -> bool:
    return (content_range or "").startswith(f"bytes {offset}-")


def _range_header(offset: int, length: int | None) -> str:
    return f"bytes={offset}-" if length is None else f"bytes={offset}-{offset + length - 1}"
