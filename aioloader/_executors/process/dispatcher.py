"""The process executor's engine: one thread ("aioloader-procpool") that starts the workers,
dispatches tasks, reads answers, watches every worker's socket and sentinel, and enforces timeouts.

See `executor.py` for the design (start methods, async tasks, faults). This module holds `Pool`:
what other threads call, and the loop the pool's thread runs. The pool owns its parts, each an
object with its own state: `Workers` (`workers.py`: starting, watching and stopping the worker
processes), `Slots` (`slots.py`: output slots, and the workers' asks for one), `Sender`
(`sending.py`: the queue, tasks to workers), `Reader` (`results.py`: answers to tasks), `Faults`
(`faults.py`: dead and stalled workers, timeouts, cancels); what they share is `PoolState` and
`WakePipe` (`core.py`) and `Outcomes` (`outcomes.py`); `config.py` holds the settings.
Used through `ProcessExecutor` only.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import pickle
import selectors
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from ..._exceptions import LoaderClosedError
from ..._util.loops import is_async_callable
from ..._util.validate import check_int
from .arena import Arena
from .batch_buffer import BatchBuffer, RowTarget
from .config import JOIN_TIMEOUT_S, Config
from .core import PoolState, WakePipe, factory
from .faults import Faults
from .outcomes import Outcomes
from .results import Reader
from .sending import Sender
from .slots import Slots
from .tasks import Task, encode_arg
from .workers import Workers

__all__ = ["Pool"]


class Pool:
    """The process pool: what other threads call, and the loop its own thread runs over its parts.

    Other threads hand it tasks and cancels through the inbox, under the lock, and wake its thread
    (`submit`, `cancel`), or ask it to stop (`close`); `batch_buffer` takes a slot of the arena
    (under the arena's own lock) and `stats` reads the counters. An arena slot's finalizer calls
    `PoolState.slot_freed`, without the lock. The parts run on the pool's thread alone.
    """

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.closed = False
        self._lock = threading.Lock()
        # appended to under the lock by any thread, emptied by the pool's thread alone
        self._inbox: collections.deque[Task] = collections.deque()
        self._cancels: collections.deque[Task] = collections.deque()
        self._fns: list[tuple[Callable[[Any], Any], tuple[int, bool]]] = []
        self._wake = WakePipe(self._lock)
        # its parts: what each owns, see the module docstring
        state = self._state = PoolState(config, self._wake)
        outcomes = self._outcomes = Outcomes()
        workers = self._workers = Workers(config, state.counts)
        slots = self._slots = Slots(state, workers)
        sender = self._sender = Sender(state, outcomes, workers, slots)
        reader = self._reader = Reader(state, outcomes, workers, slots)
        self._faults = Faults(state, outcomes, workers, reader, sender)
        self._ids = itertools.count()  # taken under the lock: `next` is not atomic without the GIL
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._state.failure is not None:
                raise self._state.failure()
            if self.closed:
                raise LoaderClosedError("the process executor was closed")
            if self._thread is not None:
                return
            self._workers.prepare()
            arena = self._state.arena = Arena(self.cfg.arena_bytes)
            arena.on_free = self._state.slot_freed
            wake_r = self._wake.open()
            self._workers.selector.register(wake_r, selectors.EVENT_READ, ("wake", None))
            self._thread = threading.Thread(
                target=self._serve, name="aioloader-procpool", daemon=True
            )
            self._thread.start()

    def wait_ready(self, timeout: float | None) -> bool:
        ready = self._state.ready.wait(timeout)
        if self._state.failure is not None:
            raise self._state.failure()
        return ready and not self.closed

    def submit(
        self,
        fn: Callable[[Any], Any],
        arg: Any,
        seed: int | None,
        into: RowTarget | None = None,
        worker: int | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> Task:
        self.start()
        task = Task(-1, self._register(fn), seed, *encode_arg(arg), loop=loop)
        task.row = into
        if worker is not None:
            check_int("worker", worker, minimum=0)
            if worker >= self.cfg.workers:
                raise ValueError(f"worker must be below workers={self.cfg.workers}, got {worker}")
            task.pin = worker
        with self._lock:
            if self.closed:
                raise LoaderClosedError("the process executor was closed")
            if self._state.failure is not None:
                raise self._state.failure()
            task.id = next(self._ids)  # ids follow the inbox's order
            self._inbox.append(task)
            self._wake.poke_locked()
        return task

    def cancel(self, task: Task) -> None:
        """Cancel an async task in its worker (a `run` was cancelled); what it sends is dropped."""
        with self._lock:
            if not self.closed:
                self._cancels.append(task)
                self._wake.poke_locked()

    def _register(self, fn: Callable[[Any], Any]) -> tuple[int, bool]:
        with self._lock:
            for known, fn_key in self._fns:
                if known is fn or (isinstance(fn, types.MethodType) and known == fn):
                    return fn_key
        try:
            given = self._workers.given
            blob: bytes | int = id(fn) if id(fn) in given else pickle.dumps(fn, protocol=5)
        except Exception as exc:
            raise TypeError(
                f"executor='process' needs a decode callable that pickles (a module-level function "
                f"or an instance of a module-level class); {fn!r} does not: {exc}"
            ) from exc
        with self._lock:
            fn_key = (len(self._fns), is_async_callable(fn))
            self._fns.append((fn, fn_key))
            self._sender.fn_blobs[fn_key[0]] = blob
        return fn_key

    def close(self) -> None:
        with self._lock:
            thread, already = self._thread, self.closed
            self.closed = self._state.stopping = True
            if thread is not None and not already:
                self._wake.poke_locked()
            self._workers.ungive()
        if thread is None:
            self._workers.close_zygote()
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)

    def batch_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> BatchBuffer | None:
        self.start()
        arena = self._state.arena
        assert arena is not None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slot = arena.acquire(max(nbytes, 1))
        if slot is None:
            return None
        arena.retire_idle_samples()  # batches are written in place from now on
        try:
            return BatchBuffer(arena, slot, shape, dtype)
        finally:
            arena.release(slot)  # the tensor's view pins it from now on

    def pids(self) -> list[int]:
        return [h.pid for h in list(self._workers.handles) if not h.killed]

    def stats(self) -> dict[str, int]:
        arena = self._state.arena
        return {
            "pipe_bytes_sent": 0, "pipe_bytes_received": 0,
            **self._state.counts, "workers": len(self.pids()), "restarts": self._state.restarts,
            "arena_budget": self.cfg.arena_bytes,
            "arena_mapped": arena.mapped_bytes if arena is not None else 0,
            "batch_slabs": arena.batch_slabs if arena is not None else 0,
        }  # fmt: skip

    def _serve(self) -> None:
        try:
            for index in range(self.cfg.workers):
                self._workers.spawn(index)
            while not self._state.stopping:
                self._step()
        except BaseException as exc:  # a bug or a failed spawn: fail every task instead of hanging
            message = f"the process executor stopped: {type(exc).__name__}: {exc}"
            self._state.fail(factory(LoaderClosedError, message, cause=exc))
        finally:
            self._shutdown()

    def _step(self) -> None:
        self._workers.watch_all()
        for key, _ in self._workers.selector.select(self._wait_timeout()):
            what, handle = key.data
            if handle is None:
                self._wake.drain()
            elif what == "conn":
                self._reader.read(handle)
            elif handle in self._workers.handles:
                self._faults.reap(handle)
        while self._inbox:
            self._sender.queue(self._inbox.popleft())
        while self._cancels:
            self._faults.cancel(self._cancels.popleft())
        self._faults.expire()
        if self._slots.wants:
            self._slots.answer_wants()
        self._sender.dispatch()
        self._workers.flush()
        self._outcomes.hand_over()

    def _shutdown(self) -> None:
        with self._lock:
            self.closed = True
        handles = self._workers.stop()
        failure = self._state.failure or factory(
            LoaderClosedError, "the process executor was closed"
        )
        pending = self._sender.take_all()
        tasks = [*pending, *self._inbox, *(t for h in handles for t in h.inflight.values())]
        self._inbox.clear()
        self._cancels.clear()
        for task in tasks:
            self._outcomes.settle(task, error=failure())
        self._outcomes.hand_over()
        if self._state.arena is not None:
            self._state.arena.close()
        self._workers.close_zygote()
        self._wake.close()
        self._state.ready.set()

    def _wait_timeout(self) -> float | None:
        now, keeps_from = time.monotonic(), self._state.keeps_from()
        deadlines = [
            *self._faults.deadlines(),
            *self._slots.deadlines(now, keeps_from),
            *self._sender.deadlines(now, keeps_from),
        ]
        return max(0.0, min(deadlines) - now) if deadlines else None
