"""W3, CPU-bound decode: torch DataLoader(num_workers=2) vs aioloader's process and thread executors.

2,000 generated 512x384 JPEGs on local disk (cached under data/w3/). Each sample: read the file,
decode with Pillow, random-resized crop to 224x224, to a float32 CHW tensor in [0, 1] (602 KB).
Batches of 32; the consumer only touches each batch.

torch's workers are persistent (like aioloader's pool), so no epoch pays for starting them twice.
Every contender runs in its own fresh interpreter (python benchmarks/decode.py --run NAME) so that no
worker pool, forkserver or allocator state leaks from one into the next. This process samples the PSS
of the contender and all its descendants (psutil, smaps_rollup) every `PSS_PERIOD_S` and keeps the
peak. Throughput is measured over the epochs after the first (pools warm, files in the page cache);
`ttfb_s` is the first epoch's time to first batch, worker start-up included. With several rounds
(contenders alternate order) each figure is the best round's: noise on a shared machine only ever
slows a run or swells it.

Usage: python benchmarks/decode.py [--quick] [--images N] [--epochs E] [--rounds R] [--rows]
--rows adds a projection (not the Loader API): the process executor filling batch rows in place.
The last line printed is a JSON summary with throughput_ratio and memory_ratio (process executor /
torch DataLoader) and ttfb_s (process executor).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import io
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _pss import run_measured
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import aioloader

ROOT = Path(__file__).resolve().parent.parent / "data" / "w3"
SIZE = (512, 384)
OUT = 224
BATCH = 32
WORKERS = 2
CONTENDERS = ("torch", "process", "thread")
ROWS = "rows"  # --rows: a projection of batch-row writes, not part of the summary's ratios


# -- data ---------------------------------------------------------------------------------------------


def make_images(n: int) -> list[str]:
    """The first `n` JPEGs, generated once (smooth random colour fields plus noise, quality 90)."""
    ROOT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        path = ROOT / f"{i:05d}.jpg"
        paths.append(str(path))
        coarse = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
        if path.exists():
            continue
        image = Image.fromarray(coarse).resize(SIZE, Image.Resampling.BICUBIC)
        noisy = np.asarray(image, dtype=np.int16) + rng.integers(-12, 13, (*SIZE[::-1], 3))
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(path, quality=90)
    return paths


# -- the sample pipeline (module level: workers import it) --------------------------------------------


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _generator() -> np.random.Generator:
    try:
        return aioloader.sample_np_generator()  # aioloader: seeded from (seed, epoch, position)
    except RuntimeError:
        return np.random.default_rng()  # torch's workers: per-worker entropy


def decode(raw: bytes) -> torch.Tensor:
    """JPEG bytes -> random-resized crop -> 3x224x224 float32 in [0, 1]."""
    image: Image.Image = Image.open(io.BytesIO(raw))
    image.draft("RGB", (OUT * 2, OUT * 2))
    image = image.convert("RGB")
    rng = _generator()
    w, h = image.size
    area = w * h * rng.uniform(0.35, 1.0)
    ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
    cw, ch = min(w, round((area * ratio) ** 0.5)), min(h, round((area / ratio) ** 0.5))
    x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
    image = image.resize((OUT, OUT), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
    array = np.array(image)  # writable: torch.from_numpy warns on a read-only array
    return torch.from_numpy(array).permute(2, 0, 1).float().div_(255)


class Jpegs(Dataset[torch.Tensor]):
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return decode(read(self.paths[index]))


class RowsLoader:
    """Not the Loader API: what batch-row writes would give once the pipeline uses them (--rows).

    The process executor's `batch_buffer` by hand: each batch is a tensor in shared memory whose rows
    the workers fill in place (no per-sample slots, no collate copy); 2 batches being filled and 1
    ready, as the Loader's prefetch=2 would hold.
    """

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self.executor = aioloader.ProcessExecutor(WORKERS)

    def __iter__(self) -> Any:
        batches: queue.Queue[torch.Tensor | None] = queue.Queue(maxsize=1)
        producer = threading.Thread(target=lambda: asyncio.run(self._produce(batches)))
        producer.start()
        while (batch := batches.get()) is not None:
            yield batch
        producer.join()

    async def _batch(self, chunk: list[str]) -> torch.Tensor:
        buffer = self.executor.batch_buffer((len(chunk), 3, OUT, OUT), torch.float32)
        assert buffer is not None

        async def row(i: int, path: str) -> None:
            raw = await asyncio.to_thread(read, path)
            sample = await self.executor.run(decode, raw, into=buffer.row(i))
            if sample.data_ptr() != buffer.tensor[i].data_ptr():
                buffer.tensor[i].copy_(sample)

        await asyncio.gather(*(row(i, path) for i, path in enumerate(chunk)))
        return buffer.tensor

    async def _produce(self, batches: queue.Queue[torch.Tensor | None]) -> None:
        ahead: collections.deque[asyncio.Task[torch.Tensor]] = collections.deque()
        for start in range(0, len(self.paths), BATCH):
            ahead.append(asyncio.create_task(self._batch(self.paths[start : start + BATCH])))
            if len(ahead) == 2:
                await asyncio.to_thread(batches.put, await ahead.popleft())
        while ahead:
            await asyncio.to_thread(batches.put, await ahead.popleft())
        await asyncio.to_thread(batches.put, None)

    def close(self) -> None:
        self.executor.close()


# -- one contender (in its own interpreter) -----------------------------------------------------------


def run_one(name: str, n: int, epochs: int) -> dict[str, Any]:
    paths = make_images(n)
    if name == "torch":
        loader: Any = DataLoader(
            Jpegs(paths), batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
        )
    elif name == "rows":
        loader = RowsLoader(paths)
    else:
        torch.set_num_threads(1)  # the collate thread stacks on busy cores, as torch's workers do
        loader = aioloader.Loader(
            paths, read, decode=decode, batch_size=BATCH, executor=name, workers=WORKERS
        )
    result = time_epochs(loader, epochs)
    if name != "torch":
        loader.close()
    return result


def time_epochs(loader: Any, epochs: int) -> dict[str, Any]:
    """samples/s over the epochs after the first, and the first epoch's time to first batch."""
    ttfb, seconds, samples = 0.0, 0.0, 0
    for epoch in range(epochs):
        start = time.perf_counter()
        count = 0
        for batch in loader:
            if count == 0 and epoch == 0:
                ttfb = time.perf_counter() - start
            count += len(batch)
            assert batch.shape[1:] == (3, OUT, OUT)
            del batch
        if epoch > 0:
            seconds += time.perf_counter() - start
            samples += count
    return {"samples_per_s": samples / seconds, "ttfb_s": ttfb}


