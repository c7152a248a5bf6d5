"""An IterableDataset read in worker processes, as torch does: a replica per worker, batches by turns."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import graph_settings

from .._exceptions import StateError
from .._executors.process.executor import ProcessExecutor
from .._pipeline.order import Group
from .._pipeline.stages import Gap
from .._util.ranges import Ranges
from .sampler import rng_restore, rng_snapshot
from .stateful import OwnStates, Stamped, own_state, start_iter, take
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

    def __call__(self, key: tuple[int, int, int | None, dict[str, Any] | None]) -> Any:
        epoch, n, pipe_seed, restore = key
        publish(self.dataset)
        stream = _streams.get(self.token)
        if (
            restore is not None or stream is None or stream.epoch != epoch
            or (n < stream.made and n not in stream.ahead)
        ):  # fmt: skip
            if pipe_seed is not None:  # a datapipe's random ops, from the epoch's shared seed
                graph_settings.apply_random_seed(
                    self.dataset, torch.Generator().manual_seed(pipe_seed)
                )
            stream = _streams[self.token] = _Stream(start_iter(self.dataset, restore), epoch)
            if restore and (restore.get("dataset") is not None or restore.get("iter") is not None):
                stream.made = n  # the state saved stands at batch n: nothing is made again
        if n in stream.ahead:
            return stream.ahead.pop(n)
        while True:
            batch, m = self._stamped(stream), stream.made
            stream.made += 1
            if m == n:
                return batch
            if n - m <= _AHEAD_MAX:
                stream.ahead[m] = batch

    def _stamped(self, stream: _Stream) -> Any:
        """The stream's next batch, with the state the dataset (or its iterator) has after it
        where it keeps one of its own (`Stamped`)."""
        batch = self._next(stream)
        # (at its end too: what the next epoch starts from)
        state = own_state(self.dataset, stream.items, worker=True)
        return Stamped(batch, state) if state else batch

    def _next(self, stream: _Stream) -> Any:
        if stream.ended:
            return Exhausted()
        if self.batch_size is None:
            try:
                return collate_here(self.collate, next(stream.items))
            except StopIteration:
                stream.ended = True
                return Exhausted()
        items = take(stream.items, self.batch_size)
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

    def __init__(self, workers: int, own: OwnStates, generator: torch.Generator | None) -> None:
        self.workers, self.own = workers, own
        self.generator = generator  # the epoch's seeds are drawn from it (None: torch's own)
        self.ended: set[int] = set()
        self.pipe_seed: int | None = None  # an IterDataPipe's shared seed for this epoch

    def groups(self, epoch: int, consumed: Ranges) -> Iterable[Group]:
        if consumed:
            raise StateError(
                "states: an IterableDataset read in worker processes cannot resume on another "
                "world size",
                field="consumed",
            )
        return self._groups(epoch, self.own.begin(epoch))

    def _groups(self, epoch: int, resume: dict[str, Any] | None) -> Iterator[Group]:
        """Round robin from the resume's turn, each worker from its batch number (`OwnStates`
        records them as batches are handed over): a resumed worker is sent its state (or {}, to
        run its stream from the start to that number) with its first batch."""
        self.ended = set()
        made = [0] * self.workers
        restores: dict[int, dict[str, Any]] = {}
        index, turn = 0, 0
        if resume is not None:
            index, turn = int(resume.get("next", 0)), int(resume.get("turn", 0))
            for w, entry in resume.get("workers", {}).items():
                worker = int(w)
                if entry.get("ended"):
                    self.ended.add(worker)
                made[worker] = int(entry.get("n", 0))
                restores[worker] = {
                    k: v for k, v in entry.items() if k in ("dataset", "iter", "rng")
                }
            for worker in range(self.workers):
                restores.setdefault(worker, {})  # fresh streams, whatever a live worker had
        while True:
            if len(self.ended) >= self.workers:
                return
            for k in range(self.workers):
                worker = (turn + k) % self.workers
                if worker in self.ended:
                    continue
                key = (
                    worker,
                    epoch,
                    made[worker],
                    self.pipe_seed,
                    index,
                    restores.pop(worker, None),
                )
                yield Group(index, [(index, key)], False)
                made[worker] += 1
                index += 1

    def __len__(self) -> int:
        raise TypeError("an IterableDataset has no length")

    def rank_and_world(self) -> tuple[int, int]:
        return 0, 1

    def snapshot(self) -> dict[str, Any]:
        """The random state the epoch's seeds will be drawn from, so a resume can redraw them."""
        return rng_snapshot(self.generator)

    def restore(self, state: Mapping[str, Any]) -> None:
        rng_restore(self.generator, state)

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
        worker, epoch, n, pipe_seed, index, restore = key
        result = await self.pool.run(fn, (epoch, n, pipe_seed, restore), seed, worker=worker)
        turn = (worker + 1) % self.workers
        state: dict[str, Any] = {}
        if type(result) is Stamped:
            result, state = result.batch, result.state
        if isinstance(result, Exhausted):
            self.plan.ended.add(worker)
            self.plan.own.record(index, worker=(worker, {"ended": True, **state}), turn=turn)
        else:
            self.plan.own.record(index, worker=(worker, {"n": n + 1, **state}), turn=turn)
        return result

    def stats(self) -> dict[str, int]:
        return self.pool.stats()

    def close(self) -> None:
        self.pool.close()
