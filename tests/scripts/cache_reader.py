"""Read objects over HTTP through cache directories another process shares, checking every read.

Usage: cache_reader.py BASE_URL READY_DIR PEERS PHASES

PHASES is JSON: a list of {"cache_dir", "limit" (bytes or null), "passes", "keys"}. For each phase the
process marks itself ready in READY_DIR/<phase> and waits until PEERS processes have (so that their
reads overlap), then fetches every key `passes` times, 8 at a time, through
`sources.http(BASE_URL, keys, cache_dir=..., cache_limit=...)`. It prints one JSON line: a list of
{"digests": {key: [sha256 of each read]}, "stats": the source's stats()}, one per phase.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from aioloader import sources

READY_POLL_S = 0.01
READY_WAIT_S = 60.0


def wait_for_peers(ready: Path, peers: int) -> None:
    ready.mkdir(parents=True, exist_ok=True)
    (ready / str(os.getpid())).touch()
    end = time.monotonic() + READY_WAIT_S
    while len(list(ready.iterdir())) < peers and time.monotonic() < end:
        time.sleep(READY_POLL_S)


async def read_all(src: sources.Http, keys: list[str], passes: int) -> dict[str, list[str]]:
    digests: dict[str, list[str]] = {key: [] for key in keys}
    gate = asyncio.Semaphore(8)

    async def one(key: str) -> None:
        async with gate:
            body = await src.fetch(key)
        digests[key].append(hashlib.sha256(body).hexdigest())

    try:
        for _ in range(passes):
            await asyncio.gather(*(one(key) for key in keys))
    finally:
        await src.aclose()
    return digests


def run_phase(base: str, ready: Path, peers: int, phase: dict[str, Any]) -> dict[str, Any]:
    keys = phase["keys"]
    src = sources.http(base, keys, cache_dir=phase["cache_dir"], cache_limit=phase["limit"])
    wait_for_peers(ready, peers)
    digests = asyncio.run(read_all(src, keys, phase["passes"]))
    return {"digests": digests, "stats": src.stats()}


def main() -> None:
    base, ready, peers, phases = sys.argv[1:]
    results = [
        run_phase(base, Path(ready) / str(i), int(peers), phase)
        for i, phase in enumerate(json.loads(phases))
    ]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
