"""The decode turns of Parquet sources: shared by loops in several threads, lowest order first, a
cancelled waiter's turn passed on."""

from __future__ import annotations

import asyncio
import threading

from aioloader.sources.formats.parquet_readahead import Turns


def test_a_turn_ended_on_one_loop_goes_to_the_lowest_waiter_on_any_loop() -> None:
    turns = Turns(1)
    order: list[str] = []
    held, waiting = threading.Event(), threading.Barrier(3)

    async def holder() -> None:
        async with turns.turn(0):
            held.set()
            waiting.wait(10)  # both others are queued (or about to be)
            await asyncio.sleep(0.05)
            order.append("holder")

    async def waiter(name: str, rank: int) -> None:
        held.wait(10)
        task = asyncio.ensure_future(_take(turns, rank, name, order))
        await asyncio.sleep(0)  # queued
        waiting.wait(10)
        await task

    threads = [
        threading.Thread(target=asyncio.run, args=(holder(),)),
        threading.Thread(target=asyncio.run, args=(waiter("late", 5),)),
        threading.Thread(target=asyncio.run, args=(waiter("first", 1),)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert order == ["holder", "first", "late"]
    assert turns.free == 1


async def _take(turns: Turns, rank: int, name: str, order: list[str]) -> None:
    async with turns.turn(rank):
        order.append(name)


def test_a_cancelled_waiter_passes_its_turn_on() -> None:
    turns = Turns(1)

    async def main() -> list[str]:
        order: list[str] = []
        gate = asyncio.Event()

        async def hold() -> None:
            async with turns.turn(0):
                await gate.wait()
                order.append("holder")

        first = asyncio.ensure_future(hold())
        await asyncio.sleep(0)
        doomed = asyncio.ensure_future(_take(turns, 1, "doomed", order))
        after = asyncio.ensure_future(_take(turns, 2, "after", order))
        await asyncio.sleep(0)
        doomed.cancel()
        gate.set()
        await asyncio.gather(first, after)
        assert doomed.cancelled()
        return order

    assert asyncio.run(main()) == ["holder", "after"]
    assert turns.free == 1
