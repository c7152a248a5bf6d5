"""W7, Azure row: torch DataLoader with the official SDK vs aioloader's `sources.azure`, through Azurite.

Azurite (Azure Blob's emulator, from .azurite/, in memory) holds 256 blobs of 256 KiB, written with the
official SDK; every request reaches it through a proxy in a subprocess that holds each request 20 ms
before passing it on (a far store, as W2's server waits 20 ms per GET). An epoch reads 2,000 keys,
each blob about eight times: Azurite's cost per GET grows with the number of blobs it stores (the
same 300 reads, one process after the other: 759 objects/s with 300 blobs stored, 227-255/s once
2,000 are), which a real account's does not, so a store of 2,000 would measure the emulator's
lookups rather than the clients. Measured in one run, on the same keys through the same proxy (W2's
`measure`: a warm-up epoch, then the faster of two timed epochs):
- torch DataLoader(num_workers=8, batch_size=32) over a map-style dataset whose __getitem__ downloads
  one blob with azure-storage-blob (a BlobServiceClient made once in each worker process);
- aioloader: `sources.azure` (SharedKey-signed GETs on the project's transport) at concurrency 64 and
  256 (64 only with --quick), engines "aiohttp" and "fast".
Then, to choose the client the source is built on, each client reads the epoch's keys with 64 reads
in flight on one event loop (uvloop, as a Loader's; a warm-up pass, then rounds in rotated order,
the median pass counting), objects/s and this process's CPU seconds per 1,000 objects: the project's
transport with the SharedKey signer (both engines), obstore's AzureStore and adlfs
(azure-storage-blob's aio client), the latter two when installed.

Usage: python benchmarks/cloud_azure.py [--quick] [--objects N] [--blobs N] [--no-clients]
(W7_DISK=1 in the environment: Azurite keeps its blobs in files instead of memory.)
The last line printed is a JSON summary (ratio: the best aioloader row over torch's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
import weakref
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _delayproxy import Proxy
from remote import BATCH, DELAY_S, SERVERS, SIZE, Result, measure, run_aio
from torch.utils.data import DataLoader, Dataset

from aioloader._util.loops import new_event_loop
from aioloader.sources import azure

TESTS = Path(__file__).resolve().parent.parent / "tests"
PREFIX = "w7/"
CLIENT_CONCURRENCY = 64
IN_MEMORY = os.environ.get("W7_DISK") != "1"
API_VERSION = "2025-11-05"  # the newest Azurite 3.35 knows; the SDK's own default is newer


# -- torch with the official SDK --------------------------------------------------------------------


class SdkBlobs(Dataset[bytes]):
    """Map-style dataset: one azure-storage-blob download per item, a client per worker process."""

    def __init__(self, connection_string: str, container: str, keys: list[str]) -> None:
        self.connection_string, self.container, self.keys = connection_string, container, keys
        self._client: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> bytes:
        if self._pid != os.getpid():  # first use in this worker: its own client and connections
            from azure.storage.blob import BlobServiceClient

            service = BlobServiceClient.from_connection_string(
                self.connection_string, api_version=API_VERSION
            )
            self._client, self._pid = service.get_container_client(self.container), os.getpid()
        data: bytes = self._client.download_blob(self.keys[index]).readall()
        return data


TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def run_torch(connection_string: str, container: str, keys: list[str], workers: int) -> Result:
    dataset = SdkBlobs(connection_string, container, keys)
    loader = DataLoader(dataset, batch_size=BATCH, num_workers=workers, collate_fn=list,
                        persistent_workers=True)  # fmt: skip

    def close() -> None:
        if loader._iterator is not None:  # persistent workers: stop them now
            loader._iterator._shutdown_workers()

    return measure(f"torch DataLoader(num_workers={workers}) + SDK", loader, close)


# -- the clients, each reading every blob once with 64 in flight ------------------------------------


Reader = tuple[Callable[[int], Awaitable[int]], Callable[[], Awaitable[None]] | None]


async def one_pass(read: Callable[[int], Awaitable[int]], n: int) -> tuple[float, float]:
    """(seconds, this process's CPU seconds) to read blobs 0..n-1 with CLIENT_CONCURRENCY in flight."""
    gate = asyncio.Semaphore(CLIENT_CONCURRENCY)

    async def one(i: int) -> None:
        async with gate:
            assert await read(i) == SIZE

    cpu0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, time.process_time() - cpu0


async def compare(readers: dict[str, Reader], n: int, rounds: int) -> dict[str, dict[str, float]]:
    """Each reader: a warm-up pass, then `rounds` timed passes, the readers taking turns in rotated
    order (the host's load moves); the median pass of each counts."""
    try:
        for read, _ in readers.values():
            await one_pass(read, n)
        passes: dict[str, list[tuple[float, float]]] = {name: [] for name in readers}
        names = list(readers)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                passes[name].append(await one_pass(readers[name][0], n))
    finally:
        for _, close in readers.values():
            if close is not None:
                await close()
    results = {}
    for name, timed in passes.items():
        seconds = statistics.median(t for t, _ in timed)
        cpu = statistics.median(c for _, c in timed)
        print(f"  {name:<38} {n / seconds:>9.0f} obj/s {cpu / n * 1000:>7.2f} CPU s/1k")
        results[name] = {
            "items_per_s": round(n / seconds, 1),
            "cpu_s_per_1k": round(cpu / n * 1000, 3),
        }
    return results


def run_clients(
    server: Any, endpoint: str, keys: list[str], rounds: int
) -> dict[str, dict[str, float]]:
    readers: dict[str, Reader] = {}
    for engine in ("aiohttp", "fast"):
        src = azure(f"az://{server.container}/{PREFIX}", keys, account_name=server.account,
                    account_key=server.key, endpoint_url=endpoint, engine=engine,
                    concurrency=CLIENT_CONCURRENCY)  # fmt: skip

        async def via_transport(i: int, src: Any = src) -> int:
            return len(await src.fetch(keys[i]))

        readers[f"aioloader transport {engine}"] = (via_transport, src.aclose)
    for name, make in (("obstore", _obstore_reader), ("adlfs", _adlfs_reader)):
        try:
            readers[name] = make(server, endpoint, keys)
        except ImportError as exc:
            print(f"  {name}: skipped ({exc.name} is not installed)")
    loop = new_event_loop()  # uvloop when installed, as a Loader's own loop is
    try:
        return loop.run_until_complete(compare(readers, len(keys), rounds))
    finally:
        loop.close()


def _obstore_reader(server: Any, endpoint: str, keys: list[str]) -> Reader:
    import obstore
    from obstore.store import AzureStore

    store = AzureStore(server.container, account_name=server.account, account_key=server.key,
                       endpoint=endpoint, client_options={"allow_http": True,
                       "pool_max_idle_per_host": str(CLIENT_CONCURRENCY)})  # fmt: skip

    async def read(i: int) -> int:
        got = await obstore.get_async(store, keys[i])
        return len(await got.bytes_async())

    return read, None


def _adlfs_reader(server: Any, endpoint: str, keys: list[str]) -> Reader:
    from adlfs import AzureBlobFileSystem

    cs = server.connection_string(endpoint)
    holder: list[Any] = []

    async def read(i: int) -> int:
        if not holder:  # made on the running loop: adlfs binds its clients to it
            holder.append(AzureBlobFileSystem(connection_string=cs, asynchronous=True,
                                              skip_instance_cache=True))  # fmt: skip
        return len(await holder[0]._cat_file(f"{server.container}/{keys[i]}"))

    async def close() -> None:
        if holder:
            await holder[0].service_client.close()
            for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
                found = finalizer.peek()  # its close-at-exit would need this loop, then closed
                if found is not None and found[0] is holder[0]:
                    finalizer.detach()

    return read, close


# -- setup ----------------------------------------------------------------------------------------


def start_store(n: int) -> Any:
    """Azurite with `n` blobs of SIZE bytes under PREFIX (None when it cannot run here)."""
    sys.path.insert(0, str(TESTS))
    import pytest
    from support.azurite import start_azurite

    try:
        server = start_azurite(Path(tempfile.mkdtemp(prefix="aioloader-w7-")), IN_MEMORY)
    except pytest.skip.Exception as exc:  # no node, no Azurite or no azure-storage-blob
        print(f"skipped: {exc}")
        return None
    SERVERS.add(server.proc.pid)
    blobs = server.blobs()
    body = os.urandom(SIZE)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: blobs.upload_blob(f"{PREFIX}{i:05d}.bin", body), range(n)))
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blobs (under 60 s in all)")
    parser.add_argument("--objects", type=int, default=None, help="reads per epoch")
    parser.add_argument("--blobs", type=int, default=256, help="distinct blobs stored")
    parser.add_argument("--no-clients", action="store_true", help="skip the client comparison")
    args = parser.parse_args()
    # torch warns that 8 workers exceed the cores here; 8 is the configuration being compared
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    n = args.objects or (512 if args.quick else 2000)
    blobs = min(n, args.blobs)
    print(f"{n} reads per epoch of {blobs} blobs of {SIZE // 1024} KiB in Azurite, "
          f"{DELAY_S * 1000:.0f} ms per request "
          f"(proxy); {os.cpu_count()} cores")  # fmt: skip
    server = start_store(blobs)
    if server is None:
        print(json.dumps({"workload": "cloud_azure", "skipped": "no Azurite"}))
        return
    proxy = Proxy(f"http://127.0.0.1:{server.port}", DELAY_S * 1000)
    SERVERS.add(proxy.proc.pid)
    endpoint = f"{proxy.url}/{server.account}"
    try:
        listing = azure(f"az://{server.container}/{PREFIX}", account_name=server.account,
                        account_key=server.key, endpoint_url=endpoint)  # fmt: skip
        names = listing.keys()
        assert isinstance(names, list)
        assert len(names) == blobs
        keys = [names[i % blobs] for i in range(n)]
        results = [run_torch(server.connection_string(endpoint), server.container, keys, 8)]
        for engine in ("aiohttp", "fast"):
            for c in (64,) if args.quick else (64, 256):  # Azurite slows with 256 connections
                src = azure(f"az://{server.container}/{PREFIX}", keys, account_name=server.account,
                            account_key=server.key, endpoint_url=endpoint, concurrency=c,
                            engine=engine)  # fmt: skip
                results.append(run_aio(f"aioloader azure {engine} (concurrency {c})", src, c))
        print("clients, every blob once, 64 in flight:")
        rounds = 2 if args.quick else 5
        clients = {} if args.no_clients else run_clients(server, endpoint, keys, rounds)
    finally:
        proxy.stop()
        server.stop()
    print(f"{'configuration':<42} {'objects/s':>9} {'MB/s':>8} {'ttfb s':>7} {'warm':>7} "
          f"{'CPU s/1k obj':>12}")  # fmt: skip
    for r in results:
        print(r.row())
    torch_r, best = results[0], max(results[1:], key=lambda r: r.per_s)
    summary = {
        "workload": "cloud_azure",
        "torch_items_per_s": round(torch_r.per_s, 1),
        "aioloader_items_per_s": round(best.per_s, 1),
        "aioloader_best": best.name,
        "ratio": round(best.per_s / torch_r.per_s, 2),
        "cpu_s_per_1k": {r.name: round(r.cpu_s / r.objects * 1000, 3) for r in results},
        # client CPU per object, torch's over the best row's: what the store's speed does not move
        # CPU is counted in clock ticks: a run under one tick counts as one (the ratio is then a
        # lower bound), where it was a division by zero
        "cpu_ratio": round(
            (torch_r.cpu_s / torch_r.objects) / (max(best.cpu_s, TICK_S) / best.objects), 2
        ),
        "clients": clients,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
