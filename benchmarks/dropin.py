"""Drop-in: unchanged torch-style user code, run with torch's DataLoader and aioloader's.

The user code is written once, as a torch user writes it, and only the DataLoader class changes:

  (a) map-style: `__getitem__` blocks 3.125 ms (`time.sleep`, a read) and returns
      `np.random.random((1000, 150))`; batch 128 stacked by the default collate; a 50 ms train step;
      `prefetch_factor=4, persistent_workers=True`.
  (b) the same items from an IterableDataset sharded with `get_worker_info()`, and a `collate_fn`
      that returns the list of arrays (the "serialization tax" question's script).
  (c) a folder of 512x384 JPEGs decoded with Pillow in `__getitem__` (random-resized crop to 224,
      float CHW), batch 32, no train step: throughput, and the peak PSS of the process tree.

Each contender runs in a fresh interpreter (`--run WORKLOAD LIBRARY N`) at num_workers 0, 2, 4, 8;
this process samples the PSS of its tree. Figures per contender: seconds per batch over the measured
batches (after a warm-up), the main process's CPU seconds per batch, and for aioloader the bytes that
crossed its worker pipes per batch.

Usage: python benchmarks/dropin.py [--quick] [--workloads abc] [--workers 0,2,4,8]
(--quick: num_workers 2, fewer batches; under 60 s)
The last line printed is a JSON summary: per-N ratios (aioloader s/batch / torch s/batch), the
best-vs-best ratios, main-process CPU per batch of both, pipe bytes per batch.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, IterableDataset, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _pss import run_measured
from decode import make_images

N_ITEMS = 20_000
IO_WAIT_S = 0.003125
SHAPE = (1000, 150)
BATCH = {"a": 128, "b": 128, "c": 32}
STEP_S = {"a": 0.05, "b": 0.05, "c": 0.0}
OUT = 224
WORKERS = (0, 2, 4, 8)
QUICK = (2,)  # --quick: under 60 s
NAMES = {"a": "map-style", "b": "iterable + list collate", "c": "JPEG folder"}


# -- the user's code (module level: torch's workers and aioloader's import it) ------------------------


class SleepyArrays(Dataset[np.ndarray]):
    """(a): each item blocks on a read, then returns a fresh array."""

    def __len__(self) -> int:
        return N_ITEMS

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(IO_WAIT_S)
        return np.random.random(SHAPE)


class SleepyStream(IterableDataset[np.ndarray]):
    """(b): the same items from a stream, each worker taking its share."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        for _ in range(me, N_ITEMS, workers):
            time.sleep(IO_WAIT_S)
            yield np.random.random(SHAPE)


def list_collate(batch: list[np.ndarray]) -> list[np.ndarray]:
    """(b)'s collate_fn: the batch as a list of arrays."""
    return list(batch)


class ImageFolder(Dataset[torch.Tensor]):
    """(c): JPEG files -> random-resized crop -> 3x224x224 float32 in [0, 1]."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        with open(self.paths[index], "rb") as f:
            image: Image.Image = Image.open(io.BytesIO(f.read()))
        image.draft("RGB", (OUT * 2, OUT * 2))
        image = image.convert("RGB")
        w, h = image.size
        area = w * h * np.random.uniform(0.35, 1.0)
        ratio = np.exp(np.random.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw, ch = min(w, round((area * ratio) ** 0.5)), min(h, round((area / ratio) ** 0.5))
        x, y = np.random.randint(0, w - cw + 1), np.random.randint(0, h - ch + 1)
        image = image.resize((OUT, OUT), Image.Resampling.BILINEAR, box=(x, y, x + cw, y + ch))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div_(255)


def make_loader(cls: Any, workload: str, workers: int, images: int) -> Any:
    """The user's DataLoader call, the same for both libraries."""
    extra: dict[str, Any] = {}
    if workers:
        extra = {"prefetch_factor": 4, "persistent_workers": True}
    if workload == "a":
        return cls(
            SleepyArrays(), batch_size=BATCH["a"], shuffle=True, num_workers=workers, **extra
        )
    if workload == "b":
        return cls(
            SleepyStream(), batch_size=BATCH["b"], collate_fn=list_collate, num_workers=workers,
            **extra,
        )  # fmt: skip
    paths = make_images(images)
    return cls(
        ImageFolder(paths), batch_size=BATCH["c"], shuffle=True, num_workers=workers, **extra
    )


# -- one contender, in its own interpreter ------------------------------------------------------------


def batch_bytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    return sum(int(a.nbytes) for a in batch)


def pipe_bytes(loader: Any) -> int | None:
    pool = getattr(loader, "stats", None)
    if pool is None:
        return None
    counts = loader.stats().extra.get("decode_pool", {})
    return int(counts.get("pipe_bytes_sent", 0) + counts.get("pipe_bytes_received", 0))


