"""Autotuning: the climber on simulated sources, the tuners' bounds, and the loader's "auto" knobs."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import pytest
from support.fakes import Tracker

from aioloader import Loader
from aioloader._observe.stats import NullRecorder, Recorder
from aioloader._tuning.auto import (
    AUTO_INITIAL,
    AutoConcurrency,
    AutoWorkers,
    Climber,
    resolve_concurrency,
)
from aioloader._tuning.memory import MemoryBudget

# -- the climber, driven by a simulated source (no clock, no threads) ----------------------------

Model = Callable[[int, float], tuple[float, float]]  # (limit, t) -> (items/s, mean in flight)


def store(latency: Callable[[float], float], capacity: float = 1e9, cpu: float = 1e9) -> Model:
    """A store answering after `latency(t)` s; it serves `capacity` requests at once (more queue
    there), and the client completes at most `cpu` items/s (more limit then stays unused)."""

    def model(limit: int, t: float) -> tuple[float, float]:
        lat = latency(t)
        rate = min(min(limit, capacity) / lat, cpu)
        in_flight = limit if rate < cpu else rate * lat  # CPU-bound: the launcher falls behind
        return rate, in_flight

    return model


def drive(
    climber: Climber,
    model: Model,
    seconds: float,
    t0: float = 0.0,
    noise: float = 0.0,
    seed: int = 0,
    ceiling: int | None = None,
) -> list[tuple[float, int]]:
    """Tick `climber` as the model completes items; returns (t, limit) at each change."""
    rng = random.Random(seed)
    t, area, factor, changes = t0, 0.0, 1.0, [(t0, climber.limit)]
    next_noise = t0
    while t < t0 + seconds:
        if noise and t >= next_noise:  # the host's load moves every 0.3 s
            factor, next_noise = 1.0 - noise * rng.random(), t + 0.3
        rate, in_flight = model(climber.limit, t)
        dt = 1.0 / (rate * factor)
        t += dt
        area += in_flight * dt
        climber.tick(t, area, ceiling)
        if climber.limit != changes[-1][1]:
            changes.append((t, climber.limit))
    return changes


def limit_at(changes: list[tuple[float, int]], t: float) -> int:
    return [limit for when, limit in changes if when <= t][-1]


def test_slow_start_climbs_to_a_store_capacity_and_stays_there() -> None:
    climber = Climber("fetch", 16, 1, 256)
    changes = drive(climber, store(lambda t: 0.02, capacity=100), 20.0)
    assert limit_at(changes, 5.0) >= 90  # within 90% of the best rate after 5 s
    assert all(limit >= 90 for when, limit in changes if when > 5.0)
    assert max(limit for _, limit in changes) <= 256


def test_slow_start_doubles_every_few_latencies() -> None:
    """A fast store (20 ms): from 16 to 128 and beyond within 0.6 s, not a quarter second a step."""
    climber = Climber("fetch", 16, 1, 1024)
    changes = drive(climber, store(lambda t: 0.02), 0.6)
    assert [limit for _, limit in changes][:4] == [16, 32, 64, 128]
    assert limit_at(changes, 0.6) >= 128


def test_items_queued_beyond_what_the_store_needs_are_drained() -> None:
    """The client completes 2,000 items/s and every item the limit lets in waits its turn: at
    20 ms, 40 in flight do it (Little's law); more only queue (latency grows with the limit), so
    the limit comes back to about 40 plus headroom, and stays near it."""

    def model(limit: int, t: float) -> tuple[float, float]:
        return min(limit / 0.02, 2000.0), float(limit)

    climber = Climber("fetch", 16, 1, 1024)
    changes = drive(climber, model, 10.0)
    assert max(limit for _, limit in changes) <= 128  # slow start ends at the first flat doubling
    assert all(40 <= limit <= 64 for when, limit in changes if when > 2.0)


def test_a_step_that_costs_throughput_is_undone() -> None:
    """Beyond 64 in flight, every item in flight costs throughput (e.g. the host's CPU)."""

    def model(limit: int, t: float) -> tuple[float, float]:
        return min(limit / 0.02, 3200 / (1 + 0.3 * max(0, limit - 64) / 64)), float(limit)

    climber = Climber("fetch", 16, 1, 256)
    changes = drive(climber, model, 10.0)
    assert all(limit <= 100 for when, limit in changes if when > 2.0)
    assert climber.limit >= 48


def test_never_beyond_the_maximum_or_below_the_minimum() -> None:
    climber = Climber("fetch", 4, 2, 40)
    changes = drive(climber, store(lambda t: 0.01), 10.0)
    assert all(2 <= limit <= 40 for _, limit in changes)
    assert climber.limit == 40  # an unbounded store: the ceiling is the best


def test_a_slower_store_gets_more_in_flight() -> None:
    """20 ms, then 80 ms from t=10 s, with the client able to complete 2,000 items/s at most."""
    climber = Climber("fetch", 16, 1, 512)
    model = store(lambda t: 0.02 if t < 10 else 0.08, cpu=2000)
    changes = drive(climber, model, 20.0)
    before = limit_at(changes, 10.0)
    assert model(before, 5.0)[0] >= 0.9 * 2000
    rate_after = model(limit_at(changes, 13.0), 13.0)[0]
    assert rate_after >= 0.9 * 2000  # within 3 s of the change
    assert model(climber.limit, 19.0)[0] >= 0.9 * 2000


@pytest.mark.parametrize("seed", range(3))
def test_a_noisy_host_does_not_drag_the_limit_down(seed: int) -> None:
    climber = Climber("fetch", 16, 1, 256)
    model = store(lambda t: 0.02 if t < 10 else 0.08, cpu=2000)
    changes = drive(climber, model, 20.0, noise=0.4, seed=seed)
    assert model(limit_at(changes, 8.0), 8.0)[0] >= 0.8 * 2000
    assert model(limit_at(changes, 15.0), 15.0)[0] >= 0.8 * 2000


def test_a_limit_that_does_not_bind_is_not_raised() -> None:
    """A fetch stage starved downstream: few in flight whatever the limit."""
    climber = Climber("fetch", 16, 1, 256)
    drive(climber, lambda limit, t: (500.0, 3.0), 10.0)
    assert climber.limit == 16


def test_the_ceiling_caps_the_limit() -> None:
    climber = Climber("fetch", 16, 1, 256)
    changes = drive(climber, store(lambda t: 0.02), 10.0, ceiling=40)
    assert max(limit for _, limit in changes) <= 40
    assert climber.limit == 40


def test_changes_are_logged_at_info(caplog: pytest.LogCaptureFixture) -> None:
    climber = Climber("fetch concurrency", 16, 1, 256)
    with caplog.at_level(logging.INFO, logger="aioloader"):
        drive(climber, store(lambda t: 0.02, capacity=64), 5.0)
    records = [r for r in caplog.records if r.name == "aioloader"]
    assert records
    assert all(r.levelno == logging.INFO for r in records)
    assert "fetch concurrency 16 -> 32" in records[0].getMessage()


# -- AutoConcurrency: throttling and the byte budget ---------------------------------------------


def test_throttling_halves_the_limit_once_per_round() -> None:
    tuner = AutoConcurrency(Recorder(), initial=32, maximum=256)
    tuner.throttled()
    assert tuner.limit == 16
    tuner.throttled()  # sent before the cut: says nothing new
    assert tuner.limit == 16


def test_the_source_throttle_count_counts_as_throttling(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {"n": 0}
    tuner = AutoConcurrency(Recorder(), initial=32, throttles=lambda: seen["n"])
    monkeypatch.setattr("aioloader._tuning.auto.THROTTLE_CHECK_S", 0.0)
    tuner.completed(0.0)
    assert tuner.limit == 32
    seen["n"] = 3
    tuner.completed(0.0)
    assert tuner.limit == 16


def test_the_byte_budget_bounds_the_ceiling() -> None:
    rec = Recorder()
    rec.stages["fetch"].items, rec.stages["fetch"].bytes = 10, 10 * 1000
    tuner = AutoConcurrency(rec, initial=16, maximum=256, budget=MemoryBudget(20_000))
    assert tuner._ceiling() == 20
    assert AutoConcurrency(NullRecorder(), budget=MemoryBudget(20_000))._ceiling() is None


def test_resolve_refuses_other_words() -> None:
    with pytest.raises(TypeError, match="concurrency"):
        resolve_concurrency("fast", is_async=True, recorder=Recorder(), budget=MemoryBudget())
    limit, tuner = resolve_concurrency(
        "auto", is_async=False, recorder=Recorder(), budget=MemoryBudget()
    )
    assert isinstance(tuner, AutoConcurrency)
    assert tuner.limit == AUTO_INITIAL
    assert limit >= AUTO_INITIAL


# -- the loader with "auto" ----------------------------------------------------------------------


async def tiny(key: int) -> bytes:
    await asyncio.sleep(0.001)
    return bytes([key % 256]) * 8


def test_auto_concurrency_loads_everything_within_its_limit() -> None:
    tracker = Tracker()

    async def fetch(key: int) -> int:
        tracker.enter(key)
        try:
            await asyncio.sleep(0.001)
            return key
        finally:
            tracker.exit()

    with Loader(range(400), fetch, batch_size=10, collate=None, concurrency="auto") as loader:
        seen = [k for batch in loader for k in batch]
        stats = loader.stats()
    assert seen == list(range(400))
    assert 1 <= stats.concurrency <= 256
    assert stats.stages["fetch"].limit == stats.concurrency
    assert tracker.peak <= 256


def test_a_timeout_in_fetch_throttles_auto_concurrency(caplog: pytest.LogCaptureFixture) -> None:
    async def fetch(key: int) -> bytes:
        if key == 5:
            raise TimeoutError("the store did not answer")
        return await tiny(key)

    with (
        caplog.at_level(logging.INFO, logger="aioloader"),
        Loader(
            range(20), fetch, concurrency="auto", on_error="skip", max_skipped=None, collate=None
        ) as loader,  # fmt: skip
    ):
        assert len(list(loader)) == 19
    assert any("throttled" in r.getMessage() for r in caplog.records)


@pytest.mark.in_process
def test_auto_workers_decode_everything_and_report_their_number() -> None:
    def decode(raw: bytes) -> int:
        return len(raw)

    with Loader(range(60), tiny, decode=decode, executor="thread", workers="auto",
                batch_size=6, collate=None) as loader:  # fmt: skip
        assert [x for b in loader for x in b] == [8] * 60
        decode_stats = loader.stats().stages["decode"]
    assert isinstance(loader._stages.decoder, AutoWorkers)
    assert decode_stats.limit is not None
    assert decode_stats.limit >= 1


@pytest.mark.asyncio
async def test_auto_workers_never_run_more_than_their_limit_and_survive_cancelling() -> None:
    pool = AutoWorkers(maximum=4, initial=2)
    tracker = Tracker(limit=2)
    release = asyncio.Event()
    loop = asyncio.get_running_loop()

    def work(x: Any) -> Any:
        tracker.enter(x)
        try:
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result(10)
            return x
        finally:
            tracker.exit()

    tasks = [asyncio.create_task(pool.run(work, i)) for i in range(6)]
    await asyncio.to_thread(tracker.wait_for, lambda t: t.in_flight == 2)
    tasks[5].cancel()  # a waiter
    release.set()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    pool.close()
    assert done[:5] == [0, 1, 2, 3, 4]
    assert isinstance(done[5], asyncio.CancelledError)
    assert tracker.violations == []
    assert pool._in_use == 0


def test_workers_auto_with_inline_or_a_word_other_than_auto() -> None:
    with Loader(range(4), tiny, workers="auto") as loader:
        assert len(list(loader)) == 4
    with pytest.raises(TypeError, match="workers"):
        Loader(range(4), tiny, executor="thread", workers="many")
