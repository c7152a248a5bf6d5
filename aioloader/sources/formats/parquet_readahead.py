"""The row groups of a Parquet source being read: each one's read, one walk's read-ahead, decode turns.

A `RowGroup` is read once (fetch, then decode) by a task on the running loop and shared by the
samples that need it; dropped by everything, it cancels a read still going. `Ahead` is what one walk
over an epoch holds (see `parquet.py`): the row groups it still hands rows of out and those read
ahead of them, in the order first needed, and, once it has asked for all of its own, the next
epoch's first ones. `Turns` lets decodes in one per core, the row group needed first going first.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import numpy as np

__all__ = ["Ahead", "Reader", "RowGroup", "Runs", "Turns", "cores", "runs_of"]


class Reader(Protocol):
    """What the row groups and the read-ahead use of their source (`parquet.Parquet`)."""

    row_groups_in_flight: int
    max_bytes_ahead: int | None

    def begin(self, group: RowGroup) -> asyncio.Task[Any]:
        """Start reading `group` (fetch and decode) on the running loop; the task gives its value."""
        ...

    def group(self, index: int) -> RowGroup:
        """The row group `index` while anything holds it, else a new one (not read yet)."""
        ...

    def forget(self, index: int, group: RowGroup) -> None:
        """Row group `index` is no longer held by the walk, if it is `group`."""
        ...

    def early_reads(self, epoch: int) -> int:
        """How many of `epoch`'s first row groups are read early now."""
        ...

    def read_early(self, epoch: int, room: int, order: int) -> None:
        """Read `epoch`'s first row groups now, up to `room` of them (`order`: their decodes'
        place in the queue)."""
        ...


class RowGroup:
    """One row group of one file: loading, then loaded; shared by the samples that need it. While
    it decodes in parts (`Parquet` with `rows_per_sample`), the parts decoded so far serve the
    samples whose rows they hold (`rows`)."""

    __slots__ = (
        "__weakref__", "_waiters", "after", "index", "nbytes", "needed", "order", "parts",
        "ready", "task",
    )  # fmt: skip

    def __init__(self, index: int) -> None:
        self.index = index  # among all the files' row groups
        self.task: asyncio.Task[Any] | None = None
        self.nbytes = 0
        self.order = 0  # when the walk needs it, relative to the others read ahead (lower: sooner)
        self.needed = False  # asked for by the rows being handed out, not read ahead of them
        self.parts: list[Any] = []  # record batches decoded so far, while the decode goes on
        self.ready = 0  # the rows they hold
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []  # (rows wanted, woken when in)
        # the row group whose read a remote one's fetch waits for (a walk's first, see `Ahead`)
        self.after: RowGroup | None = None

    def start(self, source: Reader) -> asyncio.Task[Any]:
        """Begin the read (once), on the running loop."""
        if self.task is None:
            self.task = task = source.begin(self)
            task.add_done_callback(_retrieve)
        return self.task

    async def value(self, source: Reader) -> Any:
        """The decoded row group (a fetch that is cancelled leaves the read to the others)."""
        task = self.start(source)
        if task.done():
            return task.result()
        return await asyncio.shield(task)

    async def rows(self, source: Reader, upto: int) -> Any:
        """A pyarrow Table of at least the row group's first `upto` rows: the decoded row group,
        or while it decodes in parts, the parts decoded so far once they hold them."""
        task = self.start(source)
        if not task.done() and self.ready < upto:
            woken = asyncio.get_running_loop().create_future()
            self._waiters.append((upto, woken))
            await woken
        if task.done() or self.ready < upto:  # ended (or failed) before its parts held them
            return await self.value(source)
        import pyarrow as pa

        return pa.Table.from_batches(self.parts)

    def waited(self) -> bool:
        """Whether rows of it are wanted now: asked for by the rows being handed out, or a
        sample waits for them."""
        return self.needed or any(not woken.done() for _, woken in self._waiters)

    def arrived(self, part: Any) -> None:
        """On the loop: the decode's next part (a record batch) is in."""
        self.parts.append(part)
        self.ready += part.num_rows
        self._wake(self.ready)

    def ended(self) -> None:
        """On the loop, as the read ends (done, failed or cancelled): every waiter goes on; the
        parts are let go (the row group's value holds what it needs of them)."""
        self.parts, self.ready = [], 0
        self._wake(None)

    def reading(self) -> bool:
        """Whether its read has begun and not ended."""
        return self.task is not None and not self.task.done()

    async def read_ended(self) -> None:
        """Until its read has ended, however it ends (at once if it has, or never began); a
        waiter cancelled leaves the read to go on."""
        task = self.task
        if task is not None and not task.done():
            await asyncio.wait([task])

    def _wake(self, ready: int | None) -> None:
        waiting, self._waiters = self._waiters, []
        for upto, woken in waiting:
            if woken.done():  # its fetch was cancelled
                continue
            if ready is None or upto <= ready:
                woken.set_result(None)
            else:
                self._waiters.append((upto, woken))

    def __del__(self) -> None:  # nothing needs it any more: stop a read still going
        task = self.task
        if task is not None and not task.done():
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs
                task.get_loop().call_soon_threadsafe(task.cancel)


