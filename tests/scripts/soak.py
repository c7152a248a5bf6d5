"""Soak: many epochs of one loader over a small dataset; what the process holds must stay flat.

Usage: soak.py [--executor thread|process|all] [--mode sync|async|all] [--epochs N] [--samples N]
               [--out FILE]

For each executor and mode asked for (default: all four pairs, one after the other), one loader
(files source, a decode that builds tensors and draws a seeded augmentation, default collate,
shuffled epochs) runs `--epochs` epochs. Every epoch must deliver each sample exactly once. After
each epoch (nothing held, after `gc.collect()`) the runner records RSS, open descriptors, sockets,
OS threads, descendant processes, Python objects tracked by the garbage collector and this process's
/dev/shm entries; once more after `close()`.

Verdict (`verdict()`), printed as the last line of stdout as JSON, exit status 1 if it fails:
- from the end of epoch `WARMUP` on, every metric stays within `TOLERANCE` (5%) of its value then,
  plus a small absolute slack for small counts (`SLACK`: 2 descriptors, 1 OS thread; none for
  sockets, processes and /dev/shm entries, which must not move at all);
- after close: no aioloader thread, no descendant process, no socket or descriptor more than before
  the loader was made, no /dev/shm entry.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import aioloader
from aioloader.sources import files

try:
    from leakcheck import census, left_behind, settle, warm_up
except ImportError:  # imported by the tests, as scripts.soak
    from scripts.leakcheck import census, left_behind, settle, warm_up

WARMUP = 3  # epochs before the baseline: pools, buffers and caches fill up during these
TOLERANCE = 0.05
SLACK = {"rss": 0, "objects": 0, "fds": 2, "sockets": 0, "threads": 1, "children": 0, "shm": 0}
SIDE = 16
BATCH = 8


def write_dataset(folder: Path, samples: int) -> None:
    """`samples` files of 3 x SIDE x SIDE bytes; the first two bytes hold the sample's index."""
    for i in range(samples):
        body = bytearray((i * 7 + j) % 251 for j in range(3 * SIDE * SIDE))
        body[0:2] = i.to_bytes(2, "little")
        (folder / f"{i:05d}.bin").write_bytes(bytes(body))


def decode(raw: bytes) -> dict[str, Any]:
    """bytes -> an image tensor with a seeded random flip, and the sample's index."""
    index = int.from_bytes(raw[0:2], "little")
    image = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(3, SIDE, SIDE)
    image = image.float().div_(255)
    if torch.rand((), generator=aioloader.sample_generator()) < 0.5:
        image = image.flip(-1)
    return {"image": image, "index": index}


def measure() -> dict[str, Any]:
    gc.collect()
    snap = census().as_dict()
    snap["objects"] = len(gc.get_objects())
    snap["children"] = len(snap.pop("children"))
    snap["shm"] = len(snap["shm"])
    snap.pop("loader_threads")
    return snap


def check_epoch(indices: list[int], samples: int, epoch: int) -> None:
    if sorted(indices) != list(range(samples)):
        missing = sorted(set(range(samples)) - set(indices))
        twice = sorted({i for i in indices if indices.count(i) > 1})
        raise AssertionError(f"epoch {epoch}: missing {missing[:10]}, delivered twice {twice[:10]}")


def make_loader(root: Path, executor: str) -> aioloader.Loader[Any]:
    return aioloader.Loader(
        files(root), decode=decode, executor=executor, workers=2, batch_size=BATCH,
        shuffle=True, seed=5, concurrency=8, prefetch=2, timeout=60,
    )  # fmt: skip


def run_sync(root: Path, executor: str, epochs: int, samples: int) -> list[dict[str, Any]]:
    record = []
    with make_loader(root, executor) as loader:
        for epoch in range(epochs):
            indices: list[int] = []
            for batch in loader:
                indices += batch["index"].tolist()
                del batch
            check_epoch(indices, samples, epoch)
            record.append(measure())
    return record


def run_async(root: Path, executor: str, epochs: int, samples: int) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        record = []
        async with make_loader(root, executor) as loader:
            for epoch in range(epochs):
                indices: list[int] = []
                async for batch in loader:
                    indices += batch["index"].tolist()
                    del batch
                check_epoch(indices, samples, epoch)
                record.append(measure())
        return record

    return asyncio.run(main())


def verdict(result: dict[str, Any]) -> list[str]:
    """What went wrong (empty: the soak passed)."""
    problems = []
    epochs = result["epochs"]
    if len(epochs) <= WARMUP:
        return [f"need more than {WARMUP} epochs, got {len(epochs)}"]
    base = epochs[WARMUP - 1]
    for metric, slack in SLACK.items():
        allowed = base[metric] * TOLERANCE + slack
        for n, snap in enumerate(epochs[WARMUP:], start=WARMUP + 1):
            if abs(snap[metric] - base[metric]) > allowed:
                problems.append(
                    f"{metric} after epoch {n}: {snap[metric]} vs {base[metric]} after epoch "
                    f"{WARMUP} (allowed +-{allowed:g})"
                )
                break
    if result["left_behind"]:
        problems.append(f"left behind after close: {result['left_behind']}")
    return problems


def soak(root: Path, executor: str, mode: str, epochs: int, samples: int) -> dict[str, Any]:
    """Run one soak and judge it: {"executor", "mode", "wall_s", "epochs", ..., "problems"}."""
    warm_up()
    before = census()
    start = time.monotonic()
    run = run_sync if mode == "sync" else run_async
    record = run(root, executor, epochs, samples)
    wall = time.monotonic() - start
    settle()
    after = census()
    result = {
        "executor": executor, "mode": mode, "wall_s": round(wall, 2), "epochs": record,
        "before": before.as_dict(), "after_close": after.as_dict(),
        "left_behind": left_behind(before, after),
    }  # fmt: skip
    result["problems"] = verdict(result)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--executor", choices=["thread", "process", "all"], default="all")
    parser.add_argument("--mode", choices=["sync", "async", "all"], default="all")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--out", type=Path, help="write every measurement here (JSON)")
    args = parser.parse_args()
    executors = ["thread", "process"] if args.executor == "all" else [args.executor]
    modes = ["sync", "async"] if args.mode == "all" else [args.mode]
    results = []
    with tempfile.TemporaryDirectory(prefix="aioloader-soak-") as tmp:
        root = Path(tmp)
        write_dataset(root, args.samples)
        for executor in executors:
            for mode in modes:
                results.append(soak(root, executor, mode, args.epochs, args.samples))
                summary = {k: results[-1][k] for k in ("executor", "mode", "wall_s", "problems")}
                print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    failed = [r for r in results if r["problems"]]
    print(json.dumps({"passed": not failed, "runs": len(results), "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
