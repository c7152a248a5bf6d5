"""`aioloader.DataLoader(num_workers=N)`: whole batches made in worker processes, as torch makes them.

Real worker processes throughout: batch i is read and collated by worker i % N, with threads inside
each worker where the reads block, and handed over in shared memory.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from test_dataloader import CASES, MapDataset, Stream, assert_same
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from aioloader import DataLoader as FrontDoor
from aioloader import LoaderTimeout, WorkerDied
from aioloader._executors.process.arena import NAME_PREFIX, SHM_DIR
from aioloader._torch import workers as _workers
from aioloader._util import threads as _threads

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

# Cases whose arguments pickle (a worker process gets them); custom_collate's lambda does not.
PROCESS_CASES = sorted(c for c in CASES if c != "custom_collate")


# These tests are of the worker processes: on a free-threaded build worker_mode="auto" would read
# in threads (tests/dataloader/test_worker_mode.py).
DataLoader = functools.partial(FrontDoor, worker_mode="process")


def labels_times_ten(batch: list[dict[str, Any]]) -> list[int]:
    return [s["label"] * 10 for s in batch]


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("case", PROCESS_CASES)
def test_same_batches_as_torch_in_workers(case: str, workers: int, threads: int) -> None:
    expected = list(TorchDataLoader(MapDataset(), **CASES[case]()))
    with DataLoader(
        MapDataset(), num_workers=workers, threads_per_worker=threads, **CASES[case]()
    ) as ours:
        got = [list(ours), list(ours)]
    assert_same(got[0], expected)
    assert len(got[1]) == len(expected)


def test_a_user_collate_fn_matches_torch_in_workers() -> None:
    expected = list(TorchDataLoader(MapDataset(), batch_size=4, collate_fn=labels_times_ten))
    with DataLoader(MapDataset(), batch_size=4, collate_fn=labels_times_ten, num_workers=2) as dl:
        assert list(dl) == expected


class WhoReads(Dataset[Any]):
    """Each sample says which worker read it, in which process and thread."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = get_worker_info()
        assert info is not None
        time.sleep(0.002)
        return {"i": i, "worker": info.id, "pid": os.getpid(), "x": torch.full((8,), float(i))}


def test_batch_i_is_built_by_worker_i_mod_n() -> None:
    with DataLoader(WhoReads(), batch_size=4, shuffle=True, num_workers=3) as loader:
        batches = list(loader)
    assert len(batches) == 10
    for n, batch in enumerate(batches):
        assert set(batch["worker"].tolist()) == {n % 3}
        assert len(set(batch["pid"].tolist())) == 1  # one process made the whole batch
    assert os.getpid() not in {int(b["pid"][0]) for b in batches}


