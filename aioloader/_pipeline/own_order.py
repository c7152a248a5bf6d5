"""The order stage of a source that orders its own rows (`sources.parquet`) or shares its own stream
(`sources.tar_shards`, `aioloader.mix`): its order, its shares.

Such a source says, from what it knows before reading (a Parquet file's footer), which rows an epoch
holds in which order (`epoch_order`), which indices of that order a reader delivers (`share`: one
contiguous share per reader, all of one length), and what keys those make (`refs`). The plan is
otherwise the order stage's: groups of `batch_size` samples, numbered within the epoch, so the
loader's state and its resume (also elastic: `group_indices`) work as for any keys.

A source that shares its own stream (`SharesItsKeys`) knows its order only as it streams, but says
which positions of its epoch the first keys of any reader's stream stand for (`positions`, from
what it knows without reading: shards' sample counts, a mix's draws): `StreamPlan` numbers its keys
as they come and counts a saved state's delivered groups as consumed positions from that.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._exceptions import StateError
from .._protocol import EndsEarly, RecordsDraws, SharesItsKeys
from .._util.aiters import closing
from .._util.ranges import Ranges
from .order import Group, KeyOrder, KeyPlan, achunk, dealt

__all__ = ["OrdersItself", "OwnOrder", "OwnPlan", "StreamPlan"]


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

    def share_indices(
        self, rank: int, world_size: int, consumed: Ranges, groups: Iterable[int] | None = None
    ) -> np.ndarray:
        """`KeyPlan.share_indices`: the rows of reader `rank` of `world_size`."""
        mine = self.order.source.share(consumed, self.drop_last, rank, world_size)
        return dealt(np.asarray(mine, dtype=np.int64), self._rows_per_group(), groups)


class StreamPlan(KeyPlan):
    """`KeyPlan` over the keys a `SharesItsKeys` source streams for this reader: its own shares,
    positions and place (`rank_and_world`), so a state records the real rank and world size."""

    def __init__(
        self, order: KeyOrder, source: SharesItsKeys, batch_size: int | None, drop_last: bool
    ) -> None:
        super().__init__(order, batch_size, drop_last)
        self.source = source
        self._epoch = 0  # the epoch of the states being resumed (`restore`)
        self._streams: dict[tuple[Any, ...], list[int]] = {}  # their readers' positions so far

    def groups(self, epoch: int, consumed: Ranges) -> AsyncIterable[Group]:
        first, self._first = self._first, 0
        keys = self.source.share_keys(epoch, consumed, self.drop_last)
        return achunk(_numbered(keys, first * self.group_size), self.batch_size, self.drop_last,
                      first)  # fmt: skip

    def rank_and_world(self) -> tuple[int, int]:
        return self.source.rank_and_world()

    def snapshot(self) -> dict[str, Any]:
        """A mix's draws: its weights, where loads changed them, where a resume on another world
        size began them (`RecordsDraws`)."""
        return self.source.draws_state() if isinstance(self.source, RecordsDraws) else {}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Before the saved states' groups are counted (`group_indices`): their epoch, and a mix's
        draws as the state records them (this reader's own state: changed weights draw from the
        position after its furthest delivered group on)."""
        self._epoch = int(state["epoch"])
        self._streams.clear()
        if isinstance(self.source, RecordsDraws) and "weights" in state:  # (not a bare {"epoch"})
            own = (state.get("rank"), state.get("world_size")) == self.rank_and_world()
            reached = _reached(state, self.group_size)
            consumed = Ranges(state.get("consumed", []))
            self.source.load_draws(state, self._epoch, reached if own else None, consumed)

    def resumed_elsewhere(self, states: Sequence[Mapping[str, Any]]) -> None:
        """After a resume on another world size has counted what every old reader delivered: a
        mix's new draws begin where the furthest of them had drawn to (not at the epoch's start:
        a schedule goes on from there)."""
        if isinstance(self.source, RecordsDraws):
            self.source.resume_draws(self._epoch, max(
                self.source.draw_reached(
                    self._epoch, Ranges(s.get("consumed", [])), int(s.get("rank", 0)),
                    int(s["world_size"]), _reached(s, self.group_size),
                )
                for s in states
            ))  # fmt: skip

    def group_indices(self, rank: int, world_size: int, group: int, consumed: Ranges) -> list[int]:
        """The positions of group `group` of reader `rank` of `world_size`, in the restored epoch."""
        stop = (group + 1) * self.group_size
        key = (rank, world_size, tuple(map(tuple, consumed.pairs)))
        known = self._streams.get(key, [])
        if len(known) < stop:  # the first keys of that reader's stream, more each time
            most = max(stop, 2 * len(known))
            known = self._streams[key] = self.source.positions(
                self._epoch, consumed, self.drop_last, rank, world_size, most
            )
        return known[group * self.group_size : stop]

    def left_out(self, epoch: int, consumed: Ranges, world_size: int) -> Ranges:
        """The positions of `epoch` its `world_size` readers would never reach (`EndsEarly`)."""
        if isinstance(self.source, EndsEarly):
            return self.source.left_out(epoch, consumed, world_size)
        return Ranges()

    def share_indices(
        self, rank: int, world_size: int, consumed: Ranges, groups: Iterable[int] | None = None
    ) -> np.ndarray:
        """The positions of `groups` of reader `rank` of `world_size` (`group_indices`); its
        whole share (None) is not known before it is streamed: StateError."""
        if groups is None:
            raise StateError(
                "world_size: a stream's whole share of another world size is not known before "
                "it is read (what an old rank that went past an epoch delivered of it)",
                field="world_size",
            )
        return np.asarray(
            [i for g in groups for i in self.group_indices(rank, world_size, g, consumed)],
            dtype=np.int64,
        )


def _reached(state: Mapping[str, Any], group_size: int) -> int:
    """The keys a saved reader's stream had given: up to its furthest delivered group."""
    delivered = Ranges(state.get("delivered", []))
    return delivered.pairs[-1][1] * group_size if delivered else 0


async def _numbered(keys: AsyncIterable[Any], start: int) -> AsyncIterator[tuple[int, Any]]:
    i = start
    async with closing(keys) as each:
        async for key in each:
            yield i, key
            i += 1
