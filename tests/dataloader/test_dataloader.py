"""aioloader.DataLoader against torch.utils.data.DataLoader: same batches, same order, same errors."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import threading
import time
import typing
from typing import Any

import pytest
import torch
from support.compare import assert_same
from support.datasets import (
    AsyncDataset,
    GetItemsDataset,
    MapDataset,
    Stream,
    both,
    outcomes,
    seeded,
)
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset, DistributedSampler, SubsetRandomSampler, WeightedRandomSampler

import aioloader
from aioloader import DataLoader, LoaderTimeout

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


def test_getitem_calls_overlap_where_the_dataset_is_thread_safe() -> None:
    """A dataset that declares `thread_safe = True` is read in threads, calls at the same time
    (torch with 0 workers: one at a time; without the declaration, here too)."""
    barrier = threading.Barrier(4, timeout=10)

    class Blocking(MapDataset):
        thread_safe = True

        def __getitem__(self, i: int) -> Any:
            barrier.wait()  # only passes when 4 calls are in flight together
            return super().__getitem__(i)

    with DataLoader(Blocking(8), batch_size=4, concurrency=4) as ours:
        assert len(list(ours)) == 2


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
        thread_safe = True  # read side by side: both keys in flight

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


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_error_ends_its_batch_and_the_next_call_goes_on(num_workers: int) -> None:
    dataset = FailsAt(bad=(5, 9))
    expected = outcomes(TorchDataLoader(dataset, batch_size=2, num_workers=num_workers))
    with DataLoader(dataset, batch_size=2, num_workers=num_workers) as ours:
        got = outcomes(ours)
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


def _every_error() -> list[type[BaseException]]:
    import aioloader.sources.formats.parquet_bytes  # its ParquetError

    found, todo = [], [aioloader.AioloaderError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__qualname__)


@pytest.mark.parametrize("cls", _every_error(), ids=lambda c: c.__qualname__)
def test_every_error_survives_pickling_and_rebuilding_from_its_message(
    cls: type[BaseException],
) -> None:  # a worker's error, rebuilt in the parent (or in the trainer, beside it)
    exc = cls("what happened")
    for again in (pickle.loads(pickle.dumps(exc)), type(exc)(str(exc))):
        assert type(again) is cls
        assert str(again) == "what happened"
    died = aioloader.WorkerDied("gone", pid=12, exitcode=-9, tasks=[3])
    assert pickle.loads(pickle.dumps(died)).__dict__ == died.__dict__


def test_the_class_is_generic() -> None:
    typed = DataLoader[list[torch.Tensor]]
    assert typing.get_origin(typed) is DataLoader


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


def test_construction_works_while_torch_dataloader_is_patched(monkeypatch: Any) -> None:
    monkeypatch.setattr(torch.utils.data, "DataLoader", DataLoader)  # the usual global drop-in
    many = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 64) + 1
    with pytest.warns(UserWarning, match=f"will create {many} worker processes"):
        DataLoader(MapDataset(4), num_workers=many).close()
