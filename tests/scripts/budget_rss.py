"""Peak RSS growth of a loader holding 10 MB samples behind a slow consumer.

Usage: budget_rss.py BUDGET_MB|none [SAMPLE_MB BATCH_SIZE]
  -> prints JSON {"peak_growth_mb": ..., "max_held_mb": ..., "batch_mb": ...}
"""

from __future__ import annotations

import json
import sys
import threading
import time

import numpy as np
import psutil

import aioloader

SAMPLE_MB = 10  # (the defaults)
BATCH_SIZE = 4
# psutil is read at this period from a sampler thread (RSS is not something anything signals).
SAMPLE_PERIOD_S = 0.01


def fetch(key: int) -> np.ndarray:
    out = np.empty(SAMPLE_MB * 2**20 // 8)  # (SAMPLE_MB as given on the command line)
    out.fill(key)  # touch every page, as a decoder would
    return out


def main(budget: int | None) -> None:
    proc = psutil.Process()
    fetch(0)
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_PERIOD_S):
            peak[0] = max(peak[0], proc.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    max_held = 0
    loader = aioloader.Loader(
        list(range(12 * BATCH_SIZE)), fetch, batch_size=BATCH_SIZE, prefetch=8, concurrency=16,
        max_bytes_in_flight=budget,
    )  # fmt: skip
    with loader:
        for batch in loader:
            max_held = max(max_held, loader.stats().held_bytes)
            time.sleep(0.1)  # a slow model step
            del batch
    stop.set()
    sampler.join()
    growth, held = (peak[0] - base) / 2**20, max_held / 2**20
    print(
        json.dumps(
            {"peak_growth_mb": growth, "max_held_mb": held, "batch_mb": SAMPLE_MB * BATCH_SIZE}
        )
    )


if __name__ == "__main__":
    arg = sys.argv[1]
    if len(sys.argv) > 2:
        SAMPLE_MB, BATCH_SIZE = int(sys.argv[2]), int(sys.argv[3])
    main(None if arg == "none" else int(arg) * 2**20)
