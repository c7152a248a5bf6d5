"""What a loader costs per batch when the batches cost nothing: its own hand-over, the floor under
every workload.

The batches are the items of an in-memory list of ints (`batch_size=None`: each item is a batch;
nothing to fetch, wait for or decode). Each contender runs in a fresh interpreter:

- "torch-0": torch's `DataLoader(items, batch_size=None)`, num_workers 0 (all in the consumer's
  thread: no pipeline to hand over from);
- "torch-2": the same with `num_workers=2` (worker processes, a pipe per batch);
- "dataloader-2": the same torch user code with `from aioloader import DataLoader`;
- "for" / "async-for": aioloader's `Loader(items, fetch, batch_size=None, collate=None)` (an async
  identity fetch), iterated with `for` and with `async for` (its pipeline on its own loop thread).

Figures: µs of wall time per batch over the epoch after its first batch, and CPU µs per batch (the
process and its children). The last line is a JSON summary with aioloader's `for` and front door over
each torch contender (wall per batch: lower is better).

Usage: python benchmarks/per_batch.py [--quick] [--items N] [--rounds R]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
from typing import Any

CONTENDERS = ("torch-0", "torch-2", "dataloader-2", "for", "async-for")


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


async def same(x: int) -> int:
    return x


def child(name: str, n: int) -> dict[str, float]:
    items = list(range(n))
    if name.startswith(("torch", "dataloader")):
        if name.startswith("torch"):
            from torch.utils.data import DataLoader
        else:
            from aioloader import DataLoader  # type: ignore[assignment]
        workers = int(name.rsplit("-", 1)[1])
        loader: Any = DataLoader(items, batch_size=None, num_workers=workers)  # type: ignore[arg-type]
        return timed(iter(loader), n)
    from aioloader import Loader

    with Loader(items, same, batch_size=None, collate=None) as ours:
        if name == "for":
            return timed(iter(ours), n)
        return asyncio.run(atimed(ours, n))


def timed(batches: Any, n: int) -> dict[str, float]:
    next(batches)  # the first batch: workers and threads started
    t0, c0 = time.perf_counter(), cpu_s()
    count = sum(1 for _ in batches)
    return result(count, n, t0, c0)


async def atimed(loader: Any, n: int) -> dict[str, float]:
    batches = aiter(loader)
    await anext(batches)
    t0, c0 = time.perf_counter(), cpu_s()
    count = 0
    async for _ in batches:
        count += 1
    return result(count, n, t0, c0)


def result(count: int, n: int, t0: float, c0: float) -> dict[str, float]:
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    if count != n - 1:
        raise SystemExit(f"{count + 1} batches, not {n}")
    return {
        "us_per_batch": round(wall / count * 1e6, 1),
        "cpu_us_per_batch": round(cpu / count * 1e6, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items, one round: under 60 s")
    parser.add_argument("--items", type=int, default=None, help="batches an epoch (default 20,000)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="each contender's runs (default 3)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.items or (3_000 if args.quick else 20_000)
    if args.child:
        print(json.dumps(child(args.child, n)))
        return
    rounds = args.rounds or (1 if args.quick else 3)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
    for r in range(rounds):  # alternating order: the machine's minute falls on all alike
        for name in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
            cmd = [sys.executable, __file__, "--child", name, "--items", str(n)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    best = {
        name: {key: min(r[key] for r in rs) for key in ("us_per_batch", "cpu_us_per_batch")}
        for name, rs in runs.items()
    }
    print(
        f"{'contender':14s} {'us/batch':>9s} {'CPU us/batch':>13s}   ({n} batches, best of {rounds})"
    )
    for name, fig in best.items():
        print(f"{name:14s} {fig['us_per_batch']:9.1f} {fig['cpu_us_per_batch']:13.1f}")
    vs = {
        f"{ours}/{peer}": round(best[ours]["us_per_batch"] / best[peer]["us_per_batch"], 3)
        for ours in ("for", "async-for", "dataloader-2")
        for peer in ("torch-0", "torch-2")
    }
    for key, ratio in vs.items():
        print(f"{key}: {ratio}x the wall time per batch")
    print(json.dumps({"workload": "per_batch", "batches": n, "rounds": rounds, **best, "vs": vs}))


if __name__ == "__main__":
    main()
