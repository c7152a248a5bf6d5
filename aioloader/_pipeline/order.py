"""Order stage: which keys, in which order, on which rank, grouped into which batches, per epoch.

Everything downstream works on *groups*: a group is the list of (position, key) pairs that become one
batch (or one unbatched sample). Groups are numbered from 0 within an epoch; their composition depends
only on (keys, seed, epoch, shuffle, rank, world size, batch_size, drop_last), never on timing, so
`in_order=False` only changes the order in which whole groups are delivered.

For one epoch of a sequence of N keys:

1. `perm`: the key positions in delivery order: `range(N)`, or a permutation seeded from (seed, epoch).
2. `remaining`: the indices into `perm` not yet consumed (all of them, unless resuming elastically).
3. padded to a multiple of the world size by wrapping around (or cut down to one, with `drop_last`),
   so that every rank gets the same number of samples and therefore of batches;
4. rank r takes every world_size-th entry starting at r;
5. cut into batches of `batch_size` (the last one dropped if short and `drop_last`).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import count, islice
from typing import Any, Protocol

import numpy as np
import torch

from .._exceptions import StateError
from .._util.aiters import closing
from .._util.ranges import Ranges

__all__ = ["Group", "KeyOrder", "KeyPlan", "Plan", "achunk", "chunk", "dealt", "shard"]


@dataclass(frozen=True, slots=True)
class Group:
    """One future batch: its number in the epoch and the (position, key) pairs it is made of."""

    index: int
    items: list[tuple[int, Any]]
    batched: bool


def chunk(
    pairs: Iterable[tuple[int, Any]], size: int | None, drop_last: bool, first: int = 0
) -> Iterator[Group]:
    """Cut (position, key) pairs into groups of `size` (None: one unbatched sample per group),
    numbered from `first`."""
    it = iter(pairs)
    step = 1 if size is None else size
    for index in count(first):
        items = list(islice(it, step))
        if not items or (drop_last and len(items) < step):
            return
        yield Group(index, items, size is not None)


async def achunk(
    pairs: AsyncIterable[tuple[int, Any]], size: int | None, drop_last: bool, first: int = 0
) -> AsyncIterator[Group]:
    """`chunk` for pairs that arrive asynchronously (a streamed listing)."""
    step = 1 if size is None else size
    items: list[tuple[int, Any]] = []
    index = first
    async with closing(pairs) as each:
        async for pair in each:
            items.append(pair)
            if len(items) == step:
                yield Group(index, items, size is not None)
                index, items = index + 1, []
    if items and not drop_last:
        yield Group(index, items, size is not None)


async def _aenumerate(keys: AsyncIterable[Any], start: int = 0) -> AsyncIterator[tuple[int, Any]]:
    i = start
    async with closing(keys) as each:
        async for key in each:
            yield i, key
            i += 1


def dealt(share: np.ndarray, unit: int, groups: Iterable[int] | None) -> np.ndarray:
    """The indices of `groups` (None: all) of a share cut into groups of `unit` indices."""
    if groups is None:
        return share
    parts = [share[g * unit : (g + 1) * unit] for g in groups]
    return np.concatenate(parts) if parts else share[:0]


def permutation(n: int, shuffle: bool, seed: int, epoch: int) -> Sequence[int]:
    """Key positions in delivery order for `epoch`: identity, or seeded from (seed, epoch)."""
    if not shuffle:
        return range(n)
    gen = torch.Generator()
    gen.manual_seed(seed + epoch)
    return torch.randperm(n, generator=gen).tolist()


def shard(remaining: Sequence[int], rank: int, world_size: int, drop_last: bool) -> list[int]:
    """This rank's share of `remaining`: equal shares for all ranks, by wrapping or dropping."""
    m = len(remaining)
    if m == 0:
        return []
    if world_size == 1:
        return list(remaining)
    total = (m // world_size) * world_size if drop_last else -(-m // world_size) * world_size
    return [remaining[j % m] for j in range(rank, total, world_size)]


class KeyOrder:
    """The keys, their order per epoch and this rank's share of them.

    Args:
        keys: a sequence (random access, known length), any iterable (read once per epoch, in order)
            or an async iterable (a streamed listing; no shuffle and one rank only).
        shuffle: permute a sequence per epoch with a generator seeded from (seed, epoch).
        seed: the base seed.
        rank, world_size: this process's share (see `_util/ranks.resolve_rank`).
        drop_last: drop the tail instead of wrapping around to give every rank the same count.
    """

    def __init__(
        self,
        keys: Sequence[Any] | Iterable[Any] | AsyncIterable[Any],
        *,
        shuffle: bool,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(keys, Iterable | AsyncIterable):
            raise TypeError(
                "keys: expected a sequence, an iterable or an async iterable of keys (or a "
                f"Source), got {type(keys).__name__}"
            )
        sized = isinstance(keys, Sequence)
        if not sized and shuffle:
            raise ValueError(
                "shuffle=True needs keys with a length and random access (a Sequence); "
                f"got {type(keys).__name__}"
            )
        if not sized and world_size > 1:
            raise ValueError(
                f"world_size={world_size} needs keys with a length (a Sequence) so that every "
                f"rank gets the same number of batches; got {type(keys).__name__}"
            )
        self.keys = keys
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        # a generator (an iterator, sync or async) gives its keys once: a second epoch would be empty
        self.one_shot = isinstance(keys, Iterator | AsyncIterator)
        self.epochs_read = 0

    @property
    def sized(self) -> bool:
        return isinstance(self.keys, Sequence)

    def __len__(self) -> int:
        """Keys on this rank per epoch."""
        if not isinstance(self.keys, Sequence):
            raise TypeError(f"the number of keys of a {type(self.keys).__name__} is not known")
        return len(shard(range(len(self.keys)), self.rank, self.world_size, self.drop_last))

    def mine(self, consumed: Ranges) -> list[int]:
        """Indices into the epoch's permutation that this rank delivers, in order."""
        assert isinstance(self.keys, Sequence)
        remaining = consumed.complement(len(self.keys))
        return shard(remaining, self.rank, self.world_size, self.drop_last)

    def pairs(
        self, epoch: int, consumed: Ranges, start: int = 0
    ) -> Iterable[tuple[int, Any]] | AsyncIterable[tuple[int, Any]]:
        """(position, key) pairs this rank delivers in `epoch`, skipping `consumed` indices; keys
        without a length that begin mid-epoch (`start_at`) are numbered from `start`."""
        keys = self.keys
        if isinstance(keys, Sequence):
            perm = permutation(len(keys), self.shuffle, self.seed, epoch)
            if not consumed and self.world_size == 1:
                positions = perm  # the whole epoch, in its order
            else:
                mine = self.mine(consumed)
                positions = mine if isinstance(perm, range) else list(map(perm.__getitem__, mine))
            if isinstance(keys, range) and keys == range(len(keys)):  # each key its position
                return zip(positions, positions, strict=True)
            return zip(positions, map(keys.__getitem__, positions), strict=True)
        if self.one_shot and self.epochs_read:
            raise ValueError(
                f"keys: a one-shot {type(keys).__name__} (an iterator: its keys come once) was used "
                "up by an earlier epoch, so this one would be empty; pass a sequence or an iterable "
                "that starts again each time it is iterated (a list, a class with __iter__)"
            )
        self.epochs_read += 1
        if isinstance(keys, AsyncIterable):
            return _aenumerate(keys, start)
        return enumerate(keys, start)


class Plan(Protocol):
    """The groups of one epoch; what the loader asks of the order stage."""

    group_size: int

    def groups(self, epoch: int, consumed: Ranges) -> Iterable[Group] | AsyncIterable[Group]:
        """The epoch's groups in launch order, skipping the permutation indices in `consumed`."""
        ...

    def __len__(self) -> int: ...

    def rank_and_world(self) -> tuple[int, int]: ...

    def snapshot(self) -> dict[str, Any]:
        """Extra state to save, taken just before `groups()` of an epoch (e.g. a generator's)."""
        ...

    def restore(self, state: Mapping[str, Any]) -> None:
        """Put back what `snapshot` saved, before the resumed epoch's `groups()`."""
        ...

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Ranges) -> list[int]:
        """Permutation indices of group `group` of the plan `rank` had among `world_size`."""
        ...


class KeyPlan:
    """Keys in `KeyOrder`, cut into batches of `batch_size` (None: unbatched samples)."""

    def __init__(self, order: KeyOrder, batch_size: int | None, drop_last: bool) -> None:
        self.order = order
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.group_size = batch_size or 1
        self._first = 0  # the group the next epoch's keys begin at (`start_after`)

    def groups(self, epoch: int, consumed: Ranges) -> Iterable[Group] | AsyncIterable[Group]:
        first, self._first = self._first, 0
        pairs = self.order.pairs(epoch, consumed, first * self.group_size)
        if isinstance(pairs, AsyncIterable):
            return achunk(pairs, self.batch_size, self.drop_last, first)
        return chunk(pairs, self.batch_size, self.drop_last, first)

    def start_after(self, epoch: int, skip: set[int]) -> set[int]:
        """For keys that can begin mid-epoch (their `start_at(epoch, position)` says True, as a
        mix's do): begin the resumed epoch past its delivered groups 0..g-1 instead of making and
        dropping them. Returns the groups still to skip."""
        start_at = getattr(self.order.keys, "start_at", None)
        g = 0
        while g in skip:
            g += 1
        if start_at is None or g == 0 or not start_at(epoch, g * self.group_size):
            return skip
        self._first = g
        return {i for i in skip if i >= g}

    def rank_and_world(self) -> tuple[int, int]:
        return self.order.rank, self.order.world_size

    def snapshot(self) -> dict[str, Any]:
        return {}  # everything follows from (seed, epoch)

    def restore(self, state: Mapping[str, Any]) -> None:
        pass

    def _order_of(self, rank: int, world_size: int) -> KeyOrder:
        """This plan's order as rank `rank` of `world_size` would have it (keys with a length)."""
        order = self.order
        if not order.sized:
            raise StateError(
                "world_size: resuming on another world size needs keys with a length",
                field="world_size",
            )
        return KeyOrder(
            order.keys, shuffle=order.shuffle, seed=order.seed, rank=rank,
            world_size=world_size, drop_last=order.drop_last,
        )  # fmt: skip

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Ranges) -> list[int]:
        mine = self._order_of(rank, world_size).mine(consumed)
        return mine[group * self.group_size : (group + 1) * self.group_size]

    def share_indices(
        self, rank: int, world_size: int, consumed: Ranges, groups: Iterable[int] | None = None
    ) -> np.ndarray:
        """The permutation indices the plan of `rank` of `world_size` deals to its `groups` (None:
        to all of them, its whole share) in an epoch less `consumed`, in order; the share worked
        out once (a mix resumed on another world size counts what each old rank delivered)."""
        mine = self._order_of(rank, world_size).mine(consumed)
        return dealt(np.asarray(mine, dtype=np.int64), self.group_size, groups)

    def __len__(self) -> int:
        n, size = len(self.order), self.group_size
        return n // size if self.drop_last else -(-n // size)
