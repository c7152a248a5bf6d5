"""A lean HTTP/1.1 GET client for the hot path (`engine="fast"`): bodies land in their final buffer.

aiohttp parses each response into objects and copies every body chunk into a new `bytes` before the
caller copies it again. Here each keep-alive connection is an `asyncio.BufferedProtocol`: once the head
is parsed, the socket is read straight into a `bytearray` of Content-Length bytes (one copy, by the
kernel), and a request costs a few dozen Python lines. Those bytearrays are recycled (`Bytearrays`):
once nothing refers to a body any more, a later body of the same length is received into it, without
a fresh buffer's page faults. Only what a GET for a stored object needs is
spoken: a response without Content-Length (chunked, say) raises `Unsupported`, and the transport
falls back to aiohttp for that source.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextvars
import ssl as _ssl
from urllib.parse import unquote, urlsplit

from ..._util.bytearrays import Bytearrays, landing
from .responses import Failure, dns_failure, is_dns_error

__all__ = ["FastPool", "Response", "Unsupported"]

_SCRATCH = 64 * 1024
_MAX_HEAD = 64 * 1024
_NO_BODY = frozenset({204, 304})
BODIES_BYTES = 64 << 20  # recycled body buffers kept per pool, at most


class Unsupported(Exception):
    """The response cannot be read by this client (no Content-Length); use aiohttp instead."""


class Response:
    __slots__ = ("body", "headers", "reason", "status")

    def __init__(
        self, status: int, reason: str, headers: dict[str, str], body: bytearray | memoryview
    ) -> None:
        self.status, self.reason, self.headers, self.body = status, reason, headers, body


def _parse_head(head: bytes) -> tuple[int, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise Failure(f"malformed HTTP status line {lines[0][:80]!r}", retryable=True)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(code), reason, headers


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection serving one request at a time."""

    def __init__(self, bodies: Bytearrays | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self._bodies = bodies
        self._landing: memoryview | None = None  # where this request's body may go (`landing`)
        self.progress = 0
        self.reusable = False
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._head = bytearray()
        self._resp: Response | None = None
        self._view: memoryview | None = None
        self._pos = 0
        # set (to None) once `response` is there: a future holding the response itself would keep
        # the body referenced for as long as anything holds the finished future, and a recycled
        # body must be free once its user lets go of it
        self._waiter: asyncio.Future[None] | None = None
        self.response: Response | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        got = (
            f" after {self._pos} of {len(self._view)} body bytes" if self._view is not None else ""
        )
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "closed by the server"
        self._fail(Failure(f"connection failed: {why}{got}", retryable=True))

    def request(self, data: bytes, into: memoryview | None = None) -> asyncio.Future[None]:
        """Send `data`; the body goes into `into` if it fits there, else into a recycled buffer."""
        assert self.transport is not None
        self._landing = into
        self._waiter = asyncio.get_running_loop().create_future()
        self._head.clear()
        self._resp, self._view, self._pos, self.reusable = None, None, 0, False
        self.response = None
        self.transport.write(data)
        return self._waiter

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._pos :] if self._view is not None else self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.progress += 1
        if self._view is not None:
            self._pos += nbytes
            if self._pos == len(self._view):
                self._done()
            return
        self._head += self._scratch[:nbytes]
        end = self._head.find(b"\r\n\r\n")
        if end < 0:
            if len(self._head) > _MAX_HEAD:
                self._fail(Failure("response head too large", retryable=False))
            return
        try:
            self._start_body(end)
        except (Failure, Unsupported) as exc:
            self._fail(exc)

    def _start_body(self, end: int) -> None:
        status, reason, headers = _parse_head(bytes(self._head[:end]))
        length = headers.get("content-length")
        if status in _NO_BODY:
            length = "0"
        if (
            length is None
            or not length.isdigit()
            or "chunked" in headers.get("transfer-encoding", "")
        ):
            raise Unsupported(f"HTTP {status} response without Content-Length")
        n = int(length)
        body: bytearray | memoryview
        if self._landing is not None and 0 < n <= len(self._landing):
            body = self._landing[:n]
        elif self._bodies is not None:
            body = self._bodies.take(n)
        else:
            body = bytearray(n)
        self._landing = None
        self._resp = Response(status, reason, headers, body)
        self._view = memoryview(body)
        rest = self._head[end + 4 :]
        if len(rest) > len(body):
            raise Failure("more bytes than Content-Length", retryable=True)
        self._view[: len(rest)] = rest
        self._pos = len(rest)
        if self._pos == len(body):
            self._done()

    def _done(self) -> None:
        resp, waiter = self._resp, self._waiter
        self._resp, self._view, self._waiter = None, None, None
        self.reusable = resp is not None and resp.headers.get("connection", "").lower() != "close"
        if waiter is not None and not waiter.done() and resp is not None:
            self.response = resp
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self.reusable = False
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool:
        return False


