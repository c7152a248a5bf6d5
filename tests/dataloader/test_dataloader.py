"""aioloader.DataLoader against torch.utils.data.DataLoader: same batches, same order, same errors."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
import typing
import warnings
from collections import namedtuple
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import (
    Dataset,
    DistributedSampler,
    IterableDataset,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

import aioloader
from aioloader import DataLoader, LoaderTimeout

Point = namedtuple("Point", ["x", "label"])


def assert_same(a: Any, b: Any) -> None:
    """Structural equality including container types, tensor dtypes and values."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    else:
        assert a == b


def sample(i: int, kind: str) -> Any:
    x = torch.arange(4, dtype=torch.float32) + i
    if kind == "tensor":
        return x
    if kind == "dict":
        return {"x": x, "label": i, "name": f"s{i}", "w": float(i) / 2}
    if kind == "tuple":
        return (x.numpy().copy(), i, np.float32(i))
    if kind == "namedtuple":
        return Point(x, i)
    if kind == "nested":
        return {"pair": (x, [i, i + 1]), "meta": {"id": f"k{i}", "raw": b"r"}}
    raise AssertionError(kind)


class MapDataset(Dataset[Any]):
    def __init__(self, n: int = 23, kind: str = "dict") -> None:
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return sample(int(i), self.kind)


class GetItemsDataset(MapDataset):
    def __init__(self) -> None:
        super().__init__(kind="dict")
        self.calls: list[list[int]] = []

    def __getitems__(self, indices: list[int]) -> list[Any]:
        self.calls.append(list(indices))
        return [self[i] for i in indices]


class AsyncDataset(MapDataset):
    async def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        await asyncio.sleep(0.001 * (i % 3))
        return sample(int(i), self.kind)


class Stream(IterableDataset[Any]):
    def __init__(self, n: int = 17) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return (sample(i, "tuple") for i in range(self.n))

    def __len__(self) -> int:
        return self.n


def both(dataset: Any, make: Any = None, **kwargs: Any) -> tuple[list[Any], list[Any]]:
    """Two epochs of each loader, each with its own arguments from `make()` (fresh samplers and
    generators, so that both start from the same random state)."""
    expected = TorchDataLoader(dataset, **(make() if make else kwargs))
    with DataLoader(dataset, **(make() if make else kwargs)) as ours:
        got = [list(ours), list(ours)]
        assert len(ours) == len(expected)
    return [list(expected), list(expected)], got


def seeded(seed: int = 7) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


