"""Reordering: which made batches go to the consumer now, in key order or as they complete."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["AsCompleted", "InOrder", "Item", "Reorder", "reorder"]


class Item(NamedTuple):
    """A made group on its way to the consumer: its batch, or the error that took its place."""

    group: int  # the group's index in its epoch; -1: the end, or an error of the whole epoch
    batch: Any  # the batch, `END`, `SKIPPED`, or None beside an error
    samples: int  # the samples it holds a place for (released when the consumer takes it)
    held_bytes: int  # the bytes of the budget it holds (likewise)
    error: BaseException | None
    # the samples dropped from it under `on_error="skip"`, as (stage, key, error): counted against
    # `max_skipped` as the group goes out (`settle`), so that in key order the same fault is the one
    # that spends the budget whichever decode ended first
    faults: tuple[tuple[str, Any, BaseException], ...] = ()


def _as_is(item: Item) -> Item:
    return item


class Reorder:
    """The groups launched and not yet handed over, in launch order; what `deliver` puts out.

    `deliver(item)` puts out what may go now into `out` (calling `moved()` for each, since another
    batch may then be the oldest) and returns True when an error it put out ends the epoch (`ends`:
    errors end the epoch, not only their batch). `settle(item)` is what goes out in its place, called
    in the order items go out (skipped samples are counted there).
    """

    def __init__(
        self, out: asyncio.Queue[Item], moved: Callable[[], None], ends: bool,
        settle: Callable[[Item], Item] = _as_is,
    ) -> None:  # fmt: skip
        self.out = out
        self.moved = moved
        self.ends = ends
        self.settle = settle
        self.launched: deque[int] = deque()  # group indices in launch order, until delivered
        self.failed: int | None = None  # the group whose error ends the epoch, once known

    def launch(self, index: int) -> None:
        self.launched.append(index)

    def oldest(self) -> int:
        """The index of the oldest group not handed over yet."""
        return self.launched[0]

    def deliver(self, item: Item) -> bool:
        raise NotImplementedError

    def clear(self) -> None:
        """Drop what waits for its turn (the epoch is closed)."""


class InOrder(Reorder):
    """Hands groups over in launch (key) order: a group made early waits for those before it."""

    def __init__(
        self, out: asyncio.Queue[Item], moved: Callable[[], None], ends: bool,
        settle: Callable[[Item], Item] = _as_is,
    ) -> None:  # fmt: skip
        super().__init__(out, moved, ends, settle)
        self._ready: dict[int, Item] = {}

    def deliver(self, item: Item) -> bool:
        if item.error is not None and self.ends and self.failed is None:
            self.failed = item.group
        self._ready[item.group] = item
        while self.launched and self.launched[0] in self._ready:
            ready = self.settle(self._ready.pop(self.launched.popleft()))
            self.moved()  # another batch is the oldest now
            self.out.put_nowait(ready)
            if ready.error is not None and self.ends:
                if self.failed is None:
                    self.failed = ready.group
                return True
        return False

    def clear(self) -> None:
        self._ready.clear()


class AsCompleted(Reorder):
    """Hands each group over as soon as it is made."""

    def deliver(self, item: Item) -> bool:
        item = self.settle(item)
        self.out.put_nowait(item)
        self.launched.remove(item.group)
        self.moved()  # another batch may be the oldest now
        return item.error is not None and self.ends


def reorder(
    in_order: bool, out: asyncio.Queue[Item], moved: Callable[[], None], ends: bool,
    settle: Callable[[Item], Item] = _as_is,
) -> Reorder:  # fmt: skip
    """`InOrder` or `AsCompleted`, as `in_order` says."""
    return (InOrder if in_order else AsCompleted)(out, moved, ends, settle)
