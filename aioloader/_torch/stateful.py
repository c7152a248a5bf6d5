"""A dataset's and a sampler's own state, saved and restored with a DataLoader's (torchdata's contract).

A dataset, its iterator or a sampler that has `state_dict()` and `load_state_dict()` (torchdata's
`Stateful`) is asked for its state as each batch is made, where it is made: the sampler as it draws
the batch's indices, a dataset in the process that reads it (a worker, or this one with
`num_workers=0`). The state travels with the batch (`Stamped`, out of a worker), and `OwnStates`
keeps the states as of the last batch handed over, never one made ahead; `DataLoader.state_dict()`
saves them under "own_states". A resume loads each state where it was taken, before that reader's
next batch, and the sampler or the stream goes on from there, not from the epoch's start:

- a stateful sampler (or its iterator) is restored and draws the rest of the epoch (torch's
  `BatchSampler` around one is batched here, so that its inner sampler's state is the one kept);
- a map-style dataset's state goes to the worker that reads the next batch of its share (batch i is
  worker i % N's), or into the dataset here;
- an IterableDataset's stream, in each worker (or here), starts again from the state (the
  dataset's, then its iterator's after `iter()`) at the batch number it had reached; a stream
  without a state of its own is run from its start and its batches before that number dropped.

What is kept between epochs is what the uninterrupted run keeps: the dataset in this process
always, in the workers only with `persistent_workers` (fresh workers fork from the dataset as it
is here); a sampler starts each epoch from its own state (taken at the epoch's end).
"""

from __future__ import annotations

import base64
import itertools
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._exceptions import NumWorkersChanged, StateError
from .._pipeline.order import Group

__all__ = [
    "OwnItems",
    "OwnStates",
    "ReadOwn",
    "Stamped",
    "batches",
    "holds_states",
    "own_state",
    "restore_into",
    "start_iter",
    "stateful",
    "take",
]  # fmt: skip


def stateful(obj: Any) -> bool:
    """Whether `obj` saves and loads a state of its own (torchdata's `Stateful`)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def own_state(dataset: Any, it: Any = None, worker: bool = False) -> dict[str, Any]:
    """{"dataset": its state, "iter": its iterator's}, each where it has one (a dataset that is
    its own iterator is saved as one: its state is loaded after `iter()`); in a worker
    process (`worker`), where it has either, "rng" too: the worker's random generators (torch's,
    `random`'s, numpy's), which a persistent worker carries on with into its next epoch."""
    state: dict[str, Any] = {}
    if stateful(dataset) and it is not dataset:  # (one that is its own iterator: as an iterator)
        state["dataset"] = dataset.state_dict()
    if it is not None and stateful(it):
        state["iter"] = it.state_dict()
    if worker and state:
        state["rng"] = _rng_state()
    return state


def _rng_state() -> dict[str, Any]:
    """This process's random generators' states, JSON-ready (as a state's other fields may be)."""
    version, internal, gauss = random.getstate()
    numpy = np.random.get_state(legacy=False)
    return {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "random": [version, list(internal), gauss],
        "numpy": {**numpy, "state": {**numpy["state"], "key": numpy["state"]["key"].tolist()}},
    }


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    raw = bytearray(base64.b64decode(rng["torch"]))
    torch.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8))
    version, internal, gauss = rng["random"]
    random.setstate((version, tuple(internal), gauss))
    numpy = rng["numpy"]
    key = np.asarray(numpy["state"]["key"], dtype=np.uint32)
    np.random.set_state({**numpy, "state": {**numpy["state"], "key": key}})


def restore_into(dataset: Any, state: Mapping[str, Any] | None) -> None:
    """Load a dataset's saved state (from `own_state`) into it, where it has one, and a worker's
    random generators where they were saved."""
    if not state:
        return
    rng = state.get("rng")
    if rng is not None:
        _set_rng_state(rng)
    if state.get("dataset") is not None and stateful(dataset):
        dataset.load_state_dict(state["dataset"])


def start_iter(dataset: Any, state: Mapping[str, Any] | None) -> Iterator[Any]:
    """`iter(dataset)` after its state is loaded, its iterator's state loaded after."""
    restore_into(dataset, state)
    it: Iterator[Any] = iter(dataset)
    if state and state.get("iter") is not None and stateful(it):
        it.load_state_dict(state["iter"])  # type: ignore[attr-defined]
    return it


def holds_states(own: Mapping[str, Any]) -> bool:
    """Whether saved own states (`OwnStates.saved`) hold a sampler's, a dataset's or an
    iterator's state (not only the places of streams without one)."""
    workers = own.get("workers") or {}
    return bool(
        own.get("sampler") or own.get("main")
        or any(set(w) & {"dataset", "iter"} for w in workers.values())
    )  # fmt: skip


def take(it: Iterator[Any], n: int) -> list[Any]:
    """Up to `n` items of `it`, by `next()` alone: `iter()` again on an iterator that is its
    dataset may start it over (as `islice` would call it)."""
    items: list[Any] = []
    for _ in range(n):
        try:
            items.append(next(it))
        except StopIteration:
            break
    return items


