"""H2D overlap: does aioloader hide a 100 MB host-to-device copy behind a matmul-heavy step?

The same model step (`layers` times `x = tanh(x @ W)` on a (3200, 8192) float32 batch, then
`loss.item()` as a training loop that logs its loss does) is timed three ways in one run:

- resident: the batches are already on the device: the floor;
- aioloader: `Loader(..., device="cuda")`: batches are staged in pinned memory and copied on a side
  stream while the previous step computes;
- torch: `DataLoader(pin_memory=True, num_workers=N)` and `.to(device, non_blocking=True)` in the loop
  (the copy is queued on the compute stream, in line with the steps);
- front door: the same torch user's code with `from aioloader import DataLoader` (batches pinned on the
  host, as torch's are; the copy is still the loop's own).

Each batch is 100 samples of (32, 8192) float32 (1 MiB each): 104.9 MB. `layers` is calibrated so that
the resident step takes about `--step-ms`. The goal: aioloader's step within 5% of the resident one.

Usage: python benchmarks/h2d_overlap.py [--quick] [--step-ms 60] [--workers N]
The last line printed is a JSON summary. Without CUDA it says so and exits 0. Needs the transfer stage
wired into `Loader` (its `device` argument).
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import aioloader
from aioloader import Loader

ROWS, DIM, BATCH = 32, 8192, 100  # one sample: 1 MiB of float32; one batch: 100 MiB
DISTINCT_SAMPLES = 8
WORKLOAD = "h2d_overlap"

Step = Callable[[torch.Tensor], float]


class Samples(Dataset[torch.Tensor]):
    """`n` samples cycling over a few pre-made ones: reading costs nothing, moving them is the test."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.pool = [torch.randn(ROWS, DIM, generator=gen) for _ in range(DISTINCT_SAMPLES)]
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.pool[i % DISTINCT_SAMPLES]


def make_step(weight: torch.Tensor, layers: int) -> Step:
    """One training-like step: `layers` matmuls, then the loss read back to the host."""

    def step(x: torch.Tensor) -> float:
        h = x
        for _ in range(layers):
            h = torch.tanh(h @ weight)
        return float(h.mean().item())

    return step


def timed(
    batches: Iterable[torch.Tensor],
    step: Step,
    warmup: int,
    steps: int,
    move: Callable[[torch.Tensor], torch.Tensor],
) -> float:
    """Seconds per step over `steps` steps, after `warmup` untimed ones."""
    it: Iterator[torch.Tensor] = iter(batches)
    for _ in range(warmup):
        step(move(next(it)))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step(move(next(it)))
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def calibrate(weight: torch.Tensor, x: torch.Tensor, step_s: float) -> int:
    """The number of layers for which one step on resident data takes about `step_s`."""
    one = make_step(weight, 1)
    for _ in range(3):
        one(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        one(x)
    torch.cuda.synchronize()
    return max(1, round(step_s / ((time.perf_counter() - start) / 10)))


def run_resident(device: torch.device, step: Step, warmup: int, steps: int) -> float:
    data = Samples(2 * BATCH)
    resident = [torch.stack([data[b * BATCH + i] for i in range(BATCH)]).to(device) for b in (0, 1)]
    return timed(itertools.cycle(resident), step, warmup, steps, lambda x: x)


def run_aioloader(device: torch.device, step: Step, warmup: int, steps: int) -> float:
    data = Samples((warmup + steps) * BATCH)

    async def fetch(i: int) -> torch.Tensor:
        return data[i]

    transfer: dict[str, Any] = {"device": device}  # the transfer stage's argument (see module doc)
    loader: Loader[torch.Tensor] = Loader(range(len(data)), fetch, batch_size=BATCH, **transfer)
    with loader:
        return timed(loader, step, warmup, steps, lambda x: x)


def run_torch(
    device: torch.device, step: Step, warmup: int, steps: int, workers: int, loader_type: Any = None
) -> float:
    """A torch user's loop: `loader_type` is torch's DataLoader, or aioloader's (the front door)."""
    data = Samples((warmup + steps) * BATCH)
    prefetch = 2 if workers else None
    loader = (loader_type or DataLoader)(
        data, batch_size=BATCH, num_workers=workers, pin_memory=True, prefetch_factor=prefetch
    )
    try:
        return timed(loader, step, warmup, steps, lambda x: x.to(device, non_blocking=True))
    finally:
        getattr(loader, "close", lambda: None)()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, one repeat (< 60 s)")
    parser.add_argument("--step-ms", type=float, default=60.0, help="resident step time to aim at")
    workers = min(8, (os.cpu_count() or 2) // 2)
    parser.add_argument("--workers", type=int, default=workers, help="torch DataLoader workers")
    return parser.parse_args()


def skip(reason: str, code: int = 0) -> None:
    print(f"{WORKLOAD}: {reason}; nothing measured.")
    print(json.dumps({"workload": WORKLOAD, "skipped": reason}))
    sys.exit(code)


def main() -> None:
    args = parse()
    if not torch.cuda.is_available():
        skip("no CUDA device")
    if "device" not in inspect.signature(Loader).parameters:
        skip("Loader has no `device` argument yet (transfer stage not wired in)", code=1)
    device = torch.device("cuda", torch.cuda.current_device())
    warmup, steps, repeats = (3, 15, 1) if args.quick else (5, 60, 3)
    torch.set_grad_enabled(False)
    weight = torch.randn(DIM, DIM, device=device) / DIM**0.5
    probe = torch.randn(BATCH * ROWS, DIM, device=device)
    layers = calibrate(weight, probe, args.step_ms / 1000)
    del probe
    step = make_step(weight, layers)
    name, batch_mb = torch.cuda.get_device_name(device), BATCH * ROWS * DIM * 4 / 1e6
    print(
        f"{WORKLOAD}: {name}, batch {batch_mb:.1f} MB, {layers} layers, {steps} steps x {repeats}"
    )
    runs: dict[str, list[float]] = {"resident": [], "aioloader": [], "front_door": [], "torch": []}
    for _ in range(repeats):  # interleaved, so that drift hits every mode alike
        runs["resident"].append(run_resident(device, step, warmup, steps))
        runs["aioloader"].append(run_aioloader(device, step, warmup, steps))
        runs["front_door"].append(
            run_torch(device, step, warmup, steps, args.workers, aioloader.DataLoader)
        )
        runs["torch"].append(run_torch(device, step, warmup, steps, args.workers))
        print("  " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in runs.items()))
    resident, ours, door, theirs = (
        statistics.median(runs[k]) for k in ("resident", "aioloader", "front_door", "torch")
    )
    summary: dict[str, Any] = {
        "workload": WORKLOAD,
        "resident_step_s": round(resident, 5),
        "aioloader_step_s": round(ours, 5),
        "torch_step_s": round(theirs, 5),
        "overhead_vs_resident": round(ours / resident - 1, 4),
        "ratio_vs_torch": round(ours / theirs, 4),
        "front_door_step_s": round(door, 5),
        "front_door_ratio_vs_torch": round(door / theirs, 4),
        "within_5pct": ours <= 1.05 * resident,
        "batch_mb": round(batch_mb, 1),
        "layers": layers,
        "steps": steps,
        "repeats": repeats,
        "torch_workers": args.workers,
        "device": name,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
