"""loader.diagnose(): pipelines whose bottleneck is known, and the verdict's rules on made-up stats."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from support.fakes import FakeSource
from support.faultproxy import ServerThread

from aioloader import DataLoader, Loader, sources
from aioloader._observe.diagnose import BOTTLENECKS, Diagnosis, diagnose
from aioloader._observe.stats import STAGES, LoaderStats, StageStats


async def quick(key: int) -> bytes:
    await asyncio.sleep(0)
    return bytes(64)


def verdict(loader: Loader[Any], consume_s: float = 0.0) -> Diagnosis:
    with loader:
        for _ in loader:
            if consume_s:
                time.sleep(consume_s)
        return loader.diagnose()


# -- pipelines with a known bottleneck ----------------------------------------------------------


def test_slow_fetch_at_low_concurrency_is_fetch() -> None:
    async def slow(key: int) -> bytes:
        await asyncio.sleep(0.02)
        return bytes(64)

    d = verdict(Loader(range(40), slow, batch_size=4, concurrency=2, collate=None))
    assert d.bottleneck == "fetch", d
    assert "concurrency" in d.text
    assert "Raise concurrency" in d.text
    assert any(line.startswith("fetch: all 2 slots") for line in d.evidence)


def test_slow_decode_on_one_thread_is_decode() -> None:
    def decode(raw: bytes) -> int:
        time.sleep(0.01)
        return len(raw)

    d = verdict(Loader(range(40), quick, decode=decode, executor="thread", workers=1,
                       batch_size=4, collate=None))  # fmt: skip
    assert d.bottleneck == "decode", d
    assert "workers" in d.text
    assert "executor='process'" in d.text


def test_slow_inline_decode_is_the_event_loop() -> None:
    def decode(raw: bytes) -> int:
        time.sleep(0.01)
        return len(raw)

    loader = Loader(range(30), quick, decode=decode, batch_size=3, collate=None, executor="inline")
    d = verdict(loader)
    assert d.bottleneck == "loop", d
    assert "executor='thread'" in d.text


def test_slow_consumer_is_the_model() -> None:
    loader = Loader(range(48), quick, batch_size=4, collate=None, prefetch=4)
    d = verdict(loader, consume_s=0.04)
    assert d.bottleneck == "consumer", d
    assert "model" in d.text


class RetryingSource(FakeSource):
    """Every fetch needed two retries (as an HTTP source under 503s reports them)."""

    async def fetch(self, key: int) -> int:
        await asyncio.sleep(0.005)
        return await super().fetch(key)

    def stats(self) -> dict[str, int]:
        return {"requests": 3 * len(self.fetched), "retries": 2 * len(self.fetched)}


def test_a_retrying_source_is_named() -> None:
    d = verdict(Loader(RetryingSource(30), batch_size=3, collate=None, concurrency=2))
    assert d.bottleneck == "fetch", d
    assert "retr" in d.text
    assert "throttl" in d.text


def write_shard(path: Path, shard: int, samples: int, size: int) -> bytes:
    with tarfile.open(path, "w") as tar:
        for i in range(samples):
            member = tarfile.TarInfo(f"s{shard}-{i:04d}.bin")
            member.size = size
            tar.addfile(member, io.BytesIO(bytes([i % 251]) * size))
    return path.read_bytes()


def test_a_bandwidth_bound_shard_stream_is_fetch_and_advises_parallel(tmp_path: Path) -> None:
    """Shards served over HTTP at about 2 MB/s each: the shard reads set the pace."""
    shards = {f"shard-{s}.tar": write_shard(tmp_path / f"{s}.tar", s, 24, 8192) for s in range(3)}

    async def trickle(request: web.Request) -> web.StreamResponse:
        data = shards[request.match_info["name"]]
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(request)
        for at in range(0, len(data), 16384):
            await resp.write(data[at : at + 16384])
            await asyncio.sleep(0.008)
        return resp

    app = web.Application()
    app.router.add_get("/{name}", trickle)
    server = ServerThread(app, "test-trickle")
    try:
        src = sources.tar_shards([f"{server.url}/{name}" for name in shards], parallel=1)
        with Loader(src, batch_size=8, collate=None) as loader:
            assert sum(len(batch) for batch in loader) == 72
            st, d = loader.stats(), loader.diagnose()
    finally:
        server.stop()
    fetch = st.stages["fetch"]
    assert (fetch.items, fetch.limit) == (72, 1)  # the shard reads, against one reader
    assert fetch.bytes == 72 * 8192
    assert fetch.service_mean_s is not None
    assert fetch.service_mean_s > 0.001  # reading, not the 0.0 ms of handing a sample over
    assert d.bottleneck == "fetch", d
    assert "parallel=2" in d.text, d
    assert any(line.startswith("fetch: all 1 shard readers reading") for line in d.evidence)


class SlowItems:
    """A map-style dataset whose items take 20 ms each to make."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> int:
        time.sleep(0.02)
        return i


def test_dataloader_advice_names_num_workers() -> None:
    loader = DataLoader(
        SlowItems(), batch_size=4, num_workers=1, threads_per_worker=1, worker_mode="process"
    )  # the workers' advice (on a free-threaded build "auto" would read in threads)
    d = verdict(loader)
    assert d.bottleneck == "decode", d  # the workers' stage
    assert "num_workers=" in d.text, d
    assert " workers=" not in d.text.replace("num_workers=", ""), d


