"""The seed workload as a torch user writes it: `__getitem__` returns a 1.2 MB array, batch 128
(153 MB batches), through aioloader's DataLoader.

Usage: seed_workload.py NUM_WORKERS PREFETCH_FACTOR BATCHES
  -> prints JSON {"batches": ..., "s_per_batch": ..., "budget": ..., "budget_origin": ...}
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from torch.utils.data import Dataset

from aioloader import DataLoader

SHAPE = (1000, 150)
BATCH = 128
WAIT_S = 0.003125  # a read
STEP_S = 0.05  # a train step


class SleepyArrays(Dataset[np.ndarray]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(WAIT_S)
        return np.random.random(SHAPE)


def main(workers: int, prefetch: int, batches: int) -> None:
    loader = DataLoader(
        SleepyArrays(BATCH * batches), batch_size=BATCH, num_workers=workers,
        prefetch_factor=prefetch,
    )  # fmt: skip
    got, start = 0, 0.0
    for batch in loader:
        assert tuple(batch.shape) == (BATCH, *SHAPE)
        got += 1
        if got == 2:
            start = time.perf_counter()
        del batch
        time.sleep(STEP_S)
    took = time.perf_counter() - start
    stats = loader.stats()
    print(json.dumps({
        "batches": got, "s_per_batch": took / max(1, got - 2),
        "budget": stats.max_bytes_in_flight, "budget_origin": stats.budget_origin,
    }))  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