CASES: dict[str, Any] = {
    "sequential": lambda: dict(batch_size=4),
    "drop_last": lambda: dict(batch_size=4, drop_last=True),
    "shuffle_generator": lambda: dict(batch_size=5, shuffle=True, generator=seeded()),
    "shuffle_generator_drop_last": lambda: dict(
        batch_size=5, shuffle=True, drop_last=True, generator=seeded(1)
    ),
    "unbatched": lambda: dict(batch_size=None),
    "unbatched_shuffle": lambda: dict(batch_size=None, shuffle=True, generator=seeded(2)),
    "subset_random_sampler": lambda: dict(
        batch_size=3, sampler=SubsetRandomSampler(range(0, 23, 2), seeded(3))
    ),
    "weighted_sampler": lambda: dict(
        batch_size=4, sampler=WeightedRandomSampler([1.0] * 23, 30, generator=seeded(4))
    ),
    "list_sampler": lambda: dict(batch_size=2, sampler=[5, 3, 1, 22, 0]),
    "batch_sampler_lists": lambda: dict(batch_sampler=[[1, 2], [0], [22, 5, 7]]),
    "distributed_sampler": lambda: dict(
        batch_size=3, sampler=DistributedSampler(range(23), num_replicas=2, rank=1, seed=5)
    ),
    "custom_collate": lambda: dict(batch_size=4, collate_fn=lambda b: [s["label"] * 10 for s in b]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_batches_as_torch(case: str) -> None:
    expected, got = both(MapDataset(), CASES[case])
    assert_same(got, expected)


@pytest.mark.parametrize("kind", ["tensor", "dict", "tuple", "namedtuple", "nested"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_same_nested_samples_as_torch(kind: str, shuffle: bool) -> None:
    expected, got = both(
        MapDataset(13, kind), lambda: dict(batch_size=4, shuffle=shuffle, generator=seeded(9))
    )
    assert_same(got, expected)


@pytest.mark.parametrize("batch_size", [None, 1, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_same_as_torch(batch_size: int | None, drop_last: bool) -> None:
    if batch_size is None and drop_last:
        pytest.skip("torch rejects this combination (tested below)")
    expected, got = both(Stream(), batch_size=batch_size, drop_last=drop_last)
    assert_same(got, expected)


def test_getitems_is_called_once_per_batch() -> None:
    dataset = GetItemsDataset()
    expected, got = both(dataset, lambda: dict(batch_size=6, shuffle=True, generator=seeded(11)))
    assert_same(got, expected)
    ours, torchs = dataset.calls[:8], dataset.calls[8:]  # ours ran its 2 epochs first
    assert len(dataset.calls) == 16  # one call per batch: 2 loaders x 2 epochs x 4 batches
    assert sorted(map(tuple, ours)) == sorted(map(tuple, torchs))


def test_async_dataset_is_fetched_concurrently_and_matches_sync_torch() -> None:
    expected = list(TorchDataLoader(MapDataset(), batch_size=5, shuffle=True, generator=seeded()))
    with DataLoader(AsyncDataset(), batch_size=5, shuffle=True, generator=seeded()) as ours:
        assert_same(list(ours), expected)


def test_set_epoch_reaches_distributed_sampler() -> None:
    sampler = DistributedSampler(range(20), num_replicas=2, rank=0, shuffle=True, seed=1)
    with DataLoader(MapDataset(20), batch_size=5, sampler=sampler) as ours:
        ours.set_epoch(0)
        first = [b["label"].tolist() for b in ours]
        ours.set_epoch(1)
        second = [b["label"].tolist() for b in ours]
    sampler.set_epoch(1)
    expected = [b["label"].tolist() for b in TorchDataLoader(MapDataset(20), 5, sampler=sampler)]
    assert second == expected
    assert first != second


def test_getitem_calls_overlap() -> None:
    """Plain __getitem__ calls run in threads at the same time (torch with 0 workers: one at a time)."""
    barrier = threading.Barrier(4, timeout=10)

    class Blocking(MapDataset):
        def __getitem__(self, i: int) -> Any:
            barrier.wait()  # only passes when 4 calls are in flight together
            return super().__getitem__(i)

    with DataLoader(Blocking(8), batch_size=4, concurrency=4) as ours:
        assert len(list(ours)) == 2


BAD_ARGUMENTS = {
    "negative_workers": dict(num_workers=-1),
    "negative_timeout": dict(timeout=-1),
    "prefetch_without_workers": dict(prefetch_factor=2),
    "negative_prefetch": dict(num_workers=1, prefetch_factor=-1),
    "persistent_without_workers": dict(persistent_workers=True),
    "sampler_and_shuffle": dict(sampler=[0, 1], shuffle=True),
    "batch_sampler_and_batch_size": dict(batch_sampler=[[0]], batch_size=2),
    "batch_sampler_and_shuffle": dict(batch_sampler=[[0]], shuffle=True),
    "batch_sampler_and_drop_last": dict(batch_sampler=[[0]], drop_last=True),
    "no_batch_size_and_drop_last": dict(batch_size=None, drop_last=True),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_same_validation_errors_as_torch(case: str) -> None:
    kwargs = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match="option") as torch_error:
        TorchDataLoader(MapDataset(), **kwargs)
    with pytest.raises(ValueError, match="option") as our_error:
        DataLoader(MapDataset(), **kwargs)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.parametrize(
    "kwargs", [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])], ids=str
)
def test_iterable_dataset_validation_same_as_torch(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="IterableDataset") as torch_error:
        TorchDataLoader(Stream(), **kwargs)
    with pytest.raises(ValueError, match="IterableDataset") as our_error:
        DataLoader(Stream(), **kwargs)
    assert str(our_error.value) == str(torch_error.value)


def test_pin_memory_without_accelerator_warns_once() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator is found") as record:
        loader = DataLoader(MapDataset(4), batch_size=2, pin_memory=True)
    with loader:
        assert len(list(loader)) == 2
    assert len(record) == 1


def test_worker_init_fn_runs_once_per_fetch_thread() -> None:
    seen: list[tuple[int, str]] = []
    lock = threading.Lock()

    def init(worker_id: int) -> None:
        with lock:
            seen.append((worker_id, threading.current_thread().name))

    with DataLoader(
        MapDataset(12), batch_size=4, num_workers=2, worker_init_fn=init, worker_mode="thread"
    ) as ours:
        list(ours)
    ids = [w for w, _ in seen]
    assert sorted(ids) == list(range(len(ids)))
    assert ids
    assert all(name.startswith("aioloader-fetch") for _, name in seen)


def test_timeout_raises_loader_timeout_naming_the_limit() -> None:
    class Slow(MapDataset):
        def __getitem__(self, i: int) -> Any:
            time.sleep(1.0)
            return super().__getitem__(i)

    with (
        DataLoader(Slow(2), batch_size=2, timeout=0.2) as ours,
        pytest.raises(LoaderTimeout) as err,
    ):
        next(iter(ours))
    assert str(err.value).startswith("DataLoader timed out after 0.2 seconds; ")  # torch's words
    assert isinstance(err.value, RuntimeError)  # as torch's
    # ... then where the work is stuck: the stage and the keys in flight there, with their ages
    assert err.value.stage == "fetch"
    assert sorted(err.value.keys) == [0, 1]
    assert re.search(r"stage 'fetch', keys in flight there: \d \(0\.\d s\), \d", str(err.value))


def test_error_in_getitem_keeps_type_and_names_the_index() -> None:
    class Broken(MapDataset):
        def __getitem__(self, i: int) -> Any:
            if i == 6:
                raise KeyError("missing")
            return super().__getitem__(i)

    with DataLoader(Broken(10), batch_size=3) as ours:
        batches = iter(ours)
        assert next(batches)["label"].tolist() == [0, 1, 2]
        assert next(batches)["label"].tolist() == [3, 4, 5]
        with pytest.raises(KeyError) as err:
            next(batches)
    assert any("key 6" in note and "fetch" in note for note in err.value.__notes__)


def test_is_a_loader() -> None:
    assert issubclass(DataLoader, aioloader.Loader)


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


class ShardedStream(IterableDataset[Any]):
    """Worker w of n yields items w, w + n, ... (all of them in the main process), plus its pid;
    `uneven` makes worker 0's share much longer than the others'."""

    def __init__(self, n: int = 17, uneven: bool = False) -> None:
        self.n, self.uneven = n, uneven

    def __iter__(self) -> Any:
        import os

        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = list(range(self.n))[worker::workers]
        if self.uneven and worker > 0:
            mine = mine[:2]
        for i in mine:
            yield {"i": i, "x": torch.full((2,), float(i)), "pid": os.getpid(), "worker": worker}


def _strip_pids(batches: list[Any]) -> list[Any]:
    for b in batches:
        b.pop("pid")
    return batches


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize(
    "kwargs",
    [dict(batch_size=4), dict(batch_size=4, drop_last=True), dict(batch_size=None),
     dict(batch_size=3, uneven=True), dict(batch_size=1, uneven=True, workers=3)],
    ids=["batched", "drop_last", "unbatched", "uneven", "uneven-3"],
)  # fmt: skip
def test_iterable_dataset_is_iterated_in_each_worker_as_torch_does(kwargs: dict[str, Any]) -> None:
    import os

    kwargs = dict(kwargs)
    dataset = ShardedStream(uneven=kwargs.pop("uneven", False))
    workers = kwargs.pop("workers", 2)
    expected = _strip_pids(list(TorchDataLoader(dataset, num_workers=workers, **kwargs)))
    with DataLoader(dataset, num_workers=workers, **kwargs) as ours:
        epochs = [list(ours), list(ours)]  # the workers persist: each epoch starts a new stream
    pids = {int(p) for b in epochs[0] for p in torch.as_tensor(b["pid"]).reshape(-1)}
    assert os.getpid() not in pids
    assert len(pids) == workers
    for got in epochs:
        assert_same(_strip_pids(got), expected)


def _fail_in_worker_1() -> Any:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is not None and info.id == 1:
        raise KeyError("shard 1 is missing")
    yield from range(4)


class FailingStream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        return _fail_in_worker_1()


def test_an_error_in_a_workers_stream_keeps_its_type() -> None:
    loader = DataLoader(FailingStream(), batch_size=2, num_workers=2)
    with loader, pytest.raises(KeyError, match="shard 1 is missing") as info:
        list(loader)
    assert any("decode" in note for note in info.value.__notes__), info.value.__notes__


# -- drop-in fidelity: a script that works with torch's DataLoader works the same ------------------


class FailsAt(Dataset[Any]):
    """`dataset[i]` is i, except at `bad`, which raise ValueError naming the index."""

    def __init__(self, n: int = 12, bad: tuple[int, ...] = (5,)) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i in self.bad:
            raise ValueError(f"bad sample {i}")
        return i


def _outcomes(loader: Any) -> list[Any]:
    """Each `next()` of one epoch: the batch as a list, or the type and message it raised."""
    got: list[Any] = []
    it = iter(loader)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return got
        except Exception as exc:
            got.append((type(exc).__name__, str(exc).splitlines()[-1]))
            continue
        got.append(batch.tolist())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_ends_its_batch_and_the_next_call_goes_on(num_workers: int) -> None:
    dataset = FailsAt(bad=(5, 9))
    expected = _outcomes(TorchDataLoader(dataset, batch_size=2, num_workers=num_workers))
    with DataLoader(dataset, batch_size=2, num_workers=num_workers) as ours:
        got = _outcomes(ours)
    assert [b if isinstance(b, list) else b[0] for b in got] == [
        b if isinstance(b, list) else b[0] for b in expected
    ]
    assert got == [[0, 1], [2, 3], ("ValueError", "bad sample 5"), [6, 7],
                   ("ValueError", "bad sample 9"), [10, 11]]  # fmt: skip


def test_an_error_ends_its_batch_in_async_for_too() -> None:
    async def main() -> list[Any]:
        got: list[Any] = []
        async with DataLoader(FailsAt(bad=(3,)), batch_size=4) as loader:
            it = aiter(loader)
            while True:
                try:
                    got.append((await anext(it)).tolist())
                except StopAsyncIteration:
                    return got
                except ValueError as exc:
                    got.append(str(exc))

    assert asyncio.run(main()) == ["bad sample 3", [4, 5, 6, 7], [8, 9, 10, 11]]


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


@pytest.mark.parametrize("name", aioloader._exceptions.__all__)
def test_every_error_survives_pickling_and_rebuilding_from_its_message(name: str) -> None:
    cls = getattr(aioloader._exceptions, name)
    exc = cls("what happened")
    for again in (pickle.loads(pickle.dumps(exc)), type(exc)(str(exc))):
        assert type(again) is cls
        assert str(again) == "what happened"
    died = aioloader.WorkerDied("gone", pid=12, exitcode=-9, tasks=[3])
    assert pickle.loads(pickle.dumps(died)).__dict__ == died.__dict__


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


def test_without_fork_what_does_not_pickle_is_named_at_construction() -> None:
    class Local(MapDataset):
        def __init__(self) -> None:
            super().__init__(4)
            self.transform = lambda x: x

    with pytest.raises(
        TypeError, match=r"dataset\.transform does not pickle.*worker_mode='thread'"
    ):
        DataLoader(Local(), batch_size=2, num_workers=1, multiprocessing_context="spawn")


SCRIPT_WITHOUT_MAIN_GUARD = """
import threading, time, sys
sys.path.insert(0, {tests!r})
from aioloader import DataLoader
from test_dataloader import MapDataset
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()  # a thread runs already
loader = DataLoader(MapDataset(8, "tensor"), batch_size=4, num_workers=2)
print(sum(len(b) for b in loader))
loader.close()
"""


def test_a_script_without_a_main_guard_works_while_a_thread_runs(tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_WITHOUT_MAIN_GUARD.format(tests=os.path.dirname(__file__)))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["8"]


def test_fixed_attributes_cannot_be_set_after_construction() -> None:
    loader = DataLoader(MapDataset(4), batch_size=2)
    for name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(loader, name, None)
    loader.num_workers = 0  # others may change, as in torch
    loader.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_workers=0, multiprocessing_context="fork"), ValueError, "num_workers > 0"),
        (dict(num_workers=1, multiprocessing_context="nope"), ValueError, "'forkserver'"),
        (dict(num_workers=1, multiprocessing_context=3), TypeError, "valid context object"),
    ],
)
def test_multiprocessing_context_is_checked_as_torch_does(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TorchDataLoader(MapDataset(4), **kwargs)
    with pytest.raises(error, match=match):
        DataLoader(MapDataset(4), **kwargs)


def test_a_context_object_picks_the_start_method() -> None:
    context = multiprocessing.get_context("fork")
    with DataLoader(
        MapDataset(6, "tensor"), batch_size=3, num_workers=1, multiprocessing_context=context
    ) as loader:
        assert [b.shape[0] for b in loader] == [3, 3]
        assert loader._workers is not None
        assert loader._workers.start_method == "fork"


def test_more_workers_than_cpus_warns() -> None:
    many = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 64) + 1
    with pytest.warns(UserWarning, match=f"will create {many} worker processes"):
        DataLoader(MapDataset(4), num_workers=many).close()


