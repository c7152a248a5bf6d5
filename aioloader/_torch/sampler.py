"""A torch sampler (or batch sampler) as the order stage's plan: its groups, length and saved state."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DistributedSampler

from .._exceptions import StateError
from .._pipeline.order import Group, shard
from .._protocol import HasSetEpoch
from .._util.ranges import Ranges
from .stateful import OwnStates, batches, stateful

__all__ = ["SamplerPlan", "draw_seed", "rng_restore", "rng_snapshot"]


class SamplerPlan:
    """Groups of a map-style dataset as torch's DataLoader forms them: from its (batch) sampler.

    Each epoch draws one int64 from `generator` before the sampler runs, as torch's iterator does, so
    that a shared generator is consumed identically and the shuffles match torch's.
    """

    def __init__(
        self,
        index_sampler: Iterable[Any],
        batched: bool,
        generator: torch.Generator | None,
        own: OwnStates | None = None,
        readers: int = 1,
    ) -> None:
        self.index_sampler = index_sampler
        self.batched = batched
        self.generator = generator
        # the own states of the sampler and of the `readers` (batch i is read by i % readers) that
        # are saved with the loader's, and a resume's restored (see `stateful.py`)
        self.own, self.readers = own, readers
        self.batch_len = getattr(index_sampler, "batch_size", None) or 1
        self.group_size = self.batch_len  # samples per group, as the pipeline counts them
        self.base_seed: int | None = None  # drawn for each epoch, as torch's iterator draws it
        self.reads_batches = False  # each key is a whole batch's indices (see `read_batches`)
        self.numbered = False  # ... as `(batch number, indices)` (`ReadSamples` in workers)

    def read_batches(self, numbered: bool = False) -> None:
        """Make each key a whole batch's indices, read as one sample (so a group is one)."""
        self.reads_batches, self.numbered, self.group_size = True, numbered, 1

    def groups(self, epoch: int, consumed: Ranges) -> Iterable[Group]:
        self.base_seed = draw_seed(self.generator)
        resume = self.own.begin(epoch) if self.own is not None else None
        if consumed:
            return self._number(iter(self._remainder(consumed)))
        if self.own is None:
            indices = iter(self.index_sampler)
            first = list(itertools.islice(indices, 1))  # draw the sampler's seed on this thread
            return self._number(itertools.chain(first, indices))
        return self._own_groups(resume)

    def _own_groups(self, resume: dict[str, Any] | None) -> Iterator[Group]:
        """The groups where the sampler's own state and the readers' are kept: the sampler (the
        one inside torch's BatchSampler, whose batches are cut here as it cuts them) goes on from
        a resume's state when it has one of its own; each reader is given its state with its
        first batch from the resume on."""
        own, target = self.own, self._sampler()
        cut = type(self.index_sampler) is BatchSampler
        if not cut:
            target = self.index_sampler
        assert own is not None
        saved = resume.get("sampler") if resume is not None else None
        if saved and saved.get("sampler") is not None and stateful(target):
            target.load_state_dict(saved["sampler"])
        elif resume is None and stateful(target):
            own.record(-1, sampler={"sampler": target.state_dict()})  # (the epoch's start)
        it = iter(target)
        if saved and saved.get("iter") is not None and stateful(it):
            it.load_state_dict(saved["iter"])
        keep = stateful(it) or stateful(target)
        after = int(resume.get("next", 0)) if resume is not None else 0  # the resume's first batch
        first = after if saved and keep else 0  # from its state: no batch drawn again
        restores: dict[int, Any] = {}
        if resume is not None:
            if resume.get("main") is not None and after > 0:
                restores[0] = resume["main"]  # (at an epoch's start it was loaded with the state)
            for worker, state in resume.get("workers", {}).items():
                restores[int(worker)] = state
        sampler: Any = self.index_sampler
        draws = batches(it, sampler.batch_size, sampler.drop_last) if cut else it
        head = list(itertools.islice(draws, 1))  # the sampler's own seed, drawn on this thread
        for i, index in enumerate(itertools.chain(head, draws), first):
            if keep:
                own.record(i, sampler={
                    "sampler": target.state_dict() if stateful(target) else None,
                    "iter": it.state_dict() if stateful(it) else None,
                })  # fmt: skip
            if self.batched and not self.numbered:
                yield Group(i, [(i, j) for j in index], True)
                continue
            key: tuple[Any, ...] = (i, index)
            if restores and i >= after and i % self.readers in restores:
                key = (i, index, restores.pop(i % self.readers))
            yield Group(i, [(i, key if self.numbered else index)], False)

    def sampler_state(self) -> dict[str, Any] | None:
        """The sampler's own state now (at an epoch's end: where the next one starts from)."""
        target: Any = self.index_sampler
        if type(target) is BatchSampler:
            target = self._sampler()
        return {"sampler": target.state_dict()} if stateful(target) else None

    def _number(self, indices: Iterator[Any]) -> Iterator[Group]:
        for i, index in enumerate(indices):
            if self.batched:
                yield Group(i, [(i, j) for j in index], True)
            else:
                yield Group(i, [(i, (i, index) if self.numbered else index)], False)

    def __len__(self) -> int:
        return len(self.index_sampler)  # type: ignore[arg-type]

    def _sampler(self) -> Any:
        return getattr(self.index_sampler, "sampler", self.index_sampler)

    def rank_and_world(self) -> tuple[int, int]:
        sampler = self._sampler()
        return int(getattr(sampler, "rank", 0)), int(getattr(sampler, "num_replicas", 1))

    def snapshot(self) -> dict[str, Any]:
        """The random state the epoch's shuffle will be drawn from, so a resume can redraw it."""
        state = rng_snapshot(self.generator)
        sampler_epoch = getattr(self._sampler(), "epoch", None)
        if isinstance(sampler_epoch, int):
            state["sampler_epoch"] = sampler_epoch
        return state

    def restore(self, state: Mapping[str, Any]) -> None:
        rng_restore(self.generator, state)
        sampler = self._sampler()
        if "sampler_epoch" in state and isinstance(sampler, HasSetEpoch):
            sampler.set_epoch(state["sampler_epoch"])

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Ranges) -> list[int]:
        """Dataset indices of batch `group` that rank `rank` of `world_size` had (elastic resume)."""
        sampler = self._distributed()
        if consumed:
            raise StateError(
                "states: resuming an elastic resume again on another world size is not "
                "supported by aioloader.DataLoader; use aioloader.Loader",
                field="world_size",
            )
        old: DistributedSampler[Any] = DistributedSampler(
            sampler.dataset, num_replicas=world_size, rank=rank, shuffle=sampler.shuffle,
            seed=sampler.seed, drop_last=sampler.drop_last,
        )  # fmt: skip
        old.set_epoch(sampler.epoch)
        size = self.batch_len
        return list(old)[group * size : (group + 1) * size]

    def _distributed(self) -> DistributedSampler[Any]:
        sampler = self._sampler()
        if not isinstance(sampler, DistributedSampler) or not self.batched:
            raise StateError(
                "world_size: aioloader.DataLoader resumes on another world size only with a "
                "DistributedSampler and batch_size; use aioloader.Loader otherwise",
                field="world_size",
            )
        return sampler

    def _remainder(self, consumed: Ranges) -> list[list[int]]:
        """This rank's batches of what the saved ranks left of the epoch, shared equally."""
        sampler = self._distributed()
        n = len(sampler.dataset)  # type: ignore[arg-type]
        order: Iterable[int] = range(n)
        if sampler.shuffle:
            gen = torch.Generator()
            gen.manual_seed(sampler.seed + sampler.epoch)
            order = torch.randperm(n, generator=gen).tolist()
        left = [i for i in order if i not in consumed]
        mine = shard(left, sampler.rank, sampler.num_replicas, sampler.drop_last)
        size, drop = self.batch_len, bool(getattr(self.index_sampler, "drop_last", False))
        cut = [mine[i : i + size] for i in range(0, len(mine), size)]
        return [b for b in cut if len(b) == size or not drop]


def rng_snapshot(generator: torch.Generator | None) -> dict[str, Any]:
    """{"rng_state": the state of `generator` (None: torch's global one)}, JSON-ready."""
    rng = generator.get_state() if generator is not None else torch.get_rng_state()
    return {"rng_state": base64.b64encode(rng.numpy().tobytes()).decode()}


def rng_restore(generator: torch.Generator | None, state: Mapping[str, Any]) -> None:
    """Put back what `rng_snapshot` saved, where `state` has it."""
    if "rng_state" in state:
        raw = torch.frombuffer(bytearray(base64.b64decode(state["rng_state"])), dtype=torch.uint8)
        if generator is not None:
            generator.set_state(raw)
        else:
            torch.set_rng_state(raw)


def draw_seed(generator: torch.Generator | None) -> int:
    """One int64 from `generator` (None: the global RNG), as torch's iterator draws its base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
