"""`aioloader.DataLoader(num_workers=N)`: the dataset read in N worker processes, as torch does.

The callables here are sent once to each worker of a `ProcessExecutor` (they pickle the dataset).
Inside a worker, `torch.utils.data.get_worker_info()` answers as it does in torch's workers (id,
num_workers, seed, dataset), so sharding code written for torch's DataLoader keeps working; the
worker's torch and `random` generators are seeded from the loader's base seed plus the worker id.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data._utils import worker as torch_worker

from ._exceptions import StateError
from ._order import Group
from ._pipeline import Gap
from ._procpool import ProcessExecutor
from ._ranges import Ranges

__all__ = [
    "Exhausted", "ReadBatch", "ReadItem", "ReadStream", "StreamExecutor", "WorkerSetup",
    "WorkerStreams",
]  # fmt: skip

_worker: dict[str, int] = {}  # in a worker process: its id, the number of workers, its seed


class WorkerSetup:
    """`worker_init_fn` of the process pool: seeds the worker, then calls the user's hook."""

    def __init__(
        self, num_workers: int, base_seed: int, user_fn: Callable[[int], Any] | None
    ) -> None:
        self.num_workers, self.base_seed, self.user_fn = num_workers, base_seed, user_fn

    def __call__(self, worker_id: int) -> None:
        seed = (self.base_seed + worker_id) % 2**63
        _worker.update(id=worker_id, num_workers=self.num_workers, seed=seed)
        torch.manual_seed(seed)
        random.seed(seed)
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _publish(dataset: Any) -> None:
    """Make `get_worker_info()` describe this worker, with the dataset the reads run on."""
    if _worker and torch_worker._worker_info is None:
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=_worker["id"], num_workers=_worker["num_workers"], seed=_worker["seed"],
            dataset=dataset,
        )  # fmt: skip


class ReadItem:
    """index -> `dataset[index]` (then `convert`, torch's per-sample collate_fn without batching)."""

    def __init__(self, dataset: Any, convert: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.convert = dataset, convert

    def __call__(self, index: Any) -> Any:
        _publish(self.dataset)
        item = self.dataset[index]
        return item if self.convert is None else self.convert(item)


class ReadBatch:
    """indices -> `collate(dataset.__getitems__(indices))`, one call per batch as torch makes it."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        self.dataset, self.collate = dataset, collate

    def __call__(self, indices: list[Any]) -> Any:
        _publish(self.dataset)
        return self.collate(self.dataset.__getitems__(indices))


class Exhausted(Gap):
    """What a worker answers for a batch past the end of its replica's stream (no batch at all)."""


class _Stream:
    """One worker's pass over its replica of an IterableDataset, batch by batch."""

    def __init__(self, items: Iterator[Any], epoch: int) -> None:
        self.items, self.epoch = items, epoch
        self.made = 0  # batches taken from `items` so far (Exhausted ones included)
        self.ahead: dict[int, Any] = {}  # made before they were asked for
        self.ended = False


# Batches made before they were asked for that a worker keeps: requests overtake each other by
# fewer than this. One asked for later than that is made again from a fresh iterator (slow, right).
_AHEAD_MAX = 64
_streams: dict[str, _Stream] = {}  # in a worker: a DataLoader's token -> this epoch's stream


class ReadStream:
    """(epoch, n) -> batch n of this worker's replica of an IterableDataset, or `Exhausted`.

    torch's rules: each worker iterates its own copy of the dataset (sharding by
    `get_worker_info()` is the dataset's business) and makes batches of `batch_size` consecutive
    items with `collate` (drop_last drops a short last batch); without a batch size each item is
    `collate`d alone. The parent asks every worker for its batches in order, but requests may
    arrive out of order or again after the worker was replaced: a batch asked for early is made
    (and kept) in turn, and a new worker, or a new epoch, starts a fresh iterator and skips to n.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None,
        drop_last: bool,
        collate: Callable[[Any], Any],
        token: str,
    ) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.collate, self.token = collate, token

    def __call__(self, key: tuple[int, int]) -> Any:
        epoch, n = key
        _publish(self.dataset)
        stream = _streams.get(self.token)
        if stream is None or stream.epoch != epoch or (n < stream.made and n not in stream.ahead):
            stream = _streams[self.token] = _Stream(iter(self.dataset), epoch)
        if n in stream.ahead:
            return stream.ahead.pop(n)
        while True:
            batch, m = self._next(stream), stream.made
            stream.made += 1
            if m == n:
                return batch
            if n - m <= _AHEAD_MAX:
                stream.ahead[m] = batch

    def _next(self, stream: _Stream) -> Any:
        if stream.ended:
            return Exhausted()
        if self.batch_size is None:
            try:
                return self.collate(next(stream.items))
            except StopIteration:
                stream.ended = True
                return Exhausted()
        items = list(itertools.islice(stream.items, self.batch_size))
        if len(items) < self.batch_size:
            stream.ended = True
            if not items or self.drop_last:
                return Exhausted()
        return self.collate(items)


# -- the parent's side of an IterableDataset read in workers ------------------------------------------


class WorkerStreams:
    """The plan of an IterableDataset read in `workers` processes: one key `(worker, epoch, n)` per
    batch, round robin over the workers whose stream has not ended, which is the order torch's
    DataLoader takes batches from its workers in. `StreamExecutor` marks a worker ended when it
    answers `Exhausted`; keys asked of it after its end come back as gaps and are dropped."""

    group_size = 1

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.ended: set[int] = set()

    def groups(self, epoch: int, consumed: Ranges) -> Iterable[Group]:
        return self._groups(epoch, consumed)

    def _groups(self, epoch: int, consumed: Ranges) -> Iterator[Group]:
        if consumed:
            raise StateError(
                "states: an IterableDataset read in worker processes cannot resume mid-epoch",
                field="consumed",
            )
        self.ended = set()
        index = 0
        for n in itertools.count():
            live = [w for w in range(self.workers) if w not in self.ended]
            if not live:
                return
            for worker in live:
                if worker not in self.ended:
                    yield Group(index, [(index, (worker, epoch, n))], False)
                    index += 1

    def __len__(self) -> int:
        raise TypeError("an IterableDataset has no length")

    def rank_and_world(self) -> tuple[int, int]:
        return 0, 1

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        pass

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Ranges) -> list[int]:
        raise StateError(
            "states: an IterableDataset read in worker processes has no elastic resume",
            field="world_size",
        )


class StreamExecutor:
    """Sends each `(worker, epoch, n)` to that worker of `pool`, and tells `plan` which ended."""

    def __init__(self, pool: ProcessExecutor, plan: WorkerStreams) -> None:
        self.pool, self.plan = pool, plan
        self.workers = pool.workers

    async def run(self, fn: Callable[[Any], Any], key: Any, seed: int | None = None) -> Any:
        worker, epoch, n = key
        result = await asyncio.wrap_future(self.pool.submit(fn, (epoch, n), seed, worker=worker))
        if isinstance(result, Exhausted):
            self.plan.ended.add(worker)
        return result

    def stats(self) -> dict[str, int]:
        return self.pool.stats()

    def close(self) -> None:
        self.pool.close()
