"""The order stage of a source that orders its own rows (`sources.parquet`): its order, its shares.

Such a source says, from what it knows before reading (a Parquet file's footer), which rows an epoch
holds in which order (`epoch_order`), which indices of that order a reader delivers (`share`: one
contiguous share per reader, all of one length), and what keys those make (`refs`). The plan is
otherwise the order stage's: groups of `batch_size` samples, numbered within the epoch, so the
loader's state and its resume (also elastic: `group_indices`) work as for any keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._util.ranges import Ranges
from .order import KeyOrder, KeyPlan

__all__ = ["OrdersItself", "OwnOrder", "OwnPlan"]


@runtime_checkable
class OrdersItself(Protocol):
    """What a source that orders its own rows gives the order stage."""

    shuffle: bool
    seed: int
    slot: int
    slots: int
    max_bytes_ahead: int | None
    rows_per_sample: int | None  # rows per key (None: one)

    def keys(self) -> Sequence[Any]: ...

    def share(
        self, consumed: Ranges, drop_last: bool = False, slot: int | None = None,
        slots: int | None = None,
    ) -> Any: ...  # fmt: skip

    def samples_of(self, rows: int) -> int: ...

    def refs(self, epoch: int, mine: Any, skipped: Any = None) -> Iterable[tuple[int, Any]]: ...


class OwnOrder(KeyOrder):
    """`KeyOrder` with the source's order and shares (rows; `samples_of` them per key)."""

    def __init__(self, source: OrdersItself, drop_last: bool) -> None:
        super().__init__(
            source.keys(), shuffle=source.shuffle, seed=source.seed, rank=source.slot,
            world_size=source.slots, drop_last=drop_last,
        )  # fmt: skip
        self.source = source
        self.skipped: tuple[int, Ranges, int] | None = None  # (epoch, groups, rows per group)

    def __len__(self) -> int:
        """Samples on this reader per epoch."""
        return self.source.samples_of(len(self.mine(Ranges())))

    def mine(self, consumed: Ranges) -> Any:
        return self.source.share(consumed, self.drop_last)

    def pairs(self, epoch: int, consumed: Ranges, start: int = 0) -> Iterable[tuple[int, Any]]:
        """The source's keys of `epoch` (`start` is for keys that begin mid-epoch, which these do
        not: their resume skips delivered groups without reading for them)."""
        mine = self.mine(consumed)
        skipped, self.skipped = self.skipped, None
        if skipped is None or skipped[0] != epoch:
            return self.source.refs(epoch, mine)
        mask = np.zeros(len(mine), bool)
        for a, b in skipped[1].pairs:  # groups delivered before the resume: nothing to read
            mask[a * skipped[2] : b * skipped[2]] = True
        return self.source.refs(epoch, mine, mask)


class OwnPlan(KeyPlan):
    """`KeyPlan` over an `OwnOrder`: a group's indices are its samples' rows."""

    order: OwnOrder

    def __init__(
        self, source: OrdersItself, batch_size: int | None, drop_last: bool, read_ahead: int | None
    ) -> None:
        super().__init__(OwnOrder(source, drop_last), batch_size, drop_last)
        source.max_bytes_ahead = read_ahead  # the budget's share for it (`MemoryBudget`)

    def rank_and_world(self) -> tuple[int, int]:
        return self.order.source.slot, self.order.source.slots

    def restore(self, state: Mapping[str, Any]) -> None:
        """A state of this rank: its delivered groups will be skipped, so the source need not read
        the row groups only they hold."""
        if (state.get("rank"), state.get("world_size")) == self.rank_and_world():
            delivered = Ranges(state.get("delivered", []))
            self.order.skipped = (int(state["epoch"]), delivered, self._rows_per_group())

    def _rows_per_group(self) -> int:
        return self.group_size * (self.order.source.rows_per_sample or 1)

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Ranges) -> list[int]:
        source = self.order.source
        mine = source.share(consumed, self.drop_last, rank, world_size)
        rows = self._rows_per_group()
        return [int(i) for i in mine[group * rows : (group + 1) * rows]]