def _retrieve(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # read by the fetches that awaited it; a read-ahead nobody took is dropped


Runs = tuple[np.ndarray, dict[int, int], list[int]]


def runs_of(groups: np.ndarray) -> Runs:
    """Of the row groups of a walk's positions (-1: skipped): each one's first position, in the
    order first needed; its last position; the row groups in that order. Found from the runs of
    one row group, in one pass: there are far fewer runs than rows."""
    if len(groups) == 0:  # no positions (a share with nothing left): no row groups
        return np.empty(0, np.int64), {}, []
    starts = np.flatnonzero(np.concatenate([[True], groups[1:] != groups[:-1]]))
    stops = np.append(starts[1:], len(groups)) - 1  # each run's last position
    values = groups[starts]
    keep = values >= 0
    starts, stops, values = starts[keep], stops[keep], values[keep]
    uniq, first_i = np.unique(values, return_index=True)
    _, last_rev = np.unique(values[::-1], return_index=True)
    last = stops[len(stops) - 1 - last_rev]
    first = starts[first_i]
    order = np.argsort(first)
    return first[order], dict(zip(uniq.tolist(), last.tolist(), strict=True)), uniq[order].tolist()


class Ahead:
    """The row groups one walk over an epoch holds: those it has handed rows of out and will hand
    out more of, and up to `row_groups_in_flight` read ahead of that (in the order first needed)."""

    def __init__(self, source: Reader, runs: Runs, epoch: int, early: bool) -> None:
        self.source = source
        self.epoch = epoch
        self.early = early  # read the next epoch's first row groups once this one's are asked for
        self.first, self.last, self.need = runs
        self.pinned: dict[int, RowGroup] = {}
        self.ends: list[tuple[int, int]] = []  # (last position, row group) of the pinned ones
        self.next = 0  # in `need`: the next to pin
        # the walk's first row group: until it is read (fetched and decoded), a remote read
        # ahead waits to fetch. Side by side, the first batch waited for every read ahead's
        # bytes (on the 20 ms store of benchmarks/tokens.py --store, 16 row groups a source came
        # in 0.5 s where one takes 40 ms), then for its decode among their fetches' CPU.
        self.lead: RowGroup | None = None  # (let go once read)

    def reach(self, a: int, b: int) -> None:
        """The walk hands out positions [a, b): pin what they need and read ahead; let go of the
        row groups whose last position is behind."""
        reached = int(np.searchsorted(self.first, b, side="left"))  # needed by positions < b
        # Reads ahead go out a quarter of row_groups_in_flight at a time, once that many have
        # been reached: a server (SeaweedFS here) spends about half as much CPU per request on
        # requests that come together as on the same ones one after the other. Three quarters
        # stay read ahead, to cover a far store's latency (with half, W8 behind 20 ms was slower).
        # Under a byte limit fewer are read ahead, and each goes out as soon as it may.
        flight = self.source.row_groups_in_flight
        low = flight - max(1, flight // 4)
        refill = self.next - reached <= low
        while self.next < len(self.need) and (
            self.next < reached or (refill and self._room(reached))
        ):
            g = self.need[self.next]
            group = self.pinned[g] = self.source.group(g)
            group.order = self.next
            group.needed = group.needed or self.next < reached  # not read ahead: wanted now
            lead = self.lead
            if self.next == 0:  # the walk's first
                self.lead = group
            elif lead is not None and not lead.reading():
                self.lead = None  # (not held by the walk once read)
            elif lead is not None and not group.needed and group.task is None:
                group.after = lead
            heapq.heappush(self.ends, (self.last[g], g))
            with contextlib.suppress(RuntimeError):  # no running loop: read when fetched
                group.start(self.source)
            self.next += 1
        while self.ends and self.ends[0][0] < a:
            _, g = heapq.heappop(self.ends)
            self._let_go(g)
        if self.early and self.next == len(self.need):
            ahead = max(0, self.next - reached)
            source = self.source
            if ahead + source.early_reads(self.epoch + 1) <= low:
                source.read_early(self.epoch + 1, self._early_room(ahead), len(self.need))

    def _early_room(self, ahead: int) -> int:
        """How many of the next epoch's row groups may be read now, `ahead` of this one's being
        read ahead of the rows handed out."""
        room = self.source.row_groups_in_flight - ahead
        limit = self.source.max_bytes_ahead
        sizes = [g.nbytes for g in self.pinned.values() if g.nbytes]
        if limit is not None and sizes:
            room = min(room, int(limit * len(sizes) / sum(sizes)) - ahead)
        return max(0, room)

    def _room(self, reached: int) -> bool:
        """Whether one more row group may be read ahead."""
        ahead = self.next - reached
        if ahead >= self.source.row_groups_in_flight:
            return False
        limit = self.source.max_bytes_ahead
        if limit is None or ahead == 0:
            return True
        sizes = [g.nbytes for g in self.pinned.values() if g.nbytes]
        return not sizes or (ahead + 1) * sum(sizes) / len(sizes) <= limit

    def group(self, g: int) -> RowGroup:
        return self.pinned[g]

    def _let_go(self, g: int) -> None:
        self.source.forget(g, self.pinned.pop(g))  # the samples that hold it keep it until done

    def close(self) -> None:
        for g in list(self.pinned):
            self._let_go(g)
        self.ends.clear()


class Turns:
    """At most `limit()` holders at once (asked again at each turn, so it may move); waiters are
    let in lowest `order` first. Until a first turn has ended, one holder only: the row group
    needed first is decoded alone (the first batch waits for it; read ahead beside it, each
    decode in a fresh process would take as long as all of them, its memory being new)."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self.limit = limit
        self.ended = 0  # turns ended so far
        self.busy = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrived = itertools.count()  # equal orders: first come, first served

    @contextlib.asynccontextmanager
    async def turn(self, order: int) -> AsyncIterator[None]:
        if self.busy < self._limit() and not self._waiting:
            self.busy += 1
        else:
            fut = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiting, (order, next(self._arrived), fut))
            try:
                await fut
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():  # handed a turn as it was cancelled
                    self._release()
                raise
        try:
            yield
        finally:
            self._release()

    def _limit(self) -> int:
        return self.limit() if self.ended else 1

    def _release(self) -> None:
        self.busy -= 1
        self.ended += 1
        limit = self._limit()
        while self._waiting and self.busy < limit:
            fut = heapq.heappop(self._waiting)[2]
            if not fut.done():  # else: its waiter was cancelled
                fut.set_result(None)
                self.busy += 1


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1
