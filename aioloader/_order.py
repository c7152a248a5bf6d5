"""Order stage: which keys, in which order, grouped into which batches, for one epoch.

Everything downstream works on *groups*: a group is the list of (position, key) pairs that become one
batch (or one unbatched sample). Groups are numbered from 0 within an epoch; their composition depends
only on (keys, seed, epoch, shuffle, batch_size, drop_last), never on timing, so `in_order=False` only
changes the order in which whole groups are delivered.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count, islice
from typing import Any, Protocol

import torch

__all__ = ["Group", "KeyOrder", "KeyPlan", "Plan", "chunk"]


@dataclass(frozen=True, slots=True)
class Group:
    """One future batch: its number in the epoch and the (position, key) pairs it is made of."""

    index: int
    items: list[tuple[int, Any]]
    batched: bool


def chunk(pairs: Iterable[tuple[int, Any]], size: int | None, drop_last: bool) -> Iterator[Group]:
    """Cut (position, key) pairs into groups of `size` (None: one unbatched sample per group)."""
    it = iter(pairs)
    step = 1 if size is None else size
    for index in count():
        items = list(islice(it, step))
        if not items or (drop_last and len(items) < step):
            return
        yield Group(index, items, size is not None)


class KeyOrder:
    """The order of keys per epoch: the key order, or a seeded permutation of it.

    Args:
        keys: a sequence (random access, known length) or any iterable (read once per epoch, in order).
        shuffle: permute a sequence per epoch with a generator seeded from (seed, epoch).
        seed: the base seed.
    """

    def __init__(self, keys: Sequence[Any] | Iterable[Any], *, shuffle: bool, seed: int) -> None:
        if shuffle and not isinstance(keys, Sequence):
            raise ValueError(
                "shuffle=True needs keys with a length and random access (a Sequence); "
                f"got {type(keys).__name__}"
            )
        self.keys = keys
        self.shuffle = shuffle
        self.seed = seed

    def __len__(self) -> int:
        if not isinstance(self.keys, Sequence):
            raise TypeError(f"the number of keys of a {type(self.keys).__name__} is not known")
        return len(self.keys)

    def positions(self, epoch: int) -> Iterable[int]:
        """The positions of the keys for `epoch`, in delivery order."""
        n = len(self)
        if not self.shuffle:
            return range(n)
        gen = torch.Generator()
        gen.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=gen).tolist()

    def pairs(self, epoch: int) -> Iterable[tuple[int, Any]]:
        """(position, key) pairs for `epoch`, in delivery order."""
        if isinstance(self.keys, Sequence):
            keys = self.keys
            return ((p, keys[p]) for p in self.positions(epoch))
        return enumerate(self.keys)


class Plan(Protocol):
    """The groups of one epoch; the only thing the pipeline asks of the order stage."""

    group_size: int

    def groups(self, epoch: int) -> Iterable[Group]: ...

    def __len__(self) -> int: ...


class KeyPlan:
    """Keys in `KeyOrder`, cut into batches of `batch_size` (None: unbatched samples)."""

    def __init__(self, order: KeyOrder, batch_size: int | None, drop_last: bool) -> None:
        self.order = order
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.group_size = batch_size or 1

    def groups(self, epoch: int) -> Iterable[Group]:
        return chunk(self.order.pairs(epoch), self.batch_size, self.drop_last)

    def __len__(self) -> int:
        n, size = len(self.order), self.group_size
        return n // size if self.drop_last else -(-n // size)