class SlowItemsWithALambda(SlowItems):
    """Does not pickle, so a worker's read threads cannot each get a copy of it."""

    def __init__(self) -> None:
        self.transform = lambda i: i

    def __getitem__(self, i: int) -> int:
        return self.transform(super().__getitem__(i))  # type: ignore[no-any-return]


def test_dataloader_advice_says_why_a_worker_reads_one_call_at_a_time() -> None:
    loader = DataLoader(SlowItemsWithALambda(), batch_size=4, num_workers=1, worker_mode="process")
    d = verdict(loader)
    assert d.bottleneck == "decode", d
    assert "one call at a time" in d.text, d
    assert "it does not pickle" in d.text, d
    assert "thread_safe = True" in d.text, d
    fine = verdict(DataLoader(SlowItems(), batch_size=4, num_workers=1, worker_mode="process"))
    assert "one call at a time" not in fine.text, fine  # it pickles: its threads read copies


def test_str_is_the_text_then_the_evidence() -> None:
    d = Diagnosis("fetch", "Fetch is slow.", ["a", "b"])
    assert str(d) == "Fetch is slow.\n  - a\n  - b"


# -- the rules, on made-up snapshots -------------------------------------------------------------


def snapshot(full: dict[str, float], data_bound: float = 90.0, **kw: Any) -> LoaderStats:
    stages = {
        name: StageStats(items=100, busy_mean=full.get(name, 0.0), limit=4 if name == "fetch" else 1,
                         full_pct=100.0 * full.get(name, 0.0), latency_p50_s=0.01)
        for name in STAGES
    }  # fmt: skip
    base = dict(wall_s=10.0, stages=stages, batches=50, samples=500, consumer_wait_s=9.0 * data_bound / 100,
                data_bound_pct=data_bound * 0.9, ready_batches=0, held_samples=0, held_bytes=0,
                max_bytes_in_flight=1 << 20, concurrency=4, first_batch_s=0.0)  # fmt: skip
    base.update(kw)
    return LoaderStats(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("stage", ["fetch", "decode", "collate", "transfer"])
def test_the_stage_full_most_of_the_time_is_named(stage: str) -> None:
    d = diagnose(
        snapshot({stage: 0.9, **{s: 0.1 for s in STAGES if s != stage}}), executor="thread"
    )
    assert d.bottleneck == stage
    assert d.bottleneck in BOTTLENECKS


def test_no_full_stage_while_the_consumer_waits_is_the_loop() -> None:
    d = diagnose(snapshot({s: 0.2 for s in STAGES}), executor="thread")
    assert d.bottleneck == "loop"


def test_a_consumer_that_rarely_waits_wins_over_a_busy_stage() -> None:
    d = diagnose(snapshot({"fetch": 1.0}, data_bound=2.0))
    assert d.bottleneck == "consumer"


def test_throttles_reported_by_the_source_name_fetch() -> None:
    d = diagnose(snapshot({"decode": 0.9}, extra={"throttles": 4}), executor="thread")
    assert d.bottleneck == "fetch"
    assert "4 throttled" in d.text


def test_the_first_batch_wait_does_not_make_a_fast_loader_look_slow() -> None:
    # 3 s of start-up, then 7 s during which the consumer waited 0.1 s
    st = snapshot({"fetch": 0.3}, data_bound=31.0, consumer_wait_s=3.1, first_batch_s=3.0)
    st.data_bound_pct = 31.0
    assert diagnose(st).bottleneck == "consumer"


def decode_bound(workers: int) -> LoaderStats:
    st = snapshot({"decode": 1.0})
    d = st.stages["decode"]
    d.limit, d.busy_mean = workers, 20.0 * workers
    d.latency_p50_s, d.service_mean_s, d.queued_mean_s = 0.3196, 0.010, 0.3096
    return st


def test_latency_is_split_into_work_and_waiting() -> None:
    d = diagnose(decode_bound(2), executor="thread", cores=8)
    line = next(line for line in d.evidence if line.startswith("decode:"))
    assert "p50 319.6 ms" in line
    assert "10.0 ms at work and 309.6 ms waiting for a slot" in line
    assert "a decode works 10.0 ms and waits 309.6 ms" in d.text


@pytest.mark.parametrize(
    ("workers", "cores", "advised"), [(1, 8, 2), (3, 4, 4), (4, 4, None), (8, 4, None)]
)
def test_workers_are_advised_up_to_the_cores_by_the_apis_argument(
    workers: int, cores: int, advised: int | None
) -> None:
    for argument in ("workers", "num_workers"):
        d = diagnose(decode_bound(workers), executor="process", workers_argument=argument,
                     cores=cores)  # fmt: skip
        assert d.bottleneck == "decode"
        if advised is None:
            assert "cheaper" in d.text
            assert f"every one of the {cores} cores" in d.text
            assert f"{argument}={workers} already" in d.text
        else:
            assert f"add workers ({argument}={advised}, at most one per core: {cores})" in d.text
