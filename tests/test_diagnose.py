"""loader.diagnose(): pipelines whose bottleneck is known, and the verdict's rules on made-up stats."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from fakes import FakeSource

from aioloader import Loader
from aioloader._diagnose import BOTTLENECKS, Diagnosis, diagnose
from aioloader._stats import STAGES, LoaderStats, StageStats


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
