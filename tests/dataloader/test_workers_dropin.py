"""DataLoader(num_workers=N) as a script written for torch's expects (`_torch/workers.py`): worker_info,
worker_init_fn, the dataset as it is when an epoch starts, seeds, a killed worker worded as torch's,
a script without a main guard."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from support.datasets import MapDataset, seeded
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

import aioloader
from aioloader import DataLoader as FrontDoor

# These tests are of the worker processes: on a free-threaded build worker_mode="auto" would read
# in threads (tests/dataloader/test_worker_mode.py).
DataLoader = functools.partial(FrontDoor, worker_mode="process")


class WhereAmI(Dataset[Any]):
    """Each sample says which process read it and what get_worker_info() said there."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> dict[str, Any]:
        import os

        from torch.utils.data import get_worker_info

        info = get_worker_info()  # None in the main process (torch with num_workers=0)
        return {
            "i": i, "pid": os.getpid(), "x": torch.full((3,), float(i)),
            "worker": -1 if info is None else info.id,
            "num_workers": 0 if info is None else info.num_workers,
            "has_dataset": info is not None and isinstance(info.dataset, WhereAmI),
        }  # fmt: skip


def _mark_worker(worker_id: int) -> None:
    import os

    os.environ["AIOLOADER_TEST_WORKER"] = str(worker_id)


def test_num_workers_reads_in_worker_processes_with_worker_info() -> None:
    import os

    expected = list(TorchDataLoader(WhereAmI(), batch_size=4, shuffle=True, generator=seeded(5)))
    with DataLoader(
        WhereAmI(), batch_size=4, shuffle=True, generator=seeded(5), num_workers=2,
        worker_init_fn=_mark_worker,
    ) as ours:  # fmt: skip
        got = list(ours)
    assert [b["i"].tolist() for b in got] == [b["i"].tolist() for b in expected]
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, expected, strict=True))
    pids = {int(p) for b in got for p in b["pid"]}
    assert os.getpid() not in pids  # read in other processes
    assert {int(w) for b in got for w in b["worker"]} <= {0, 1}
    assert {int(n) for b in got for n in b["num_workers"]} == {2}
    assert all(bool(h) for b in got for h in b["has_dataset"])


def _broken_init(worker_id: int) -> None:
    raise ZeroDivisionError(f"Error in worker_init_fn {worker_id}")


def test_a_failing_worker_init_fn_raises_its_own_error() -> None:
    loader = DataLoader(MapDataset(8), batch_size=2, num_workers=2, worker_init_fn=_broken_init)
    with loader, pytest.raises(ZeroDivisionError, match="Error in worker_init_fn"):
        list(loader)


class KillsItself(Dataset[Any]):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        return i


def test_a_killed_worker_is_a_runtime_error_worded_as_torchs() -> None:
    loader = DataLoader(KillsItself(), batch_size=2, num_workers=2)
    killed = r"DataLoader worker \(pid \d+\) is killed by signal: Killed"
    with loader, pytest.raises(RuntimeError, match=killed) as info:
        list(loader)
    assert isinstance(info.value, aioloader.WorkerDied)
    assert info.value.exitcode == -signal.SIGKILL


class Counted(Dataset[Any]):
    """Counts its reads in a `multiprocessing.Value` under a `Lock`, shared with the parent."""

    def __init__(self, n: int = 10) -> None:
        self.n = n
        self.reads = multiprocessing.Value("i", 0)
        self.lock = multiprocessing.Lock()
        self.scale = 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.reads.value += 1
        return i * self.scale

    def init_worker(self, worker_id: int) -> None:
        self.scale = 100  # a bound method: the very dataset the reads use


