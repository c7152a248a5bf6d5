"""Throttling that slows down: a store answering 503 SlowDown above a request rate for seconds is
waited out (retries until each read's deadline, full jitter), by the listing and by every read, so no
sample is lost and no error raised; failures that are not throttling still stop at `attempts`."""

from __future__ import annotations

import io
import random
import tarfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.faultproxy import Fault, FaultProxy, RateLimit
from support.s3server import SeaweedServer

from aioloader import FetchError, Loader
from aioloader.sources.s3 import s3
from aioloader.sources.tar import tar_shards
from aioloader.sources.transport.retry import MAX_THROTTLE_BACKOFF, Retry

PREFIX = "throttled/"
# Backoff small enough for a test, a deadline far past the throttle: attempts alone (5) would fail.
RETRY = {"backoff": 0.02, "max_backoff": 0.2, "deadline": 60.0, "attempts": 5}


@pytest.fixture(scope="module")
def stored(seaweed: SeaweedServer) -> dict[str, bytes]:
    objects = {f"{PREFIX}{i:04d}.bin": bytes([i % 251]) * (512 + i) for i in range(80)}
    for name, body in objects.items():
        seaweed.put(name, body)
    return objects


@pytest.fixture(scope="module")
def shards(seaweed: SeaweedServer) -> list[str]:
    urls = []
    for s in range(6):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(5):
                data = f"{s}-{i}".encode()
                info = tarfile.TarInfo(f"x{s}_{i}.txt")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        name = f"throttled-shards/{s}.tar"
        seaweed.put(name, buf.getvalue())
        urls.append(f"s3://{seaweed.bucket}/{name}")
    return urls


@pytest.fixture
def proxy(seaweed: SeaweedServer) -> Iterator[FaultProxy]:
    server = FaultProxy(seaweed.endpoint)
    yield server
    server.stop()


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
@pytest.mark.in_process
def test_a_throttled_store_is_waited_out_by_the_listing_and_every_read(
    engine: str, proxy: FaultProxy, seaweed: SeaweedServer, stored: dict[str, bytes]
) -> None:
    limit = proxy.plan = RateLimit(per_second=20, seconds=2.0)
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", endpoint_url=proxy.url,
             credentials=seaweed.credentials, concurrency=16, engine=engine, page_size=10,
             **RETRY)  # fmt: skip
    keys = src.keys()  # 8 pages, listed through the throttle
    assert keys == sorted(stored)
    with Loader(src, concurrency=16, collate=None, max_bytes_in_flight=None) as loader:
        got = [bytes(x) for x in loader]
    assert got == [stored[k] for k in keys]  # every sample, in order, none lost
    stats = src.stats()
    assert limit.throttled > 5 * 16  # more throttles than five attempts per read would survive
    assert stats["failures"] == 0
    assert stats["retries"] >= stats["throttles"] > 0


def test_tar_shards_through_a_throttle_lose_no_sample(
    proxy: FaultProxy, seaweed: SeaweedServer, shards: list[str]
) -> None:
    limit = proxy.plan = RateLimit(per_second=10, seconds=1.5)
    options = {"endpoint_url": proxy.url, "credentials": seaweed.credentials, **RETRY}
    src = tar_shards(shards, parallel=6, s3_options=options)
    with Loader(src, collate=None) as loader:
        got = sorted(sample["txt"].decode() for sample in loader)
    assert got == sorted(f"{s}-{i}" for s in range(6) for i in range(5))
    assert limit.throttled > 0


def test_throttling_stops_at_the_deadline_and_other_failures_at_attempts(
    proxy: FaultProxy, seaweed: SeaweedServer, stored: dict[str, bytes]
) -> None:
    keys = sorted(stored)[:1]
    options = {"endpoint_url": proxy.url, "credentials": seaweed.credentials, "backoff": 0.01,
               "max_backoff": 0.05, "attempts": 3}  # fmt: skip
    proxy.plan = lambda path, n: Fault("slowdown")  # a throttle that never ends
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", keys, deadline=0.5, **options)
    with Loader(src, collate=None) as loader, pytest.raises(FetchError) as throttled:
        list(loader)
    assert "deadline of 0.5 s passed; last error: HTTP 503" in str(throttled.value)
    assert "SlowDown" in str(throttled.value)
    assert proxy.seen[keys[0].replace(PREFIX, f"{seaweed.bucket}/{PREFIX}")] > 3  # past attempts
    proxy.reset_counts()
    proxy.plan = lambda path, n: Fault("500")  # a server error: tried `attempts` times
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", keys, deadline=30.0, **options)
    with Loader(src, collate=None) as loader, pytest.raises(FetchError, match=r"after 3 attempt"):
        list(loader)
    proxy.reset_counts()
    proxy.plan = lambda path, n: Fault("slowdown")
    src = s3(f"s3://{seaweed.bucket}/{PREFIX}", keys, **{**options, "attempts": 1})
    with Loader(src, collate=None) as loader, pytest.raises(FetchError, match=r"after 1 attempt"):
        list(loader)  # attempts=1: never retried, not even a throttle