class ShortStream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        return iter(range(5))

    def __len__(self) -> int:
        return 2


def test_an_iterable_dataset_longer_than_its_len_warns() -> None:
    with DataLoader(ShortStream(), batch_size=1) as loader:
        assert len(loader) == 2
        with pytest.warns(UserWarning, match="reported to be 2.*samples have been fetched") as w:
            assert len(list(loader)) == 5
    assert [str(x.message).split("but ")[1][0] for x in w] == ["3", "4", "5"]  # as torch warns


def test_an_iter_datapipe_accepts_shuffle() -> None:
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(10)).shuffle()  # shuffle=True turns its shuffler on
    with DataLoader(pipe, batch_size=5, shuffle=True) as loader:
        got = sorted(x for b in loader for x in b.tolist())
    assert got == list(range(10))


def test_the_class_is_generic() -> None:
    typed = DataLoader[list[torch.Tensor]]
    assert typing.get_origin(typed) is DataLoader


def test_zero_element_tensors_batch_in_worker_processes() -> None:
    class Empty(MapDataset):
        def __getitem__(self, i: int) -> Any:
            return torch.empty(0), torch.zeros(0, 3)

    with DataLoader(Empty(6), batch_size=3, num_workers=2) as loader:
        shapes = [(a.shape, b.shape) for a, b in loader]
    assert shapes == [((3, 0), (3, 0, 3))] * 2


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_get_torchs_default_collate_error() -> None:
    class Nested(MapDataset):
        def __getitem__(self, i: int) -> Any:
            return torch.nested.nested_tensor([torch.ones(i + 1), torch.ones(2)])

    for make in (TorchDataLoader, DataLoader):
        loader = make(Nested(4), batch_size=2)
        with pytest.raises(RuntimeError, match="not currently supported by the default collate_fn"):
            list(loader)
        getattr(loader, "close", lambda: None)()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shuffle_without_a_generator_matches_torch_and_leaves_the_same_rng(
    num_workers: int,
) -> None:
    def run(make: Any) -> tuple[list[Any], torch.Tensor]:
        torch.manual_seed(1234)
        loader = make(MapDataset(20, "tensor"), batch_size=5, shuffle=True, num_workers=num_workers)
        batches = [b.tolist() for b in loader]
        after = torch.rand(3)
        getattr(loader, "close", lambda: None)()
        return batches, after

    expected, expected_after = run(TorchDataLoader)
    got, got_after = run(DataLoader)
    assert got == expected
    assert torch.equal(got_after, expected_after)


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


