"""`worker_mode`: where `DataLoader(num_workers=N)` reads. "auto" (the default) is worker processes on a
build with the GIL and threads on a free-threaded one, unless the script may count on processes.

The GIL is probed through the project's one probe (`_util.threads.gil_enabled`, as `_torch.arguments`
imports it); the tests that set it stand in for the other build, and `make test-ft` runs the real one.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import psutil
import pytest
from support.compare import assert_same
from support.datasets import MapDataset
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset

from aioloader import DataLoader
from aioloader._torch import arguments
from aioloader._util.threads import LazyThreadPool, gil_enabled

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


@pytest.fixture
def gil_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The front door sees a free-threaded build (the GIL off)."""
    monkeypatch.setattr(arguments, "gil_enabled", lambda: False)


@pytest.fixture
def gil_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arguments, "gil_enabled", lambda: True)


class Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(8))


def child_processes() -> set[int]:
    """This process's children (a start method's server, such as 3.14's forkserver, stays)."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def test_auto_reads_in_threads_with_the_gil_off(gil_off: None) -> None:
    torch_batches = list(TorchDataLoader(MapDataset(23), batch_size=4, num_workers=2))
    before = child_processes()
    with DataLoader(MapDataset(23), batch_size=4, num_workers=2) as ours:
        assert ours.worker_mode == "thread"
        assert "num_workers=2, worker_mode='thread'" in repr(ours)  # the choice is shown
        batches = []
        for batch in ours:
            assert child_processes() <= before, "a worker process runs"
            batches.append(batch)
        assert ours._workers is None
    assert_same(batches, torch_batches)


def test_auto_reads_in_processes_with_the_gil_on(gil_on: None) -> None:
    torch_batches = list(TorchDataLoader(MapDataset(23), batch_size=4, num_workers=2))
    with DataLoader(MapDataset(23), batch_size=4, num_workers=2) as ours:
        assert ours.worker_mode == "process"
        batches = list(ours)
        assert ours._workers is not None
    assert_same(batches, torch_batches)


@pytest.mark.parametrize("why", ["iterable", "worker_init_fn", "multiprocessing_context"])
def test_auto_keeps_processes_where_the_script_may_count_on_them(gil_off: None, why: str) -> None:
    """An IterableDataset (each worker iterates a replica, sharded by get_worker_info()), a
    worker_init_fn (set up by worker id) or a start method given: worker processes, GIL or not."""
    arguments_of: dict[str, dict[str, Any]] = {
        "iterable": {"dataset": Stream()},
        "worker_init_fn": {"dataset": MapDataset(8), "worker_init_fn": lambda worker_id: None},
        "multiprocessing_context": {"dataset": MapDataset(8), "multiprocessing_context": "fork"},
    }
    loader = DataLoader(batch_size=4, num_workers=2, **arguments_of[why])
    try:
        assert loader.worker_mode == "process"
    finally:
        loader.close()


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_mode_given_is_kept_whatever_the_build(gil_off: None, mode: str) -> None:
    with DataLoader(MapDataset(8), batch_size=4, num_workers=2, worker_mode=mode) as ours:
        assert ours.worker_mode == mode
        assert [b["label"].tolist() for b in ours] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_mode_not_known_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"worker_mode: expected one of 'auto', 'process', 'thread'"
    ):
        DataLoader(MapDataset(8), batch_size=4, num_workers=2, worker_mode="threads")


def test_this_build_reads_where_auto_says() -> None:
    """On this interpreter as it is: processes with the GIL, threads without (`make test-ft`)."""
    expected = "process" if gil_enabled() else "thread"
    torch_batches = list(
        TorchDataLoader(MapDataset(23), batch_size=4, shuffle=False, num_workers=2)
    )
    with DataLoader(MapDataset(23), batch_size=4, num_workers=2) as ours:
        assert ours.worker_mode == expected
        assert_same(list(ours), torch_batches)


def test_in_threads_the_workers_asked_for_read_from_the_start(gil_off: None) -> None:
    """num_workers=3 in threads: the fetch pool starts 3 threads as reads wait, whatever the reads
    do (computing ones too, which the pool's own rule would not grow for)."""
    with DataLoader(MapDataset(8), batch_size=4, num_workers=3) as ours:
        list(ours)
        assert ours._stages.fetch._threads.floor == 3


# -- the pool's floor ------------------------------------------------------------------------------


@pytest.mark.parametrize("floor", [1, 3])
def test_a_pool_starts_its_floor_of_threads_as_calls_wait(floor: int) -> None:
    """Calls that wait: `floor` threads start as they are queued (the growth rule, which would add
    more, is held off by a long `grow_after`)."""
    release = threading.Event()
    pool = LazyThreadPool(8, "test-floor", grow_after=60.0, floor=floor)

    async def main() -> int:
        calls = [asyncio.ensure_future(pool.run(release.wait, 30)) for _ in range(6)]
        await asyncio.sleep(0)  # every call queued
        started = pool.threads
        release.set()
        await asyncio.gather(*calls)
        return started

    try:
        assert asyncio.run(main()) == floor
    finally:
        release.set()
        pool.close()


def test_a_pool_floor_is_at_most_its_size() -> None:
    assert LazyThreadPool(2, "test-floor", floor=5).floor == 2
    assert LazyThreadPool(2, "test-floor", floor=0).floor == 1
