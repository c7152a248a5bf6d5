"""W7 (GCS): torch DataLoader with the official GCS client vs aioloader's gcs source, 20 ms per request.

fake-gcs-server (the emulator the tests use, in memory) holds 2,000 objects of 256 KiB, written with
`google-cloud-storage`. Every request goes through benchmarks/_delayproxy.py, a relay in a subprocess
that passes each request on 20 ms late (W2's far object store, see benchmarks/remote.py); answers
pass at once. Measured in one run, on the same
objects, each with W2's `measure` (a warm-up epoch, then the faster of two timed epochs):
- torch DataLoader(num_workers=8, batch_size=32) whose `__getitem__` downloads one object with
  `google-cloud-storage` (one client per worker process);
- aioloader with `sources.gcs` (JSON API) at concurrency 256 (as W2), engines "aiohttp" and "fast", on the
  loader's event loop, and with `fetch_in_workers=True` ("multi-loop": each of the process workers,
  one per core, fetches its share on its own loop; engine "fast"), as in W2;
- the same loader reading through `obstore` (its GCSStore, the Rust object_store client, XML API) as
  the fetch of a small source, when obstore is installed, and likewise through `gcsfs` (fsspec's GCS
  filesystem, async, on the loader's loop), when installed: the clients chosen against.
Printed: a table (objects/s, MB/s, time to first batch, client CPU per 1,000 objects) and, as the
last line, JSON with the ratios to torch: `ratio` for the best aioloader configuration (named in
`best`), `one_loop_ratio` for the best on one event loop, `obstore_ratio` for the obstore client.

Usage: python benchmarks/cloud_gcs.py [--quick] [--objects N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

DELAY_S = float(os.environ.get("W7_DELAY_S", "0.020"))
CONCURRENCY = 256  # as W2: 64 leaves the client short of what the emulator serves (5.7x vs 6.6x)
PREFIX = "w7/"


# -- the contenders -----------------------------------------------------------------------------


class SdkObjects:
    """Map-style dataset: `__getitem__` downloads one object with google-cloud-storage, through a
    client made once per worker process (what a DataLoader user writes)."""

    def __init__(self, endpoint: str, bucket: str, keys: list[str]) -> None:
        self.endpoint, self.bucket_name, self.keys = endpoint, bucket, keys
        self._bucket: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> bytes:
        if self._pid != os.getpid():
            from google.auth.credentials import AnonymousCredentials
            from google.cloud import storage

            client = storage.Client(project="bench", credentials=AnonymousCredentials(),
                                    client_options={"api_endpoint": self.endpoint})  # fmt: skip
            self._bucket, self._pid = client.bucket(self.bucket_name), os.getpid()
        data: bytes = self._bucket.blob(self.keys[index]).download_as_bytes()
        return data


class ObstoreObjects:
    """A source whose fetch is obstore's `get_async` (keys given)."""

    def __init__(self, endpoint: str, bucket: str, keys: list[str]) -> None:
        from obstore.store import GCSStore

        options = {"allow_http": True, "pool_max_idle_per_host": "256"}
        self.store = GCSStore(
            bucket, base_url=endpoint, skip_signature=True, client_options=options
        )
        self._keys = keys

    def keys(self) -> list[str]:
        return list(self._keys)

    async def fetch(self, key: str) -> bytes:
        import obstore

        result = await obstore.get_async(self.store, key)
        return bytes(await result.bytes_async())

    async def aclose(self) -> None:
        """Nothing to close: obstore keeps its pool until the store is dropped."""


class GcsfsObjects:
    """A source whose fetch is gcsfs's `_cat_file` on the loader's loop (keys given)."""

    def __init__(self, endpoint: str, bucket: str, keys: list[str]) -> None:
        import gcsfs

        self.endpoint, self.bucket, self._keys = endpoint, bucket, keys
        self._fs: gcsfs.GCSFileSystem | None = None
        self._ready: asyncio.Future[Any] | None = None

    def keys(self) -> list[str]:
        return list(self._keys)

    async def fetch(self, key: str) -> bytes:
        if self._fs is None:  # made on the loop that uses it, its session once
            import gcsfs

            self._fs = gcsfs.GCSFileSystem(endpoint_url=self.endpoint, token="anon",
                                           asynchronous=True, skip_instance_cache=True)  # fmt: skip
            self._ready = asyncio.ensure_future(self._fs._set_session())
        await self._ready
        data: bytes = await self._fs._cat_file(f"{self.bucket}/{key}")
        return data

    async def aclose(self) -> None:
        fs, self._fs = self._fs, None
        if fs is not None and fs.session is not None:
            await fs.session.close()


def run_torch(remote: Any, endpoint: str, bucket: str, keys: list[str]) -> Any:
    from torch.utils.data import DataLoader

    loader = DataLoader(SdkObjects(endpoint, bucket, keys), batch_size=remote.BATCH, num_workers=8,
                        collate_fn=list, persistent_workers=True)  # fmt: skip

    def close() -> None:
        if loader._iterator is not None:
            loader._iterator._shutdown_workers()

    return remote.measure("torch DataLoader(8) + google-cloud-storage", loader, close)


