"""Feed: the transfer stage staging batches ahead of the consumer, at most `device_prefetch`, in
order, errors after the batches before them, cancel and aclose reaching the epoch (a fake CUDA backend)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.fakecuda import FakeBackend, FakeEpoch
from support.fakes import Boom

from aioloader._pipeline.handover import LoopThread
from aioloader._pipeline.stages import END
from aioloader._pipeline.transfer import DeviceStage


@pytest.mark.asyncio
async def test_feed_stages_at_most_device_prefetch_batches_ahead(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage(device_prefetch=2)
    over_limit: list[int] = []

    def check() -> (
        None
    ):  # on every pull: never more than device_prefetch staged and not handed over
        if stage.stats()["ahead"] >= stage.device_prefetch:
            over_limit.append(stage.stats()["ahead"])

    epoch = FakeEpoch([torch.full((4,), float(i)) for i in range(6)], check)
    feed = stage.feed(epoch)
    _, first = await feed.get()
    await feed.get()
    for _ in range(20):  # a third pull would come at once: nothing but the slot holds it back
        await asyncio.sleep(0)
    assert epoch.pulled == 2
    assert stage.stats()["ahead"] == 2
    stage.hand_over(first)
    await feed.get()
    assert epoch.pulled == 3
    await feed.aclose()
    assert epoch.closed
    assert not over_limit


@pytest.mark.asyncio
async def test_feed_delivers_in_order_then_end(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage(device_prefetch=3)
    feed = stage.feed(FakeEpoch([torch.full((2,), float(i)) for i in range(5)]))
    seen = []
    while True:
        index, staged = await feed.get()
        if staged is END:
            break
        seen.append((index, stage.hand_over(staged)[0].item()))
    assert seen == [(i, float(i)) for i in range(5)]
    assert stage.stats()["ahead_peak"] <= 3
    await feed.aclose()


@pytest.mark.asyncio
async def test_feed_raises_the_epoch_error_after_the_batches_before_it(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage()
    feed = stage.feed(FakeEpoch([torch.ones(1), torch.ones(1), Boom("in fetch")]))
    for _ in range(2):
        stage.hand_over((await feed.get())[1])
    with pytest.raises(Boom, match="in fetch"):
        await feed.get()
    await feed.aclose()


@pytest.mark.asyncio
async def test_a_staging_error_names_the_transfer_stage(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    backend.fail_copy = lambda t: t.numel() == 3
    feed = stage.feed(FakeEpoch([torch.ones(2), torch.ones(3)]))
    stage.hand_over((await feed.get())[1])
    with pytest.raises(RuntimeError, match="fake copy failed") as caught:
        await feed.get()
    assert "aioloader: raised in stage 'transfer'" in caught.value.__notes__
    await feed.aclose()


@pytest.mark.asyncio
async def test_feed_cancel_and_aclose_reach_the_epoch(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage()
    epoch = FakeEpoch([torch.ones(1)] * 4)
    feed = stage.feed(epoch)
    await feed.get()
    feed.cancel()
    assert epoch.cancelled
    await feed.aclose()
    await feed.aclose()  # idempotent
    assert epoch.closed


def test_feed_on_a_loop_thread_hands_over_in_the_consumer_thread(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    """The shape of `for batch in loader`: the feed runs on the loop thread, hand-over in the caller's."""
    stage, backend = make_stage()
    runner = LoopThread()
    consumer = backend.new_stream()

    async def open_feed() -> Any:
        return stage.feed(FakeEpoch([torch.full((3,), float(i)) for i in range(8)]))

    try:
        feed = runner.run(open_feed())
        values = []
        with backend.use_stream(consumer):
            while (item := runner.run(feed.get(), 10.0))[1] is not END:
                values.append(stage.hand_over(item[1])[0].item())
        runner.run(feed.aclose(), 10.0)
    finally:
        runner.stop()
    assert values == [float(i) for i in range(8)]
    waits = backend.kinds("wait")
    assert len(waits) == 8
    assert {(op.stream, op.thread) for op in waits} == {
        (consumer.name, threading.current_thread().name)
    }
    assert {op.thread for op in backend.kinds("copy")} == {"aioloader-transfer_0"}
    assert stage.stats()["ahead_peak"] <= stage.device_prefetch
