"""What the process pool's parts share: its state (`PoolState`), the pipe that wakes its thread
(`WakePipe`), and `factory` for the errors it fails tasks with."""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .arena import Arena, Slot
from .config import FIRST_OUTPUT_BYTES, RELEASES_STOP_S, Config

__all__ = ["PoolState", "WakePipe", "factory"]


class WakePipe:
    """The pipe that wakes the pool's thread out of its selector: other threads write a byte to it
    (`submit`, `cancel` and `close` under the pool's lock; an arena slot's finalizer without it)."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock  # the pool's: `_pending` is set and reset under it
        self.r = self.w = -1
        self._pending = False  # a byte is in the wake pipe (see `poke_locked`)

    def open(self) -> int:
        """Make the pipe (the pool's lock held); returns the end the pool's thread waits on."""
        self.r, self.w = os.pipe()
        os.set_blocking(self.w, False)
        return self.r

    def poke_locked(self) -> None:
        """(The pool's lock held.) Wake the pool's thread."""
        # one byte until the pool's thread reads it: a burst of submits costs one write, one wake-up
        if not self._pending:
            self._pending = True
            with contextlib.suppress(BlockingIOError):
                os.write(self.w, b"\0")

    def poke(self) -> None:
        """(Any thread, no lock.) Wake the pool's thread, unless the pipe is closed."""
        fd = self.w
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.write(fd, b"\0")

    def drain(self) -> None:
        """(The pool's thread.) Read what woke it."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.r, 4096)
        with self._lock:  # before the inbox is read: a later submit writes again
            self._pending = False

    def close(self) -> None:
        with self._lock:
            wake_r, wake_w = self.r, self.w
            self.r = self.w = -1  # `PoolState.slot_freed` writes to it no more
            os.close(wake_r)
            os.close(wake_w)


class PoolState:
    """What the parts of the pool's thread share: the arena, the size results take, the consumer's
    pace (when it last freed a slot, was handed one), the restarts, the counters, and whether the
    pool failed or stops. `slot_freed` alone runs on other threads."""

    def __init__(self, config: Config, wake: WakePipe) -> None:
        self.cfg = config
        self.wake = wake
        self.arena: Arena | None = None  # made by `Pool.start`
        self.counts: collections.Counter[str] = collections.Counter()
        self.failure: Callable[[], BaseException] | None = None
        self.stopping = False
        self.ready = threading.Event()
        self.restarts = 0
        self.slot_waits = False  # a task asks for an output slot (see `slot_freed`)
        self.freed_at = 0.0  # when a slot was last freed (the consumer let go of a batch)
        self.free_gap = 0.0  # the usual time between two frees (a moving mean)
        self.delivered_at = 0.0  # when the consumer was last handed a result
        self.out_bytes, self.out_known = FIRST_OUTPUT_BYTES, False

    def slot_freed(self) -> None:
        """(Any thread: a view's finalizer.) A slot came back: wake the pool's thread if a task
        waits for one. It takes no lock: a finalizer may run in a thread that holds one of ours."""
        now = time.monotonic()
        if self.freed_at:
            self.free_gap += (now - self.freed_at - self.free_gap) / 4
        self.freed_at = now
        if self.slot_waits:
            self.slot_waits = False
            self.wake.poke()

    def keeps_from(self) -> float:
        """When the consumer will be taken to keep the batches it holds, if it frees none before:
        `RELEASES_STOP_S`, or three of its usual gaps between frees where that is longer (a slow
        step is not keeping), after the later of its last free and the last slot it was handed
        (results just handed over in slots are not kept yet: the consumer has not seen them)."""
        since = max(self.freed_at, self.delivered_at)
        return since + max(RELEASES_STOP_S, 3 * self.free_gap)

    def free(self, slot: Slot | None) -> None:
        if slot is not None and self.arena is not None:
            self.arena.release(slot)

    def fail(self, error: Callable[[], BaseException]) -> None:
        """Refuse new tasks with `error()` and stop the pool; every queued task fails with it."""
        self.failure = error
        self.stopping = True
        self.ready.set()


def factory(
    cls: type[BaseException], text: str, cause: BaseException | None = None, **attrs: Any
) -> Callable[[], BaseException]:
    """Makes a fresh `cls(text, **attrs)` per call (one exception object per failed task)."""

    def make() -> BaseException:
        exc = cls(text, **attrs)
        exc.__cause__ = cause
        return exc

    return make
