"""A torch sampler (or batch sampler) as the order stage's plan: its groups, length and saved state."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from .._exceptions import StateError
from .._pipeline.order import Group, shard
from .._protocol import HasSetEpoch
from .._util.ranges import Ranges

__all__ = ["SamplerPlan", "draw_seed"]


class SamplerPlan:
    """Groups of a map-style dataset as torch's DataLoader forms them: from its (batch) sampler.

    Each epoch draws one int64 from `generator` before the sampler runs, as torch's iterator does, so
    that a shared generator is consumed identically and the shuffles match torch's.
    """

    def __init__(
        self, index_sampler: Iterable[Any], batched: bool, generator: torch.Generator | None
    ) -> None:
        self.index_sampler = index_sampler
        self.batched = batched
        self.generator = generator
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
        if consumed:
            return self._number(iter(self._remainder(consumed)))
        indices = iter(self.index_sampler)
        first = list(itertools.islice(indices, 1))  # draw the sampler's own seed on this thread
        return self._number(itertools.chain(first, indices))

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
        rng = self.generator.get_state() if self.generator is not None else torch.get_rng_state()
        state: dict[str, Any] = {"rng_state": base64.b64encode(rng.numpy().tobytes()).decode()}
        sampler_epoch = getattr(self._sampler(), "epoch", None)
        if isinstance(sampler_epoch, int):
            state["sampler_epoch"] = sampler_epoch
        return state

    def restore(self, state: Mapping[str, Any]) -> None:
        if "rng_state" in state:
            raw = torch.frombuffer(
                bytearray(base64.b64decode(state["rng_state"])), dtype=torch.uint8
            )
            if self.generator is not None:
                self.generator.set_state(raw)
            else:
                torch.set_rng_state(raw)
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


def draw_seed(generator: torch.Generator | None) -> int:
    """One int64 from `generator` (None: the global RNG), as torch's iterator draws its base seed."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
