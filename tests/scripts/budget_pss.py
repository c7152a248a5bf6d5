"""Peak memory growth (PSS of the process and its workers) of a loader decoding 10 MB samples in
worker processes behind a slow consumer; growth is counted from the first batch on, once the
workers have started.

Usage: budget_pss.py BUDGET_MB SAMPLE_MB BATCH_SIZE  -> prints JSON {"peak_growth_mb": ..., "batch_mb": ...}
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from functools import partial

import numpy as np
import psutil

import aioloader

# The tree's PSS is read at this period from a sampler thread.
SAMPLE_PERIOD_S = 0.02


def fetch(key: int) -> int:
    return key


def decode(sample_mb: int, key: int) -> np.ndarray:
    out = np.empty(sample_mb * 2**20 // 8)
    out.fill(key)  # touch every page, as a decoder would
    return out


def tree_pss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_full_info().pss
    return total


def main(budget: int, sample_mb: int, batch_size: int) -> None:
    proc = psutil.Process()
    loader = aioloader.Loader(
        list(range(12 * batch_size)), fetch, decode=partial(decode, sample_mb),
        batch_size=batch_size, prefetch=8, concurrency=16, executor="process", workers=2,
        max_bytes_in_flight=budget,
    )  # fmt: skip
    stop = threading.Event()
    with loader:
        batches = iter(loader)
        next(batches)
        peak = [tree_pss(proc)]
        base = peak[0]

        def sample() -> None:
            while not stop.wait(SAMPLE_PERIOD_S):
                peak[0] = max(peak[0], tree_pss(proc))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for batch in batches:
            time.sleep(0.1)  # a slow model step
            del batch
        stop.set()
        sampler.join()
    growth = (peak[0] - base) / 2**20
    print(json.dumps({"peak_growth_mb": growth, "batch_mb": sample_mb * batch_size}))


if __name__ == "__main__":
    main(int(sys.argv[1]) * 2**20, int(sys.argv[2]), int(sys.argv[3]))