# -- the orchestrator ---------------------------------------------------------------------------------


def measure(name: str, n: int, epochs: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", name, "--images", str(n), "--epochs", str(epochs)]
    return run_measured(cmd, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="600 images, 2 epochs, 1 round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--rows", action="store_true", help="also run the batch-row projection")
    parser.add_argument("--run", choices=(*CONTENDERS, ROWS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.images or (600 if args.quick else 2000)
    epochs = args.epochs or (2 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 2)
    if args.run:
        print(json.dumps(run_one(args.run, n, epochs)), flush=True)
        return
    make_images(n)
    print(f"W3 decode: {n} JPEGs {SIZE[0]}x{SIZE[1]} -> 3x{OUT}x{OUT} float32, batch {BATCH}, "
          f"{WORKERS} workers, {epochs} epochs (the first is warm-up), {rounds} round(s), "
          f"{len(os.sched_getaffinity(0))} cores")  # fmt: skip
    print(f"{'contender':<34} {'samples/s':>10} {'ttfb s':>8} {'peak PSS MB':>12}")
    results: dict[str, dict[str, Any]] = {}
    contenders = (*CONTENDERS, ROWS) if args.rows else CONTENDERS
    for round_ in range(rounds):
        for name in contenders if round_ % 2 == 0 else contenders[::-1]:
            r = measure(name, n, epochs)
            label = {
                "torch": "torch DataLoader(num_workers=2)",
                ROWS: "process + batch rows (projection)",
            }.get(name, f'aioloader "{name}"')
            print(f"{label:<34} {r['samples_per_s']:>10.1f} {r['ttfb_s']:>8.2f} "
                  f"{r['peak_pss_mb']:>12.0f}", flush=True)  # fmt: skip
            best = results.setdefault(name, r)
            for key in r:
                best[key] = (max if key == "samples_per_s" else min)(best[key], r[key])
    torch_r, proc, thread = results["torch"], results["process"], results["thread"]
    summary = {
        "throughput_ratio": round(proc["samples_per_s"] / torch_r["samples_per_s"], 3),
        "memory_ratio": round(proc["peak_pss_mb"] / torch_r["peak_pss_mb"], 3),
        "ttfb_s": round(proc["ttfb_s"], 3),
        "thread_throughput_ratio": round(thread["samples_per_s"] / torch_r["samples_per_s"], 3),
        "thread_memory_ratio": round(thread["peak_pss_mb"] / torch_r["peak_pss_mb"], 3),
        "torch_ttfb_s": round(torch_r["ttfb_s"], 3),
        "images": n,
        "epochs": epochs,
    }
    if args.rows:
        rows = results[ROWS]
        summary["rows_throughput_ratio"] = round(
            rows["samples_per_s"] / torch_r["samples_per_s"], 3
        )
        summary["rows_memory_ratio"] = round(rows["peak_pss_mb"] / torch_r["peak_pss_mb"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