def test_workers_get_the_dataset_at_start_with_its_shared_values() -> None:
    dataset = Counted()
    with DataLoader(dataset, batch_size=3, num_workers=2) as loader:
        assert [b.tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert dataset.reads.value == 10  # counted in the workers, seen here


def test_a_bound_method_worker_init_fn_changes_the_dataset_the_reads_use() -> None:
    dataset = Counted(4)
    with DataLoader(
        dataset, batch_size=2, num_workers=2, worker_init_fn=dataset.init_worker
    ) as loader:
        assert [b.tolist() for b in loader] == [[0, 100], [200, 300]]


def test_a_local_closure_worker_init_fn_and_a_local_dataset_class_work() -> None:
    marks: list[int] = []

    class Local(Dataset[Any]):
        transform = staticmethod(lambda x: x * 2)

        def __init__(self) -> None:
            self.offset = lambda x: x + 1

        def __len__(self) -> int:
            return 6

        def __getitem__(self, i: int) -> Any:
            return (self.transform(i), self.offset(i), len(marks))

    def init(worker_id: int) -> None:
        marks.append(worker_id)  # the worker's own copy of `marks`

    with DataLoader(Local(), batch_size=3, num_workers=2, worker_init_fn=init) as loader:
        batches = [[t.tolist() for t in b] for b in loader]
    assert batches == [[[0, 2, 4], [1, 2, 3], [1, 1, 1]], [[6, 8, 10], [4, 5, 6], [1, 1, 1]]]
    assert marks == []


SCRIPT_WITHOUT_MAIN_GUARD = """
import threading, time, sys
sys.path.insert(0, {tests!r})
from aioloader import DataLoader
from support.datasets import MapDataset
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()  # a thread runs already
loader = DataLoader(MapDataset(8, "tensor"), batch_size=4, num_workers=2)
print(sum(len(b) for b in loader))
loader.close()
"""


def test_a_script_without_a_main_guard_works_while_a_thread_runs(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        SCRIPT_WITHOUT_MAIN_GUARD.format(tests=os.path.dirname(os.path.dirname(__file__)))
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["8"]


def test_zero_element_tensors_batch_in_worker_processes() -> None:
    class Empty(MapDataset):
        def __getitem__(self, i: int) -> Any:
            return torch.empty(0), torch.zeros(0, 3)

    with DataLoader(Empty(6), batch_size=3, num_workers=2) as loader:
        shapes = [(a.shape, b.shape) for a, b in loader]
    assert shapes == [((3, 0), (3, 0, 3))] * 2


class Versioned(Dataset[Any]):
    def __init__(self) -> None:
        self.version = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return self.version


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_see_the_dataset_as_it_is_when_their_epoch_starts(persistent: bool) -> None:
    dataset = Versioned()
    seen: dict[str, list[list[int]]] = {}
    for name, make in (("torch", TorchDataLoader), ("ours", DataLoader)):
        dataset.version = 0
        loader = make(dataset, batch_size=4, num_workers=2, persistent_workers=persistent)
        dataset.version = 1  # after construction, before the first epoch: both see it
        epochs = [next(iter(loader)).tolist()]
        dataset.version = 2  # between epochs: fresh workers see it, persistent ones do not
        epochs.append(next(iter(loader)).tolist())
        seen[name] = epochs
        getattr(loader, "close", lambda: None)()
    assert seen["ours"] == seen["torch"]
    assert seen["ours"] == [[1] * 4, [1 if persistent else 2] * 4]


class Draws(Dataset[Any]):
    """Each read: the worker's seed and one draw from each of torch, numpy and random."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> Any:
        import random as stdlib_random

        from torch.utils.data import get_worker_info

        info = get_worker_info()
        return (
            info.seed if info is not None else -1, torch.rand(()).item(),
            float(np.random.rand()), stdlib_random.random(),
        )  # fmt: skip


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_are_seeded_as_torchs_each_epoch(persistent: bool) -> None:
    def epochs(make: Any) -> list[Any]:
        torch.manual_seed(2024)
        loader = make(Draws(), batch_size=2, num_workers=2, persistent_workers=persistent)
        got = [[[t.tolist() for t in b] for b in loader] for _ in range(2)]
        getattr(loader, "close", lambda: None)()
        return got

    expected, got = epochs(TorchDataLoader), epochs(DataLoader)
    assert got == expected
    seeds = [{seed for batch in epoch for seed in batch[0]} for epoch in got]
    assert (seeds[0] == seeds[1]) == persistent  # fresh workers: a fresh base seed each epoch
