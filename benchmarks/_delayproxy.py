"""The benchmarks' far-store proxy: forwards each request to an upstream after a fixed delay (a subprocess).

Requests (GET, HEAD, PUT, ...) go to the upstream with their headers (a signed S3 request passes intact:
its Host is kept) after `delay_ms`; answers come back whole. `start_proxy()` runs this file as a
subprocess and waits until it has written its port to a file (a process boundary: nothing else
signals readiness). It counts requests and body bytes sent back: GET /__counts__ answers them as JSON.

Usage (from start_proxy): python benchmarks/_delayproxy.py PORT_FILE --upstream URL --delay-ms MS
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


def serve(port_file: str, upstream: str, delay_ms: float) -> None:
    """Forward requests to `upstream` after `delay_ms`. Runs until killed."""
    import aiohttp
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    counts = {"requests": 0, "bytes": 0}

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path == "/__counts__":
            return web.json_response(counts)
        await asyncio.sleep(delay_ms / 1000)
        session: aiohttp.ClientSession = request.app["session"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        body = await request.read()
        async with session.request(
            request.method, upstream + request.path_qs, headers=headers, data=body or None,
            allow_redirects=False,
        ) as resp:  # fmt: skip
            data = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
            length = resp.headers.get("Content-Length")
        counts["requests"] += 1
        counts["bytes"] += len(data)
        if request.method == "HEAD":  # no body, but the object's length
            head = web.StreamResponse(status=resp.status, headers=out)
            if length is not None:
                head.content_length = int(length)
            await head.prepare(request)
            await head.write_eof()
            return head
        return web.Response(status=resp.status, headers=out, body=data)

    async def main() -> None:
        app = web.Application(client_max_size=1 << 30)
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        await asyncio.to_thread(Path(port_file).write_text, str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(main())


def start_proxy(upstream: str, delay_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    """Start the proxy in a subprocess; returns it and its base URL (http://127.0.0.1:<port>)."""
    port_file = Path(tempfile.mkdtemp()) / "port"
    cmd = [sys.executable, __file__, str(port_file), "--upstream", upstream,
           "--delay-ms", str(delay_ms)]  # fmt: skip
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the delay proxy did not start")
        time.sleep(0.05)  # a process boundary: nothing else signals readiness
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def counts(base: str) -> dict[str, int]:
    """The requests and body bytes the proxy at `base` has sent back so far."""
    import urllib.request

    with urllib.request.urlopen(base + "/__counts__", timeout=10) as resp:
        out: dict[str, int] = json.loads(resp.read())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port_file", help="where to write the port once listening")
    parser.add_argument("--upstream", required=True, help="base URL to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="delay per request")
    args = parser.parse_args()
    serve(args.port_file, args.upstream, args.delay_ms)


if __name__ == "__main__":
    main()
