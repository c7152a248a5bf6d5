"""The benchmarks' far store: a TCP proxy that holds each request 20 ms (or as told), in a subprocess.

Bytes from the client wait `delay_ms` before they go on to the upstream (an HTTP/1.1 request arrives
as one write, so each request waits once; a connection's requests follow one another); answers come
back as they arrive, untouched, so signed requests and Range answers pass as they are. The proxy
copies bytes on asyncio's protocol callbacks without parsing HTTP, so that it costs the shared cores
little (an HTTP proxy in Python halved what an emulator alone serves here). `Proxy()` runs this file
as a subprocess, on a free port or the one given, and waits until it has written its port to a file
(a process boundary: nothing else signals readiness); the subprocess counts the client writes it
forwarded and the bytes it sent back, and writes them to PORT_FILE.counts on SIGUSR1 (`counts()`).

Usage (from Proxy): python benchmarks/_delayproxy.py PORT_FILE --upstream HOST:PORT --delay-ms MS
                    [--port P]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit


class _Side(asyncio.Protocol):
    """One end of a proxied connection: what arrives is written to `peer`, `delay` seconds late
    (the client's side: each request is one write, so each request waits once; the server's
    side passes at once). `counts` gathers the client writes and the bytes sent back."""

    def __init__(self, delay: float, counts: dict[str, int]) -> None:
        self.delay, self.counts = delay, counts
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self.early: list[bytes] = []  # what came before the peer was connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.delay:
            self.counts["requests"] += 1
            asyncio.get_running_loop().call_later(self.delay, self._pass, data)
        else:
            self.counts["bytes"] += len(data)
            self._pass(data)

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


def serve(port_file: str, upstream: str, delay_ms: float, port: int = 0) -> None:
    """Forward connections on `port` (0: any free one) to `upstream` (host:port), each client
    write `delay_ms` late; the port is written to `port_file` once listening."""
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
            client = _Side(delay_ms / 1000, counts)
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

    def __init__(self, upstream: str, delay_ms: float, port: int = 0) -> None:
        self._port_file = Path(tempfile.mkdtemp()) / "port"
        netloc = urlsplit(upstream).netloc
        cmd = [sys.executable, __file__, str(self._port_file), "--upstream", netloc,
               "--delay-ms", str(delay_ms), "--port", str(port)]  # fmt: skip
        self.proc = subprocess.Popen(cmd)
        deadline = time.monotonic() + 30
        while not self._port_file.exists() or not self._port_file.read_text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("the delay proxy did not start")
            time.sleep(0.05)  # a process boundary: nothing else signals readiness
        self.url = f"http://127.0.0.1:{self._port_file.read_text()}"

    def counts(self) -> dict[str, int]:
        """Client reads forwarded (about one per request) and bytes sent back, so far."""
        out = Path(str(self._port_file) + ".counts")
        out.unlink(missing_ok=True)
        os.kill(self.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while not out.exists() or not out.read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("the delay proxy did not write its counts")
            time.sleep(0.01)  # a process boundary: nothing else signals it
        counts: dict[str, int] = json.loads(out.read_text())
        return counts

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port_file", help="where to write the port once listening")
    parser.add_argument("--upstream", required=True, help="host:port to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="delay per request")
    parser.add_argument("--port", type=int, default=0, help="where to listen (0: any free port)")
    args = parser.parse_args()
    serve(args.port_file, args.upstream, args.delay_ms, args.port)


if __name__ == "__main__":
    main()
