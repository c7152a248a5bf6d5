"""Autotuning: concurrency="auto" against the best of several fixed concurrencies, per phase.

An aiohttp server on 127.0.0.1 (a subprocess) answers GET /obj/<n> with 16 KiB after a delay that the
benchmark changes mid-run: 20 ms in phase 1, then 80 ms in phase 2 (the store got slower). Each
configuration runs both phases in one loader, fetching through the `http` source (aiohttp), and counts
the objects delivered to the consumer in each phase:
- fixed concurrency 16, 64 and 256;
- concurrency="auto" (starting from 16 and finding its own way: slow start doubling every few
  latencies, then additive steps, with queueing beyond rate x least latency drained (Little's law);
  its phase 1 includes that ramp, and its phase 2 the time it takes to notice the change and adapt).
Every setting runs `--rounds` times (3; 1 with --quick), in rotated order, and the median is kept:
the host is shared, and its load moves between runs. Printed: objects/s per configuration and phase,
the limit auto had at the end of each, and per phase the ratio of auto to the best fixed setting
(the target is >= 0.9). The last line is a JSON summary.

Usage: python benchmarks/autotune.py [--quick] [--phase-s SECONDS] [--rounds N] [-v]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import urllib.request
from typing import Any

from _objserver import start_server

from aioloader import Loader
from aioloader.sources import http

SIZE = 16 * 1024
PHASES_MS = (20, 80)
FIXED = (16, 64, 256)
BATCH = 32
POOL = 256  # connections the source may open: as many as the largest setting needs


def set_delay(base: str, ms: int) -> None:
    with urllib.request.urlopen(urllib.request.Request(f"{base}/delay/{ms}", method="POST")) as r:
        r.read()


def run(base: str, concurrency: int | str, phase_s: float) -> dict[str, Any]:
    """Both phases in one loader: objects/s per phase, and the fetch limit at the end of each."""
    keys = [f"{i}" for i in range(300_000)]
    set_delay(base, PHASES_MS[0])
    source = http(f"{base}/obj/", keys, concurrency=POOL)
    out: dict[str, Any] = {"name": f"concurrency={concurrency!r}", "rates": [], "limits": []}
    with Loader(source, concurrency=concurrency, batch_size=BATCH, collate=None) as loader:
        batches = iter(loader)
        for phase, ms in enumerate(PHASES_MS):
            if phase:
                set_delay(base, ms)
            logging.getLogger("aioloader").info("phase %d ms starts", ms)
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < phase_s:
                count += len(next(batches))
            out["rates"].append(count / (time.perf_counter() - start))
            out["limits"].append(loader.stats().concurrency)
        del batches
    return out


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase, the median rate over the rounds (and the limits of the median round)."""
    out = dict(runs[0])
    out["rates"] = [statistics.median(r["rates"][i] for r in runs) for i in range(len(PHASES_MS))]
    out["spread"] = [(min(r["rates"][i] for r in runs), max(r["rates"][i] for r in runs))
                     for i in range(len(PHASES_MS))]  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short phases (under 60 s in all)")
    parser.add_argument("--phase-s", type=float, default=None, help="seconds per phase")
    parser.add_argument("--rounds", type=int, default=None, help="runs of every setting")
    parser.add_argument("-v", "--verbose", action="store_true", help="log auto's changes")
    args = parser.parse_args()
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms  %(message)s")
    phase_s = args.phase_s or (5.0 if args.quick else 12.0)
    rounds = args.rounds or (1 if args.quick else 3)
    print(f"{SIZE // 1024} KiB objects; GET latency {PHASES_MS[0]} ms, then {PHASES_MS[1]} ms; "
          f"{phase_s:.0f} s per phase; median of {rounds} rounds; {os.cpu_count()} cores")  # fmt: skip
    configs: list[int | str] = [*FIXED, "auto"]
    runs: dict[int | str, list[dict[str, Any]]] = {c: [] for c in configs}
    proc, base = start_server(SIZE, PHASES_MS[0], backlog=2048)
    try:
        for r in range(rounds):  # rotated, so that no setting always runs while the host is busy
            for c in configs[r % len(configs) :] + configs[: r % len(configs)]:
                runs[c].append(run(base, c, phase_s))
    finally:
        proc.kill()
        proc.wait()
    merged = {c: _median(rs) for c, rs in runs.items()}
    fixed, auto = [merged[c] for c in FIXED], merged["auto"]
    head = "".join(f"{f'{ms} ms: obj/s (min-max)':>26}" for ms in PHASES_MS)
    print(f"{'configuration':<22}{head}   fetch limit at each phase's end")
    for r in [*fixed, auto]:
        rates = "".join(
            f"{f'{rate:.0f} ({lo:.0f}-{hi:.0f})':>26}"
            for rate, (lo, hi) in zip(r["rates"], r["spread"], strict=True)
        )
        print(f"{r['name']:<22}{rates}   {r['limits']}")
    summary: dict[str, Any] = {"workload": "autotune"}
    for i, ms in enumerate(PHASES_MS):
        best = max(fixed, key=lambda r: r["rates"][i])
        ratio = auto["rates"][i] / best["rates"][i]
        print(f"phase {ms} ms: auto {auto['rates'][i]:.0f} obj/s vs best fixed {best['name']} "
              f"{best['rates'][i]:.0f} obj/s: ratio {ratio:.2f}")  # fmt: skip
        summary[f"phase_{ms}ms_ratio"] = round(ratio, 3)
        summary[f"phase_{ms}ms_best_fixed"] = best["name"]
    summary["auto_limits"] = auto["limits"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
