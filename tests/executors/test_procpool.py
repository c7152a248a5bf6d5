"""The process executor: shared-memory results, faults (death, stall, exceptions) and clean shutdown.

Decode callables must pickle by reference, so the ones used here are module-level functions; workers
import this module to find them. One pool serves the tests that do not break it; fault tests make
their own (forking a worker from the running forkserver takes ~0.1 s).
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import gc
import operator
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

import aioloader
from aioloader import DecodeError, LoaderClosedError, WorkerDied, WorkerTimeout
from aioloader._executors.process.arena import NAME_PREFIX, SHM_DIR, SLAB_LINKS
from aioloader._executors.process.config import RELEASES_STOP_S
from aioloader._executors.process.executor import ProcessExecutor
from aioloader._executors.process.sending import Sender
from aioloader._util.rng import call_seeded

# How soon a dead worker must be reported (the design's promise), and a bound for everything else.
NOTICE_S = 1.0
WAIT_S = 30.0

# -- decode callables (run in the workers) ----------------------------------------------------------


def echo(x: Any) -> Any:
    return x


def nested(n: int) -> dict[str, Any]:
    return {
        "image": torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3).transpose(1, 2),
        "extras": (torch.ones(n, dtype=torch.bfloat16), [torch.tensor(n), torch.zeros(2, dtype=torch.bool)]),
        "numpy": np.asfortranarray(np.arange(n * 4, dtype=np.float16).reshape(n, 4)),
        "complex": torch.full((2,), n, dtype=torch.complex64),
        "label": f"sample-{n}",
        "graded": torch.ones(2, requires_grad=True),  # not plain: pickled in-band
        "empty": np.zeros((0, 3)),
    }  # fmt: skip


def describe(raw: Any) -> tuple[int, str, int]:
    return len(raw), type(raw).__name__, zlib.crc32(bytes(raw))


def draw(_: Any) -> torch.Tensor:
    return torch.rand(4, generator=aioloader.sample_generator())


def block(marker: str) -> None:
    Path(marker).touch()
    time.sleep(WAIT_S)


def die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    elif how == "segfault":
        faulthandler.disable()  # inherited from pytest: its report would only add noise here
        ctypes.string_at(0)


def stall(how: str) -> None:
    if how == "sleep":
        time.sleep(WAIT_S)
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # "spin": an endless loop that holds the CPU
        pass


def die_once_at(arg: tuple[str, int, int]) -> int:
    folder, i, fatal = arg
    marker = Path(folder, f"died-{fatal}")
    if i == fatal and not marker.exists():
        marker.touch()
        os._exit(1)
    with open(Path(folder, "log"), "a") as log:
        log.write(f"{i}\n")
    return i


def image_or_not(i: int) -> Any:
    if i == 2:
        return torch.zeros(2)  # not the row's shape
    if i == 3:
        return np.full((3, 4, 4), i, dtype=np.float32)  # an array converts
    return torch.full((3, 4, 4), float(i))


def half_mebibyte(i: int) -> np.ndarray[Any, Any]:
    return np.full(200_000, i % 251, dtype=np.uint8)


class Unrebuildable(Exception):
    def __init__(self, a: int, *, b: int) -> None:
        super().__init__(a)


def fail(kind: str) -> None:
    if kind == "value":
        raise ValueError("bad sample")
    raise Unrebuildable(1, b=2)


WORKER_ID: int | None = None


def remember_id(worker_id: int) -> None:
    global WORKER_ID
    WORKER_ID = worker_id


def worker_id(_: Any) -> tuple[int | None, int]:
    return WORKER_ID, os.getpid()


def broken_init(worker_id: int) -> None:
    raise ValueError(f"cannot set up worker {worker_id}")


class CountsPickles:
    """A decode callable that counts how often it is pickled (here) and unpickled (in a worker)."""

    pickled = 0
    unpickled = 0

    def __reduce__(self) -> tuple[Any, ...]:
        CountsPickles.pickled += 1
        return (_rebuild_counter, ())

    def __call__(self, _: Any) -> tuple[int, int]:
        return os.getpid(), CountsPickles.unpickled


def _rebuild_counter() -> CountsPickles:
    CountsPickles.unpickled += 1
    return CountsPickles()


async def snooze(arg: tuple[float, Any]) -> tuple[int, Any, torch.Tensor]:
    """An async task: waits, then answers its pid, its argument and a draw of the sample's seed."""
    seconds, value = arg
    await asyncio.sleep(seconds)
    return os.getpid(), value, torch.rand(2, generator=aioloader.sample_generator())