class BreaksMidway(IterableDataset[Any]):
    """Worker 1's stream raises at its third item; worker 0's goes on."""

    def __iter__(self) -> Any:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = 0 if info is None else info.id
        for i in range(6):
            if worker == 1 and i == 2:
                raise KeyError(f"worker {worker} item {i}")
            yield worker * 100 + i


def test_an_error_in_one_workers_stream_ends_that_batch_as_in_torch() -> None:
    expected = _outcomes(TorchDataLoader(BreaksMidway(), batch_size=2, num_workers=2))
    with DataLoader(BreaksMidway(), batch_size=2, num_workers=2) as ours:
        got = _outcomes(ours)
    assert [b if isinstance(b, list) else b[0] for b in got] == [
        b if isinstance(b, list) else b[0] for b in expected
    ]
    assert got[3] == ("KeyError", "'worker 1 item 2'")


def test_an_iterable_dataset_does_not_warn_until_len_was_asked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loader's own use of the length arms nothing
        with DataLoader(ShortStream(), batch_size=1) as loader:
            got = [batch for batch in loader]  # not list(): it asks len(), as it would of torch
            assert len(got) == 5


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


def _shard_in_init(worker_id: int) -> None:
    from torch.utils.data import get_worker_info

    info = get_worker_info()  # answers inside worker_init_fn, as in torch
    dataset = info.dataset
    dataset.start, dataset.end = 10 * info.id, 10 * info.id + 2


