"""A rank's start on a shared store (`_tuning/ramp.py`): a jitter that grows with the world size, a
concurrency that starts low in a large job and grows by one per answer until the first throttle."""

from __future__ import annotations

import asyncio
import math

import pytest

from aioloader._tuning.aimd import Aimd
from aioloader._tuning.ramp import BURST, JITTER_S_PER_DOUBLING, LEAST_START, Ramp
from aioloader.sources import s3


def test_the_schedule_is_deterministic_per_seed_and_rank() -> None:
    ramps = [Ramp.for_job(64, world=1024, rank=r, seed=5) for r in range(1024)]
    assert ramps == [Ramp.for_job(64, world=1024, rank=r, seed=5) for r in range(1024)]
    assert ramps != [Ramp.for_job(64, world=1024, rank=r, seed=6) for r in range(1024)]
    assert len({r.delay_s for r in ramps}) == 1024  # each rank its own draw


@pytest.mark.parametrize("world", [2, 8, 64, 1024])
def test_the_jitter_spans_a_span_that_grows_with_log2_of_the_world(world: int) -> None:
    span = JITTER_S_PER_DOUBLING * math.log2(world)
    delays = [Ramp.for_job(64, world=world, rank=r, seed=1).delay_s for r in range(512)]
    assert all(0.0 <= d <= span for d in delays)
    assert max(delays) > 0.9 * span  # spread over the whole span (uniform)
    assert min(delays) < 0.1 * span


def test_the_start_keeps_the_jobs_opening_burst_near_burst_requests() -> None:
    assert Ramp.for_job(64, world=1, rank=0) == Ramp(64, 0.0)  # alone: at once, at full speed
    assert Ramp.for_job(64, world=8, rank=0).start == 64  # small jobs start at full speed
    assert Ramp.for_job(64, world=64, rank=0).start == BURST // 64
    assert Ramp.for_job(64, world=1000, rank=0).start == LEAST_START
    assert Ramp.for_job(1, world=1000, rank=0).start == 1


def test_the_job_is_read_from_torchruns_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "7")
    monkeypatch.setenv("WORLD_SIZE", "1000")
    assert Ramp.for_job(64) == Ramp.for_job(64, world=1000, rank=7)
    src = s3("s3://bucket/p/", endpoint_url="http://127.0.0.1:9", credentials=("a", "b"))
    assert src.stats()["concurrency_limit"] == LEAST_START  # the source's limiter starts low


@pytest.mark.asyncio
async def test_slow_start_grows_by_one_per_answer_until_the_first_throttle() -> None:
    limiter = Aimd(maximum=32, ramp=Ramp(2, 0.0))
    limits = []
    for _ in range(6):
        limiter.release(await limiter.acquire())
        limits.append(limiter.limit)
    assert limits == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]  # a round of 2 answers: 4 in flight, doubled
    limiter.release(await limiter.acquire(), throttled=True)
    assert limiter.limit == 4.0
    limiter.release(await limiter.acquire())
    assert limiter.limit == pytest.approx(4.25)  # then additive increase: 1/limit per answer
    full = Aimd(maximum=3, ramp=Ramp(2, 0.0))
    for _ in range(4):
        full.release(await full.acquire())
    assert full.limit == 3.0  # never past the maximum


@pytest.mark.asyncio
async def test_no_request_goes_out_before_the_ramps_delay_and_waiting_is_safe_to_cancel() -> None:
    limiter = Aimd(maximum=4, ramp=Ramp(4, 60.0))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(limiter.acquire(), 0.05)
    assert limiter.in_flight == 0  # the cancelled wait took no slot
    at_once = Aimd(maximum=4, ramp=Ramp(4, 0.0))
    ticket = await asyncio.wait_for(at_once.acquire(), 5.0)
    at_once.release(ticket)
