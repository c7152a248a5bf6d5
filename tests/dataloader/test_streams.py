"""An IterableDataset in DataLoader's worker processes (`_torch/streams.py`): iterated in each
worker as torch does, sharded in worker_init_fn, errors keeping their type and ending their batch."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from support.compare import assert_same
from support.datasets import outcomes
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset

from aioloader import DataLoader


class ShardedStream(IterableDataset[Any]):
    """Worker w of n yields items w, w + n, ... (all of them in the main process), plus its pid;
    `uneven` makes worker 0's share much longer than the others'."""

    def __init__(self, n: int = 17, uneven: bool = False) -> None:
        self.n, self.uneven = n, uneven

    def __iter__(self) -> Any:

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
    expected = outcomes(TorchDataLoader(BreaksMidway(), batch_size=2, num_workers=2))
    with DataLoader(BreaksMidway(), batch_size=2, num_workers=2) as ours:
        got = outcomes(ours)
    assert [b if isinstance(b, list) else b[0] for b in got] == [
        b if isinstance(b, list) else b[0] for b in expected
    ]
    assert got[3] == ("KeyError", "'worker 1 item 2'")


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
