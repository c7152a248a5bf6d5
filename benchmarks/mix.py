"""What mixing costs: items/s of a Loader over `aioloader.mix` of two sources against one source.

Both sides read the same number of items the same way, alternately (`--repeats` times each; the
median is kept, since the host is shared):
- "small": items of 64 bytes from an async fetch that only yields to the loop, in batches of 32
  (one source of N keys shuffled by the Loader, against a mix 1:1 of two sources of N keys,
  `stop="cycle"`, read for N items): the pipeline's own per-sample cost is all there is, so this is
  the worst case for the mix's per-key work (a draw, a permutation lookup, a key object);
- "w2": the W2 workload of `benchmarks/remote.py` (256 KiB objects over HTTP from a local server
  that waits 20 ms per GET, batches of 32, the loader's concurrency 64): one `http` source with a
  pool of 64 connections against a mix of two with 32 each (the same connections in all).
Reported: mix/single items/s and CPU time per item. Then the time from `load_state_dict` to the
first batch when resuming a cycle mix deep into its epoch. The last line is a JSON summary.

Usage: python benchmarks/mix.py [--quick] [--repeats N] [--no-w2]
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

from aioloader import Loader, mix

SMALL = 64
BATCH = 32


class Small:
    """A source of `n` keys whose fetch gives 64 bytes after yielding to the loop once."""

    def __init__(self, n: int) -> None:
        self.n = n

    def keys(self) -> range:
        return range(self.n)

    async def fetch(self, key: int) -> bytes:
        await asyncio.sleep(0)
        return b"x" * SMALL

    async def aclose(self) -> None:
        pass


def one_run(make: Callable[[], Loader[Any]], items: int) -> tuple[float, float]:
    """(items/s, CPU µs of this process per item) for `items` items."""
    with make() as loader:
        start, cpu, count = time.perf_counter(), time.process_time(), 0
        for batch in loader:
            count += len(batch)
            if count >= items:
                break
        return count / (time.perf_counter() - start), (time.process_time() - cpu) / count * 1e6


def compare(name: str, single: Callable[[], Loader[Any]], mixed: Callable[[], Loader[Any]],
            items: int, repeats: int) -> dict[str, Any]:  # fmt: skip
    one_run(mixed, items // 4)  # warm up: imports, thread start, connections
    runs: dict[str, list[tuple[float, float]]] = {"single": [], "mix": []}
    for _ in range(repeats):
        runs["single"].append(one_run(single, items))
        runs["mix"].append(one_run(mixed, items))
    rate = {k: statistics.median(r for r, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    ratio = rate["mix"] / rate["single"]
    print(f"{name:<6} {rate['single']:>12.0f} {rate['mix']:>12.0f} {ratio:>8.2f} "
          f"{cpu['single']:>10.1f} {cpu['mix']:>10.1f}")  # fmt: skip
    return {"single_items_per_s": round(rate["single"], 1), "mix_items_per_s": round(rate["mix"], 1),
            "ratio": round(ratio, 3), "single_cpu_us": round(cpu["single"], 1),
            "mix_cpu_us": round(cpu["mix"], 1)}  # fmt: skip


def small(n: int) -> tuple[Callable[[], Loader[Any]], Callable[[], Loader[Any]]]:
    def single() -> Loader[Any]:
        return Loader(Small(n), batch_size=BATCH, collate=None, shuffle=True)

    def mixed() -> Loader[Any]:
        both = mix([Small(n), Small(n)], [1, 1], stop="cycle")
        return Loader(both, batch_size=BATCH, collate=None)

    return single, mixed


def resume_time(position: int) -> float:
    """Seconds from `load_state_dict` to the first batch, `position` samples into a cycle mix."""
    state = {
        "version": 1, "kind": "Loader", "epoch": 0, "rank": 0, "world_size": 1, "in_order": True,
        "consumed": [], "delivered": [[0, position // BATCH]],
    }  # fmt: skip
    with Loader(mix([Small(1_000_000), Small(50_000)], [3, 1], stop="cycle"), batch_size=BATCH,
                collate=None) as loader:  # fmt: skip
        state["config"] = loader.state_dict()["config"]
        start = time.perf_counter()
        loader.load_state_dict(state)
        next(iter(loader))
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-w2", action="store_true", help="skip the HTTP workload")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    summary: dict[str, Any] = {"workload": "mix"}
    print(
        f"{'':<6} {'single it/s':>12} {'mix it/s':>12} {'ratio':>8} {'µs/it 1':>10} {'µs/it mix':>10}"
    )
    items = 5_000 if args.quick else 20_000
    summary["small"] = compare("small", *small(items), items, repeats)
    if not args.no_w2:
        summary["w2"] = w2(300 if args.quick else 600, repeats)
    position = 1_000_000 if args.quick else 10_000_000
    seconds = resume_time(position)
    print(
        f"resume {position:,} samples into a cycle mix: first batch {seconds:.2f} s after the load"
    )
    summary["resume"] = {"position": position, "first_batch_s": round(seconds, 3)}
    print(json.dumps(summary))


def w2(objects: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from remote import DELAY_S, SIZE, start_server

    from aioloader.sources import http

    proc, base = start_server(SIZE, DELAY_S * 1000)  # W2's objects: 256 KiB, 20 ms
    base += "/obj/"
    keys = [f"{i:05d}.bin" for i in range(objects)]
    try:
        return compare("w2", lambda: Loader(
            http(base, keys, concurrency=64), concurrency=64, batch_size=BATCH, collate=None,
            shuffle=True,
        ), lambda: Loader(mix([http(base, keys[::2], concurrency=32),
                               http(base, keys[1::2], concurrency=32)], [1, 1], stop="cycle"),
                          concurrency=64, batch_size=BATCH, collate=None), objects, repeats)  # fmt: skip
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
