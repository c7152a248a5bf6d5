"""aioloader.DataLoader against torch.utils.data.DataLoader: same batches, same order, same errors."""

from __future__ import annotations

import asyncio
import threading
import time
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
    assert "timeout=0.2" in str(err.value)


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
