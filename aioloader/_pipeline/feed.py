"""What a batch stage hands the consumer, and `Feed`, which runs a stage ahead of the consumer.

A stage (`BatchStage`: the transfer stage's `DeviceStage`, or `PinStage` for host pinning alone) turns
each host batch into a `Staged` in a thread of its own; `Feed` keeps at most `device_prefetch` of them
staged and not yet handed over; the consumer's thread passes each to the stage's `hand_over`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._observe.stats import Recorder
from .cuda import Event
from .stages import END

__all__ = ["BatchStage", "Feed", "StageCounts", "Staged", "map_leaves"]


@dataclass(eq=False)
class Staged:
    """A batch whose copies to the device are issued; pass it to `DeviceStage.hand_over`."""

    batch: Any
    tensors: list[torch.Tensor]
    event: Event | None  # None: nothing to wait for (pinned on the host only)
    on_hand_over: Callable[[], None] | None = None
    handed_over: bool = False


class StageCounts:
    """A stage's counters, under a lock of their own (the transfer thread and the consumer's add to
    them): "staged" and "handed_over" batches, "ahead" (staged, not handed over) and its peak."""

    def __init__(self, *extra: str) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(("staged", "handed_over", "ahead", "ahead_peak", *extra), 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta
            self._values["ahead_peak"] = max(self._values["ahead_peak"], self._values["ahead"])

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class BatchStage(Protocol):
    """What `Feed` and the loader's epochs drive: `DeviceStage`, or `PinStage` (pinned on the host only)."""

    device_prefetch: int

    async def astage(self, batch: Any) -> Staged: ...
    def hand_over(self, staged: Staged) -> Any: ...
    def feed(self, epoch: _Batches, recorder: Recorder | None = None) -> Feed: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class _Batches(Protocol):
    """What `Feed` wraps: an `Epoch` (get, aclose, cancel, loop)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    async def get(self) -> tuple[int, Any]: ...
    async def aclose(self) -> None: ...
    def cancel(self) -> None: ...
    def stuck(self) -> tuple[str, list[tuple[Any, float]]]: ...


class Feed:
    """An epoch whose batches are staged on the device ahead of the consumer; `Epoch`'s interface.

    `get()` returns `(index, Staged)`, or `(-1, END)` after the last batch, and raises the epoch's error
    in its place (a staging error carries the note "stage 'transfer'"). The consumer passes the `Staged`
    to `DeviceStage.hand_over` in its own thread; that frees its slot, so at most `device_prefetch`
    batches are staged and not handed over. Construct it on the epoch's event loop.
    """

    def __init__(
        self, stage: BatchStage, epoch: _Batches, recorder: Recorder | None = None
    ) -> None:
        self._stage, self._epoch = stage, epoch
        self._rec = recorder or Recorder()  # times each staging as the "transfer" stage
        self._slots = asyncio.Semaphore(stage.device_prefetch)
        self._out: asyncio.Queue[tuple[tuple[int, Any], BaseException | None]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="aioloader-transfer")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this feed and its epoch run on."""
        return self._loop

    def stuck(self) -> tuple[str, list[tuple[Any, float]]]:
        """The epoch's `stuck()`: where its oldest work in flight is."""
        return self._epoch.stuck()

    async def get(self) -> tuple[int, Any]:
        """The next `(index, Staged)`, `(-1, END)` after the last; safe to cancel."""
        return _got(await self._out.get())

    def ready(self) -> tuple[int, Any] | None:
        """`get()` at once when a staged batch is waiting, else None."""
        return None if self._out.empty() else _got(self._out.get_nowait())

    async def aclose(self) -> None:
        """Cancel the staging and the epoch and wait until both have ended. Idempotent."""
        self._task.cancel()
        try:
            await asyncio.wait([self._task])
        finally:
            await self._epoch.aclose()

    def cancel(self) -> None:
        """Ask the feed and its epoch to stop (non-blocking; call on the feed's loop)."""
        self._task.cancel()
        self._epoch.cancel()

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                index, batch = await self._epoch.get()
            except Exception as exc:
                return self._out.put_nowait(((-1, None), exc))
            if batch is END:
                return self._out.put_nowait(((-1, END), None))
            t0 = self._rec.start("transfer")
            try:
                staged = await self._stage.astage(batch)
            except asyncio.CancelledError:
                self._rec.cancelled("transfer", t0)
                raise
            except Exception as exc:
                self._rec.stop("transfer", t0, error=True, key=index)
                exc.add_note("aioloader: raised in stage 'transfer'")
                return self._out.put_nowait(((-1, None), exc))
            self._rec.stop("transfer", t0, key=index)
            del batch  # the host batch's buffers may be recycled now
            staged.on_hand_over = self._release
            self._out.put_nowait(((index, staged), None))

    def _release(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for the slot
            self._loop.call_soon_threadsafe(self._slots.release)


def map_leaves(
    obj: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None = None
) -> Any:
    """`obj` with `fn` applied to each CPU tensor leaf, depth first; other leaves kept as they are,
    or passed through `other` where given."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.device.type == "cpu" else obj
    if isinstance(obj, Mapping):
        moved = {key: map_leaves(value, fn, other) for key, value in obj.items()}
        if isinstance(obj, MutableMapping):
            out = copy.copy(obj)
            out.update(moved)
            return out
        return _rebuilt(obj, moved, dict)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_leaves(value, fn, other) for value in obj))
    if isinstance(obj, list | tuple):
        return _rebuilt(
            obj,
            [map_leaves(value, fn, other) for value in obj],
            list if isinstance(obj, list) else tuple,
        )
    return obj if other is None else other(obj)


def _rebuilt(obj: Any, items: Any, fallback: Callable[[Any], Any]) -> Any:
    try:
        return type(obj)(items)
    except TypeError:
        return fallback(items)


def _got(out: tuple[tuple[int, Any], BaseException | None]) -> tuple[int, Any]:
    item, error = out
    if error is not None:
        raise error
    return item
