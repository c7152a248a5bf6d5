"""Decode turns: each loop orders its own row groups' decodes, and loops that decode share the cores."""

from __future__ import annotations

import asyncio
import gc
import threading
from unittest import mock

import pytest

from aioloader.sources.formats import parquet
from aioloader.sources.formats.parquet_readahead import Turns


@pytest.mark.asyncio
async def test_turns_hold_the_limit_and_let_the_lowest_order_in_first() -> None:
    limit = [2]
    turns = Turns(lambda: limit[0])
    held, most, order = 0, 0, []
    gate = asyncio.Event()

    async def decode(o: int) -> None:
        nonlocal held, most
        async with turns.turn(o):
            held += 1
            most = max(most, held)
            order.append(o)
            await gate.wait()
            held -= 1

    async with turns.turn(9):  # a first turn, ended (until then, one at a time: see below)
        pass
    tasks = [asyncio.create_task(decode(o)) for o in (5, 1, 4, 0, 3)]
    for _ in range(3):  # each task's first step: two take the turns, three wait
        await asyncio.sleep(0)
    assert order == [5, 1]  # the first two take the free turns; the others wait
    limit[0] = 1  # fewer turns from now on: one at a time
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [5, 1, 0, 3, 4]
    assert most == 2
    assert turns.busy == 0


@pytest.mark.asyncio
async def test_the_first_turn_is_taken_alone() -> None:
    # the row group needed first decodes alone; the turns open up once it is done
    turns = Turns(lambda: 2)
    gates = [asyncio.Event() for _ in range(3)]
    held: list[int] = []

    async def decode(o: int) -> None:
        async with turns.turn(o):
            held.append(o)
            await gates[o].wait()

    tasks = [asyncio.create_task(decode(o)) for o in range(3)]
    for _ in range(3):
        await asyncio.sleep(0)
    assert held == [0]  # one turn, though the limit is two
    gates[0].set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert held == [0, 1, 2]  # both turns, once the first ended
    for gate in gates:
        gate.set()
    await asyncio.gather(*tasks)
    assert turns.busy == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_gives_its_turn_to_the_next() -> None:
    turns = Turns(lambda: 1)
    gate = asyncio.Event()
    went: list[str] = []

    async def decode(name: str) -> None:
        async with turns.turn(0):
            went.append(name)
            await gate.wait()

    first = asyncio.create_task(decode("first"))
    await asyncio.sleep(0)
    cancelled = asyncio.create_task(decode("cancelled"))
    last = asyncio.create_task(decode("last"))
    await asyncio.sleep(0)
    cancelled.cancel()
    gate.set()
    await asyncio.gather(first, last)
    assert went == ["first", "last"]
    assert cancelled.cancelled()
    assert turns.busy == 0


def test_loops_that_decode_split_the_cores_among_them() -> None:
    # several loaders mixed run a loop each: their decodes together take a core each, not each
    # loader a core each (more decodes than cores run slower in all)
    started, stop = threading.Barrier(3), threading.Event()
    shares: list[int] = []

    def loop_that_decodes() -> None:
        async def take() -> None:
            parquet.Parquet._decode_turns(None)  # type: ignore[arg-type]  # this loop's turns
            started.wait()
            await asyncio.to_thread(stop.wait)

        asyncio.run(take())

    gc.collect()  # loops of earlier tests that nothing holds
    live = sum(1 for loop in list(parquet._TURNS) if not loop.is_closed())  # (none, normally)
    with mock.patch.object(parquet, "cores", return_value=4):
        before = parquet._turns_per_loop()
        threads = [threading.Thread(target=loop_that_decodes) for _ in range(2)]
        for t in threads:
            t.start()
        started.wait()
        shares.append(parquet._turns_per_loop())
        stop.set()
        for t in threads:
            t.join()
        shares.append(parquet._turns_per_loop())
    assert before == 4 // max(1, live)  # no loop decodes here: every core
    assert shares == [4 // (live + 2), before]  # two loops: two each; once closed, as before
