"""The outbox: an epoch's made batches, from the moment each is made until the consumer has it.

Groups are delivered whole, in group order (`in_order=True`) or as they complete (`reorder.py`),
into one queue that the consumer drains: one at a time (`get`, `ready`), or many at once from
another thread (`ready_many`, then `handed` for each as it is handed over there). A batch keeps
its places in the admission's bounds until it is taken, wherever it waits, so that what the
consumer's thread holds is counted too; taking it gives them back (`Admission.let_go`) and counts
it in `stats()` (batches, samples, ready batches). The end of the epoch, or the error that ended
it, comes last in the same queue (`end`).
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

from .admission import Admission
from .order import Group
from .reorder import Item, reorder
from .stages import END, SKIPPED, BatchFailed, Stages

__all__ = ["ErrorDelivered", "Outbox", "Unraised"]


class ErrorDelivered(Exception):
    """An error was handed to the consumer and ends the epoch: raised out of the task that
    delivered it, so that the epoch's task group stops the rest (the epoch catches it)."""


class Unraised:
    """An epoch's error among batches handed over together (`Outbox.ready_many`): the consumer
    raises it where it comes, after the batches before it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Outbox:
    """Made batches on their way to the consumer. Construct it on the epoch's loop; every method
    runs there and none blocks, except `get`, which waits for the next batch (safe to cancel).

    Args:
        stages: what the epoch runs with (the order to deliver in, `batch_errors`, the recorder).
        admission: the bounds whose places a batch holds until it is taken.
        settle: what goes out in an item's place, called in the order items go out (the error
            policy's `OnError.settle`).
    """

    def __init__(
        self, stages: Stages, admission: Admission, settle: Callable[[Item], Item]
    ) -> None:
        self._rec = stages.recorder
        self._batch_errors = stages.batch_errors
        # the admission's methods a batch taken calls, bound: nothing in between on the hand-over
        self._let_go = admission.let_go
        self._over = admission.bytes.over
        self._out: asyncio.Queue[Item] = asyncio.Queue()
        self._away = 0  # batches `ready_many` gave that are not handed over yet
        self._order = reorder(
            stages.in_order, self._out, admission.bytes.poke, ends=not stages.batch_errors,
            settle=settle,
        )  # fmt: skip
        # `launched(group)`: group `group` was launched, and its batch comes out in this place
        # (`in_order`); the reorder's own method, bound: the launcher calls it for every group
        self.launched: Callable[[int], None] = self._order.launch

    # -- the epoch's side: batches come in ---------------------------------------------------------

    @property
    def ended(self) -> bool:
        """Whether an error delivered has ended the epoch (launch no more)."""
        return self._order.failed is not None

    def oldest(self, group: int) -> bool:
        """Whether `group` is the oldest batch and no other holds bytes (made batches all taken by
        the consumer): it is never held back for bytes, so a batch larger than the budget goes."""
        return self._order.oldest() == group and self._out.empty() and not self._away

    def deliver(
        self, group: Group, batch: Any, error: BaseException | None, held_bytes: int,
        faults: tuple[tuple[str, Any, BaseException], ...] = (),
    ) -> None:  # fmt: skip
        """`group` is made: its `batch` (or `SKIPPED`), or the `error` in its place, holding
        `held_bytes`; `faults`: its samples dropped under `on_error="skip"`, in slot order, not
        counted yet. It goes out in its turn.

        Raises:
            ErrorDelivered: an error that went out now ends the epoch.
        """
        if error is None:
            self._rec.made()
        item = Item(group.index, batch, len(group.items), held_bytes, error, faults)
        if self._order.deliver(item):
            raise ErrorDelivered

    def end(self, error: BaseException | None = None) -> None:
        """After what is queued, the consumer gets the end of the epoch, or `error` raised."""
        self._out.put_nowait(Item(-1, END if error is None else None, 0, 0, error))

    def clear(self) -> None:
        """Drop every batch not taken yet (the epoch is closed)."""
        self._order.clear()
        while not self._out.empty():
            self._out.get_nowait()

    # -- the consumer's side: batches go out -------------------------------------------------------

    async def get(self) -> tuple[int, Any]:
        """(group index, batch) of the next batch, `(-1, END)` after the last; raises the epoch's
        error in its place."""
        return self._got(await self._out.get())

    def ready(self) -> tuple[int, Any] | None:
        """`get()` at once when a batch is waiting (None when none is): a consumer in another
        thread then needs no task on the loop for it."""
        return None if self._out.empty() else self._got(self._out.get_nowait())

    def ready_many(self, most: int) -> list[Any] | None:
        """For a consumer in another thread, in one call on the loop: up to `most` batches
        waiting, each as `(index, batch, samples, held_bytes)` (None when none is). Each keeps its
        places until the consumer hands it over and says so (`handed(samples, held_bytes, made)`, on
        the loop), so the prefetch and byte bounds count it while it waits in the consumer's
        thread. The end comes as `ready()` gives it, `(-1, END)`; an error ends the list, as an
        `Unraised` to raise there."""
        if self._out.empty():
            return None
        out: list[Any] = []
        while len(out) < most and not self._out.empty():
            item = self._out.get_nowait()
            if item.error is not None or item.batch is END:
                try:
                    out.append(self._got(item))
                except BaseException as exc:  # the epoch's error: raised where it comes
                    out.append(Unraised(exc))
                return out
            out.append((*self._out_of(item, counted=False), item.samples, item.held_bytes))
            self._away += 1
        return out

    def handed(self, size: int, held_bytes: int, made: bool) -> None:
        """A batch of `ready_many` was handed over (`made`: not one whose samples were all
        skipped): its places go, and it is counted as `ready()` counts it (on the loop)."""
        self._away -= 1
        self._let_go(size, held_bytes)
        self._rec.taken(made, size)

    def _got(self, item: Item) -> tuple[int, Any]:
        self._let_go(item.samples, item.held_bytes)
        return self._out_of(item)

    def _out_of(self, item: Item, counted: bool = True) -> tuple[int, Any]:
        """What the consumer is handed for `item` (its error raised), counted (unless not
        `counted`: `handed` counts it then)."""
        index, batch, _, held_bytes, error, _ = item
        warning = self._over(held_bytes)
        if warning is not None:  # to the consumer (a warning that is an error reaches it as one)
            warnings.warn(warning, ResourceWarning, stacklevel=4)
        if error is not None:
            if index >= 0 and self._batch_errors:
                return index, BatchFailed(error)
            raise error
        if counted and batch is not END:
            self._rec.taken(batch is not SKIPPED, item.samples)
        return index, batch
