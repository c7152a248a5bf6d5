"""What S3, GCS and Azure Blob sources do alike, each against its real server (SeaweedFS,
fake-gcs-server, Azurite; support/stores.py puts them behind one face): listing, reading, ranges,
missing objects, throttling, tar shards and the cache. What only one store does (its credentials,
addressing, signing, its own faults) stays in test_s3.py, test_gcs.py and test_azure.py."""

from __future__ import annotations

import asyncio
import io
import math
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.faultproxy import Fault, FaultProxy
from support.stores import (
    FAST,
    SERVER_FIXTURES,
    Store,
    clear_store_setup,
    make_store,
    write_objects,
)

from aioloader import FetchError, InvalidKeyError, Loader
from aioloader.sources import tar_shards

STORES = ["s3", "gcs", "azure"]
ENGINES = ["aiohttp", "fast"]


@pytest.fixture(autouse=True)
def no_store_setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each test sees no store variables and no ~/.aws or gcloud files."""
    clear_store_setup(monkeypatch, tmp_path)


@pytest.fixture(scope="module", params=STORES)
def store(request: pytest.FixtureRequest) -> Store:
    """Each store in turn, its server started once per session."""
    return make_store(request.param, request.getfixturevalue(SERVER_FIXTURES[request.param]))


@pytest.fixture(scope="module")
def stored(store: Store) -> dict[str, bytes]:
    """Objects under the store's prefix (odd names included) plus one outside it."""
    return write_objects(store.name, store.server)


@pytest.fixture
def store_proxy(store: Store) -> Iterator[FaultProxy]:
    """A fault proxy in front of the store (forwards everything until given a plan)."""
    server = FaultProxy(store.upstream)
    yield server
    server.stop()


def pages(count: int, page_size: int) -> int:
    return math.ceil(count / page_size)


def test_listing_is_sorted_paged_and_gives_sizes(store: Store, stored: dict[str, bytes]) -> None:
    src = store.source(page_size=7)
    expected = sorted(stored, key=str.encode)
    assert src.size(expected[0]) is None  # not listed yet
    assert src.keys() == expected  # "elsewhere/x.bin" is outside the prefix
    assert src.stats()["requests"] == 0  # the blocking listing used a pool of its own
    # what a byte budget reserves before each fetch: the sizes the listing gave
    assert {k: src.size(k) for k in expected} == {k: len(stored[k]) for k in expected}

    async def streamed() -> list[str]:
        try:
            return [key async for key in src.iter_keys()]
        finally:
            await src.aclose()

    assert asyncio.run(streamed()) == expected
    assert src.stats()["requests"] == pages(len(stored), 7)


@pytest.mark.parametrize("engine", ENGINES)
def test_loader_reads_every_object(engine: str, store: Store, stored: dict[str, bytes]) -> None:
    src = store.source(engine=engine)
    keys = src.keys()
    with Loader(src, batch_size=4, concurrency=16, collate=None) as loader:
        got = [bytes(x) for batch in loader for x in batch]
    assert got == [stored[k] for k in keys]  # in the listing's order, each once
    assert dict(zip(keys, got, strict=True)) == stored
    assert src.stats()["failures"] == 0
    assert src.transport._session is None  # closed with the loader


@pytest.mark.in_process
def test_streamed_listing_feeds_the_loader(store: Store, stored: dict[str, bytes]) -> None:
    src = store.source(page_size=5, stream_keys=True, engine="fast")
    per_epoch = pages(len(stored), 5) + len(stored)  # page by page, then the GETs
    with Loader(src, concurrency=8, collate=None) as loader:
        first = [bytes(x) for x in loader]
        after_first = src.stats()["requests"]
        second = [bytes(x) for x in loader]
    assert [first, second] == [[stored[k] for k in sorted(stored, key=str.encode)]] * 2
    # the fast engine resends a request once when its first connection to fake-gcs-server is
    # closed under it (a count of requests sent, not of answers); every later epoch is exact
    assert per_epoch <= after_first <= per_epoch + 1
    assert src.stats()["requests"] - after_first == per_epoch


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.asyncio
async def test_ranges_and_missing_objects(
    engine: str, store: Store, stored: dict[str, bytes]
) -> None:
    src = store.source(engine=engine, attempts=2, **FAST)
    key = f"{store.prefix}dir a/ü+x=1.bin"
    absent = f"{store.prefix}absent.bin"
    try:
        assert bytes(await src.fetch_range(key, 10, 100)) == stored[key][10:110]
        assert bytes(await src.fetch_range(key, 2000)) == stored[key][2000:]
        assert bytes(await src.fetch_range(key, 0, 7)) == stored[key][:7]
        with pytest.raises(FetchError, match=rf"status 404.*{store.missing}") as info:
            await src.fetch(absent)
        assert "1 attempt(s)" in str(info.value)
        assert info.value.key == absent
        assert src.stats()["retries"] == 0  # a 404 is not retried
        with pytest.raises(InvalidKeyError):
            src.url("")
    finally:
        await src.aclose()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.in_process
