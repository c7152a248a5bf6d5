"""The benchmarks' object server: an aiohttp server on 127.0.0.1, run in a subprocess.

GET /obj/<name> answers `size` random bytes (the same for every name) after the current delay;
GET /files/<name> answers the file of that name in `--files DIR` after the delay; GET /count says how
many of these GETs were answered so far; POST /delay/<ms> sets that delay. `start_server()` runs
this file as a subprocess and waits until it has written its port to a file (a process boundary:
nothing else signals readiness).

Usage (from start_server): python benchmarks/_objserver.py PORT_FILE --size N --delay-ms MS [--backlog N]
    [--files DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def serve(
    port_file: str, size: int, delay_ms: float, backlog: int, files: str | None = None
) -> None:
    """Serve /obj/<n> (and /files/<name>) after the current delay; POST /delay/<ms> sets it. Runs
    until killed."""
    from aiohttp import web

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    body = os.urandom(size)
    delay = {"s": delay_ms / 1000}
    served = {"gets": 0}
    stored = {p.name: p.read_bytes() for p in Path(files).iterdir()} if files else {}

    async def get(_request: web.Request) -> web.Response:
        served["gets"] += 1
        await asyncio.sleep(delay["s"])
        return web.Response(body=body, content_type="application/octet-stream")

    async def get_file(request: web.Request) -> web.Response:
        served["gets"] += 1
        await asyncio.sleep(delay["s"])
        return web.Response(body=stored[request.match_info["name"]])

    async def count(_request: web.Request) -> web.Response:
        return web.Response(text=str(served["gets"]))

    async def set_delay(request: web.Request) -> web.Response:
        delay["s"] = int(request.match_info["ms"]) / 1000
        return web.Response(text="ok")

    async def main() -> None:
        app = web.Application()
        app.router.add_get("/obj/{name}", get)
        app.router.add_get("/files/{name}", get_file)
        app.router.add_get("/count", count)
        app.router.add_post("/delay/{ms}", set_delay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=backlog)
        await site.start()
        await asyncio.to_thread(Path(port_file).write_text, str(runner.addresses[0][1]))
        await asyncio.Event().wait()

    asyncio.run(main())


def start_server(
    size: int, delay_ms: float, backlog: int = 1024, files: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Start the server in a subprocess; returns it and its base URL (http://127.0.0.1:<port>)."""
    port_file = Path(tempfile.mkdtemp()) / "port"
    cmd = [sys.executable, __file__, str(port_file), "--size", str(size),
           "--delay-ms", str(delay_ms), "--backlog", str(backlog)]  # fmt: skip
    cmd += ["--files", files] if files else []
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the object server did not start")
        time.sleep(0.05)  # a process boundary: nothing else signals readiness
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port_file", help="where to write the port once listening")
    parser.add_argument("--size", type=int, required=True, help="bytes per object")
    parser.add_argument("--delay-ms", type=float, required=True, help="initial delay per GET")
    parser.add_argument("--backlog", type=int, default=1024)
    parser.add_argument("--files", default=None, help="a folder whose files /files/<name> serves")
    args = parser.parse_args()
    from _lifetime import exit_with_parent  # (this file's folder is on the path: a script)

    exit_with_parent()
    serve(args.port_file, args.size, args.delay_ms, args.backlog, args.files)


if __name__ == "__main__":
    main()
