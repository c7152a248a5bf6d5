"""Containers: the seed workload where /dev/shm is Docker's 64 MB, and inside a memory cgroup.

The user code is torch's (`__getitem__` blocks 3.125 ms and returns a 1.2 MB array, batch 128:
153 MB batches, a 50 ms train step); only the DataLoader class changes. Each run is a fresh
interpreter (`--run LIBRARY WORKERS BATCHES`):

  shm:    num_workers=2 with /dev/shm a 64 MB tmpfs (a private mount namespace, `unshare -m`) against
          the same run with the machine's /dev/shm, for aioloader (four pairs, each in a mount
          namespace, in turn first; the median ratio); torch's DataLoader in 64 MB too.
  cgroup: num_workers=8, prefetch_factor=2, inside a 1.5 GiB memory cgroup: batches, OOM kills, and
          the cgroup's peak usage, for both.

Needs root (mount namespaces, cgroups); prints what it skipped otherwise.
Usage: python benchmarks/containers.py [--quick]   (--quick: fewer batches, under 60 s)
The last line printed is JSON: aioloader's s/batch with 64 MB against a large /dev/shm, and what
each library did in each setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset

SHAPE = (1000, 150)
BATCH = 128
WAIT_S = 0.003125
STEP_S = 0.05
CGROUP_BYTES = 3 << 29  # 1.5 GiB


class SleepyArrays(Dataset[np.ndarray]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        time.sleep(WAIT_S)
        return np.random.random(SHAPE)


def run(library: str, workers: int, batches: int) -> None:
    if library == "torch":
        from torch.utils.data import DataLoader
    else:
        from aioloader import DataLoader  # type: ignore[assignment]
    loader = DataLoader(SleepyArrays(BATCH * batches), batch_size=BATCH, num_workers=workers,
                        prefetch_factor=2)  # fmt: skip
    got, start = 0, time.perf_counter()
    for _ in loader:
        got += 1
        if got == 2:
            start = time.perf_counter()
        time.sleep(STEP_S)
    out = {"batches": got, "s_per_batch": (time.perf_counter() - start) / max(1, got - 2)}
    stats = getattr(loader, "stats", None)  # aioloader's: the budget, and where it came from
    if stats is not None:
        got_stats = stats()
        pool = got_stats.extra.get("decode_pool", {})
        out |= {
            "budget": got_stats.max_bytes_in_flight,
            "budget_origin": got_stats.budget_origin,
            "pickled": pool.get("results_pickled", 0),
            "in_shm": pool.get("results_in_shm", 0),
        }
    print(json.dumps(out))


def contender(prefix: list[str], library: str, workers: int, batches: int) -> dict[str, Any]:
    cmd = [*prefix, sys.executable, __file__, "--run", library, str(workers), str(batches)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"ok": False, "error": last[:160]}
    return {"ok": True, **json.loads(done.stdout.splitlines()[-1])}


def small_shm() -> list[str] | None:
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    probe = subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", "true"], capture_output=True)
    return ["unshare", "-m", "sh", "-c", mount, "sh"] if probe.returncode == 0 else None


def memory_cgroup() -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (base / "memory.limit_in_bytes").exists():
                return base
    return None


def in_cgroup(base: Path, library: str, batches: int) -> dict[str, Any]:
    folder = base / f"aioloader-bench-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    try:
        (folder / "memory.limit_in_bytes").write_text(str(CGROUP_BYTES))
        enter = f'echo $$ > {folder}/cgroup.procs && exec "$@"'
        out = contender(["sh", "-c", enter, "sh"], library, 8, batches)
        kills = [ln for ln in (folder / "memory.oom_control").read_text().splitlines()
                 if ln.startswith("oom_kill ")]  # fmt: skip
        out["oom_kills"] = int(kills[0].split()[1]) if kills else 0
        out["peak_mb"] = int((folder / "memory.max_usage_in_bytes").read_text()) >> 20
        return out
    finally:
        for _ in range(50):
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def main(quick: bool) -> None:
    batches, repeats = (8, 1) if quick else (24, 4)
    result: dict[str, Any] = {"shm": None, "cgroup": None}
    prefix = small_shm()
    if prefix is None:
        print("shm: skipped (no private mount namespace: root needed)")
    else:
        ratios, small = [], {}
        same = ["unshare", "-m", "sh", "-c", 'exec "$@"', "sh"]  # a namespace too, /dev/shm as is
        for i in range(repeats):  # interleaved, in turn first: drift falls on both alike
            if i % 2:
                small = contender(prefix, "aioloader", 2, batches)
                large = contender(same, "aioloader", 2, batches)
            else:
                large = contender(same, "aioloader", 2, batches)
                small = contender(prefix, "aioloader", 2, batches)
            print(f"aioloader, /dev/shm large: {large}")
            print(f"aioloader, /dev/shm 64 MB: {small}")
            if small["ok"] and large["ok"]:
                ratios.append(small["s_per_batch"] / large["s_per_batch"])
        ratio = statistics.median(ratios) if ratios else None
        torch_small = contender(prefix, "torch", 2, batches)
        print(f"torch,     /dev/shm 64 MB: {torch_small}")
        result["shm"] = {"aioloader_64mb_vs_large": ratio, "aioloader_64mb": small,
                         "torch_64mb": torch_small}  # fmt: skip
    base = memory_cgroup()
    if base is None:
        print("cgroup: skipped (no v1 memory cgroup to make one under)")
    else:
        ours = in_cgroup(base, "aioloader", batches)
        theirs = in_cgroup(base, "torch", batches)
        print(f"aioloader, 8 workers in 1.5 GiB: {ours}")
        print(f"torch,     8 workers in 1.5 GiB: {theirs}")
        result["cgroup"] = {"aioloader": ours, "torch": theirs}
    print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--run", nargs=3)
    args = parser.parse_args()
    if args.run:
        run(args.run[0], int(args.run[1]), int(args.run[2]))
    else:
        main(args.quick)