class _ReadTimer:
    """A request's read timeout: fails `fut` once no byte has come for `timeout` seconds, re-armed
    while bytes keep coming (one timer per request, not one per read).

    Its timers run in an empty context: the request's own holds `landing`, the recycled buffer
    its body goes to, and a cancelled timer may be kept until its time comes (asyncio's own loop
    keeps it in its heap), so the buffer would not be free again for `timeout` seconds. `cancel`
    drops the timer, which refers back to this object: no cycle is left for the garbage
    collector to find (one per request, the connection in it)."""

    __slots__ = ("_handle", "conn", "fut", "seen", "timeout")

    def __init__(self, conn: _Connection, fut: asyncio.Future[None], timeout: float) -> None:
        self.conn, self.fut, self.timeout = conn, fut, timeout
        self.seen = conn.progress
        self._handle: asyncio.TimerHandle | None = None
        self._arm()

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._handle = loop.call_later(self.timeout, self._check, context=contextvars.Context())

    def _check(self) -> None:
        if self.fut.done():
            return
        if self.conn.progress == self.seen:
            self.fut.set_exception(
                Failure(f"timed out: no byte for {self.timeout:g} s", retryable=True)
            )
        else:
            self.seen = self.conn.progress
            self._arm()

    def cancel(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.cancel()


class FastPool:
    """Keep-alive connections per host, at most `limit` requests at once. Use on one event loop."""

    def __init__(
        self, limit: int, ssl: _ssl.SSLContext | bool, connect: float | None, read: float | None
    ) -> None:
        self.limit, self.ssl, self.connect_timeout, self.read_timeout = limit, ssl, connect, read
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._slots: asyncio.Semaphore | None = None
        self.bodies = Bytearrays(BODIES_BYTES)

    async def get(self, url: str, headers: dict[str, str]) -> Response:
        """GET `url`; raises `Failure` (connection problems, timeouts) or `Unsupported`."""
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        where = (parts.scheme, parts.hostname or "", port)
        host = parts.netloc.rpartition("@")[2]
        if parts.username is not None:
            if any(k.lower() == "authorization" for k in headers):
                raise ValueError("credentials in the URL and an Authorization header: give one")
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            headers = {**headers, "Authorization": "Basic " + base64.b64encode(pair).decode()}
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Accept-Encoding: identity"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        into = landing.get()
        async with self._slots:
            idle = self._idle.setdefault(where, collections.deque())
            while idle:
                conn = idle.pop()
                if conn.transport is not None and not conn.transport.is_closing():
                    try:
                        return await self._exchange(conn, data, idle, into)
                    except Failure:
                        if conn.progress:  # failed mid-response, not a stale keep-alive
                            raise
            return await self._exchange(await self._connect(where), data, idle, into)

    async def _connect(self, where: tuple[str, str, int]) -> _Connection:
        scheme, host, port = where
        ssl = (self.ssl or None) if scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                # made in an empty context: a transport keeps the context it is made in for as
                # long as the connection lives, and this request's holds `landing` (the recycled
                # buffer its body goes to), which would never be free to be used again
                made = loop.create_task(
                    loop.create_connection(lambda: _Connection(self.bodies), host, port, ssl=ssl),
                    context=contextvars.Context(),
                )
                _, conn = await made
        except TimeoutError:
            raise Failure(f"timed out connecting to {host}:{port}", retryable=True) from None
        except _ssl.SSLCertVerificationError as exc:
            raise Failure(f"TLS certificate verification failed: {exc}", retryable=False) from None
        except OSError as exc:
            text = f"{type(exc).__name__}: {exc}"
            if is_dns_error(exc):
                raise dns_failure(host, text) from None
            raise Failure(f"connection failed: {text}", retryable=True) from None
        self._open.add(conn)
        return conn

    async def _exchange(
        self,
        conn: _Connection,
        data: bytes,
        idle: collections.deque[_Connection],
        into: memoryview | None,
    ) -> Response:
        conn.progress = 0
        fut = conn.request(data, into)
        ok = False
        try:
            await self._wait(conn, fut)
            resp, conn.response = conn.response, None
            assert resp is not None
            ok = True
            return resp
        finally:
            if ok and conn.reusable:
                idle.append(conn)
            else:
                fut.cancel()  # nobody will read its outcome now
                self._discard(conn)

    async def _wait(self, conn: _Connection, fut: asyncio.Future[None]) -> None:
        """Until `fut` is done; `Failure` once no byte has come for `read_timeout` seconds."""
        timeout = self.read_timeout
        if timeout is None:
            return await fut
        timer = _ReadTimer(conn, fut, timeout)
        try:
            return await fut
        finally:
            timer.cancel()

    def _discard(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn.transport is not None:
            conn.transport.abort()  # at once: no TLS close_notify exchange that needs the loop

    async def aclose(self) -> None:
        """Close every connection. Idempotent."""
        for conn in list(self._open):
            self._discard(conn)
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports run their connection_lost callbacks
