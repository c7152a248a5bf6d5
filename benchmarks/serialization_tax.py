"""W1, the "serialization tax": torch DataLoader vs aioloader on an I/O-bound stream of large items.

A stream of 10,000 items; each waits 3.125 ms on I/O and returns `np.random.random((1000, 150))`
(1.2 MB of float64). Batches of 128 are stacked into one tensor; the consumer's train step is
`time.sleep(0.05)`. Worker processes pay for every batch twice: written into fresh shared memory, then
mapped by the main process. aioloader keeps everything in one process and stacks into recycled buffers.

Usage: python benchmarks/serialization_tax.py [--quick]
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from aioloader import BufferPool, Loader

N_ITEMS = 10_000
IO_WAIT_S = 0.003125
SHAPE = (1000, 150)
BATCH = 128
STEP_S = 0.05
BATCH_BYTES = BATCH * int(np.prod(SHAPE)) * 8  # float64
PROCESS = "async wait, decode in processes, global RNG"  # the process pool's figures (and W4's)


def make_item() -> np.ndarray:
    """One item, as in the forum case (numpy's global generator)."""
    return np.random.random(SHAPE)


_local = threading.local()


def make_item_local(_key: Any = None) -> np.ndarray:
    """One item from a per-thread MT19937 (the same generator without the global generator's lock).

    Worker processes each own a global generator; threads would all queue on one lock.
    """
    rng = getattr(_local, "rng", None)
    if rng is None:
        rng = _local.rng = np.random.RandomState()
    return rng.random_sample(SHAPE)


class SleepyArrays(Dataset[np.ndarray]):
    """Map-style dataset: each item sleeps on "I/O", then returns a fresh array."""

    def __len__(self) -> int:
        return N_ITEMS

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(IO_WAIT_S)
        return make_item()


def fetch_global(_key: int) -> np.ndarray:
    time.sleep(IO_WAIT_S)
    return make_item()


def fetch_local(_key: int) -> np.ndarray:
    time.sleep(IO_WAIT_S)
    return make_item_local()


async def fetch_wait(key: int) -> int:
    await asyncio.sleep(IO_WAIT_S)
    return key


def generate_global(_key: int) -> np.ndarray:
    return make_item()


@dataclass
class Result:
    name: str
    s_per_batch: float
    ttfb_s: float
    cpu_s_per_batch: float  # this process and its workers, over the measured batches
    pipe_bytes_per_batch: float | None = None  # W4: bytes through the worker pipes, both ways


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, and theirs (DataLoader's and aioloader's workers)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in map(int, (task / "children").read_text().split()):
                found += [child, *descendants(child)]
    return found


def cpu_seconds() -> float:
    """CPU time used so far by this process and the live processes it started."""
    total = time.process_time()
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def time_batches(
    make: Callable[[], Iterable[Any]],
    warmup: int,
    measure: int,
    pipe_bytes: Callable[[], int] | None = None,
) -> Result:
    """Time to first batch, then mean seconds (and CPU seconds, and bytes through worker pipes when
    `pipe_bytes` counts them) per batch over the measured ones."""
    start = time.perf_counter()
    stamps: list[float] = []
    for batch in make():
        stamps.append(time.perf_counter())
        assert batch.shape == (BATCH, *SHAPE)
        del batch
        if len(stamps) == warmup + 1:
            cpu_start = cpu_seconds()
            pipe_start = pipe_bytes() if pipe_bytes else 0
        if len(stamps) > warmup + measure:
            break
        time.sleep(STEP_S)  # the train step
    cpu = (cpu_seconds() - cpu_start) / measure
    piped = (pipe_bytes() - pipe_start) / measure if pipe_bytes else None
    return Result("", (stamps[-1] - stamps[warmup]) / measure, stamps[0] - start, cpu, piped)


def best_of(repeats: int, name: str, once: Callable[[], Result]) -> Result | None:
    """The fastest of `repeats` runs (the machine may be shared; noise only ever slows a run)."""
    try:
        result = min((once() for _ in range(repeats)), key=lambda r: r.s_per_batch)
    except Exception as exc:  # one broken config should not cost the others
        print(f"{name:<64} failed: {exc!r}", flush=True)
        return None
    result.name = name
    print_table([result], header=False)
    return result


def run_torch(workers: int, warmup: int, measure: int) -> Result:
    extra: dict[str, Any] = {}
    if workers:
        extra = {"prefetch_factor": 4, "persistent_workers": True}
    loaders = [DataLoader(SleepyArrays(), batch_size=BATCH, num_workers=workers, **extra)]
    try:
        return time_batches(lambda: loaders[0], warmup, measure)
    finally:
        loaders.clear()  # persistent workers stop when their loader goes
        gc.collect()
        for child in multiprocessing.active_children():  # joins the workers that have exited
            child.join(5)
        assert not multiprocessing.active_children(), "DataLoader workers still running"


def numpy_collate(pool: BufferPool) -> Callable[[list[np.ndarray]], torch.Tensor]:
    """Stack arrays into the pool's recycled buffers with numpy: one thread, no OpenMP team."""

    def collate(samples: list[np.ndarray]) -> torch.Tensor:
        out = pool.take((len(samples), *samples[0].shape), torch.as_tensor(samples[0]).dtype)
        np.stack(samples, out=out.numpy())
        return out

    return collate


def run_aio(kwargs: dict[str, Any], warmup: int, measure: int) -> Result:
    kwargs = dict(kwargs)
    if kwargs.get("collate") == "numpy":
        kwargs["collate"] = numpy_collate(BufferPool(per_shape=kwargs.get("prefetch", 2) + 3))
    before = torch.get_num_threads()
    torch.set_num_threads(kwargs.pop("intra_op_threads", before))  # inherited by the collate thread
    loader: Loader[torch.Tensor] | None = None

    def make() -> Iterable[Any]:
        nonlocal loader
        loader = Loader(range(N_ITEMS), batch_size=BATCH, **kwargs)
        return loader

    def pipe_bytes() -> int:
        assert loader is not None
        pool = loader.stats().extra.get("decode_pool", {})
        return int(pool.get("pipe_bytes_sent", 0) + pool.get("pipe_bytes_received", 0))

    process = kwargs.get("executor") == "process"
    try:
        return time_batches(make, warmup, measure, pipe_bytes if process else None)
    finally:
        if loader is not None:
            loader.close()
        torch.set_num_threads(before)


def aio_configs(quick: bool) -> dict[str, dict[str, Any]]:
    """The aioloader configurations to try (name -> Loader keyword arguments).

    Configs run with 1 intra-op thread (torch.set_num_threads(1) before the loader starts its threads)
    unless named "2 intra-op" or "numpy collate": torch's stack in the collate thread is then
    single-threaded, as in DataLoader's workers. An OpenMP team of 2 on 2 cores that the decode threads
    keep busy stalls at every barrier. "numpy collate" stacks with numpy into a BufferPool instead.
    "per-thread RNG": each thread draws from its own MT19937, as each worker process does (numpy's
    global generator would serialize the threads on its lock); "decode in processes" gives each
    worker process its own global generator, as DataLoader's workers have.
    """
    one = {"intra_op_threads": 1}
    decode = {"fetch": fetch_wait, "decode": make_item_local, "executor": "thread",
              "workers": len(os.sched_getaffinity(0))}  # fmt: skip
    configs: dict[str, dict[str, Any]] = {
        "fetch in 64 threads, global RNG": {"fetch": fetch_global, "concurrency": 64, **one},
        "fetch in 64 threads, per-thread RNG": {"fetch": fetch_local, "concurrency": 64, **one},
        "async wait, decode in threads, global RNG": {**decode, "decode": generate_global, **one},
        "async wait, decode in threads, c64": {**decode, "concurrency": 64, **one},
        "async wait, decode in threads, c16": {**decode, "concurrency": 16, **one},
        "async wait, decode in threads, c16, 2 intra-op": {**decode, "concurrency": 16},
        "async wait, decode in threads, c64, numpy collate": {
            **decode, "concurrency": 64, "collate": "numpy",
        },
        "fetch in 64 threads, per-thread RNG, numpy collate": {
            "fetch": fetch_local, "concurrency": 64, "collate": "numpy",
        },
        PROCESS: {
            **decode, "decode": generate_global, "executor": "process", "concurrency": 64, **one,
        },
    }  # fmt: skip
    if quick:
        keep = ("fetch in 64 threads, per-thread RNG", "async wait, decode in threads, c64",
                PROCESS)  # fmt: skip
        configs = {name: configs[name] for name in keep}
    return configs


def measure_floor(repeats: int = 3) -> tuple[float, float]:
    """(seconds per batch at best, CPU seconds to make one batch's items on one core)."""
    cpu = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(BATCH):
            item = make_item()
            del item
        cpu = min(cpu, time.thread_time() - start)
    return max(cpu / len(os.sched_getaffinity(0)), STEP_S), cpu


def print_table(results: list[Result], header: bool = True) -> None:
    if header:
        print(
            f"{'configuration':<64} {'s/batch':>8} {'samples/s':>9} {'ttfb s':>7} {'CPU s/batch':>11}"
        )
    for r in results:
        print(f"{r.name:<64} {r.s_per_batch:>8.4f} {BATCH / r.s_per_batch:>9.0f} {r.ttfb_s:>7.3f} "
              f"{r.cpu_s_per_batch:>11.3f}", flush=True)  # fmt: skip


def summary(torch_results: list[Result], aio_results: list[Result], floor: float) -> str:
    best_torch = min(torch_results, key=lambda r: r.s_per_batch)
    best_aio = min(aio_results, key=lambda r: r.s_per_batch)
    print(f"best: {best_torch.name} vs {best_aio.name}")
    process = next((r for r in aio_results if r.pipe_bytes_per_batch is not None), None)
    pool: dict[str, Any] = {}
    if process is not None:
        print(f"process pool: {process.pipe_bytes_per_batch:.0f} bytes through the pipes per batch "
              f"of {BATCH_BYTES} bytes")  # fmt: skip
        pool = {
            "process_s_per_batch": round(process.s_per_batch, 4),
            "process_ratio_vs_torch": round(process.s_per_batch / best_torch.s_per_batch, 3),
            "process_ratio_vs_floor": round(process.s_per_batch / floor, 3),
            "pipe_bytes_per_batch": round(process.pipe_bytes_per_batch or 0),
            "batch_bytes": BATCH_BYTES,
            "pipe_share": round((process.pipe_bytes_per_batch or 0) / BATCH_BYTES, 6),
        }
    return json.dumps({
        "workload": "serialization_tax",
        "torch_best_s_per_batch": round(best_torch.s_per_batch, 4),
        "aioloader_s_per_batch": round(best_aio.s_per_batch, 4),
        "floor_s_per_batch": round(floor, 4),
        "ratio_vs_torch": round(best_aio.s_per_batch / best_torch.s_per_batch, 3),
        "ratio_vs_floor": round(best_aio.s_per_batch / floor, 3),
        "ttfb_s": {"torch": round(best_torch.ttfb_s, 3), "aioloader": round(best_aio.ttfb_s, 3),
                   **({"process": round(process.ttfb_s, 3)} if process else {})},
        **pool,
    })  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer configs and batches (< 60 s)")
    parser.add_argument(
        "--repeats", type=int, help="runs per config, the best counts (1 quick, 2 full)"
    )
    args = parser.parse_args()
    args.repeats = args.repeats or (1 if args.quick else 2)
    # warm-up: long enough for the process pool to have made its batch buffers
    warmup, measure = (10, 8) if args.quick else (10, 20)
    print(f"{len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, numpy {np.__version__}, "
          f"warm-up {warmup} batches, measured {measure}, best of {args.repeats}")  # fmt: skip
    floor, cpu = measure_floor()
    print(f"one batch's items on one core: {cpu:.3f} s CPU -> floor {floor:.4f} s/batch")
    print_table([])
    torch_results = []  # torch first: its workers fork before aioloader starts any thread
    for workers in (0, 8) if args.quick else (0, 2, 4, 8):
        repeats = 1 if workers == 0 else args.repeats  # 0 workers is never close
        name = f"torch DataLoader num_workers={workers}"
        torch_results.append(
            best_of(repeats, name, lambda w=workers: run_torch(w, warmup, measure))
        )
    aio_results = [
        best_of(args.repeats, f"aioloader {name}", lambda kw=kwargs: run_aio(kw, warmup, measure))
        for name, kwargs in aio_configs(args.quick).items()
    ]
    line = summary([r for r in torch_results if r], [r for r in aio_results if r], floor)
    print(line)


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # 8 workers on 2 cores
    main()
