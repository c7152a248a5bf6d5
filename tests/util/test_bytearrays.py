"""Recycled bytearrays: a buffer is handed out again only once nothing refers to it.

The fast HTTP engine receives bodies into them (real HTTP on 127.0.0.1), and the process pool copies
bytearray results out of their slots into them (real worker processes).
"""

from __future__ import annotations

import asyncio
import gc
import random
import sys
from typing import Any

import numpy as np
import pytest
from support.faultproxy import Origin

import aioloader
from aioloader import Loader
from aioloader._executors.process.wire import _lies_at_start, place_single
from aioloader._util.bytearrays import Bytearrays, landing
from aioloader.sources.http import http

SIZE = 128 * 1024  # above MIN_BYTES: recycled


def test_a_buffer_comes_back_only_once_nothing_refers_to_it() -> None:
    pool = Bytearrays(max_bytes=1 << 20)
    a = pool.take(SIZE)
    view = memoryview(a)[10:20]  # a view keeps it in use, as a numpy array over it would
    array = np.frombuffer(a, np.uint8)
    b = pool.take(SIZE)
    assert b is not a
    del a
    c = pool.take(SIZE)
    assert c is not b
    assert c is not view.obj
    assert c is not array.base
    del view, array, b
    again = pool.take(SIZE)
    assert pool.reused == 1
    assert pool.made == 3
    assert len(again) == SIZE


def test_lengths_are_kept_apart_and_bounded() -> None:
    pool = Bytearrays(max_bytes=2 * SIZE)
    small = pool.take(100)  # below min_bytes: never kept
    assert len(small) == 100
    assert pool.kept_bytes == 0
    held = [pool.take(SIZE) for _ in range(3)]  # the third is not kept: over max_bytes
    assert pool.kept_bytes == 2 * SIZE
    other = pool.take(SIZE + 1)  # another length: a buffer of its own, not one of the free ones
    assert len(other) == SIZE + 1
    del held
    assert len(pool.take(SIZE)) == SIZE
    assert pool.reused == 1


def test_a_buffer_its_user_resized_is_forgotten() -> None:
    pool = Bytearrays(max_bytes=1 << 20)
    a = pool.take(SIZE)
    a += b"more"
    del a
    b = pool.take(SIZE)
    assert len(b) == SIZE
    assert pool.reused == 0
    assert pool.kept_bytes == SIZE


def test_max_bytes_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_bytes"):
        Bytearrays(max_bytes=-1)


@pytest.fixture
def big_origin() -> tuple[Origin, dict[str, bytes]]:
    rng = random.Random(3)
    objects = {f"big/{i}.bin": rng.randbytes(SIZE) for i in range(6)}
    server = Origin(objects)
    yield server, objects
    server.stop()


@pytest.mark.asyncio
async def test_the_fast_engine_receives_into_free_bodies_and_never_into_held_ones(
    big_origin: tuple[Origin, dict[str, bytes]],
) -> None:
    origin, objects = big_origin
    keys = list(objects)
    src = http(origin.url + "/", keys, engine="fast")
    try:
        held = [await src.fetch(k) for k in keys]  # all held: each in a buffer of its own
        assert [bytes(b) for b in held] == [objects[k] for k in keys]
        assert src.transport._fast is not None
        bodies = src.transport._fast.bodies
        assert bodies.made == len(keys)
        first = held[0]
        del held
        gc.collect()
        again = [await src.fetch(k) for k in reversed(keys[1:])]  # received into the free ones
        assert [bytes(b) for b in again] == [objects[k] for k in reversed(keys[1:])]
        assert bytes(first) == objects[keys[0]]  # still held: not written over
        assert bodies.made == len(keys)
        assert bodies.reused == len(keys) - 1
        assert all(b is not first for b in again)
    finally:
        await src.aclose()


def _filled(key: int) -> bytearray:
    return bytearray([key]) * SIZE


def test_bytearray_results_are_copied_out_into_free_buffers_only() -> None:
    async def run_all(pool: aioloader.ProcessExecutor, keys: range) -> list[bytearray]:
        return list(await asyncio.gather(*(pool.run(_filled, k) for k in keys)))

    with aioloader.ProcessExecutor(2) as pool:
        held = asyncio.run(run_all(pool, range(8)))
        assert [bytes(b) for b in held] == [bytes([k]) * SIZE for k in range(8)]
        copies = pool._pool._reader.copies
        assert copies.made == 8
        keep = held[3]
        del held
        later = asyncio.run(run_all(pool, range(10, 17)))
        assert [bytes(b) for b in later] == [bytes([k]) * SIZE for k in range(10, 17)]
        assert bytes(keep) == bytes([3]) * SIZE  # still held: not written over
        assert copies.reused == 7
        assert copies.made == 8


