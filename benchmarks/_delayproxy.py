"""The benchmarks' far store: a TCP proxy that holds each request 20 ms (or as told), in a subprocess.

Bytes from the client wait `delay_ms` before they go on to the upstream (an HTTP/1.1 request arrives
as one write, so each request waits once; a connection's requests follow one another); answers come
back as they arrive, untouched, so signed requests and Range answers pass as they are. The proxy
copies bytes on asyncio's protocol callbacks without parsing HTTP, so that it costs the shared cores
little (an HTTP proxy in Python halved what an emulator alone serves here). `Proxy()` runs this file
as a subprocess, on a free port or the one given, and waits until it has written its port to a file
(a process boundary: nothing else signals readiness); the subprocess counts the client writes it
forwarded and the bytes it sent back (in all, and by the kind of request they answer: "list_bytes",
...), and writes them to PORT_FILE.counts on SIGUSR1 (`counts()`).

Usage (from Proxy): python benchmarks/_delayproxy.py PORT_FILE --upstream HOST:PORT --delay-ms MS
                    [--port P] [--throttle RATE:SECONDS]

It also counts the requests by kind ("list", "get", "head": from each request's first line) and,
with `--throttle`, answers requests above RATE per second with S3's 503 SlowDown for SECONDS from
the first request (a store that throttles a job's start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

_SLOW_BODY = (
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_BODY), _SLOW_BODY)
)
SLOW_DOWN_HEAD = b"HTTP/1.1 503 Slow Down\r\nContent-Length: 0\r\n\r\n"


def _kind(data: bytes) -> str:
    """What a client write asks for: "list" (ListObjectsV2), "get", "head", or "other" (a body)."""
    line = data[: data.find(b"\r\n")] if b"\r\n" in data[:4096] else b""
    if line.startswith(b"GET "):
        return "list" if b"list-type=" in line else "get"
    if line.startswith(b"HEAD "):
        return "head"
    return "other"


class Throttle:
    """Refuse requests above `rate` per second during `seconds` from the first request (503 SlowDown)."""

    def __init__(self, rate: float, seconds: float) -> None:
        self.rate, self.seconds = rate, seconds
        self.start: float | None = None
        self.window, self.used = -1, 0

    def refuses(self) -> bool:
        now = time.monotonic()
        self.start = now if self.start is None else self.start
        if now - self.start >= self.seconds:
            return False
        window = int((now - self.start) * 10)  # tenths of a second: rate / 10 requests in each
        if window != self.window:
            self.window, self.used = window, 0
        self.used += 1
        return self.used > max(1.0, self.rate / 10)


COUNTS_DEADLINE_S = 60.0


class _Side(asyncio.Protocol):
    """One end of a proxied connection: what arrives is written to `peer`, `delay` seconds late
    (the client's side: each request is one write, so each request waits once; the server's
    side passes at once). `counts` gathers the client writes and the bytes sent back."""

    def __init__(
        self, delay: float, counts: dict[str, int], throttle: Throttle | None = None
    ) -> None:
        self.delay, self.counts, self.throttle = delay, counts, throttle
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []  # what came before the peer was connected
        self.asked = "other"  # the client's side: the kind of its last request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.delay:
            self.counts["requests"] += 1
            kind = _kind(data)
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.asked = kind if kind != "other" else self.asked
            if kind != "other" and self.throttle is not None and self.throttle.refuses():
                self.counts["throttled"] = self.counts.get("throttled", 0) + 1
                answer = SLOW_DOWN_HEAD if kind == "head" else SLOW_DOWN
                asyncio.get_running_loop().call_later(self.delay, self._answer, answer)
                return
            asyncio.get_running_loop().call_later(self.delay, self._pass, data)
        else:  # an answer: its bytes are the last request's (a connection's follow one another)
            self.counts["bytes"] += len(data)
            kind = f"{self.peer.asked if self.peer is not None else 'other'}_bytes"
            self.counts[kind] = self.counts.get(kind, 0) + len(data)
            self._pass(data)

    def _answer(self, answer: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(answer)

    def _pass(self, data: bytes) -> None:
        if self.peer is None or self.peer.transport is None:
            self.early.append(data)
        elif not self.peer.transport.is_closing():
            self.peer.transport.write(data)

    def connected(self, peer: _Side) -> None:
        self.peer = peer
        for data in self.early:
            self._pass(data)
        self.early.clear()

    def pause_writing(self) -> None:  # the peer reads slower than this end sends: stop reading it
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            delay = self.delay + 0.001  # after what is still on its way
            asyncio.get_running_loop().call_later(delay, self.peer.transport.close)


def serve(
    port_file: str, upstream: str, delay_ms: float, port: int = 0, throttle: str = ""
) -> None:
    """Forward connections on `port` (0: any free one) to `upstream` (host:port), each client
    write `delay_ms` late; the port is written to `port_file` once listening. `throttle`
    "RATE:SECONDS" answers requests above RATE per second with 503 SlowDown for SECONDS."""
    limit = Throttle(*map(float, throttle.split(":"))) if throttle else None
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    host, _, up_port = upstream.rpartition(":")
    counts = {"requests": 0, "bytes": 0}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        connecting: set[asyncio.Task[None]] = set()

        async def connect(client: _Side) -> None:
            try:
                _, server = await loop.create_connection(
                    lambda: _Side(0.0, counts), host, int(up_port)
                )
            except OSError:
                if client.transport is not None:
                    client.transport.close()
                return
            server.connected(client)
            client.connected(server)

        def accepted() -> _Side:
            client = _Side(delay_ms / 1000, counts, limit)
            task = loop.create_task(connect(client))
            connecting.add(task)
            task.add_done_callback(connecting.discard)
            return client

        def dump() -> None:
            Path(port_file + ".counts").write_text(json.dumps(counts))

        proxy = await loop.create_server(accepted, "127.0.0.1", port, backlog=1024)
        loop.add_signal_handler(signal.SIGUSR1, dump)
        listening = str(proxy.sockets[0].getsockname()[1])
        await asyncio.to_thread(Path(port_file).write_text, listening)
        await asyncio.Event().wait()

    asyncio.run(main())


class Proxy:
    """A running proxy subprocess: `url` to point clients at, `counts()`, `stop()`."""

    def __init__(self, upstream: str, delay_ms: float, port: int = 0, throttle: str = "") -> None:
        self._port_file = Path(tempfile.mkdtemp()) / "port"
        netloc = urlsplit(upstream).netloc
        cmd = [sys.executable, __file__, str(self._port_file), "--upstream", netloc,
               "--delay-ms", str(delay_ms), "--port", str(port), "--throttle", throttle]  # fmt: skip
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 30
        while not self._port_file.exists() or not self._port_file.read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the delay proxy did not start")
            time.sleep(0.05)  # a process boundary: nothing else signals readiness
        self.url = f"http://127.0.0.1:{self._port_file.read_text()}"

    def counts(self) -> dict[str, int]:
        """Client reads forwarded (about one per request) and bytes sent back, so far."""
        return read_counts(str(self._port_file), self.proc.pid)

    @property
    def handle(self) -> tuple[str, int]:
        """(port file, pid): what another process needs to read the counts (`read_counts`)."""
        return str(self._port_file), self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def read_counts(port_file: str, pid: int) -> dict[str, int]:
    """The counts of the proxy subprocess `pid` that listens on the port in `port_file` (from any
    process): client reads forwarded (about one per request) and bytes sent back, so far."""
    out = Path(port_file + ".counts")
    out.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    start = time.monotonic()
    asked = start
    while True:
        with contextlib.suppress(OSError, ValueError):  # not there yet, or half written
            counts: dict[str, int] = json.loads(out.read_text())
            return counts
        now = time.monotonic()
        if now > start + COUNTS_DEADLINE_S:
            raise RuntimeError("the delay proxy did not write its counts")
        if now > asked + 1.0:  # a busy machine: ask again
            os.kill(pid, signal.SIGUSR1)
            asked = now
        time.sleep(0.01)  # a process boundary: nothing else signals it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port_file", help="where to write the port once listening")
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="delay per request")
    parser.add_argument("--port", type=int, default=0, help="where to listen (0: any free port)")
    parser.add_argument("--throttle", default="", help="RATE:SECONDS of 503 SlowDown above RATE/s")
    args = parser.parse_args()
    from _lifetime import exit_with_parent  # (this file's folder is on the path: a script)

    exit_with_parent()
    serve(args.port_file, args.upstream, args.delay_ms, args.port, args.throttle)


if __name__ == "__main__":
    main()