class Ranged(IterableDataset[Any]):
    def __init__(self) -> None:
        self.start, self.end = 0, 0

    def __iter__(self) -> Any:
        return iter(range(self.start, self.end))


def test_get_worker_info_answers_inside_worker_init_fn() -> None:
    def run(make: Any) -> list[int]:
        loader = make(Ranged(), batch_size=None, num_workers=2, worker_init_fn=_shard_in_init)
        got = sorted(int(x) for x in loader)
        getattr(loader, "close", lambda: None)()
        return got

    assert run(DataLoader) == run(TorchDataLoader) == [0, 1, 10, 11]


def test_construction_works_while_torch_dataloader_is_patched(monkeypatch: Any) -> None:
    monkeypatch.setattr(torch.utils.data, "DataLoader", DataLoader)  # the usual global drop-in
    many = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 64) + 1
    with pytest.warns(UserWarning, match=f"will create {many} worker processes"):
        DataLoader(MapDataset(4), num_workers=many).close()


@pytest.mark.filterwarnings("ignore:.*Shuffler.*")
def test_an_iter_datapipe_is_sharded_and_reshuffled_across_workers_as_in_torch() -> None:
    from torch.utils.data.datapipes.iter import IterableWrapper

    def run(make: Any, seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        pipe = IterableWrapper(range(40)).shuffle().sharding_filter()
        loader = make(pipe, batch_size=None, num_workers=2)
        got = [[int(x) for x in loader] for _ in range(2)]
        getattr(loader, "close", lambda: None)()
        return got

    ours = run(DataLoader, 1)
    for epoch in ours:
        assert sorted(epoch) == list(range(40))  # each item once: every worker reads its shard
    assert ours[0] != ours[1]  # a fresh shared seed each epoch
    assert run(DataLoader, 1) == ours  # drawn from torch's generator: seeded, repeatable
    assert run(DataLoader, 2) != ours
    assert sorted(run(TorchDataLoader, 1)[0]) == list(range(40))
