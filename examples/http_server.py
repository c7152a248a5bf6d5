"""A tiny object store over HTTP for the demo: serves the files of one directory, slowly.

GET /<name> returns the bytes of <root>/<name> after `--delay-ms` milliseconds, as a remote store
(S3, GCS, a CDN) would. Binds 127.0.0.1 on a port the OS picks (unless `--port` is given), then
prints one line, `READY <port>`, so that a parent process knows where and when to connect.

Usage: python examples/http_server.py --root data/demo/images [--delay-ms 20] [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path

from aiohttp import web


def load_files(root: Path) -> dict[str, bytes]:
    """Every regular file directly under `root`, read once into memory (the demo set is small)."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def make_app(files: dict[str, bytes], delay_s: float) -> web.Application:
    async def get(request: web.Request) -> web.Response:
        body = files.get(request.match_info["name"])
        if body is None:
            raise web.HTTPNotFound()
        await asyncio.sleep(delay_s)  # the store's latency
        return web.Response(body=body, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/{name}", get)
    return app


async def serve(root: Path, delay_s: float, port: int) -> None:
    runner = web.AppRunner(make_app(load_files(root), delay_s), access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        bound = runner.addresses[0][1]
        print(f"READY {bound}", flush=True)
        await asyncio.Event().wait()  # until the parent terminates us
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="directory to serve")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="latency added per request")
    parser.add_argument("--port", type=int, default=0, help="0: let the OS choose")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.root, args.delay_ms / 1000, args.port))


if __name__ == "__main__":
    main()