def run_ours(remote: Any, endpoint: str, bucket: str, keys: list[str], engine: str) -> Any:
    from aioloader.sources import gcs

    src = gcs(f"gs://{bucket}/{PREFIX}", keys, endpoint_url=endpoint, anonymous=True,
              concurrency=CONCURRENCY, engine=engine)  # fmt: skip
    return remote.run_aio(f"aioloader gcs {engine} (c {CONCURRENCY})", src, CONCURRENCY)


def run_multi_loop(
    remote: Any, pool: Any, endpoint: str, bucket: str, keys: list[str], engine: str
) -> Any:
    """`fetch_in_workers=True`: each process worker fetches its share on its own event loop."""
    from aioloader import Loader
    from aioloader.sources import gcs

    src = gcs(f"gs://{bucket}/{PREFIX}", keys, endpoint_url=endpoint, anonymous=True,
              concurrency=CONCURRENCY, engine=engine)  # fmt: skip
    loader = Loader(src, executor=pool, fetch_in_workers=True, concurrency=CONCURRENCY,
                    batch_size=remote.BATCH, collate=None)  # fmt: skip
    name = f"multi-loop gcs {engine} ({pool.workers} workers, c {CONCURRENCY})"
    return remote.measure(name, loader, loader.close)


def run_obstore(remote: Any, endpoint: str, bucket: str, keys: list[str]) -> Any:
    try:
        src = ObstoreObjects(endpoint, bucket, keys)
    except ImportError:
        print("obstore skipped: not installed")
        return None
    return remote.run_aio(f"aioloader + obstore GCSStore (c {CONCURRENCY})", src, CONCURRENCY)


def run_gcsfs(remote: Any, endpoint: str, bucket: str, keys: list[str]) -> Any:
    try:
        src = GcsfsObjects(endpoint, bucket, keys)
    except ImportError:
        print("gcsfs skipped: not installed")
        return None
    return remote.run_aio(f"aioloader + gcsfs (c {CONCURRENCY})", src, CONCURRENCY)


def upload(server: Any, keys: Sequence[str], size: int) -> None:
    body = os.urandom(size)
    server.client()  # made once, before the threads share it
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: server.put(k, body), keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer objects (under 60 s in all)")
    parser.add_argument("--objects", type=int, default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import remote
    import torch
    from _delayproxy import Proxy
    from support.gcsserver import start_gcs
    from support.serverprocs import free_port

    from aioloader import ProcessExecutor

    pool = ProcessExecutor(
        remote.MULTI_WORKERS, async_depth=-(-CONCURRENCY // remote.MULTI_WORKERS)
    )
    pool.wait_ready()  # before any thread: its workers fork from a zygote

    n = args.objects or (400 if args.quick else 2000)
    keys = [f"{PREFIX}{i:05d}.bin" for i in range(n)]
    print(f"{n} objects of {remote.SIZE // 1024} KiB, {DELAY_S * 1000:.0f} ms per request; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}")  # fmt: skip
    relay_port = free_port()  # the emulator answers XML API paths for the host it is reached at
    server = start_gcs(Path(tempfile.mkdtemp(prefix="aioloader-w7-")), f"127.0.0.1:{relay_port}")
    remote.SERVERS.add(server.proc.pid)
    proxy = Proxy(f"http://127.0.0.1:{server.port}", DELAY_S * 1000, port=relay_port)
    endpoint = proxy.url
    remote.SERVERS.add(proxy.proc.pid)
    try:
        upload(server, keys, remote.SIZE)
        results = [run_torch(remote, endpoint, server.bucket, keys)]
        results += [run_ours(remote, endpoint, server.bucket, keys, e) for e in ("aiohttp", "fast")]
        results.append(run_multi_loop(remote, pool, endpoint, server.bucket, keys, "fast"))
        peer = run_obstore(remote, endpoint, server.bucket, keys)
        fsspec_peer = run_gcsfs(remote, endpoint, server.bucket, keys)
    finally:
        pool.close()
        proxy.stop()
        server.stop()
    print(f"{'configuration':<42} {'objects/s':>9} {'MB/s':>8} {'ttfb s':>7} {'warm':>7} "
          f"{'CPU s/1k obj':>12}")  # fmt: skip
    peers = [p for p in (peer, fsspec_peer) if p is not None]
    for r in [*results, *peers]:
        print(r.row())
    torch_r, best = results[0], max(results[1:], key=lambda r: r.per_s)
    one_loop = max(results[1:3], key=lambda r: r.per_s)
    summary = {
        "workload": "cloud_gcs",
        "torch_items_per_s": round(torch_r.per_s, 1),
        "aioloader_items_per_s": round(best.per_s, 1),
        "ratio": round(best.per_s / torch_r.per_s, 2),
        "best": best.name,
        "one_loop_ratio": round(one_loop.per_s / torch_r.per_s, 2),
        "per_engine_items_per_s": {r.name: round(r.per_s, 1) for r in results[1:]},
        "obstore_items_per_s": round(peer.per_s, 1) if peer else None,
        "obstore_ratio": round(peer.per_s / torch_r.per_s, 2) if peer else None,
        "gcsfs_items_per_s": round(fsspec_peer.per_s, 1) if fsspec_peer else None,
        "cpu_s_per_1k": {r.name: round(r.cpu_s / r.objects * 1000, 3) for r in [*results, *peers]},
    }
    summary["load_average_at_end"] = round(os.getloadavg()[0], 1)  # others' work slows every row
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
