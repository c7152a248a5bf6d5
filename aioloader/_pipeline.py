"""One epoch of the pipeline on one event loop: launch, fetch, decode, reorder, collate, hand over.

Bounds (all counted in samples, never in time):
- at most `concurrency` fetches in flight;
- at most `prefetch * group_size + concurrency` samples held between launch and hand-over, so memory is
  bounded by `prefetch` batches plus `concurrency` samples whatever the consumer does.

Groups (see `_order.py`) are delivered whole, in group order (`in_order=True`) or as they complete. An
error in a user callable ends the epoch: batches before it (in delivery order) are delivered, then the
error is raised to the consumer with a note naming the stage and the key.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ._decode import Executor
from ._exceptions import LoaderClosedError
from ._fetch import Fetcher
from ._order import Group
from ._rng import derive_seed

__all__ = ["END", "Epoch", "Stages"]


class _End:
    def __repr__(self) -> str:
        return "END"


END: Any = _End()


@dataclass
class Stages:
    """The callables and bounds that an epoch runs with (owned by the loader, shared by epochs)."""

    fetch: Fetcher
    decode: Callable[[Any], Any] | None
    decoder: Executor
    collate: Callable[[list[Any]], Any] | None
    collator: Executor
    concurrency: int
    prefetch: int
    in_order: bool
    group_size: int
    seed: int = 0


_Item = tuple[int, Any, int, BaseException | None]  # group index, batch, samples, error


async def _each(groups: Iterable[Group] | AsyncIterable[Group]) -> AsyncIterable[Group]:
    if isinstance(groups, AsyncIterable):
        async for group in groups:
            yield group
    else:
        for group in groups:
            yield group


class _Failed(Exception):
    """Internal: an error was handed to the consumer; stop the epoch."""


def _note(exc: BaseException, stage: str, keys: list[Any]) -> BaseException:
    what = "" if not keys else f" for key {keys[0]!r}" if len(keys) == 1 else f" for keys {keys!r}"
    exc.add_note(f"aioloader: raised in stage {stage!r}{what}")
    return exc


class _GroupState:
    __slots__ = ("group", "remaining", "samples")

    def __init__(self, group: Group) -> None:
        self.group = group
        self.samples: list[Any] = [None] * len(group.items)
        self.remaining = len(group.items)


class Epoch:
    """Runs one pass over `groups`. Construct it inside the event loop that will run it.

    `get()` returns the next batch, or `END` after the last one; it raises the first error of the epoch.
    `aclose()` cancels everything still running and is idempotent.
    """

    def __init__(
        self, stages: Stages, groups: Iterable[Group] | AsyncIterable[Group], epoch: int = 0
    ) -> None:
        self._stages = stages
        self._epoch = epoch
        self._groups = groups
        self._out: asyncio.Queue[_Item] = asyncio.Queue()
        self._held = asyncio.Semaphore(stages.prefetch * stages.group_size + stages.concurrency)
        self._in_flight = asyncio.Semaphore(stages.concurrency)
        self._ready: dict[int, _Item] = {}
        self._launched: deque[int] = deque()  # group indices in launch order, until delivered
        self._failed_group: int | None = None
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aioloader-epoch")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this epoch runs on."""
        return self._task.get_loop()

    async def get(self) -> tuple[int, Any]:
        """(group index, batch) of the next batch, `(-1, END)` after the last; raises the epoch's
        error in its place."""
        index, batch, size, error = await self._out.get()
        for _ in range(size):
            self._held.release()
        if error is not None:
            raise error
        return index, batch

    async def aclose(self) -> None:
        """Cancel the epoch and wait until every task of it has ended."""
        self.cancel()
        with contextlib.suppress(asyncio.CancelledError, _Failed):
            await self._task

    def cancel(self) -> None:
        """Ask the epoch to stop (non-blocking; call on the epoch's loop).

        A `get()` waiting now, or called later, raises `LoaderClosedError` instead of waiting forever.
        """
        self._task.cancel()
        self._out.put_nowait((-1, None, 0, LoaderClosedError("the loader was closed")))

    async def _run(self) -> None:
        try:
            await self._launch()
        except BaseExceptionGroup as group:
            _, rest = group.split(_Failed)
            if rest is not None:
                if rest.subgroup(lambda e: not isinstance(e, Exception)) is not None:
                    raise
                # a bug, or an error raised while iterating the keys: hand it to the consumer
                self._out.put_nowait((-1, None, 0, _note(rest.exceptions[0], "order", [])))
            return
        except (KeyboardInterrupt, SystemExit) as exc:
            # TaskGroup raises these bare; escaping this task they would stop the event loop itself
            self._out.put_nowait((-1, None, 0, _note(exc, "order", [])))
            return
        self._out.put_nowait((-1, END, 0, None))

    async def _launch(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            async for group in _each(self._groups):
                if self._failed_group is not None:
                    break
                self._launched.append(group.index)
                state = _GroupState(group)
                for slot, (_, key) in enumerate(group.items):
                    await self._held.acquire()
                    await self._in_flight.acquire()
                    tasks.create_task(self._sample(state, slot, key))

    async def _sample(self, state: _GroupState, slot: int, key: Any) -> None:
        stages = self._stages
        try:
            try:
                raw = await stages.fetch(key)
            finally:
                self._in_flight.release()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            # SystemExit & co. too: they belong to the consumer; escaping, they would stop the loop
            return self._deliver(state.group, None, _note(exc, "fetch", [key]))
        if stages.decode is not None:
            try:
                seed = derive_seed(stages.seed, self._epoch, state.group.items[slot][0])
                raw = await stages.decoder.run(stages.decode, raw, seed)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                return self._deliver(state.group, None, _note(exc, "decode", [key]))
        state.samples[slot] = raw
        state.remaining -= 1
        if state.remaining == 0:
            await self._collate(state)

    async def _collate(self, state: _GroupState) -> None:
        group, samples = state.group, state.samples
        if not group.batched:
            return self._deliver(group, samples[0], None)
        if self._stages.collate is None:
            return self._deliver(group, samples, None)
        try:
            batch = await self._stages.collator.run(self._stages.collate, samples)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            keys = [key for _, key in group.items]
            return self._deliver(group, None, _note(exc, "collate", keys))
        self._deliver(group, batch, None)

    def _deliver(self, group: Group, batch: Any, error: BaseException | None) -> None:
        item = (group.index, batch, len(group.items), error)
        if not self._stages.in_order:
            self._out.put_nowait(item)
            if error is not None:
                raise _Failed
            return
        if error is not None and self._failed_group is None:
            self._failed_group = group.index
        self._ready[group.index] = item
        while self._launched and self._launched[0] in self._ready:
            item = self._ready.pop(self._launched.popleft())
            self._out.put_nowait(item)
            if item[3] is not None:
                raise _Failed
