"""The process pool's shutdown (`_executors/process/executor.py`): cancel then close, garbage
collection, even a SIGKILL of the parent leave no worker, thread or /dev/shm entry; a Loader leaves
an executor it was given open."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
from scripts.leakcheck import gone, shm_names
from support.workerfuncs import (
    WAIT_S,
    echo,
)

import aioloader
from aioloader import LoaderClosedError
from aioloader._executors.process.executor import ProcessExecutor


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
    assert shm_names(os.getpid()) == []


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
        assert shm_names(child.pid) == []


def test_loader_takes_an_executor_instance_and_leaves_it_open() -> None:

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
