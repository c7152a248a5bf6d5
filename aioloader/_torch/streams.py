"""An IterableDataset read in worker processes, as torch does: a replica per worker, batches by turns."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import graph_settings

from .._exceptions import StateError
from .._executors.process.executor import ProcessExecutor
from .._pipeline.order import Group
from .._pipeline.stages import Gap
from .._util.ranges import Ranges
from .workers import collate_here, keep_freed_memory, publish

__all__ = ["Exhausted", "ReadStream", "StreamExecutor", "WorkerStreams"]


# Batches made before they were asked for that a worker keeps: requests overtake each other by
# fewer than this. One asked for later than that is made again from a fresh iterator (slow, right).
_AHEAD_MAX = 64
_streams: dict[str, _Stream] = {}  # in a worker: a DataLoader's token -> this epoch's stream


class Exhausted(Gap):
    """What a worker answers for a batch past the end of its replica's stream (no batch at all)."""


class _Stream:
    """One worker's pass over its replica of an IterableDataset, batch by batch."""

    def __init__(self, items: Iterator[Any], epoch: int) -> None:
        self.items, self.epoch = items, epoch
        self.made = 0  # batches taken from `items` so far (Exhausted ones included)
        self.ahead: dict[int, Any] = {}  # made before they were asked for
        self.ended = False


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
        collate: Callable[[Any], Any] | None,
        token: str,
    ) -> None:
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.collate, self.token = collate, token  # collate None: the default (`collate_here`)

    def __call__(self, key: tuple[int, int, int | None]) -> Any:
        epoch, n, pipe_seed = key
        publish(self.dataset)
        stream = _streams.get(self.token)
        if stream is None or stream.epoch != epoch or (n < stream.made and n not in stream.ahead):
            if pipe_seed is not None:  # a datapipe's random ops, from the epoch's shared seed
                graph_settings.apply_random_seed(
                    self.dataset, torch.Generator().manual_seed(pipe_seed)
                )
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
                return collate_here(self.collate, next(stream.items))
            except StopIteration:
                stream.ended = True
                return Exhausted()
        items = list(itertools.islice(stream.items, self.batch_size))
        if len(items) < self.batch_size:
            stream.ended = True
            if not items or self.drop_last:
                return Exhausted()
        keep_freed_memory(items)
        return collate_here(self.collate, items)


class WorkerStreams:
    """The plan of an IterableDataset read in `workers` processes: one key `(worker, epoch, n,
    seed)` per batch, round robin over the workers whose stream has not ended, which is the order torch's
    DataLoader takes batches from its workers in. `StreamExecutor` marks a worker ended when it
    answers `Exhausted`; keys asked of it after its end come back as gaps and are dropped."""

    group_size = 1

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.ended: set[int] = set()
        self.pipe_seed: int | None = None  # an IterDataPipe's shared seed for this epoch

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
                    yield Group(index, [(index, (worker, epoch, n, self.pipe_seed))], False)
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
    """Sends each `(worker, epoch, n, seed)` to that worker of `pool`, and tells `plan` which ended
    (`seed`: an IterDataPipe's shared seed for the epoch, else None)."""

    def __init__(self, pool: ProcessExecutor, plan: WorkerStreams) -> None:
        self.pool, self.plan = pool, plan
        self.workers = pool.workers

    async def run(self, fn: Callable[[Any], Any], key: Any, seed: int | None = None) -> Any:
        worker, epoch, n, pipe_seed = key
        result = await self.pool.run(fn, (epoch, n, pipe_seed), seed, worker=worker)
        if isinstance(result, Exhausted):
            self.plan.ended.add(worker)
        return result

    def stats(self) -> dict[str, int]:
        return self.pool.stats()

    def close(self) -> None:
        self.pool.close()
