"""The process executor: results and inputs, in the pipe or in shared memory, rows written in place,
the arena's bounds (faults: test_procpool_faults.py; shutdown: test_procpool_shutdown.py).

The decode callables pickle by reference: they live in support/workerfuncs.py, which workers import to
find them (the few defined here, this module). One pool serves the tests that do not break it
(`pool`, tests/executors/conftest.py); fault tests make their own (`make`).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.workerfuncs import (
    NOTICE_S,
    WAIT_S,
    CountsPickles,
    blob,
    describe,
    draw,
    echo,
    fresh_16_mib,
    half_mebibyte,
    image_or_not,
    mebibyte_tensor,
    nested,
    parent_only_marks,
    remember_id,
    wait_for_file,
    worker_id,
)

import aioloader
from aioloader._executors.process.arena import SLAB_LINKS
from aioloader._executors.process.executor import ProcessExecutor
from aioloader._util.rng import call_seeded

WORKER_ID: int | None = None


def mapping_of(address: int) -> str:
    """The /proc/self/maps path of the mapping that holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return rest[-1] if len(rest) == 5 else ""
    return ""


# -- results and inputs --------------------------------------------------------------------------------


def test_nested_arrays_come_back_as_views_of_shared_memory(pool: ProcessExecutor) -> None:
    before = pool.stats().get("results_in_shm", 0)
    got = pool.submit(nested, 3).result(WAIT_S)
    want = nested(3)
    assert got.keys() == want.keys()
    assert torch.equal(got["image"], want["image"])
    assert got["extras"][0].dtype == torch.bfloat16
    assert torch.equal(got["extras"][0], want["extras"][0])
    assert got["extras"][1][0].item() == 3
    assert got["extras"][1][1].dtype == torch.bool
    np.testing.assert_array_equal(got["numpy"], want["numpy"])
    assert torch.equal(got["complex"], want["complex"])
    assert got["label"] == "sample-3"
    assert got["graded"].requires_grad
    assert got["empty"].shape == (0, 3)
    assert got["empty_expanded"].shape == (0,)
    assert got["empty_expanded"].dtype == torch.int32
    assert pool.stats()["results_in_shm"] == before + 1
    where = mapping_of(got["image"].data_ptr())
    assert where.startswith(tuple(f"{link}{os.getpid()}-" for link in SLAB_LINKS))  # a view
    assert where.endswith("(deleted)")  # anonymous, or unlinked: nothing left in /dev/shm


@pytest.mark.parametrize("size", [100, 300_000])
@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_inputs_small_in_the_pipe_large_in_shared_memory(
    pool: ProcessExecutor, size: int, kind: type
) -> None:
    raw = kind(os.urandom(size))
    before = pool.stats().get("inputs_in_shm", 0)
    assert pool.submit(describe, raw).result(WAIT_S) == (size, kind.__name__, zlib.crc32(raw))
    assert pool.stats().get("inputs_in_shm", 0) == before + (size > 64 << 10)


def test_the_callable_is_pickled_once_and_sent_once_per_worker(make: Any) -> None:
    executor = make(2)
    fn = CountsPickles()
    answers = [f.result(WAIT_S) for f in [executor.submit(fn, i) for i in range(40)]]
    assert CountsPickles.pickled == 1
    assert {unpickled for _, unpickled in answers} == {1}  # each worker unpickled it once


@pytest.mark.xfail(
    bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
    reason="free-threaded builds: the worker keeps ~50 MB after three 16 MiB results, in a region "
    "of CPython's object allocator (mimalloc), which glibc's malloc_trim does not reach and which "
    "no Python API purges (3.14.7t; MIMALLOC_PURGE_DELAY=0 does not change it)",
    strict=False,
)
def test_a_large_result_made_in_a_workers_heap_leaves_no_pages_there(make: Any) -> None:
    # The second 16 MiB block comes from the heap (freeing the first raised glibc's threshold for
    # using a mapping of its own), and a freed heap block stays resident unless handed back: the
    # worker would then hold a sample the loader's budget no longer counts.
    executor = make(1)
    executor.submit(echo, 0).result(WAIT_S)
    (pid,) = executor.pids
    base = heap_bytes(pid)
    for key in range(3):
        result = executor.submit(fresh_16_mib, key).result(WAIT_S)
        assert int(result[12345]) == key
        del result
    deadline = time.monotonic() + NOTICE_S  # the worker hands the pages back after it answers
    while heap_bytes(pid) - base >= 8 << 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heap_bytes(pid) - base < 8 << 20


