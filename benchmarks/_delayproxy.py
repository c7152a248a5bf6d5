"""The benchmarks' far store: a TCP proxy that holds each request 20 ms (or as told), in a subprocess.

Bytes from the client wait `delay_ms` before they go on to the upstream (an HTTP/1.1 request arrives
as one read, so each request waits once; a connection's requests follow one another); answers come
back as they arrive, untouched, so signed S3 requests and Range answers pass as they are and the
proxy costs little CPU. `start_proxy()` runs this file as a subprocess and waits until it has written
its port to a file (a process boundary: nothing else signals readiness); the subprocess counts the
reads it forwarded and the bytes it sent back, and writes them to `counts_file` on SIGUSR1.

Usage (from start_proxy): python benchmarks/_delayproxy.py PORT_FILE --upstream HOST:PORT --delay-ms MS
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

CHUNK = 1 << 20


def serve(port_file: str, upstream: str, delay_ms: float) -> None:
    """Forward connections to `upstream` (host:port), each client read after `delay_ms`."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    host, _, port = upstream.rpartition(":")
    counts = {"requests": 0, "bytes": 0}

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float) -> None:
        try:
            while data := await src.read(CHUNK):
                if delay:
                    counts["requests"] += 1
                    await asyncio.sleep(delay)
                else:
                    counts["bytes"] += len(data)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                dst.close()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, up_writer, delay_ms / 1000), pipe(up_reader, writer, 0.0))

    def dump() -> None:
        Path(port_file + ".counts").write_text(json.dumps(counts))

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
        port = str(server.sockets[0].getsockname()[1])
        await asyncio.to_thread(Path(port_file).write_text, port)
        await asyncio.Event().wait()

    asyncio.run(main())


class Proxy:
    """A running proxy subprocess: `url` to point clients at, `counts()`, `stop()`."""

    def __init__(self, upstream: str, delay_ms: float) -> None:
        self._port_file = Path(tempfile.mkdtemp()) / "port"
        netloc = urlsplit(upstream).netloc
        cmd = [sys.executable, __file__, str(self._port_file), "--upstream", netloc,
               "--delay-ms", str(delay_ms)]  # fmt: skip
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
    args = parser.parse_args()
    serve(args.port_file, args.upstream, args.delay_ms)


if __name__ == "__main__":
    main()