def test_throttling_shrinks_the_whole_sources_concurrency(
    engine: str, store: Store, stored: dict[str, bytes], store_proxy: FaultProxy
) -> None:
    kinds = (
        store.throttles
    )  # S3's SlowDown; GCS's 429 and 503; Azure's OperationTimedOut, ServerBusy

    def plan(path: str, n: int) -> Fault | None:  # the first burst of 16 requests is throttled
        total = store_proxy.seen.total()
        return Fault(kinds[total % len(kinds)]) if total <= 16 else None

    store_proxy.plan = plan
    store_proxy.hold = 16  # the burst answered together: no retry is among the first 16 requests
    keys = [k for k in sorted(stored) if "/0" in k]  # simple names: the proxy keeps their quoting
    src = store.source(keys, endpoint=store_proxy.url, concurrency=16, engine=engine, **FAST)
    # no byte budget, so that the first 16 requests go out at once (with one, the first goes
    # alone until a first size is known, and would meet all 16 throttles by itself)
    with Loader(src, concurrency=16, collate=None, max_bytes_in_flight=None) as loader:
        got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in keys]
    stats = src.stats()
    assert stats["throttles"] == 16
    assert stats["decreases"] == 1  # one halving for the burst, not one per throttled request
    assert 8 < stats["concurrency_limit"] < 16  # halved, then growing back by ~1/limit per success
    assert stats["failures"] == 0


def test_tar_shards_over_the_store(store: Store) -> None:
    samples = {
        f"s{i:03d}": (f"label {i}".encode(), random.Random(i).randbytes(3000)) for i in range(12)
    }
    shards, order = [], []
    for n in range(3):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for key in sorted(samples)[n::3]:
                order.append(key)
                for ext, data in zip(("cls", "bin"), samples[key], strict=True):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        store.put(f"shards/part-{n}.tar", buf.getvalue())
        shards.append(store.url(f"shards/part-{n}.tar"))
    src = tar_shards(shards, shuffle=False, parallel=1, **store.tar_options())
    with Loader(src, collate=None) as loader:
        got = [(s["__key__"], (bytes(s["cls"]), bytes(s["bin"]))) for s in loader]
    assert got == [(key, samples[key]) for key in order]  # shard by shard, in each shard's order


@pytest.mark.parametrize("store", ["gcs", "azure"], indirect=True)
@pytest.mark.in_process
def test_a_cached_epoch_makes_no_get_and_a_changed_object_is_fetched_again(
    store: Store, store_proxy: FaultProxy, tmp_path: Path
) -> None:
    # the cache comes with the remote base; the listing gives each object's ETag, so an object
    # rewritten with the same size is still told apart from its cached copy
    prefix = "cached/"
    bodies = {f"{prefix}{i}.bin": bytes([i]) * (3000 + i) for i in range(5)}
    for name, body in bodies.items():
        store.put(name, body)

    def epoch() -> list[bytes]:
        src = store.source(prefix=prefix, endpoint=store_proxy.url, cache_dir=tmp_path,
                           concurrency=4)  # fmt: skip
        assert src.etag(f"{prefix}0.bin") is None  # not listed yet
        with Loader(src, batch_size=5, collate=None, shuffle=False) as loader:
            got = [bytes(x) for batch in loader for x in batch]
        assert src.etag(f"{prefix}0.bin")
        return got

    assert epoch() == list(bodies.values())
    assert sum(store_proxy.seen.values()) == 1 + len(bodies)  # the listing, then each object once
    store_proxy.reset_counts()
    assert epoch() == list(bodies.values())
    assert sum(store_proxy.seen.values()) == 1  # the listing only
    changed = f"{prefix}2.bin"
    bodies[changed] = b"\xff" * len(bodies[changed])  # same size, new ETag
    store.put(changed, bodies[changed])
    store_proxy.reset_counts()
    assert epoch() == list(bodies.values())
    assert sum(store_proxy.seen.values()) == 2  # the listing, and the changed object