def batches(it: Iterator[Any], size: int, drop_last: bool) -> Iterator[list[Any]]:
    """`it` cut into lists of `size` items (by `take`), the short last one dropped with
    `drop_last`, as torch's `BatchSampler` and its IterableDataset fetcher cut them."""
    while True:
        items = take(it, size)
        if not items or (drop_last and len(items) < size):
            return
        yield items


def _dataset_only(state: dict[str, Any] | None) -> dict[str, Any] | None:
    """What of a reader's state goes on into its next epoch: not its iterator's, nor its place."""
    kept = {k: v for k, v in (state or {}).items() if k in ("dataset", "rng") and v is not None}
    return kept or None


@dataclass
class Stamped:
    """A batch made in a worker with its reader's state after making it (`own_state`)."""

    batch: Any
    state: dict[str, Any]


class OwnStates:
    """The own states of a DataLoader's sampler and dataset as of the last batch handed over.

    The parts that make batches `record(index, ...)` what making batch `index` left (from any
    thread); the consumer's side says which batches were handed over (`passed`, skipped ones too);
    the states of the batches up to the first one not yet handed over are the ones kept. A loaded
    state waits in `resume` until the plan of its epoch takes it (`begin`).
    """

    def __init__(self, workers: int, persistent: bool) -> None:
        self.workers, self.persistent = workers, persistent
        self._lock = threading.Lock()
        self._made: dict[int, dict[str, Any]] = {}  # batch index -> what making it recorded
        self._passed: set[int] = set()  # handed over, past `_last`
        self._last = -1  # every batch up to this one was handed over
        self._epoch = 0
        self.sampler: dict[str, Any] | None = None  # {"sampler": ..., "iter": ...}
        self.main: dict[str, Any] | None = None  # the dataset's in this process
        self.per_worker: dict[int, dict[str, Any]] = {}  # worker -> {"dataset", "iter", "n", ...}
        self.turn = 0  # the worker the next batch of a stream is asked of
        self.base_seed: int | None = None  # the workers' seeds were drawn from it
        self._resume: dict[str, Any] | None = None  # loaded, for its epoch's plan
        self.loaded = False  # a state was loaded since the workers last started
        self.strict_workers = False  # refuse any other num_workers (torchdata's contract)
        self._refused: StateError | None = None  # raised when the loaded state's epoch begins

    # -- the epoch's plan ----------------------------------------------------------------------------

    def begin(self, epoch: int) -> dict[str, Any] | None:
        """The epoch's plan starts: what a loaded state says of it (None: from its start, with
        what the uninterrupted run keeps between epochs)."""
        with self._lock:
            refused, self._refused = self._refused, None
            if refused is not None:
                raise refused
            resume, self._resume = self._resume, None
            if resume is not None and int(resume.get("epoch", -1)) != epoch:
                resume = None
            self._epoch = epoch
            self._made.clear()
            self._passed.clear()
            if resume is None:
                self._last, self.turn = -1, 0
                if not self.persistent:
                    self.per_worker = {}
                # (the sampler's state at the epoch's end stays: the next epoch starts from it)
                return None
            self._last = int(resume.get("next", 0)) - 1
            self.turn = int(resume.get("turn", 0))
            self.sampler = resume.get("sampler")
            self.main = resume.get("main")
            self.per_worker = {int(w): dict(s) for w, s in resume.get("workers", {}).items()}
            return resume

    def record(self, index: int, **made: Any) -> None:
        """What making batch `index` left: `sampler=`, `main=` (the states), `worker=(w, entry)`
        (a worker's entry updated), `turn=` (a stream's next worker)."""
        with self._lock:
            if index <= self._last:  # (handed over already: a plan records as it draws)
                self._apply(made)
                return
            self._made.setdefault(index, {}).update(made)

    def passed(self, index: int) -> None:
        """Batch `index` was handed over (or skipped), in the consumer's thread."""
        with self._lock:
            self._passed.add(index)
            while self._last + 1 in self._passed:
                self._last += 1
                self._passed.discard(self._last)
                made = self._made.pop(self._last, None)
                if made:
                    self._apply(made)

    def _apply(self, made: dict[str, Any]) -> None:
        for name, value in made.items():
            if name == "worker":
                worker, entry = value
                self.per_worker.setdefault(worker, {}).update(entry)
            else:
                setattr(self, name, value)

    def ended(self, sampler_state: dict[str, Any] | None) -> None:
        """The epoch was handed over whole: the next starts afresh (`sampler_state`: the
        sampler's own state now, for the next epoch to start from)."""
        with self._lock:
            for index in sorted(self._made):  # (what ending the streams left: their last states)
                self._apply(self._made[index])
            self._made.clear()
            self._passed.clear()
            self._last, self.turn, self.sampler = -1, 0, sampler_state
            self._epoch += 1
            # the next epoch's iterators are new ones: what goes on is the datasets' own states,
            # here, and in the workers where they persist
            self.main = _dataset_only(self.main)
            self.per_worker = {
                w: kept for w, s in self.per_worker.items() if (kept := _dataset_only(s))
            } if self.persistent else {}  # fmt: skip
            if not self.persistent:
                self.base_seed = None  # the next epoch's workers are new, seeded from a new draw

    # -- saved and loaded ----------------------------------------------------------------------------

    def saved(self) -> dict[str, Any]:
        with self._lock:
            return {
                "epoch": self._epoch, "next": self._last + 1, "num_workers": self.workers,
                "sampler": self.sampler, "main": self.main, "turn": self.turn,
                "workers": {str(w): dict(s) for w, s in self.per_worker.items()},
                "base_seed": self.base_seed,
            }  # fmt: skip

    def load(self, state: Mapping[str, Any] | None) -> None:
        """Take a loaded state (None: another world size, or one saved without own states) for
        the plan of its epoch; StateError where it cannot be kept with this many workers."""
        with self._lock:
            self.loaded = True
            if state is None:
                self._resume = None
                return
            saved = dict(state)
            workers = int(saved.get("num_workers", self.workers))
            if workers != self.workers and self.strict_workers:
                self._refused = NumWorkersChanged(
                    f"num_workers: the state was saved with num_workers={workers}, this "
                    f"StatefulDataLoader has num_workers={self.workers}",
                    field="num_workers",
                )
                return
            mid_stream = saved.get("workers") or (saved.get("main") is not None)
            if workers != self.workers and mid_stream:
                raise StateError(
                    f"num_workers: the state was saved with num_workers={workers}, whose "
                    f"dataset states (or stream positions) do not carry over to "
                    f"num_workers={self.workers}",
                    field="num_workers",
                )
            self._resume = saved
            self.base_seed = saved.get("base_seed")


