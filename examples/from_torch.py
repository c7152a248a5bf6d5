"""Coming from torch's DataLoader: the same script with one import changed, then the native Loader.

A map-style dataset whose `__getitem__` waits 4 ms (a disk or network read) is read three ways:
torch's DataLoader, `aioloader.DataLoader` with the very same arguments (same batches, same order:
checked here), and `aioloader.Loader`, which takes the dataset too and adds the arguments torch has
no word for (`concurrency`, `executor`, `workers`, `timeout`, ...).

Usage: python examples/from_torch.py
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.utils.data

import aioloader

N_SAMPLES = 96
BATCH = 16
READ_S = 0.004


class SlowReads(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """Sample i: a 4-value tensor and the label i % 3, after a 4 ms wait (the read)."""

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(READ_S)
        return torch.full((4,), float(i)), i % 3


def epoch(loader: Any) -> tuple[list[list[int]], float]:
    """The sample ids of each batch, and the seconds the epoch took."""
    t0 = time.perf_counter()
    ids = [x[:, 0].int().tolist() for x, _ in loader]
    return ids, time.perf_counter() - t0


def main() -> int:
    dataset = SlowReads()
    # 1. torch's DataLoader
    torch_batches, torch_s = epoch(
        torch.utils.data.DataLoader(
            dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
        )
    )
    # 2. the same call, from aioloader: num_workers=0 reads `concurrency` samples at once (threads)
    with aioloader.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0)
    ) as loader:
        print(loader)
        same_batches, same_s = epoch(loader)
    # 3. the native Loader: a dataset (or keys and a fetch, or a source), plus its own arguments
    with aioloader.Loader(
        dataset, batch_size=BATCH, shuffle=True, seed=0, concurrency=32, executor="inline"
    ) as native:
        print(native)
        native_batches, native_s = epoch(native)
    print(f"torch DataLoader:    {torch_s:.2f} s per epoch")
    print(f"aioloader.DataLoader {same_s:.2f} s per epoch")
    print(f"aioloader.Loader     {native_s:.2f} s per epoch")
    same = same_batches == torch_batches
    print(f"same batches as torch's DataLoader: {'yes' if same else 'NO'}")
    every = sorted(i for batch in native_batches for i in batch) == list(range(N_SAMPLES))
    print(f"the Loader read every sample once: {'yes' if every else 'NO'}")
    return 0 if same and every else 1


if __name__ == "__main__":
    sys.exit(main())