def where_collated(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """A user collate_fn: what get_worker_info() says where it runs."""
    info = get_worker_info()
    return {
        "worker": None if info is None else info.id,
        "pid": os.getpid(),
        "x": torch.stack([s["x"] for s in batch]),
    }


def test_a_user_collate_fn_runs_in_the_worker_and_sees_worker_info() -> None:
    with DataLoader(WhoReads(), batch_size=4, collate_fn=where_collated, num_workers=2) as loader:
        batches = list(loader)
    assert [b["worker"] for b in batches] == [n % 2 for n in range(10)]
    assert os.getpid() not in {b["pid"] for b in batches}
    assert torch.equal(batches[3]["x"][:, 0], torch.tensor([12.0, 13.0, 14.0, 15.0]))


class Tiles(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((64, 64), float(i))


def test_a_batch_the_user_keeps_never_changes() -> None:
    kept: list[torch.Tensor] = []
    with DataLoader(Tiles(), batch_size=8, shuffle=True, num_workers=2) as loader:
        for _ in range(4):
            for n, batch in enumerate(loader):
                if n % 2 == 0:
                    kept.append(batch)  # the others are dropped: their slots are reused
                del batch
        for batch in kept:
            firsts = batch[:, 0, 0]
            assert torch.equal(batch, firsts[:, None, None].expand(8, 64, 64))
    assert len({float(b[0, 0, 0]) for b in kept}) > 8  # the kept batches differ


class KillsItsWorker(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 13:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.full((4,), float(i))


def _shm_entries() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(NAME_PREFIX)}


def test_a_worker_killed_mid_batch_is_a_typed_error_naming_the_worker_and_the_batch() -> None:
    before = _shm_entries()
    loader = DataLoader(KillsItsWorker(), batch_size=4, num_workers=2)
    got: list[torch.Tensor] = []
    with pytest.raises(WorkerDied) as info:
        got.extend(loader)
    loader.close()
    assert [b[0, 0].item() for b in got] == [0.0, 4.0, 8.0]  # the batches before it came first
    assert info.value.pid is not None
    assert str(info.value.pid) in str(info.value)
    notes = "\n".join(info.value.__notes__)
    assert f"DataLoader worker 1 (pid {info.value.pid}) died making batch 3" in notes
    assert "(indices [12, 13, 14, 15])" in notes
    assert _shm_entries() == before
    assert [t.name for t in threading.enumerate() if t.name.startswith("aioloader")] == []


class NotThreadSafe(Dataset[torch.Tensor]):
    """Raises when two reads overlap (a dataset holding one file handle, say)."""

    def __init__(self) -> None:
        self.inside = 0

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> torch.Tensor:
        self.inside += 1
        try:
            if self.inside > 1:
                raise RuntimeError("two reads at once")
            time.sleep(0.004)  # blocks: more threads would start
            return torch.full((4,), float(i))
        finally:
            self.inside -= 1


class SaysThreadSafe(NotThreadSafe):
    thread_safe = True


def test_threads_per_worker_1_reads_one_sample_at_a_time() -> None:
    with DataLoader(NotThreadSafe(), batch_size=16, num_workers=2, threads_per_worker=1) as dl:
        assert [b[0, 0].item() for b in dl] == [0.0, 16.0, 32.0]
    # more threads read a batch's samples, each its own copy of the dataset ...
    with DataLoader(NotThreadSafe(), batch_size=16, num_workers=2, threads_per_worker=4) as dl:
        assert [b[0, 0].item() for b in dl] == [0.0, 16.0, 32.0]
    # ... or, where it declares itself thread-safe, the dataset itself at once
    with (
        DataLoader(SaysThreadSafe(), batch_size=16, num_workers=2, threads_per_worker=4) as dl,
        pytest.raises(RuntimeError, match="two reads at once"),
    ):
        list(dl)


@pytest.mark.parametrize("bad", [0, -1, "many", 2.0])
def test_threads_per_worker_is_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match="threads_per_worker"):
        DataLoader(MapDataset(), num_workers=1, threads_per_worker=bad)


class Arrays(Dataset[np.ndarray]):
    def __len__(self) -> int:
        return 16 * 12

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full((128, 256), i, dtype=np.float64)  # 256 KiB


def _pipe_bytes(loader: DataLoader) -> int:
    pool = loader.stats().extra["decode_pool"]
    return int(pool["pipe_bytes_sent"] + pool["pipe_bytes_received"])


def test_batches_come_back_in_shared_memory_not_through_the_pipe() -> None:
    batch_bytes = 16 * 128 * 256 * 8
    with DataLoader(Arrays(), batch_size=16, num_workers=2) as loader:
        batches = list(loader)  # the first ones too: a worker asks for a slot that fits (NEED)
        per_batch = _pipe_bytes(loader) / len(batches)
        pool = loader.stats().extra["decode_pool"]
    assert len(batches) == 12
    assert per_batch < 0.01 * batch_bytes
    assert pool.get("results_pickled", 0) == 0
    assert pool["results_in_shm"] == 12
    assert all(torch.equal(b[:, 0, 0], torch.arange(16.0) + 16 * n) for n, b in enumerate(batches))


def arrays_as_list(batch: list[np.ndarray]) -> list[np.ndarray]:
    """A user collate_fn that returns the list of arrays."""
    return list(batch)


class ArrayStream(IterableDataset[np.ndarray]):
    def __iter__(self) -> Any:
        info = get_worker_info()
        workers, me = (1, 0) if info is None else (info.num_workers, info.id)
        return (np.full((64, 512), i, dtype=np.float64) for i in range(me, 96, workers))


def test_a_list_of_arrays_from_a_user_collate_travels_in_shared_memory() -> None:
    kwargs: dict[str, Any] = dict(batch_size=8, collate_fn=arrays_as_list, num_workers=2)
    expected = list(TorchDataLoader(ArrayStream(), **kwargs))
    with DataLoader(ArrayStream(), **kwargs) as loader:
        got = list(loader)
        pool = loader.stats().extra["decode_pool"]
    assert_same(got, expected)
    assert pool["results_in_shm"] == len(got)  # the answers past a stream's end carry no array
    batch_bytes = 8 * 64 * 512 * 8
    assert (pool["pipe_bytes_sent"] + pool["pipe_bytes_received"]) / len(got) < 0.01 * batch_bytes


def test_an_iterable_dataset_in_workers_matches_torch_with_the_default_collate() -> None:
    expected = list(TorchDataLoader(Stream(), batch_size=4))
    with DataLoader(Stream(), batch_size=4, num_workers=1) as loader:
        assert_same(list(loader), expected)


class LogsReads(Dataset[torch.Tensor]):
    """Appends each index it reads to a file (workers are other processes)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __len__(self) -> int:
        return 8 * 40

    def __getitem__(self, i: int) -> torch.Tensor:
        with open(self.path, "a") as f:
            f.write(f"{i}\n")
        return torch.full((4,), float(i))


def test_whole_batches_in_flight_are_bounded_by_prefetch_factor(tmp_path: Path) -> None:
    log = tmp_path / "reads"
    log.touch()
    with DataLoader(
        LogsReads(log), batch_size=8, num_workers=2, prefetch_factor=2
    ) as loader:  # fmt: skip
        it = iter(loader)
        next(it)
        next(it)
        time.sleep(0.5)  # time to read as far ahead as it may
        read = {int(line) // 8 for line in log.read_text().split()}
        it.close()  # type: ignore[attr-defined]
    # torch's bound: num_workers * prefetch_factor batches asked for (made or not), past the two
    # handed over; one more may be on its way to the consumer
    assert len(read) <= 2 + 2 * 2 + 1


class ReadsWhere(Dataset[Any]):
    """Which thread read each sample; reads that block (sleep) or compute."""

    def __init__(self, blocks: bool) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self.blocks:
            time.sleep(0.004)
        else:
            deadline = time.thread_time() + 0.004
            while time.thread_time() < deadline:
                pass
        return {"i": i, "thread": threading.current_thread().name}


@pytest.mark.parametrize("blocks", [True, False])
def test_auto_threads_start_only_when_the_reads_block(
    blocks: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # read threads start and grow only while the machine has a core idle: the workers (forked
    # from this process) see one core idle whatever else runs on the machine
    def one_core_idle() -> int:
        return int(time.monotonic() * _threads.TICKS_PER_S)

    monkeypatch.setattr(_threads, "idle_ticks", one_core_idle)
    monkeypatch.setattr(_workers, "idle_ticks", one_core_idle)
    with DataLoader(ReadsWhere(blocks), batch_size=16, num_workers=2) as loader:
        batches = list(loader)
    assert [i for b in batches for i in b["i"].tolist()] == list(range(64))
    first = {t for b in batches[:2] for t in b["thread"]}
    later = {t for b in batches[2:] for t in b["thread"]}
    assert first == {"MainThread"}  # each worker reads its first batch one read after another
    if blocks:  # ... sees its reads wait, and reads the next batches in threads of its own
        assert all(t.startswith("aioloader-read") for t in later)
    else:  # computing reads start no thread: a worker's footprint stays torch's
        assert later == {"MainThread"}


class Stalls(Dataset[torch.Tensor]):
    """Index 5 never returns in time (a read that hangs)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == 5:
            time.sleep(30)
        return torch.full((4,), float(i))


def _children() -> set[int]:
    """This process's live descendants, once those that were stopped have had time to go."""
    import psutil

    _, alive = psutil.wait_procs(psutil.Process().children(recursive=True), timeout=5)
    return {p.pid for p in alive}


def test_a_stalled_batch_hits_the_timeout_and_closing_leaves_nothing() -> None:
    before, children = _shm_entries(), _children()  # other tests' servers and pools may run
    loader = DataLoader(Stalls(), batch_size=4, num_workers=2, timeout=0.5)
    with pytest.raises(LoaderTimeout):
        list(loader)
    loader.close()
    assert _children() <= children
    assert _shm_entries() == before
    assert [t.name for t in threading.enumerate() if t.name.startswith("aioloader")] == []


def test_breaking_out_mid_epoch_then_the_next_epoch_is_whole() -> None:
    before, children = _shm_entries(), _children()
    with DataLoader(Tiles(), batch_size=8, num_workers=2, prefetch_factor=2) as loader:
        for n, _ in enumerate(loader):
            if n == 2:
                break  # batches in flight in the workers are dropped
        assert [b[0, 0, 0].item() for b in loader] == [8.0 * n for n in range(8)]
    assert _children() <= children
    assert _shm_entries() == before


class Decoded(Dataset[torch.Tensor]):
    """Samples that take a while to make, as a decode does (a CPU-bound `__getitem__`)."""

    def __len__(self) -> int:
        return 16 * 24

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.full((256, 1024), float(i))  # 1 MiB: a batch fills a slab of its own


def test_each_worker_keeps_one_batch_of_shared_memory_when_the_consumer_takes_each_batch() -> None:
    """A worker asks for its batch's slot as it reads (`wire.py`: WANT): the one it wrote last is
    free again by then, so it maps one batch slab, not one more for the batch the consumer holds."""
    slabs = []
    with DataLoader(Decoded(), batch_size=16, num_workers=2, threads_per_worker=1) as loader:
        for n, batch in enumerate(loader):
            assert torch.equal(batch[:, 0, 0], torch.arange(16.0) + 16 * n)
            del batch
            pool = loader.stats().extra["decode_pool"]
            slabs.append(pool["batch_slabs"])
    assert pool.get("results_pickled", 0) == 0
    assert max(slabs) == 2, slabs


class SaysItsNice(Dataset[int]):
    """Each sample is the nice value of the thread that read it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return os.nice(0)


@pytest.mark.parametrize("threads", [1, 4])
def test_the_threads_that_read_in_a_worker_yield_the_cpu_to_the_trainer(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Linux sets a nice value per thread: each reading thread must have the worker's, not only the
    # thread that started the worker.
    mine = os.nice(0)
    with DataLoader(SaysItsNice(), batch_size=4, num_workers=2, threads_per_worker=threads) as dl:
        assert {int(v) for b in dl for v in b} == {min(19, mine + _threads.LOADER_NICE)}
    monkeypatch.setenv(_threads.NICE_ENV, "0")
    with DataLoader(SaysItsNice(), batch_size=4, num_workers=1, threads_per_worker=threads) as dl:
        assert {int(v) for b in dl for v in b} == {mine}