def heap_bytes(pid: int) -> int:
    """A process's private memory resident (RssAnon: not the shared memory it writes results to)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_an_unpicklable_callable_is_refused_up_front(pool: ProcessExecutor) -> None:
    with pytest.raises(TypeError, match="pickles"):
        pool.submit(lambda x: x, 1)


def test_samples_draw_the_same_numbers_as_in_threads(pool: ProcessExecutor) -> None:
    seeds = [aioloader._util.rng.derive_seed(7, 2, i) for i in range(6)]
    remote = [pool.submit(draw, None, seed).result(WAIT_S) for seed in seeds]
    local = [call_seeded(draw, None, seed) for seed in seeds]
    assert all(torch.equal(a, b) for a, b in zip(remote, local, strict=True))
    assert not torch.equal(remote[0], remote[1])


def test_loader_with_process_executor_matches_inline() -> None:
    def epoch(**kwargs: Any) -> list[torch.Tensor]:
        with aioloader.Loader(list(range(24)), echo, decode=draw, batch_size=4, **kwargs) as loader:
            return list(loader)

    inline = epoch(executor="inline")
    processes = epoch(executor="process", workers=2, concurrency=5)
    assert all(torch.equal(a, b) for a, b in zip(inline, processes, strict=True))


def test_workers_write_straight_into_batch_rows(pool: ProcessExecutor) -> None:
    batch = pool.batch_buffer((5, 3, 4, 4), torch.float32)
    assert batch is not None
    before = pool.stats().get("results_in_rows", 0)

    async def fill() -> list[Any]:
        rows = (pool.run(image_or_not, i, into=batch.row(i)) for i in range(5))
        return await asyncio.gather(*rows)

    samples = asyncio.run(fill())
    assert samples[2].shape == (2,)  # did not fit: came back as usual
    for i in (0, 1, 3, 4):
        assert samples[i].data_ptr() == batch.tensor[i].data_ptr()
        assert batch.tensor[i].eq(i).all()
    assert pool.stats()["results_in_rows"] == before + 4
    with pytest.raises(IndexError):
        batch.row(5)


_BLOCK: list[torch.Tensor] = []  # in a worker: one 4 MiB tensor, made once


def cached_block(_: Any) -> torch.Tensor:
    if not _BLOCK:
        _BLOCK.append(torch.ones(1 << 20))
    return _BLOCK[0]


def minor_faults(_: Any) -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_a_worker_maps_a_slab_whole_so_writing_rows_takes_no_page_faults() -> None:
    with ProcessExecutor(1) as pool:
        batch = pool.batch_buffer((4, 1 << 20), torch.float32)  # 4 rows of 4 MiB
        assert batch is not None
        # the slab is shared with the worker (and mapped) with the first row it is sent
        pool.submit(cached_block, 0, into=batch.row(0)).result(timeout=30)
        before = pool.submit(minor_faults, 0).result(timeout=30)
        for row in (1, 2, 3):  # 3 x 1,024 pages this worker has not written before
            pool.submit(cached_block, 0, into=batch.row(row)).result(timeout=30)
        after = pool.submit(minor_faults, 0).result(timeout=30)
        assert batch.tensor.eq(1).all()
    assert after - before < 300, after - before  # one fault per page would be 3,072


def test_an_arena_larger_than_memory_fails_at_construction() -> None:
    with pytest.raises(OSError, match=r"arena of .* MiB is more than this machine's .* MiB"):
        ProcessExecutor(1, arena_bytes=1 << 50)


def test_a_full_arena_falls_back_to_ordinary_memory(make: Any) -> None:
    executor = make(1, arena_bytes=1 << 20)
    held = [executor.submit(half_mebibyte, i).result(WAIT_S) for i in range(12)]  # > 1 MiB held
    assert [int(a[0]) for a in held] == list(range(12))
    stats = executor.stats()
    assert stats["results_pickled"] > 0
    assert stats["arena_mapped"] <= 1 << 20
    del held
    gc.collect()
    again = [executor.submit(half_mebibyte, i).result(WAIT_S) for i in range(4)]
    assert executor.stats()["results_in_shm"] > stats.get("results_in_shm", 0)
    assert [int(a[0]) for a in again] == list(range(4))


def test_pipe_bytes_are_counted_and_a_tensor_crosses_in_shared_memory(
    pool: ProcessExecutor,
) -> None:
    pool.submit(mebibyte_tensor, None).result(WAIT_S)  # the output slot size is known from now on
    before = pool.stats()
    result = pool.submit(mebibyte_tensor, None).result(WAIT_S)
    after = pool.stats()
    assert result.nbytes == 1 << 20
    assert bool((result == 1).all())
    assert 0 < after["pipe_bytes_received"] - before["pipe_bytes_received"] < 1024
    assert 0 < after["pipe_bytes_sent"] - before["pipe_bytes_sent"] < 1024


@pytest.mark.parametrize("kind", ["bytes", "bytearray"])
def test_large_bytes_in_a_result_cross_in_shared_memory(pool: ProcessExecutor, kind: str) -> None:
    before = pool.stats()
    result = pool.submit(blob, kind).result(WAIT_S)
    after = pool.stats()
    assert type(result).__name__ == kind
    assert result == blob(kind)
    assert after["pipe_bytes_received"] - before["pipe_bytes_received"] < 1024


def test_worker_init_fn_runs_in_each_worker(make: Any) -> None:
    executor = make(2, worker_init_fn=remember_id)
    seen = {executor.submit(worker_id, None).result(WAIT_S) for _ in range(30)}
    assert {wid for wid, _ in seen} <= {0, 1}
    assert len({pid for _, pid in seen}) == len({wid for wid, _ in seen})


def held_until(marker: str) -> None:
    """Runs until `marker` exists (a worker kept busy for as long as a test needs)."""
    assert wait_for_file(Path(marker))


def test_a_task_pinned_to_a_busy_worker_does_not_hold_back_the_others(
    make: Callable[..., ProcessExecutor], tmp_path: Path
) -> None:
    pool = make(2)
    pool.wait_ready(WAIT_S)
    marker = tmp_path / "release"
    # worker 0: one task running (held until the marker exists), one sent ahead, one queued here
    held = [pool.submit(held_until, str(marker), worker=0) for _ in range(3)]
    free = pool.submit(echo, 7, worker=1)  # behind them in the queue, for the other worker
    try:
        assert free.result(timeout=WAIT_S) == 7
        assert not any(f.done() for f in held)
    finally:
        marker.touch()
    for f in held:
        f.result(timeout=WAIT_S)


def batch_of_17_mib(i: int) -> torch.Tensor:
    """A whole batch as a DataLoader worker makes it: one slab of its own per batch."""
    return torch.full((17, 1 << 18), float(i))


def test_whole_batches_kept_by_the_consumer_past_the_budget_are_pickled_not_waited_for(
    make: Any,
) -> None:
    """Workers ask for their batch's slot as they need it. A consumer that lets its first batches go
    and then keeps every one: the arena runs out, and once no slot has been freed for a while
    (`PoolState.keeps_from`) the rest travel pickled. Every result arrives, in order; no deadlock, and the
    pool waits for the consumer once, not once per batch."""
    pool = make(2, arena_bytes=100 << 20, size_first=True)  # room for 2 slabs per worker, no more
    for i in range(4):
        assert int(pool.submit(batch_of_17_mib, i).result(WAIT_S)[0, 0]) == i  # and let go
    futures = [pool.submit(batch_of_17_mib, i) for i in range(10)]
    held = [f.result(WAIT_S) for f in futures]
    assert [int(b[0, 0]) for b in held] == list(range(10))
    stats = pool.stats()
    assert stats["results_pickled"] >= 4
    assert stats["results_in_shm"] > 4
    assert stats["arena_mapped"] <= 100 << 20
    # once: the pool waited (`PoolState.keeps_from`) for a consumer that frees nothing, then sent
    # the rest pickled without waiting again (counted by the pool, not timed: a busy machine)
    assert stats["consumer_waits"] == 1


def test_a_zygotes_worker_starts_with_none_of_its_parents_marks(pool: ProcessExecutor) -> None:
    # the zygote closed the descriptors marked parent-only; their numbers, free in its workers, may
    # be taken by what a worker opens, so a pool made in a worker (beside the trainer) must not
    # close them in turn (its zygote closed its own socket, and the pool stopped with EPIPE)
    from aioloader._executors.process.slab_memory import parent_only_fds

    assert pool.submit(echo, 1).result(WAIT_S) == 1  # this process's pools have marked some
    assert parent_only_fds()
    with ProcessExecutor(1, start_method="zygote") as forked:
        assert forked.submit(parent_only_marks, 0).result(WAIT_S) == []