def read_in_four_ranks(
    seaweed: SeaweedServer, proxy: FaultProxy, url: str, keys: list[str], **options: Any
) -> dict[int, list[bytes]]:
    """Four ranks' loaders over `keys` through the proxy, each in its own thread (as four processes
    would), started together: rank -> the samples it read. Any rank's error fails the test."""
    got: dict[int, list[bytes]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def rank(r: int) -> None:
        src = s3(url, keys, endpoint_url=proxy.url, credentials=seaweed.credentials,
                 concurrency=8, **options)  # fmt: skip
        try:
            with Loader(src, collate=None, rank=r, world_size=4) as loader:
                start.wait()
                got[r] = [bytes(x) for x in loader]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    return got


def test_four_ranks_at_once_through_a_throttle_all_finish_with_every_sample(
    proxy: FaultProxy, seaweed: SeaweedServer, stored: dict[str, bytes]
) -> None:
    """Four ranks' loaders (each in its own thread, as four processes would) start together
    against a store throttling above 20 requests/s for 2 s: none fails, every sample comes once."""
    limit = proxy.plan = RateLimit(per_second=20, seconds=2.0)
    keys = sorted(stored)
    got = read_in_four_ranks(seaweed, proxy, f"s3://{seaweed.bucket}/{PREFIX}", keys, **RETRY)
    assert sorted(body for r in range(4) for body in got[r]) == sorted(stored.values())
    assert limit.throttled > 0


class Logged:
    """A plan that passes each request to `plan` and notes when (the proxy's clock) it came."""

    def __init__(self, plan: RateLimit) -> None:
        self.plan = plan
        self.times: list[float] = []

    def __call__(self, path: str, n: int) -> Fault | None:
        self.times.append(time.monotonic())
        return self.plan(path, n)


def test_ranks_ask_again_soon_after_a_throttle_ends(
    proxy: FaultProxy, seaweed: SeaweedServer
) -> None:
    """Four ranks with the default backoff through 5 s of 503s at 20 requests/s: more samples than
    the throttle lets through, so most wait it out; every read asks again within a second of its
    end (the throttled backoff's ceiling), so the last request comes soon after it, not after a
    backoff that kept doubling through the throttle (up to `max_backoff`, 10 s)."""
    many = {f"after-throttle/{i:04d}.bin": bytes([i % 251]) * 64 for i in range(320)}
    for name, body in many.items():
        seaweed.put(name, body)
    limit = RateLimit(per_second=20, seconds=5.0)  # at most ~100 requests pass while it lasts
    proxy.plan = logged = Logged(limit)
    keys = sorted(many)
    got = read_in_four_ranks(seaweed, proxy, f"s3://{seaweed.bucket}/after-throttle/", keys)
    assert sorted(body for r in range(4) for body in got[r]) == sorted(many.values())
    assert limit.start is not None
    end = limit.start + limit.seconds
    after = [t for t in logged.times if t >= end]
    assert len(after) > 100  # most samples came after the throttle
    assert max(logged.times) - end < 2.5  # a second's backoff, then the rest at full speed


def test_a_throttled_reads_backoff_stays_under_a_second_other_failures_grow_to_max_backoff() -> (
    None
):
    retry = Retry(rng=random.Random(3))
    throttled = [retry.delay(n, throttled=True) for n in range(1, 200)]
    failed = [retry.delay(n) for n in range(1, 200)]
    assert max(throttled) <= MAX_THROTTLE_BACKOFF < max(failed) <= retry.max_backoff
    assert max(throttled) > MAX_THROTTLE_BACKOFF / 2  # full jitter up to the ceiling
    assert retry.delay(50, retry_after=5.0, throttled=True) == 5.0  # the server's word is a floor
    with pytest.raises(ValueError, match="max_throttle_backoff"):
        Retry(max_throttle_backoff=-1.0)