async def block_loop(seconds: float) -> None:
    time.sleep(seconds)  # noqa: ASYNC251 - blocks the worker's loop: a cancel cannot reach it


async def note_cancel(folder: str) -> None:
    Path(folder, "started").touch()  # noqa: ASYNC240 - a marker the test waits for
    try:
        await asyncio.sleep(WAIT_S)
    except asyncio.CancelledError:
        Path(folder, "cancelled").touch()  # noqa: ASYNC240
        raise


def wait_for_file(path: Path) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # a file written by another process: nothing can signal it
    return path.exists()


def mebibyte_tensor(_: Any) -> torch.Tensor:
    return torch.ones(1 << 18, dtype=torch.float32)


def fresh_16_mib(key: int) -> np.ndarray[Any, Any]:
    out = np.empty(16 << 20, dtype=np.uint8)
    out.fill(key)  # every page touched, as a decoder writes them
    return out


def blob(kind: str) -> bytes | bytearray:
    data = bytes(range(256)) * 400  # 100 KiB
    return data if kind == "bytes" else bytearray(data)


# -- helpers ------------------------------------------------------------------------------------------


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def shm_entries(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"{NAME_PREFIX}{pid}-")]


def mapping_of(address: int) -> str:
    """The /proc/self/maps path of the mapping that holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= address < hi:
            return rest[-1] if len(rest) == 5 else ""
    return ""


@pytest.fixture(scope="module")
def pool() -> Iterator[ProcessExecutor]:
    executor = ProcessExecutor(2)
    executor.wait_ready(WAIT_S)
    yield executor
    executor.close()


@pytest.fixture
def make() -> Iterator[Callable[..., ProcessExecutor]]:
    made: list[ProcessExecutor] = []

    def make(workers: int = 1, **kwargs: Any) -> ProcessExecutor:
        executor = ProcessExecutor(workers, **kwargs)
        made.append(executor)
        executor.wait_ready(WAIT_S)
        return executor

    yield make
    for executor in made:
        executor.close()


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


# -- errors ---------------------------------------------------------------------------------------------


def test_decode_errors_keep_their_type_and_name_the_worker(pool: ProcessExecutor) -> None:
    with pytest.raises(ValueError, match="bad sample") as info:
        pool.submit(fail, "value").result(WAIT_S)
    assert any("worker process pid" in note for note in info.value.__notes__)
    assert "raise ValueError" in str(info.value.__cause__)
    with pytest.raises(DecodeError, match="Unrebuildable") as info2:
        pool.submit(fail, "other").result(WAIT_S)
    assert "raise Unrebuildable" in info2.value.remote_traceback  # type: ignore[attr-defined]


@pytest.mark.parametrize("how", ["sigkill", "exit", "segfault"])
@pytest.mark.parametrize("method", ["zygote", "forkserver"])
def test_a_dying_worker_is_reported_at_once_and_replaced(make: Any, how: str, method: str) -> None:
    executor = make(1, start_method=method)
    (pid,) = executor.pids
    start = time.monotonic()
    with pytest.raises(WorkerDied) as info:
        executor.submit(die, how).result(WAIT_S)
    assert time.monotonic() - start < NOTICE_S
    assert info.value.pid == pid
    assert info.value.tasks
    assert f"pid {pid}" in str(info.value)
    if how != "exit":
        assert info.value.exitcode == -(signal.SIGKILL if how == "sigkill" else signal.SIGSEGV)
    assert executor.submit(echo, 5).result(WAIT_S) == 5  # replaced
    assert executor.pids != [pid]


def test_a_worker_killed_from_outside_is_noticed_within_a_second(make: Any, tmp_path: Path) -> None:
    executor = make(1)
    marker = tmp_path / "started"
    future = executor.submit(block, str(marker))
    deadline = time.monotonic() + WAIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # a file written by another process: nothing can signal it
    (pid,) = executor.pids
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(
        WorkerDied, match=rf"pid {pid}\) is killed by signal: Killed. .killed by SIGKILL"
    ):
        future.result(WAIT_S)
    assert time.monotonic() - killed < NOTICE_S


def test_restarts_retry_what_was_in_flight_once(make: Any, tmp_path: Path) -> None:
    executor = make(1, max_worker_restarts=1)
    futures = [executor.submit(die_once_at, (str(tmp_path), i, 4)) for i in range(10)]
    assert [f.result(WAIT_S) for f in futures] == list(range(10))
    log = [int(x) for x in (tmp_path / "log").read_text().split()]
    assert sorted(log) == list(range(10))  # nothing lost, nothing run twice
    assert executor.stats()["restarts"] == 1
    with pytest.raises(WorkerDied, match="used up"):  # the second death is past the limit
        executor.submit(die_once_at, (str(tmp_path), 0, 0)).result(WAIT_S)


def killed_by(arg: tuple[int, int]) -> int:
    i, fatal = arg
    if i == fatal:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.05)  # the others are in flight beside it
    return i


def test_a_crash_costs_the_task_that_causes_it_alone(make: Any) -> None:
    executor = make(2, max_worker_restarts=3)
    futures = [executor.submit(killed_by, (i, 3)) for i in range(8)]
    outcomes: list[Any] = []
    for f in futures:
        try:
            outcomes.append(f.result(WAIT_S))
        except WorkerDied as exc:
            outcomes.append(str(exc))
    assert outcomes[:3] + outcomes[4:] == [0, 1, 2, 4, 5, 6, 7]  # its neighbours were retried
    assert "running that task alone" in outcomes[3]
    assert "the task killed it" in outcomes[3]


def stall_once(folder: str) -> str:
    marker = Path(folder, "stalled")
    if not marker.exists():
        marker.touch()
        time.sleep(WAIT_S)  # a transient stall: the first try only
    return "done"


def test_within_restarts_a_stalled_task_runs_again_alone_and_fails_only_if_it_stalls_again(
    make: Any, tmp_path: Path
) -> None:
    executor = make(2, timeout=0.5, max_worker_restarts=2)
    assert executor.submit(stall_once, str(tmp_path)).result(WAIT_S) == "done"
    with pytest.raises(WorkerTimeout):
        executor.submit(stall, "sleep").result(WAIT_S)  # stalls alone too: it is the culprit
    assert executor.stats()["timeouts"] == 3


def test_under_skip_a_crash_skips_its_sample_alone() -> None:
    with (
        ProcessExecutor(2, max_worker_restarts=3) as pool,
        aioloader.Loader(
            [(i, 5) for i in range(12)], lambda k: k, decode=killed_by, executor=pool,
            batch_size=4, on_error="skip", max_skipped=1,
        ) as loader,
    ):  # fmt: skip
        got = [x for b in loader for x in b.tolist()]
        assert got == [i for i in range(12) if i != 5]
        assert [key for key, _ in loader.stats().skipped] == [(5, 5)]


@pytest.mark.parametrize("how", ["sleep", "sigstop", "spin"])
@pytest.mark.parametrize("method", ["zygote", "forkserver"])
def test_a_stalled_worker_times_out_and_is_replaced(make: Any, how: str, method: str) -> None:
    executor = make(1, timeout=0.5, start_method=method)
    (pid,) = executor.pids
    stalled = executor.submit(stall, how)
    # behind it on the same worker: retried on its replacement, under the same 0.5 s timeout. A
    # stdlib function: a fresh forkserver worker finds it at once, where this module's `echo` has it
    # import this test module (pytest, torch, numpy) first, which on a busy machine takes longer
    queued = executor.submit(operator.abs, -7)
    with pytest.raises(WorkerTimeout, match=f"pid {pid}") as info:
        stalled.result(WAIT_S)
    assert info.value.timeout == 0.5
    assert queued.result(WAIT_S) == 7
    assert executor.pids != [pid]
    assert gone(pid) or psutil.Process(pid).wait(WAIT_S) is not None


def test_async_tasks_run_many_at_once_on_the_workers_loop(make: Any) -> None:
    executor = make(1)
    (pid,) = executor.pids
    start = time.monotonic()
    futures = [
        executor.submit(snooze, (0.3, i), aioloader._util.rng.derive_seed(0, 0, i))
        for i in range(20)
    ]
    answers = [f.result(WAIT_S) for f in futures]
    assert time.monotonic() - start < 3.0  # one at a time: 6 s
    assert [(p, v) for p, v, _ in answers] == [(pid, i) for i in range(20)]
    for i, (_, _, drawn) in enumerate(answers):  # each task saw its own seed
        local = call_seeded(draw, None, aioloader._util.rng.derive_seed(0, 0, i))
        assert torch.equal(drawn, local[:2])
    assert executor.stats()["async_tasks"] == 20


def test_a_stuck_async_task_times_out_alone(make: Any) -> None:
    executor = make(1, timeout=1.5)  # the quick ones must beat it on a loaded machine too
    (pid,) = executor.pids
    stuck = executor.submit(snooze, (WAIT_S, "never"), 1)
    quick = [executor.submit(snooze, (0.1, i), 1) for i in range(5)]
    assert [f.result(WAIT_S)[1] for f in quick] == list(range(5))
    with pytest.raises(WorkerTimeout, match="cancelled there") as info:
        stuck.result(WAIT_S)
    assert info.value.pid == pid
    assert executor.pids == [pid]  # the worker was busy, not broken: it was kept
    assert executor.submit(snooze, (0.0, "after"), 1).result(WAIT_S)[:2] == (pid, "after")


def test_a_blocked_worker_loop_is_killed_after_the_grace(make: Any, wait_until: Any) -> None:
    # the timeout also covers `later` on the replacement worker: leave room for a loaded machine
    executor = make(1, timeout=1.5)
    (pid,) = executor.pids
    with pytest.raises(WorkerTimeout):
        executor.submit(block_loop, WAIT_S).result(WAIT_S)
    later = executor.submit(snooze, (0.0, 1), 1)  # held back from the stuck loop: runs on the next
    assert later.result(WAIT_S)[0] != pid
    assert wait_until(lambda: gone(pid), WAIT_S)


def test_cancelling_run_cancels_the_coroutine_in_the_worker(make: Any, tmp_path: Path) -> None:
    executor = make(1)

    async def cancel_one() -> None:
        task = asyncio.ensure_future(executor.run(note_cancel, str(tmp_path)))
        assert await asyncio.to_thread(wait_for_file, tmp_path / "started")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_one())
    assert wait_for_file(tmp_path / "cancelled")
    assert executor.submit(snooze, (0.0, 2), 1).result(WAIT_S)[1] == 2


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


def test_a_failing_worker_init_fn_fails_the_pool_with_its_own_error(make: Any) -> None:
    with pytest.raises(ValueError, match="cannot set up worker 0") as info:
        make(1, worker_init_fn=broken_init)
    assert any("worker_init_fn" in note for note in info.value.__notes__)


def test_a_bug_in_the_pools_thread_fails_the_tasks_instead_of_hanging(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_send(self: Any, h: Any, task: Any) -> bool:
        raise TypeError("a bug")

    monkeypatch.setattr(Sender, "_send", broken_send)
    executor = make(1)
    with pytest.raises(LoaderClosedError, match="TypeError: a bug"):
        executor.submit(abs, -1).result(WAIT_S)


def test_fork_is_refused_once_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA"):
        ProcessExecutor(1, start_method="fork")


# -- shutdown -------------------------------------------------------------------------------------------


def procpool_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "aioloader-procpool"}


def test_cancel_then_close_leaves_nothing(make: Any) -> None:
    others = procpool_threads()
    executor = make(2)
    pids = executor.pids

    async def cancel_some() -> Any:
        tasks = [asyncio.ensure_future(executor.run(time.sleep, 0.05)) for _ in range(20)]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return await executor.run(echo, "still works")

    assert asyncio.run(cancel_some()) == "still works"
    queued = [executor.submit(time.sleep, 1) for _ in range(6)]
    executor.close()
    executor.close()  # idempotent
    with pytest.raises(LoaderClosedError):
        queued[-1].result(WAIT_S)
    with pytest.raises(LoaderClosedError):
        executor.submit(echo, 1)
    assert all(gone(pid) for pid in pids)
    assert procpool_threads() <= others
    assert shm_entries(os.getpid()) == []


def test_garbage_collection_stops_the_workers(wait_until: Any) -> None:
    executor = ProcessExecutor(1)
    executor.wait_ready(WAIT_S)
    pids = executor.pids
    del executor
    gc.collect()
    assert wait_until(lambda: all(gone(pid) for pid in pids))


CHILD = textwrap.dedent(
    """
    import sys, time
    import psutil
    from aioloader._executors.process.executor import ProcessExecutor

    executor = ProcessExecutor(2, start_method=sys.argv[2])
    assert executor.start_method == sys.argv[2]
    executor.wait_ready()
    busy = [executor.submit(time.sleep, 60) for _ in range(2)]  # both workers mid-task
    print(*[p.pid for p in psutil.Process().children(recursive=True)], flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)  # without close(): interpreter exit must clean up
    time.sleep(60)
    """
)


def test_nothing_outlives_the_parent_even_a_sigkill(wait_until: Any) -> None:
    modes = [("kill", "zygote"), ("exit", "zygote"), ("kill", "forkserver")]
    children = {
        mode: subprocess.Popen(
            [sys.executable, "-c", CHILD, *mode], stdout=subprocess.PIPE, text=True
        )
        for mode in modes
    }
    descendants = {
        mode: [int(p) for p in child.stdout.readline().split()] for mode, child in children.items()
    }  # type: ignore[union-attr]
    for mode, child in children.items():
        if mode[0] == "kill":
            child.send_signal(signal.SIGKILL)
    for mode, child in children.items():
        child.wait(WAIT_S)
        child.stdout.close()  # type: ignore[union-attr]
        assert len(descendants[mode]) >= 3, descendants  # the workers and the zygote/forkserver
        assert wait_until(lambda d=descendants[mode]: all(gone(p) for p in d), 5.0), mode
        assert shm_entries(child.pid) == []


def test_loader_takes_an_executor_instance_and_leaves_it_open() -> None:
    import aioloader

    pool = aioloader.ProcessExecutor(1)
    try:
        with aioloader.Loader(list(range(6)), lambda k: k, decode=_square, executor=pool) as loader:
            assert [int(x) for x in loader] == [0, 1, 4, 9, 16, 25]
        with aioloader.Loader([7], lambda k: k, decode=_square, executor=pool) as again:
            assert [int(x) for x in again] == [49]  # still usable: the loader did not close it
    finally:
        pool.close()


def _square(x: int) -> int:
    return x * x


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
    start = time.monotonic()
    held = [f.result(WAIT_S) for f in futures]
    waited = time.monotonic() - start
    assert [int(b[0, 0]) for b in held] == list(range(10))
    stats = pool.stats()
    assert stats["results_pickled"] >= 4
    assert stats["results_in_shm"] > 4
    assert stats["arena_mapped"] <= 100 << 20
    # once: the pool's wait for a consumer that frees nothing is `RELEASES_STOP_S`, or three of its
    # usual gaps between frees where longer (here, the time the first batches took to be made)
    once = max(RELEASES_STOP_S, 3 * pool._pool._state.free_gap)
    assert waited < 3 * once, (waited, once)
