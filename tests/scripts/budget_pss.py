"""Peak memory growth (PSS of the process and its workers) of a loader decoding 10 MB samples in
worker processes behind a slow consumer; growth is counted from the first batch on, once the
workers have started.

Usage: budget_pss.py BUDGET_MB SAMPLE_MB BATCH_SIZE [fill]
  -> prints JSON {"peak_growth_mb": ..., "peak_mb": ..., "batch_mb": ..., "pickled": ..., "in_shm": ...,
     "in_rows": ...}
`peak_mb` is the tree's peak from the first batch on, whole: what the workers hold besides the
samples is the same in two runs of the same loader, so two runs compare by it even where the
loader had filled up before the first batch came (where the growth after it shows little).
With `fill`, the consumer takes each batch only once the loader holds all it may (`prefetch` batches
ready, or the epoch's last): what it holds then is set by events, not by how fast a busy machine
lets the workers run during a fixed step.
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


def _wait_full(loader: aioloader.Loader[int], batches: int) -> None:
    """Until `batches` batches wait for the consumer (a slow model, however slow the machine)."""
    end = time.monotonic() + FILL_WAIT_S
    while loader.stats().ready_batches < batches and time.monotonic() < end:
        time.sleep(0.005)


def tree_pss(proc: psutil.Process) -> int:
    """The PSS of the process and its workers that is memory, not mapped files: Pss_Anon and
    Pss_Shmem (samples in heaps and shared-memory slabs). A library's file pages are shared with
    processes outside the tree too (pytest's own, with the same torch), and their share of them
    moves as the workers start: with the free-threaded venv's CUDA torch, hundreds of MB either way."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(OSError), open(f"/proc/{p.pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                    total += int(line.split()[1]) * 1024
    return total


PREFETCH = 8
FILL_WAIT_S = (
    30.0  # `fill`: at most this long for the loader to fill up (it does in well under 1 s)
)


def main(budget: int, sample_mb: int, batch_size: int, fill: bool = False) -> None:
    proc = psutil.Process()
    loader = aioloader.Loader(
        list(range(12 * batch_size)), fetch, decode=partial(decode, sample_mb),
        batch_size=batch_size, prefetch=PREFETCH, concurrency=16, executor="process", workers=2,
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
        for left, batch in enumerate(batches, start=2):
            if fill:
                _wait_full(loader, min(PREFETCH, 12 - left))
            else:
                time.sleep(0.1)  # a slow model step
            del batch
        stop.set()
        sampler.join()
        pool = loader.stats().extra.get("decode_pool", {})
    growth = (peak[0] - base) / 2**20
    print(json.dumps({
        "peak_growth_mb": growth, "peak_mb": peak[0] / 2**20, "batch_mb": sample_mb * batch_size,
        "pickled": pool.get("results_pickled", 0), "in_shm": pool.get("results_in_shm", 0),
        "in_rows": pool.get("results_in_rows", 0),
    }))  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]) * 2**20, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:] == ["fill"])