class OwnItems:
    """The plan of an IterableDataset read in this process (`num_workers=0`, or threads as
    workers): its items are the keys, `batch_size` to a batch (None: one item, unbatched), and the
    state the dataset (or its iterator) has after each batch's items were taken is recorded. A
    resume starts a fresh iterator from the state saved and goes on at the batch number it had
    reached; a dataset with no state of its own is iterated from its start, and the batches before
    that number are dropped (torch's fast-forward)."""

    def __init__(
        self, dataset: Any, batch_size: int | None, drop_last: bool, own: OwnStates
    ) -> None:
        self.dataset, self.own = dataset, own
        self.batch_size, self.drop_last = batch_size, drop_last
        self.group_size = batch_size or 1

    def groups(self, epoch: int, consumed: Any) -> Iterator[Group]:
        if consumed:
            raise StateError(
                "states: an IterableDataset cannot resume on another world size", field="consumed"
            )
        resume = self.own.begin(epoch)
        main = resume.get("main") if resume is not None else None
        first = int(resume.get("next", 0)) if resume is not None else 0
        it = start_iter(self.dataset, main)
        if resume is None:  # before the first batch: the state it starts from
            self.own.record(-1, main=own_state(self.dataset, it) or None)
        if not (main and (main.get("dataset") is not None or main.get("iter") is not None)):
            # no state of its own to start from: run it from its start, dropping what was handed
            for _ in itertools.islice(batches(it, self.group_size, self.drop_last), first):
                pass
        return self._groups(it, first)

    def _groups(self, it: Iterator[Any], first: int) -> Iterator[Group]:
        batched = self.batch_size is not None
        index = first
        for index, items in enumerate(batches(it, self.group_size, self.drop_last), first):
            self.own.record(index, main=own_state(self.dataset, it))
            yield Group(index, [(index, item) for item in items], batched)
        self.own.record(index + 1, main=own_state(self.dataset, it))  # (its state at the end)

    def __len__(self) -> int:
        raise TypeError("an IterableDataset has no length")

    def rank_and_world(self) -> tuple[int, int]:
        return 0, 1

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, state: Mapping[str, Any]) -> None:
        pass

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Any) -> list[int]:
        raise StateError(
            "states: an IterableDataset has no resume on another world size", field="world_size"
        )


class ReadOwn:
    """(batch number, indices[, state]) -> the batch, for a map-style dataset with a state of its
    own read in this process, one batch at a time: the state given is loaded first (a resume),
    and the dataset's state after the batch is recorded under its number. `collate` makes the
    batch of the samples; unbatched (`batched` False), `collate` converts the one sample."""

    def __init__(
        self, dataset: Any, collate: Callable[[Any], Any], batched: bool, own: OwnStates
    ) -> None:
        self.dataset, self.collate, self.batched, self.own = dataset, collate, batched, own

    def __call__(self, key: tuple[Any, ...]) -> Any:
        number, indices, *restore = key
        if restore:
            restore_into(self.dataset, restore[0])
        if not self.batched:
            batch = self.collate(self.dataset[indices])
        else:
            getitems = getattr(self.dataset, "__getitems__", None)
            samples = getitems(indices) if getitems else [self.dataset[i] for i in indices]
            batch = self.collate(samples)
        self.own.record(number, main=own_state(self.dataset))
        return batch
