"""What the stats bookkeeping costs: items/s with `stats=True` (the default) against `stats=False`.

Two fetch-bound workloads, each run alternately with stats on and off (`--repeats` times each; the
median is kept, since the host is shared):
- "small": 20,000 items of 64 bytes from an async fetch that only yields to the loop, decoded inline
  by an identity function, in batches of 32: the pipeline's own per-sample cost is all there is, so
  this is the worst case for the recorder (two clock reads and a few additions per stage and sample);
- "w2": the W2 workload of `benchmarks/remote.py` (256 KiB objects over HTTP from a local server that
  waits 20 ms per GET, `http` source, concurrency 64, batches of 32), 600 objects a run.
Reported: the throughput cost (1 - on/off, items/s) and the CPU cost (CPU time of this process per
item, on/off - 1), which the host's other load disturbs less. The last line is a JSON summary.

Usage: python benchmarks/stats_overhead.py [--quick] [--repeats N] [--no-w2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aioloader import Loader

SMALL = 64
BATCH = 32


async def small_fetch(key: int) -> bytes:
    await asyncio.sleep(0)
    return b"x" * SMALL


def identity(raw: bytes) -> bytes:
    return raw


def one_run(make: Callable[[bool], Loader[Any]], stats: bool) -> tuple[float, float]:
    """(items/s, CPU µs of this process per item) for one epoch."""
    with make(stats) as loader:
        start, cpu, count = time.perf_counter(), time.process_time(), 0
        for batch in loader:
            count += len(batch)
        return count / (time.perf_counter() - start), (time.process_time() - cpu) / count * 1e6


def compare(name: str, make: Callable[[bool], Loader[Any]], repeats: int) -> dict[str, Any]:
    one_run(make, True)  # warm up: imports, thread start, connections
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(repeats):
        for stats in (True, False):
            runs[stats].append(one_run(make, stats))
    rate = {k: statistics.median(r for r, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    slower = 100.0 * (1 - rate[True] / rate[False])
    more_cpu = 100.0 * (cpu[True] / cpu[False] - 1)
    spread = {k: f"{min(r for r, _ in v):.0f}-{max(r for r, _ in v):.0f}" for k, v in runs.items()}
    print(f"{name:<6} items/s: stats on {rate[True]:.0f} ({spread[True]}), off {rate[False]:.0f} "
          f"({spread[False]}): {slower:+.2f}%   CPU per item: on {cpu[True]:.1f} µs, off "
          f"{cpu[False]:.1f} µs: {more_cpu:+.2f}%")  # fmt: skip
    return {"on_items_per_s": round(rate[True], 1), "off_items_per_s": round(rate[False], 1),
            "throughput_cost_pct": round(slower, 2), "cpu_cost_pct": round(more_cpu, 2)}  # fmt: skip


def small(items: int) -> Callable[[bool], Loader[Any]]:
    def make(stats: bool) -> Loader[Any]:
        return Loader(range(items), small_fetch, decode=identity, batch_size=BATCH, collate=None,
                      stats=stats)  # fmt: skip

    return make


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-w2", action="store_true", help="skip the HTTP workload")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    summary: dict[str, Any] = {"workload": "stats_overhead"}
    summary["small"] = compare("small", small(5_000 if args.quick else 20_000), repeats)
    if not args.no_w2:
        sys.path.insert(0, str(Path(__file__).parent))
        from remote import DELAY_S, SIZE, start_server

        from aioloader.sources import http

        proc, base = start_server(SIZE, DELAY_S * 1000)  # W2's objects: 256 KiB, 20 ms
        base += "/obj/"
        keys = [f"{i:05d}.bin" for i in range(300 if args.quick else 600)]
        try:
            summary["w2"] = compare("w2", lambda stats: Loader(
                http(base, keys, concurrency=64), concurrency=64, batch_size=BATCH, collate=None,
                stats=stats), repeats)  # fmt: skip
        finally:
            proc.kill()
            proc.wait()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
