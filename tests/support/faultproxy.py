"""Real HTTP on 127.0.0.1 for the remote-source tests: an object server and a fault-injecting proxy.

`Origin` serves in-memory objects (GET with Range, optional auth). `FaultProxy` sits between a client
and an origin and, for the n-th request of each path, does what `proxy.plan(path, n)` says: forward it
(after `Fault.seconds`), answer 503 (with or without Retry-After, or as S3's "SlowDown"), reset the
connection, send a body shorter than its Content-Length, stall, or send the body slowly in pieces.
`RateLimit` is such a plan that throttles by rate, as a store does: for some seconds it answers
503 SlowDown to the requests beyond a rate. Each runs its own event loop on its own thread.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["Fault", "FaultProxy", "Origin", "RateLimit", "ServerThread"]

HOLD_DEADLINE_S = 10.0  # a held burst that never fills up is answered anyway by then
KINDS = ("503", "503-retry-after", "429", "500", "reset", "reset-mid-body", "truncate", "stall",
         "latency", "trickle")  # fmt: skip
SLOWDOWN = (
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
# Azure's throttling answers (kinds "server-busy" and "500-timed-out"): status, then the XML body
AZURE_BUSY = {
    "server-busy": (503, b"<Error><Code>ServerBusy</Code><Message>Too busy.</Message></Error>"),
    "500-timed-out": (
        500,
        b"<Error><Code>OperationTimedOut</Code><Message>Not done in time.</Message></Error>",
    ),
}


@dataclass(frozen=True)
class Fault:
    """What the proxy does to one request. `kind` is one of KINDS; `seconds` is the latency or stall
    ("trickle": the pause between the eight pieces of the body)."""

    kind: str
    seconds: float = 0.0


class RateLimit:
    """A proxy's plan: for `seconds` from the first request, each tenth of a second lets through
    `per_second / 10` requests (at least one) and answers the others with `kind` (S3's SlowDown);
    after that, everything passes. `throttled` and `passed` count what it did."""

    def __init__(self, per_second: float, seconds: float, kind: str = "slowdown") -> None:
        self.per_window = max(1, int(per_second / 10))
        self.seconds, self.kind = seconds, kind
        self.start: float | None = None
        self.window, self.used = -1, 0
        self.throttled = self.passed = 0

    def __call__(self, path: str, n: int) -> Fault | None:
        now = time.monotonic()  # a server's rule: time is what it throttles by
        if self.start is None:
            self.start = now
        if now - self.start >= self.seconds:
            self.passed += 1
            return None
        window = int((now - self.start) * 10)
        if window != self.window:
            self.window, self.used = window, 0
        if self.used < self.per_window:
            self.used += 1
            self.passed += 1
            return None
        self.throttled += 1
        return Fault(self.kind)


class ServerThread:
    """An aiohttp application served on 127.0.0.1 (a free port) by an event loop on its own thread."""

    def __init__(
        self, app: web.Application, name: str, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self.app = app
        self.ssl_context = ssl_context
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        self.port: int = self.call(self._start())

    async def _start(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ssl_context)
        await site.start()
        return int(self.runner.addresses[0][1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def open_connections(self) -> int:
        """Client connections the server holds open now."""

        async def count() -> int:
            server = self.runner.server
            return 0 if server is None else len(server.connections)

        return int(self.call(count()))

    def stop(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


class Origin(ServerThread):
    """Serves `objects` at /<name>; `token`, when set, must come as `Authorization: Bearer <token>`."""

    def __init__(self, objects: dict[str, bytes], token: str | None = None) -> None:
        self.objects = objects
        self.token = token
        self.hits: collections.Counter[str] = collections.Counter()
        app = web.Application()
        app.router.add_get("/{name:.*}", self._get)
        super().__init__(app, "test-origin")

    async def _get(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits[name] += 1
        if (
            self.token is not None
            and request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return web.Response(status=401, text="no entry")
        body = self.objects.get(name)
        if body is None:
            return web.Response(status=404, text="no such object")
        ranged = request.headers.get("Range")
        if ranged is None:
            return web.Response(body=body)
        first, _, last = ranged.removeprefix("bytes=").partition("-")
        if not first:  # a suffix: the last `last` bytes
            first, last = str(max(0, len(body) - int(last))), ""
        start, end = int(first), min(int(last) if last else len(body) - 1, len(body) - 1)
        if start >= len(body):
            return web.Response(status=416)
        headers = {"Content-Range": f"bytes {start}-{end}/{len(body)}"}
        return web.Response(status=206, body=body[start : end + 1], headers=headers)


def _reset(request: web.Request) -> None:
    """Close the request's connection with a TCP reset (SO_LINGER 0)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.close()


class FaultProxy(ServerThread):
    """Forwards GETs to `upstream`, injecting the faults `plan(path, n)` asks for (None: forward).

    With `hold = N`, no injected fault is answered before N were injected (a burst answered together,
    whatever the machine's load: no answer, and so no retry, can come in between), for at most
    `HOLD_DEADLINE_S`.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.plan: Callable[[str, int], Fault | None] = lambda path, n: None
        self.seen: collections.Counter[str] = collections.Counter()
        self.injected: collections.Counter[str] = collections.Counter()
        self.hold = 0
        self._held: asyncio.Event | None = None
        self._session: aiohttp.ClientSession | None = None
        app = web.Application()
        app.router.add_get("/{path:.*}", self._handle)
        app.on_cleanup.append(self._close_session)
        super().__init__(app, "test-faultproxy")

    def reset_counts(self) -> None:
        self.seen.clear()
        self.injected.clear()
        self._held = None

    async def _close_session(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        self.seen[path] += 1
        fault = self.plan(path, self.seen[path])
        if fault is not None:
            self.injected[fault.kind] += 1
            if self.hold:
                await self._until_all_held()
            if fault.kind == "latency":
                await asyncio.sleep(fault.seconds)
            else:
                return await self._inject(request, fault)
        status, headers, body = await self._forward(request)
        return web.Response(status=status, headers=headers, body=body)

    async def _until_all_held(self) -> None:
        """Wait (on the proxy's loop) until `hold` faults were injected."""
        if self._held is None:
            self._held = asyncio.Event()
        if self.injected.total() >= self.hold:
            self._held.set()
        await asyncio.wait_for(self._held.wait(), HOLD_DEADLINE_S)

    async def _forward(self, request: web.Request) -> tuple[int, dict[str, str], bytes]:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        # and x-amz-*, x-ms-*: a signed request must pass intact
        keep = ("authorization", "range", "host")
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in keep or k.lower().startswith(("x-amz-", "x-ms-"))
        }
        async with self._session.get(
            self.upstream + request.path_qs, headers=headers, allow_redirects=False
        ) as resp:
            body = await resp.read()
            passed = ("Content-Range", "Retry-After", "Content-Type", "ETag", "Last-Modified")
            return resp.status, {k: v for k, v in resp.headers.items() if k in passed}, body

    async def _inject(self, request: web.Request, fault: Fault) -> web.StreamResponse:
        if fault.kind in ("503", "429", "500"):
            return web.Response(status=int(fault.kind), text="busy")
        if fault.kind in AZURE_BUSY:
            status, body = AZURE_BUSY[fault.kind]
            return web.Response(status=status, body=body, content_type="application/xml")
        if fault.kind == "slowdown":
            return web.Response(status=503, body=SLOWDOWN, content_type="application/xml")
        if fault.kind == "503-retry-after":
            return web.Response(status=503, headers={"Retry-After": "1"}, text="busy")
        if fault.kind == "reset":
            _reset(request)
            return web.Response(status=500)  # never reaches the client
        if fault.kind == "stall":
            await asyncio.sleep(fault.seconds)
            return web.Response(status=503, text="stalled")
        status, headers, body = await self._forward(request)
        resp = web.StreamResponse(status=status, headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        if fault.kind == "trickle":
            step = -(-len(body) // 8)
            for i in range(0, len(body), step):
                await resp.write(body[i : i + step])
                await asyncio.sleep(fault.seconds)
            await resp.write_eof()
            return resp
        await resp.write(body[: len(body) // 2])
        if fault.kind == "reset-mid-body":
            _reset(request)
        elif request.transport is not None:
            request.transport.close()  # a FIN before Content-Length bytes were sent
        return resp