@pytest.mark.asyncio
async def test_a_body_lands_in_the_slot_it_is_given_when_it_fits(
    big_origin: tuple[Origin, dict[str, bytes]],
) -> None:
    origin, objects = big_origin
    keys = list(objects)
    src = http(origin.url + "/", keys, engine="fast")
    slot = memoryview(bytearray(SIZE + 100))

    async def fetch_into(key: str, into: memoryview | None) -> Any:
        landing.set(into)  # as `FetchDecode` does in a worker's task (this task's context only)
        return await src.fetch(key)

    try:
        body = await asyncio.create_task(fetch_into(keys[0], slot))
        assert type(body) is memoryview
        assert body.obj is slot.obj
        assert body.nbytes == SIZE
        assert bytes(slot[:SIZE]) == objects[keys[0]]
        assert place_single(body, slot) == ("B", 0, SIZE, "", (), ())  # the worker copies nothing
        # too small a slot, or none: a recycled bytearray as usual
        small = await asyncio.create_task(fetch_into(keys[1], slot[: SIZE // 2]))
        assert type(small) is bytearray
        assert small == objects[keys[1]]
        assert landing.get() is None  # set in those tasks' contexts, not here
        plain = await src.fetch(keys[2])
        assert type(plain) is bytearray
        assert plain == objects[keys[2]]
    finally:
        await src.aclose()


def test_fit_serves_lengths_that_vary_from_one_kept_set() -> None:
    pool = Bytearrays(max_bytes=1 << 22)
    sizes = [300_000, 310_000, 290_000, 305_000, 280_000, 299_999]
    first = [pool.fit(n) for n in sizes[:2]]
    assert [len(b) >= n for b, n in zip(first, sizes, strict=False)] == [True, True]
    made = pool.made
    del first
    for n in sizes:  # one at a time: the two kept ones serve every length
        body = pool.fit(n)
        assert n <= len(body) < 2 * n
        del body
    assert pool.made == made
    held = pool.fit(300_000)
    assert pool.fit(300_000) is not held  # still referenced: another one
    small = pool.fit(100_000)  # no kept one under twice its length: its own
    assert 100_000 <= len(small) < 200_000
    assert len(pool.fit(1000)) == 1000  # below min_bytes: not kept


@pytest.mark.asyncio
async def test_a_kept_connection_does_not_hold_the_slot_its_first_body_landed_in(
    big_origin: tuple[Origin, dict[str, bytes]],
) -> None:
    # The connection is made during the first request, whose context holds that request's
    # landing slot; the connection lives on (kept alive), the slot must not be held with it, nor
    # by the request's read-timeout timer, else a recycled buffer is never free again.
    origin, objects = big_origin
    keys = list(objects)
    src = http(origin.url + "/", keys, engine="fast")
    slot = bytearray(SIZE + 100)
    free = sys.getrefcount(slot)

    async def fetch_into(key: str) -> int:
        landing.set(memoryview(slot))
        body = await src.fetch(key)
        n = len(body)
        del body
        return n

    async def fetched(key: str) -> None:
        assert await asyncio.create_task(fetch_into(key)) == SIZE
        await asyncio.sleep(0)  # the finished task's own callbacks let go of it
        assert bytes(slot[:SIZE]) == objects[key]

    try:
        await fetched(keys[0])
        fast = src.transport._fast
        assert fast is not None
        assert len(fast._open) == 1
        assert sys.getrefcount(slot) == free  # no garbage collection needed
        await fetched(keys[1])  # over the same connection
        assert len(fast._open) == 1
        assert sys.getrefcount(slot) == free
    finally:
        await src.aclose()


@pytest.mark.asyncio
async def test_a_fast_request_leaves_no_garbage_cycle_behind(
    big_origin: tuple[Origin, dict[str, bytes]],
) -> None:
    # a cycle per request (its read timer and what refers back to it) holds the request's
    # objects, its body's buffer among them, until a garbage collection finds it
    origin, objects = big_origin
    keys = list(objects)
    src = http(origin.url + "/", keys, engine="fast")
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for key in keys * 3:
            assert bytes(await src.fetch(key)) == objects[key]
        gc.collect()
        ours = [o for o in gc.garbage if "aioloader" in (getattr(o, "__module__", None) or "")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        await src.aclose()
    assert ours == []


def test_only_a_view_of_the_slots_start_is_answered_without_a_copy() -> None:
    slot = memoryview(bytearray(1000))
    assert _lies_at_start(slot[:10], slot)
    assert not _lies_at_start(slot[5:10], slot)  # the same memory, but not at the start
    assert not _lies_at_start(memoryview(bytearray(10)), slot)  # other memory
    assert not _lies_at_start(slot[:0], slot)
    copy = memoryview(bytearray(slot[:10]))
    assert place_single(copy, slot) is None  # a small copy: pickled as usual


def test_fetch_in_workers_hands_over_bodies_received_in_their_slots(
    big_origin: tuple[Origin, dict[str, bytes]],
) -> None:
    origin, objects = big_origin
    keys = list(objects) * 4  # each slot serves several bodies in turn
    src = http(origin.url + "/", keys, engine="fast")
    options: dict[str, Any] = {"executor": "process", "workers": 2, "fetch_in_workers": True}
    with Loader(src, batch_size=4, collate=None, concurrency=8, **options) as loader:
        for _ in range(2):
            got = [sample for batch in loader for sample in batch]
            assert [type(s) for s in got] == [bytearray] * len(keys)
            assert [bytes(s) for s in got] == [objects[k] for k in keys]
        stats = loader._stages.decoder.stats()  # type: ignore[attr-defined]
    assert stats["results_in_shm"] == 2 * len(keys)
