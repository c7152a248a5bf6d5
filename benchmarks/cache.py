"""Cache: epoch 2 of remote data read from the local cache (`cache_dir=`) against epoch 1 over the network.

The objects and shards are served on 127.0.0.1 by the benchmarks' object server (`_objserver.py`, the
one of W2) in a subprocess that waits 20 ms before each answer (a far object store) and counts the
GETs it answers. Measured in one run:
- objects: 2,000 objects of 256 KiB through `sources.http(..., cache_dir=)` (engine "fast",
  concurrency 64, batches of 32): epoch 1 downloads and keeps them, epoch 2 reads the cache (the
  faster of epochs 2 and 3 counts). For reference, the same reads without a cache (the first
  epoch, and the faster of two more, with connections made and buffers touched) and
  torch DataLoader(num_workers=8) with one urllib GET per `__getitem__` (warm-up, then the faster
  of two epochs, as in W2);
- tar shards: 64 WebDataset shards of 64 samples of 16 KiB through `sources.tar_shards(...,
  cache_dir=)`, shuffled per epoch (`parallel=2`, the default): epoch 1 streams each shard into
  the cache, epochs 2 and 3 read them from it;
- two processes at once (this script with `--child`), one cache directory: 600 objects (`--quick`:
  200) and the shards, each process reading all of them; the server counts the GETs the two
  made together.
The cache's files are written on epoch 1 and read on epoch 2 from the page cache (the machine has
the memory for them), as they would be on a training machine between two epochs.

Usage: python benchmarks/cache.py [--quick] [--objects N] [--shards N]
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import torch
from _lifetime import exit_with_parent
from _objserver import start_server
from remote import SERVERS, SIZE, run_torch

from aioloader import Loader
from aioloader.sources import http, tar_shards

DELAY_S = 0.020
BATCH = 32
CONCURRENCY = 64
SHARD_SAMPLES = 64
SAMPLE_BYTES = 16 * 1024
SHARED_OBJECTS = 600  # objects the two processes read (`--quick`: 200)
READY_POLL_S = 0.01  # the children wait for each other at a process boundary


def server_gets(base: str) -> int:
    """GETs the object server has answered so far."""
    with urllib.request.urlopen(f"{base}/count", timeout=10) as resp:
        return int(resp.read())


def timed_epoch(loader: Loader[Any]) -> tuple[float, int]:
    start, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch)
    return time.perf_counter() - start, count


def two_epochs(name: str, base: str, loader: Loader[Any], items: int) -> dict[str, Any]:
    """Epoch 1 (network, filling the cache), then epochs 2 and 3 (the cache; the faster counts as
    "epoch 2": noise on a shared machine only ever slows one): seconds and server GETs."""
    with loader:
        g0 = server_gets(base)
        first, n1 = timed_epoch(loader)
        g1 = server_gets(base)
        (second, n2), (third, n3) = timed_epoch(loader), timed_epoch(loader)
        second = min(second, third)
        g2 = server_gets(base)
    assert n1 == n2 == n3 == items, (n1, n2, n3, items)
    return {"name": name, "items": items, "epoch1_s": first, "epoch2_s": second,
            "gets1": g1 - g0, "gets2": g2 - g1, "ratio": first / second}  # fmt: skip


def objects_loader(base: str, keys: list[str], cache_dir: str | None) -> Loader[Any]:
    src = http(f"{base}/obj/", keys, concurrency=CONCURRENCY, engine="fast", cache_dir=cache_dir)
    return Loader(src, concurrency=CONCURRENCY, batch_size=BATCH, collate=None)


def shards_loader(base: str, names: list[str], cache_dir: str) -> Loader[Any]:
    urls = [f"{base}/files/{name}" for name in names]
    shards = tar_shards(urls, cache_dir=cache_dir)
    return Loader(shards, concurrency=CONCURRENCY, batch_size=BATCH, collate=None)


def uncached(base: str, keys: list[str]) -> tuple[float, float]:
    """Seconds of the first epoch of the same reads without a cache, and of the faster of the
    next two."""
    with objects_loader(base, keys, None) as loader:
        first = timed_epoch(loader)[0]
        return first, min(timed_epoch(loader)[0], timed_epoch(loader)[0])


def write_shards(folder: Path, count: int) -> list[str]:
    names = []
    for s in range(count):
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w") as tar:
            for i in range(SHARD_SAMPLES):
                for ext, body in (("bin", os.urandom(SAMPLE_BYTES)), ("cls", b"%d" % (i % 10))):
                    info = tarfile.TarInfo(f"s{s:04d}-{i:04d}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        names.append(f"shard-{s:04d}.tar")
        (folder / names[-1]).write_bytes(out.getvalue())
    return names


def two_processes(base: str, keys: list[str], shards: list[str], work: Path) -> dict[str, Any]:
    """Two children read every object and shard through one cache directory at once."""
    ready = work / "ready"
    ready.mkdir()
    cmd = [sys.executable, __file__, "--child", base, str(work / "shared"), str(ready)]
    g0 = server_gets(base)
    procs = [
        subprocess.Popen([*cmd, json.dumps([keys, shards])], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    stats = [json.loads(p.communicate(timeout=300)[0].splitlines()[-1]) for p in procs]
    expected = len(keys) + len(shards)
    return {"gets": server_gets(base) - g0, "expected": expected, "children": stats}


def child(base: str, cache_dir: str, ready: str, what: str) -> None:
    """One of the two processes: wait for the other, read everything, print how many items."""
    exit_with_parent()
    keys, shards = json.loads(what)
    Path(ready, str(os.getpid())).touch()
    while len(os.listdir(ready)) < 2:
        time.sleep(READY_POLL_S)
    with objects_loader(base, keys, cache_dir) as loader:
        n = timed_epoch(loader)[1]
    with shards_loader(base, shards, cache_dir) as loader:
        n += timed_epoch(loader)[1]
    assert n == len(keys) + len(shards) * SHARD_SAMPLES
    print(json.dumps({"items": n}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer objects (under 60 s in all)")
    parser.add_argument("--objects", type=int, default=None)
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument("--child", nargs=4, metavar=("BASE", "CACHE", "READY", "WHAT"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    n = args.objects or (400 if args.quick else 2000)
    n_shards = args.shards or (16 if args.quick else 64)
    n_shared = min(n, 200 if args.quick else SHARED_OBJECTS)
    keys = [f"{i:05d}.bin" for i in range(n)]
    print(f"{n} objects of {SIZE // 1024} KiB; {n_shards} shards of {SHARD_SAMPLES} x "
          f"{SAMPLE_BYTES // 1024} KiB; {DELAY_S * 1000:.0f} ms per GET; {os.cpu_count()} cores, "
          f"torch {torch.__version__}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="aioloader-cache-bench-") as tmp:
        work = Path(tmp)
        (work / "shards").mkdir()
        names = write_shards(work / "shards", n_shards)
        proc, base = start_server(SIZE, DELAY_S * 1000, files=str(work / "shards"))
        SERVERS.add(proc.pid)
        try:
            torch_r = run_torch(f"{base}/obj/", keys, 8)
            uncached_s = uncached(base, keys)
            objects = two_epochs("objects: http fast c64, cache", base,
                                 objects_loader(base, keys, str(work / "objects")), n)  # fmt: skip
            shards = two_epochs(f"tar shards ({n_shards}), cache", base,
                                shards_loader(base, names, str(work / "tars")),
                                n_shards * SHARD_SAMPLES)  # fmt: skip
            shared = two_processes(base, keys[:n_shared], names, work)
        finally:
            proc.kill()
            proc.wait()
    report(torch_r, uncached_s, objects, shards, shared)


def report(torch_r: Any, uncached_s: tuple[float, float], objects: dict[str, Any], shards: dict[str, Any],
           shared: dict[str, Any]) -> None:  # fmt: skip
    print(f"{'configuration':<34} {'epoch 1 s':>9} {'epoch 2 s':>9} {'ratio':>6} "
          f"{'GETs 1':>7} {'GETs 2':>7} {'items/s 2':>10}")  # fmt: skip
    for r in (objects, shards):
        print(f"{r['name']:<34} {r['epoch1_s']:>9.3f} {r['epoch2_s']:>9.3f} {r['ratio']:>6.1f} "
              f"{r['gets1']:>7} {r['gets2']:>7} {r['items'] / r['epoch2_s']:>10.0f}")  # fmt: skip
    n = objects["items"]
    print(f"{'objects without a cache':<34} {uncached_s[0]:>9.3f} {uncached_s[1]:>9.3f} "
          f"{uncached_s[0] / uncached_s[1]:>6.1f} {n:>7} {n:>7} {n / uncached_s[1]:>10.0f}")  # fmt: skip
    print(f"{torch_r.name:<34} {torch_r.seconds:>9.3f} {'':>9} {'':>6} {n:>7} {'':>7} "
          f"{torch_r.per_s:>10.0f}")  # fmt: skip
    print(
        f"two processes, one cache dir: {shared['gets']} GETs for {shared['expected']} "
        "objects and shards (each read by both)"
    )
    cached_per_s = n / objects["epoch2_s"]
    summary = {
        "workload": "cache",
        "objects_ratio": round(objects["ratio"], 2),
        "objects_epoch2_gets": objects["gets2"],
        "shards_ratio": round(shards["ratio"], 2),
        "shards_epoch2_gets": shards["gets2"],
        "objects_epoch1_vs_uncached_epoch1": round(objects["epoch1_s"] / uncached_s[0], 2),
        "objects_vs_uncached_warm": round(uncached_s[1] / objects["epoch2_s"], 2),
        "two_process_gets": shared["gets"],
        "two_process_objects": shared["expected"],
        "torch_items_per_s": round(torch_r.per_s, 1),
        "cached_items_per_s": round(cached_per_s, 1),
        "ratio_vs_torch": round(cached_per_s / torch_r.per_s, 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
