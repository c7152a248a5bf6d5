"""A listing in parts at once over the key space (`stores/keyspace.py`) is exactly the serial listing:
against SeaweedFS (StartAfter) and fake-gcs-server (startOffset/endOffset), with keys exactly at the
cuts, empty parts, a prefix of one key and of none; at about one request a page; a failing page
ends the listing with the error and nothing left running."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.faultproxy import Fault, FaultProxy
from support.gcsserver import GcsServer
from support.s3server import SeaweedServer

from aioloader import FetchError
from aioloader.sources import GCS, S3, gcs, s3
from aioloader.sources.stores.keyspace import Objects, _Space

PAGE = 10
N_KEYS = 230  # 23 pages: cut into parts of 1, 2, 4, ... pages, the last ones empty


def names(prefix: str, n: int) -> list[str]:
    rng = random.Random(n)
    return [f"{prefix}{i:05d}{rng.choice('abc')}.bin" for i in range(n)]


def serial(src: S3 | GCS) -> list[tuple[str, int, str]]:
    """The listing page after page (the streamed listing's path), with sizes and ETags."""

    async def run() -> list[tuple[str, int]]:
        try:
            return [o async for o in src.iter_objects()]
        finally:
            await src.aclose()

    return [(key, size, src.etag(key) or "") for key, size in asyncio.run(run())]


def in_parts(src: S3 | GCS) -> tuple[list[tuple[str, int, str]], Objects]:
    found = src.listing._list_here()
    return list(zip(found.keys, found.sizes, found.etags, strict=True)), found


def check_equal_to_serial(src: S3 | GCS, n: int) -> Objects:
    got, found = in_parts(src)
    want = serial(src)
    assert len(want) == n
    assert got == want
    assert found.requests <= math.ceil(n / PAGE) + len(found.cuts) + 1
    return found


# -- S3 (SeaweedFS) -----------------------------------------------------------------------------


def s3_source(server: SeaweedServer, prefix: str, **options: Any) -> S3:
    return s3(f"s3://{server.bucket}/{prefix}", endpoint_url=server.endpoint,
              credentials=server.credentials, page_size=PAGE, **options)  # fmt: skip


def test_s3_parts_join_into_the_serial_listing_with_keys_at_the_cuts(
    seaweed: SeaweedServer,
) -> None:
    prefix = "keyspace-s3/"
    for i, name in enumerate(names(prefix, N_KEYS)):
        seaweed.put(name, bytes(i % 7 + 1))
    first = check_equal_to_serial(s3_source(seaweed, prefix), N_KEYS)
    assert len(first.cuts) >= 7
    assert first.empty >= 1  # parts past the last key held none
    # Keys exactly at the first cuts (made from the first page alone, so made again) and just
    # around them: each belongs to one part, and is listed once.
    extra = [c for cut in first.cuts[:7] for c in (cut, cut + "0", cut[:-1])]
    extra = sorted(set(extra) - set(names(prefix, N_KEYS)))
    for name in extra:
        seaweed.put(name, b"x")
    again = check_equal_to_serial(s3_source(seaweed, prefix), N_KEYS + len(extra))
    assert again.cuts[:7] == first.cuts[:7]
    assert set(first.cuts[:7]) <= set(again.keys)


def test_s3_a_prefix_of_one_key_or_none_is_one_request(seaweed: SeaweedServer) -> None:
    seaweed.put("keyspace-one/only.bin", b"1")
    found = check_equal_to_serial(s3_source(seaweed, "keyspace-one/"), 1)
    assert (found.requests, found.cuts) == (1, [])
    found = check_equal_to_serial(s3_source(seaweed, "keyspace-none/"), 0)
    assert (found.requests, found.empty) == (1, 1)


def test_s3_dense_numbered_keys_cost_about_one_request_a_page(seaweed: SeaweedServer) -> None:
    prefix = "keyspace-dense/"
    n = 600
    for i in range(n):
        seaweed.put(f"{prefix}{i:07d}.bin", b"d")
    found = check_equal_to_serial(s3_source(seaweed, prefix), n)  # a page or less per cut
    assert len(found.cuts) >= 7  # in parts at once


def test_a_failing_page_ends_the_listing_with_its_error(seaweed: SeaweedServer) -> None:
    prefix = "keyspace-fail/"
    for name in names(prefix, 120):
        seaweed.put(name, b"f")
    proxy = FaultProxy(seaweed.endpoint)
    try:
        proxy.plan = lambda path, n: Fault("500") if n > 2 else None  # the parts' pages fail
        src = s3(f"s3://{seaweed.bucket}/{prefix}", endpoint_url=proxy.url, page_size=PAGE,
                 credentials=seaweed.credentials, attempts=1)  # fmt: skip
        with pytest.raises(FetchError, match="HTTP 500"):
            src.manifest()
    finally:
        proxy.stop()


# -- GCS (fake-gcs-server) ----------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_google_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)


def gcs_source(server: GcsServer, prefix: str) -> GCS:
    return gcs(f"gs://{server.bucket}/{prefix}", endpoint_url=server.endpoint, anonymous=True,
               page_size=PAGE)  # fmt: skip


def test_gcs_parts_join_into_the_serial_listing_with_keys_at_the_cuts(
    gcs_server: GcsServer,
) -> None:
    prefix = "keyspace-gcs/"
    for i, name in enumerate(names(prefix, N_KEYS)):
        gcs_server.put(name, bytes(i % 5 + 1))
    first = check_equal_to_serial(gcs_source(gcs_server, prefix), N_KEYS)
    assert len(first.cuts) >= 7
    assert first.empty >= 1
    extra = [c for cut in first.cuts[:7] for c in (cut, cut + "0", cut[:-1])]
    extra = sorted(set(extra) - set(names(prefix, N_KEYS)))
    for name in extra:
        gcs_server.put(name, b"x")
    again = check_equal_to_serial(gcs_source(gcs_server, prefix), N_KEYS + len(extra))
    assert set(first.cuts[:7]) <= set(again.keys)


def test_gcs_a_prefix_of_one_key_is_one_request(gcs_server: GcsServer) -> None:
    gcs_server.put("keyspace-gcs-one/only.bin", b"1")
    found = check_equal_to_serial(gcs_source(gcs_server, "keyspace-gcs-one/"), 1)
    assert (found.requests, found.cuts) == (1, [])


# -- the key space as numbers -------------------------------------------------------------------

keys = st.lists(st.text("ab0/.~ü", min_size=1, max_size=8), min_size=2, max_size=30, unique=True)


@settings(max_examples=200, deadline=None)
@given(keys, st.lists(st.text("ab0/.~üz", max_size=10), min_size=2, max_size=10))
def test_numbers_keep_key_order_and_cuts_fall_between(first: list[str], others: list[str]) -> None:
    space = _Space("p/", ["p/" + k for k in sorted(first)])
    ordered = sorted("p/" + k for k in others)
    number: Callable[[str], int] = space.number
    assert [number(k) for k in ordered] == sorted(number(k) for k in ordered)
    for a, b in itertools.pairwise(ordered):
        middle = space.key((number(a) + number(b)) // 2)
        assert middle.startswith("p/")
        assert number(a) <= number(middle) <= number(b)
