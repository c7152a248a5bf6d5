"""The process pool's faults (`_executors/process/faults.py`): a decode error keeps its type and names
the worker; a worker that dies, is killed or stalls is reported at once, replaced, and costs only the
task that caused it; async tasks time out alone; a failing worker_init_fn or a bug in the pool's
thread fails the tasks instead of hanging."""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from scripts.leakcheck import gone
from support.workerfuncs import (
    NOTICE_S,
    WAIT_S,
    block,
    block_loop,
    broken_init,
    die,
    die_once_at,
    draw,
    echo,
    fail,
    note_cancel,
    snooze,
    stall,
    stall_once,
    wait_for_file,
)

import aioloader
from aioloader import DecodeError, LoaderClosedError, WorkerDied, WorkerTimeout
from aioloader._executors.process.executor import ProcessExecutor
from aioloader._executors.process.sending import Sender
from aioloader._util.rng import call_seeded


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
