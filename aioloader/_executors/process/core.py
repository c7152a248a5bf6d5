"""The process pool's state, and what every part of its thread uses: wake, settle, free, fail."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import os
import pickle
import selectors
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._util.bytearrays import Bytearrays
from .arena import Arena, Slot
from .config import COPIES_BYTES, FIRST_OUTPUT_BYTES, FORKED, RELEASES_STOP_S, Config
from .outcomes import Mailbox, Outcome, cancelled, settle_future
from .tasks import Handle, Task
from .worker import GIVEN, serve
from .zygote import Zygote

__all__ = ["PoolCore", "factory", "pickle_given"]


class PoolCore:
    """The workers, the task queue and the arena; one thread ("aioloader-procpool") runs it all.

    Other threads only append to the inbox and wake that thread (`submit`), or ask it to stop.
    The parts of that thread build on this class, each on the one before: `WorkerProcesses`
    (`workers.py`), `Sending` (`sending.py`), `Results` (`results.py`), `Faults` (`faults.py`),
    and `Pool` (`dispatcher.py`), which runs them.
    """

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.closed = False
        self._lock = threading.Lock()
        self._inbox: collections.deque[Task] = collections.deque()
        self._cancels: collections.deque[Task] = collections.deque()
        self._pending: collections.deque[Task] = collections.deque()
        self._handles: list[Handle] = []
        self._fns: list[tuple[Callable[[Any], Any], tuple[int, bool]]] = []
        self._fn_blobs: dict[int, bytes | int] = {}
        # objects given to the workers as they start (see `worker.GIVEN`), by id
        self._given = {id(o): o for o in (*config.given, config.init) if o is not None}
        self._given_blob = (
            None if config.method in FORKED else pickle_given(self._given, config.method)
        )
        GIVEN.update(self._given)  # before any fork
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._arena: Arena | None = None
        # bytearray results are copied out of their slot into these (see `_util/bytearrays.py`)
        self._copies = Bytearrays(COPIES_BYTES)
        self._wake_r = self._wake_w = -1
        self._wake_pending = False  # a byte is in the wake pipe (see `_wake_locked`)
        # what the pool's thread waits on: each worker's socket and sentinel, and the wake pipe
        self._selector = selectors.DefaultSelector()
        self._stopping = False
        self._ready = threading.Event()
        self._failure: Callable[[], BaseException] | None = None
        self._restarts = 0
        self._slot_waits = False  # a task asks for an output slot (see `_slot_freed`)
        self._send_waits = False  # a task waits to be sent until a slot is freed (`_releasing`)
        self._wants: list[tuple[Handle, int, float]] = []  # (worker, task id, since): slot asks
        self._consumer_keeps = False  # a slot ask waited `SLOT_WAIT_S` in vain
        self._freed_at = 0.0  # when a slot was last freed (the consumer let go of a batch)
        self._free_gap = 0.0  # the usual time between two frees (a moving mean)
        self._delivered_at = 0.0  # when the consumer was last handed a result
        self._out_bytes, self._out_known = FIRST_OUTPUT_BYTES, False
        # from torch's seed, without drawing from its generator (a DataLoader must leave the global
        # RNG as torch's leaves it)
        self._seed = (torch.initial_seed() * 0x9E3779B97F4A7C15 + 1) % 2**62
        self._zygote: Zygote | None = None
        if config.method == "zygote" and not config.fork_at_start:
            self._zygote = Zygote(serve)
        self.counts: collections.Counter[str] = collections.Counter()
        self._outcomes: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}  # see `_settle`
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    def _wake_locked(self) -> None:
        # one byte until the pool's thread reads it: a burst of submits costs one write, one wake-up
        if not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def _slot_freed(self) -> None:
        """(Any thread: a view's finalizer.) A slot came back: wake the pool's thread if a task
        waits for one. It takes no lock: a finalizer may run in a thread that holds one of ours."""
        now = time.monotonic()
        if self._freed_at:
            self._free_gap += (now - self._freed_at - self._free_gap) / 4
        self._freed_at = now
        if self._slot_waits:
            self._slot_waits = False
            fd = self._wake_w
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.write(fd, b"\0")

    def _keeps_from(self) -> float:
        """When the consumer will be taken to keep the batches it holds, if it frees none before:
        `RELEASES_STOP_S`, or three of its usual gaps between frees where that is longer (a slow
        step is not keeping), after the later of its last free and the last slot it was handed
        (results just handed over in slots are not kept yet: the consumer has not seen them)."""
        since = max(self._freed_at, self._delivered_at)
        return since + max(RELEASES_STOP_S, 3 * self._free_gap)

    def _settle(self, task: Task, result: Any = None, error: BaseException | None = None) -> None:
        """Give `task` its outcome: a concurrent future at once, an asyncio one at `_hand_over`."""
        if task.loop is None:
            settle_future(task.future, result, error)  # type: ignore[arg-type]
        else:
            outcome = (task.future, result, error)
            self._outcomes.setdefault(task.loop, []).append(outcome)  # type: ignore[arg-type]

    def _hand_over(self) -> None:
        """Post the queued outcomes of `run` calls to their loops' mailboxes."""
        outcomes, self._outcomes = self._outcomes, {}
        for loop, items in outcomes.items():
            box = self._mailboxes.get(loop)
            if box is None:
                for old in [x for x in self._mailboxes if x.is_closed()]:
                    del self._mailboxes[old]
                box = self._mailboxes[loop] = Mailbox(loop)
            box.post(items)

    def _free(self, slot: Slot | None) -> None:
        if slot is not None and self._arena is not None:
            self._arena.release(slot)

    def _live(self, tasks: list[Task]) -> list[Task]:
        """Of `tasks` taken from a worker, those still wanted; the others are answered."""
        for t in tasks:
            if t.abandoned:
                self._settle(t, error=cancelled())
        return [t for t in tasks if not t.abandoned]

    def _fail_pool(self, error: Callable[[], BaseException]) -> None:
        """Refuse new tasks with `error()` and stop the pool; every queued task fails with it."""
        self._failure = error
        self._stopping = True
        self._ready.set()


def pickle_given(given: dict[int, Any], method: str) -> bytes:
    """`given` pickled for workers that are not forked; a TypeError naming what does not pickle."""
    try:
        return pickle.dumps(given, protocol=5)
    except Exception as exc:
        where = next(
            (path for obj in given.values() for path in _unpicklable(obj, type(obj).__name__)),
            None,
        )
        raise TypeError(
            f"the worker processes do not fork (start method {method!r}), so what they run is "
            f"pickled, and "
            f"{where or 'it'} does not pickle ({type(exc).__name__}: {exc}). Define it at module "
            "level, keep the default (fork) start method, or read in threads "
            "(aioloader.DataLoader(..., worker_mode='thread'))"
        ) from exc


def _unpicklable(obj: Any, path: str, depth: int = 4) -> Iterator[str]:
    """Paths (`Dataset.transform.fn`) of the innermost attributes of `obj` that do not pickle."""
    try:
        pickle.dumps(obj, protocol=5)
        return
    except Exception:
        pass
    inner = vars(obj) if depth > 0 and hasattr(obj, "__dict__") else {}
    if isinstance(obj, functools.partial):
        inner = {"func": obj.func}
    elif depth > 0 and hasattr(obj, "__self__") and hasattr(obj, "__func__"):
        inner = {"__self__": obj.__self__}
    found = False
    for name, value in inner.items():
        for deeper in _unpicklable(value, f"{path}.{name}", depth - 1):
            found = True
            yield deeper
    if not found:
        yield path


def factory(
    cls: type[BaseException], text: str, cause: BaseException | None = None, **attrs: Any
) -> Callable[[], BaseException]:
    """Makes a fresh `cls(text, **attrs)` per call (one exception object per failed task)."""

    def make() -> BaseException:
        exc = cls(text, **attrs)
        exc.__cause__ = cause
        return exc

    return make