def run_one(library: str, workload: str, workers: int, warmup: int, measure: int) -> dict[str, Any]:
    if library == "torch":
        from torch.utils.data import DataLoader
    else:
        from aioloader import DataLoader  # type: ignore[assignment]
    images = (warmup + measure) * BATCH["c"]
    loader = make_loader(DataLoader, workload, workers, images)
    stamps: list[float] = []
    nbytes = cpu0 = piped0 = 0.0
    start = time.perf_counter()
    while len(stamps) <= warmup + measure:
        for batch in loader:
            stamps.append(time.perf_counter())
            nbytes = batch_bytes(batch)
            del batch
            if len(stamps) == warmup + 1:
                cpu0, piped0 = time.process_time(), pipe_bytes(loader) or 0
            if len(stamps) > warmup + measure:
                break
            time.sleep(STEP_S[workload])  # the train step
    cpu = (time.process_time() - cpu0) / measure
    piped = pipe_bytes(loader)
    result = {
        "s_per_batch": (stamps[-1] - stamps[warmup]) / measure,
        "ttfb_s": stamps[0] - start,
        "main_cpu_s_per_batch": cpu,
        "pipe_bytes_per_batch": None if piped is None else (piped - piped0) / measure,
        "batch_bytes": nbytes,
    }
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return result


# -- the orchestrator ---------------------------------------------------------------------------------


def measure_one(library: str, workload: str, workers: int, warmup: int, n: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", workload, library, str(workers)]
    cmd += ["--warmup", str(warmup), "--measure", str(n)]
    return run_measured(cmd, f"{library} {workload} N={workers}")


def batches_for(workload: str, library: str, workers: int, quick: bool) -> tuple[int, int]:
    """(warm-up, measured) batches: fewer where a batch is slow (torch reading on one thread). The
    warm-up gives every worker a few batches of its own (each maps the shared memory it writes,
    and its allocator settles) for both libraries alike: the figures are the steady state's."""
    if workload == "c":
        return (3, 8) if quick else (10, 60)
    slow = workers == 0 or (workload == "b" and library == "torch")
    if quick:
        return (1, 3) if slow else (max(3, 2 * workers), 6)
    return (2, 8) if slow else (max(6, 4 * workers), 30)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="abc")
    parser.add_argument("--workers", help="num_workers to try (default 0,2,4,8; --quick 2)")
    parser.add_argument("--run", nargs=3, metavar=("WORKLOAD", "LIBRARY", "N"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--measure", type=int, default=10)
    args = parser.parse_args()
    if args.run:
        workload, library, workers = args.run
        print(json.dumps(run_one(library, workload, int(workers), args.warmup, args.measure)))
        return
    counts = [
        int(n)
        for n in (args.workers or ",".join(map(str, QUICK if args.quick else WORKERS))).split(",")
    ]
    results: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    print(
        f"{'workload':<26}{'N':>3} {'library':<10}{'s/batch':>9}{'ttfb s':>8}{'main CPU s':>11}"
        f"{'pipe B/batch':>14}{'peak PSS MB':>13}",
        flush=True,
    )
    for workload in args.workloads:
        results[workload] = {"torch": {}, "aioloader": {}}
        for workers in counts:
            for library in ("torch", "aioloader"):
                warmup, n = batches_for(workload, library, workers, args.quick)
                r = measure_one(library, workload, workers, warmup, n)
                results[workload][library][workers] = r
                print(
                    f"{NAMES[workload]:<26}{workers:>3} {library:<10}{r['s_per_batch']:>9.3f}"
                    f"{r['ttfb_s']:>8.2f}{r['main_cpu_s_per_batch']:>11.3f}"
                    f"{fmt(r['pipe_bytes_per_batch'], ',.0f'):>14}{r['peak_pss_mb']:>13.0f}",
                    flush=True,
                )
    print(json.dumps(summary(results)))


def summary(results: dict[str, dict[str, dict[int, dict[str, Any]]]]) -> dict[str, Any]:
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d")}
    for workload, by_lib in results.items():
        ours, theirs = by_lib["aioloader"], by_lib["torch"]
        ratios = {n: ours[n]["s_per_batch"] / theirs[n]["s_per_batch"] for n in ours if n in theirs}
        best_ours = min(r["s_per_batch"] for r in ours.values())
        best_torch = min(r["s_per_batch"] for r in theirs.values())
        piped = [r["pipe_bytes_per_batch"] / r["batch_bytes"] for n, r in ours.items() if n > 0]
        out[workload] = {
            "ratio_per_workers": {str(n): round(v, 3) for n, v in ratios.items()},
            "best_vs_best": round(best_ours / best_torch, 3),
            "main_cpu_s_per_batch": {
                lib: {str(n): round(r["main_cpu_s_per_batch"], 4) for n, r in rs.items()}
                for lib, rs in (("aioloader", ours), ("torch", theirs))
            },
            "pipe_bytes_per_batch": {
                str(n): round(r["pipe_bytes_per_batch"]) for n, r in ours.items() if n > 0
            },
            "pipe_share_max": round(max(piped), 6) if piped else None,
        }
        if workload == "c" and 2 in ours and 2 in theirs:
            out[workload]["throughput_ratio_n2"] = round(
                theirs[2]["s_per_batch"] / ours[2]["s_per_batch"], 3
            )
            out[workload]["memory_ratio_n2"] = round(
                ours[2]["peak_pss_mb"] / theirs[2]["peak_pss_mb"], 3
            )
    return out


if __name__ == "__main__":
    main()
