"""The process executor's engine: one thread ("aioloader-procpool") that starts the workers,
dispatches tasks, reads answers, watches every worker's socket and sentinel, and enforces timeouts.

See `executor.py` for the design (start methods, async tasks, faults); this module is its
implementation, used through `ProcessExecutor` only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import math
import multiprocessing as mp
import os
import pickle
import selectors
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.context import BaseContext
from typing import Any

import torch

from ..._exceptions import LoaderClosedError, WorkerDied, WorkerTimeout
from ..._util.bytearrays import Bytearrays
from ..._util.loops import is_async_callable
from ..._util.validate import check_int
from . import worker as wire
from .arena import Arena, Slot
from .tasks import (
    BatchBuffer,
    Handle,
    Mailbox,
    Outcome,
    RowTarget,
    Task,
    cancelled,
    died_text,
    encode_arg,
    settle_future,
)
from .worker import GIVEN, Unpacker, load_placed, rebuild_error, serve
from .zygote import Zygote, ZygoteProcess, zygote_allowed

__all__ = ["ASYNC_DEPTH", "Config", "Pool", "factory", "pick_start_method"]

# Tasks sent ahead to one worker: one running, one waiting in its socket (hides the round trip).
# With `INLINE_MAX` this keeps what a worker has not read yet far below a socket's buffer, so the
# pool's thread never blocks on a send.
QUEUE_DEPTH = 2
ASYNC_DEPTH = 64  # async tasks one worker may hold at once, by default
COPIES_BYTES = 64 << 20  # recycled bytearrays kept for results copied out of slots, at most
# Whole batches: the slabs one worker may map for itself, the one it writes and the one it wrote last
# (the consumer has not taken it yet). Each costs the worker its pages' mapping once. (Measured with
# one: a worker still made a second whenever both batches waited for the consumer, as they do
# whenever it is quick.) A task that waits for a slot is woken as soon as one is released.
SLABS_PER_WORKER = 2
FIRST_OUTPUT_BYTES = 1 << 20  # output slot for tasks before the first result tells the real size
CANCEL_GRACE_S = 1.0  # a timed-out async task not ended this long after its cancel: kill the worker
START_TIMEOUT_S = 60.0  # a worker not ready by then (hung worker_init_fn) fails the pool
STOP_GRACE_S = 0.5  # close(): how long workers get to exit before SIGKILL
JOIN_TIMEOUT_S = 2.0
_FORKED = ("zygote", "fork")  # start methods whose workers inherit what they are given
_PRELOAD = (
    "aioloader._executors.process.worker",
)  # imports torch, numpy and aioloader once, in the forkserver


def pick_start_method(
    method: str | None, like_torch: bool = False
) -> tuple[str, BaseContext | None]:
    """(method, its multiprocessing context; None for "zygote"). None picks as the docstring says;
    `like_torch`: forks where torch's DataLoader does (any Linux process, threads or CUDA)."""
    methods = [*mp.get_all_start_methods(), "zygote"]
    torch_fork = like_torch and method is None and sys.platform.startswith("linux")
    if method is None:
        method = "zygote" if torch_fork or zygote_allowed() is None else "forkserver"
        method = method if method in methods else "spawn"
    if method not in methods:
        raise ValueError(f"start_method must be one of {methods}, got {method!r}")
    cuda_live: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if method in ("fork", "zygote") and cuda_live and not torch_fork:
        raise RuntimeError(
            f"start_method={method!r} after CUDA was initialised in this process: a forked "
            "worker inherits a CUDA context it cannot use; use 'forkserver' or 'spawn'"
        )
    if method == "zygote":
        return method, None
    ctx = mp.get_context(method)
    if method == "forkserver":
        from multiprocessing import forkserver

        preload = list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))
        ctx.set_forkserver_preload(preload + [m for m in _PRELOAD if m not in preload])
    return method, ctx


@dataclass(frozen=True)
class Config:
    workers: int
    method: str
    context: BaseContext | None
    timeout: float | None
    max_restarts: int
    init: Callable[[int], Any] | None
    arena_bytes: int
    inline_max: int
    async_depth: int
    size_first: bool = False  # see ProcessExecutor
    given: tuple[Any, ...] = ()  # see ProcessExecutor
    fork_at_start: bool = False  # the zygote is forked by `start`, not by the constructor


class Pool:
    """The workers, the task queue and the arena; one thread ("aioloader-procpool") runs it all.

    Other threads only append to the inbox and wake that thread (`submit`), or ask it to stop.
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
        # objects given to the workers as they start (see `_worker.GIVEN`), by id
        self._given = {id(o): o for o in (*config.given, config.init) if o is not None}
        self._given_blob = (
            None if config.method in _FORKED else _pickle_given(self._given, config.method)
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
        self._slot_waits = False  # a task waits for an output slot (see `_slot_freed`)
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

    # -- any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._failure is not None:
                raise self._failure()
            if self.closed:
                raise LoaderClosedError("the process executor was closed")
            if self._thread is not None:
                return
            if self._given_blob is not None:  # as they are now (checked at construction)
                self._given_blob = _pickle_given(self._given, self.cfg.method)
            if self.cfg.method == "zygote" and self._zygote is None:
                self._zygote = Zygote(serve)
            self._arena = Arena(self.cfg.arena_bytes)
            self._arena.on_free = self._slot_freed
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            self._selector.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
            self._thread = threading.Thread(
                target=self._serve, name="aioloader-procpool", daemon=True
            )
            self._thread.start()

    def wait_ready(self, timeout: float | None) -> bool:
        ready = self._ready.wait(timeout)
        if self._failure is not None:
            raise self._failure()
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
        task = Task(next(self._ids), self._register(fn), seed, *encode_arg(arg), loop=loop)
        task.row = into
        if worker is not None:
            check_int("worker", worker, minimum=0)
            if worker >= self.cfg.workers:
                raise ValueError(f"worker must be below workers={self.cfg.workers}, got {worker}")
            task.pin = worker
        with self._lock:
            if self.closed:
                raise LoaderClosedError("the process executor was closed")
            if self._failure is not None:
                raise self._failure()
            self._inbox.append(task)
            self._wake_locked()
        return task

    def cancel(self, task: Task) -> None:
        """Cancel an async task in its worker (a `run` was cancelled); what it sends is dropped."""
        with self._lock:
            if not self.closed:
                self._cancels.append(task)
                self._wake_locked()

    def _register(self, fn: Callable[[Any], Any]) -> tuple[int, bool]:
        with self._lock:
            for known, fn_key in self._fns:
                if known is fn or (isinstance(fn, types.MethodType) and known == fn):
                    return fn_key
        try:
            blob: bytes | int = id(fn) if id(fn) in self._given else pickle.dumps(fn, protocol=5)
        except Exception as exc:
            raise TypeError(
                f"executor='process' needs a decode callable that pickles (a module-level function "
                f"or an instance of a module-level class); {fn!r} does not: {exc}"
            ) from exc
        with self._lock:
            fn_key = (len(self._fns), is_async_callable(fn))
            self._fns.append((fn, fn_key))
            self._fn_blobs[fn_key[0]] = blob
        return fn_key

    def _slot_freed(self) -> None:
        """(Any thread: a view's finalizer.) A slot came back: wake the pool's thread if a task
        waits for one. It takes no lock: a finalizer may run in a thread that holds one of ours."""
        if self._slot_waits:
            self._slot_waits = False
            fd = self._wake_w
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.write(fd, b"\0")

    def _wake_locked(self) -> None:
        # one byte until the pool's thread reads it: a burst of submits costs one write, one wake-up
        if not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def close(self) -> None:
        with self._lock:
            thread, already = self._thread, self.closed
            self.closed = self._stopping = True
            if thread is not None and not already:
                self._wake_locked()
            for key, obj in self._given.items():
                if GIVEN.get(key) is obj:
                    del GIVEN[key]
        if thread is None and self._zygote is not None:
            self._zygote.close()
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)

    def batch_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> BatchBuffer | None:
        self.start()
        assert self._arena is not None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        slot = self._arena.acquire(max(nbytes, 1))
        if slot is None:
            return None
        self._arena.retire_idle_samples()  # batches are written in place from now on
        try:
            return BatchBuffer(self._arena, slot, shape, dtype)
        finally:
            self._arena.release(slot)  # the tensor's view pins it from now on

    def pids(self) -> list[int]:
        return [h.pid for h in list(self._handles) if not h.killed]

    def stats(self) -> dict[str, int]:
        arena = self._arena
        return {
            "pipe_bytes_sent": 0, "pipe_bytes_received": 0,
            **self.counts, "workers": len(self.pids()), "restarts": self._restarts,
            "arena_budget": self.cfg.arena_bytes,
            "arena_mapped": arena.mapped_bytes if arena is not None else 0,
        }  # fmt: skip

    # -- the pool's thread -------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            for index in range(self.cfg.workers):
                self._spawn(index)
            while not self._stopping:
                self._step()
        except BaseException as exc:  # a bug or a failed spawn: fail every task instead of hanging
            message = f"the process executor stopped: {type(exc).__name__}: {exc}"
            self._fail_pool(factory(LoaderClosedError, message, cause=exc))
        finally:
            self._shutdown()

    def _spawn(self, index: int) -> None:
        conn, child_conn = mp.Pipe(duplex=True)
        lifeline_r, lifeline_w = mp.Pipe(duplex=False)
        init = None if self.cfg.init is None else id(self.cfg.init)
        args = (index, self._seed + index, init, self._given_blob is not None)
        process: Any
        try:
            if self._zygote is not None:
                sentinel, sentinel_w = os.pipe()
                try:
                    fds = [child_conn.fileno(), lifeline_r.fileno(), sentinel_w]
                    process = ZygoteProcess(self._zygote, self._zygote.spawn(args, fds), sentinel)
                finally:
                    os.close(sentinel_w)
            else:
                assert self.cfg.context is not None
                process = self.cfg.context.Process(  # type: ignore[attr-defined]
                    target=serve, args=(child_conn, lifeline_r, *args), daemon=True,
                    name=f"aioloader-decode-{index}",
                )  # fmt: skip
                process.start()
        finally:
            child_conn.close()
            lifeline_r.close()
        handle = Handle(index, process, conn, lifeline_w, self.counts)
        self._handles.append(handle)
        if self._given_blob is not None:
            handle.send_bytes(self._given_blob)
            handle.flush()

    def _watch(self, h: Handle) -> None:
        """Wait on `h`'s socket (while it is open) and on its process's sentinel."""
        if h.open and not h.watched_conn:
            self._selector.register(h.conn.fileno(), selectors.EVENT_READ, ("conn", h))
            h.watched_conn = True
        if not h.open and h.watched_conn:  # at EOF it would read as ready forever
            self._selector.unregister(h.conn.fileno())
            h.watched_conn = False
        if not h.watched_exit:
            self._selector.register(h.process.sentinel, selectors.EVENT_READ, ("exit", h))
            h.watched_exit = True

    def _unwatch(self, h: Handle) -> None:
        """Stop waiting on `h` (before its descriptors close)."""
        if h.watched_conn:
            self._selector.unregister(h.conn.fileno())
        if h.watched_exit:
            self._selector.unregister(h.process.sentinel)
        h.watched_conn = h.watched_exit = False

    def _step(self) -> None:
        for h in self._handles:
            self._watch(h)
        for key, _ in self._selector.select(self._wait_timeout()):
            what, handle = key.data
            if handle is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                with self._lock:  # before the inbox is read: a later submit writes again
                    self._wake_pending = False
            elif what == "conn":
                self._read(handle)
            elif handle in self._handles:
                self._reap(handle)
        while self._inbox:
            self._pending.append(self._inbox.popleft())
        while self._cancels:
            self._cancel(self._cancels.popleft())
        self._expire()
        self._dispatch()
        for h in self._handles:
            try:
                h.flush()
            except OSError:
                h.open = False  # it is dying: its sentinel will tell, and what it held is retried
        self._hand_over()

    def _wait_timeout(self) -> float | None:
        deadlines = [h.spawned_at + START_TIMEOUT_S for h in self._handles if not h.ready]
        if self.cfg.timeout is not None:
            deadlines += [h.head_since + self.cfg.timeout for h in self._handles if h.sync_n]
            deadlines += [d for h in self._handles for d in self._async_deadlines(h)]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _read(self, h: Handle) -> None:
        if not h.open:
            return
        try:
            msgs = h.receive()
        except OSError:
            h.open = False  # it is exiting; its sentinel says when it is gone
            return
        for msg in msgs:
            kind = msg[0]
            if kind == wire.DONE:
                self._done(h, *msg[1:])
            elif kind == wire.NEED:
                self._grow(h, *msg[1:])
            elif kind == wire.FAILED:
                self._failed(h, *msg[1:])
            elif kind == wire.READY:
                h.ready = True
                if all(x.ready for x in self._handles):
                    self._ready.set()
            elif kind == wire.INIT_FAILED:  # the user's own error, raised anew each time
                self._fail_pool(functools.partial(rebuild_error, msg[1], h.pid, "worker_init_fn"))

    def _finish(self, h: Handle, task_id: int, needed: int | None = None) -> Task | None:
        task = h.inflight.pop(task_id, None)
        if task is None:
            return None  # it timed out meanwhile and was answered already
        if task.is_async:
            h.async_n -= 1
            h.expired_n -= task.expired
        else:
            h.head_since = time.monotonic()
        if needed is not None and (needed or not self._out_known):  # a result tells its size
            self._out_bytes = needed if not self._out_known else max(self._out_bytes, needed)
            self._out_known = True
        self._free(task.in_slot)
        self._free(task.spare)
        task.in_slot = task.spare = None
        return task

    def _grow(self, h: Handle, task_id: int, needed: int) -> None:
        """A result did not fit its output slot (the first of a `size_first` pool): learn the size,
        and give the worker a slot that holds it (or none: it then pickles the result)."""
        self._out_bytes, self._out_known = max(self._out_bytes, needed), True
        task = h.inflight.get(task_id)
        if task is None or self._arena is None:
            return  # it timed out meanwhile: the worker is being replaced
        task.spare, task.out_slot = task.out_slot, self._out_slot(h, needed)
        ref = None
        if task.out_slot is not None:
            h.share(self._arena, task.out_slot.slab_id)
            ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        h.send((wire.GROWN, task_id, ref))

    def _done(self, h: Handle, task_id: int, data: Any, how: str, needed: int) -> None:
        task = self._finish(h, task_id, needed)
        if task is None:
            return
        slot, task.out_slot = task.out_slot, None
        if task.abandoned:
            self._free(slot)
            self._settle(task, error=cancelled())
            return
        try:
            if how == wire.ROW and task.row is not None:
                result = task.row.batch.tensor[task.row.row]
                self.counts["results_in_rows"] += 1
            elif how == wire.SINGLE and slot is not None and self._arena is not None:
                result = load_placed(self._arena, slot, data, self._copies)
                self.counts["results_in_shm"] += 1
            elif how == wire.SHM and slot is not None and self._arena is not None:
                result = Unpacker(data, self._arena, slot, self._copies).load()
                self.counts["results_in_shm"] += 1
            else:
                result = Unpacker(data, None, None).load()  # arrays in band (`_in_band`)
                self.counts["results_pickled"] += 1
        except Exception as exc:
            exc.add_note(f"aioloader: while reading the result of decode worker pid {h.pid}")
            self._settle(task, error=exc)
        else:
            self._settle(task, result)
        finally:
            self._free(slot)

    def _failed(self, h: Handle, task_id: int, error: Any) -> None:
        task = self._finish(h, task_id)
        if task is not None:
            self._free(task.out_slot)
            task.out_slot = None
            if task.abandoned:
                self._settle(task, error=cancelled())
                return
            where = "an async task" if task.is_async else "decode"
            self._settle(task, error=rebuild_error(error, h.pid, where))

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

    # -- faults --------------------------------------------------------------------------------------

    def _reap(self, h: Handle) -> None:
        """`h`'s process has exited: keep what it sent, then replace it and retry or fail its tasks."""
        self._read(h)
        h.process.join(0)
        code, pid = h.process.exitcode, h.pid
        self._unwatch(h)
        h.close_pipes()
        self._handles.remove(h)
        with contextlib.suppress(ValueError):
            h.process.close()
        tasks = h.take_all()
        for slot in h.quarantine + [s for t in tasks for s in t.take_slots()]:
            self._free(slot)
        tasks = self._live(tasks)
        if self._stopping or h.killed:
            return
        if not h.ready:
            text = f"{died_text(pid, code)} It died while starting."
            self._fail_pool(factory(WorkerDied, text, pid=pid, exitcode=code, tasks=[]))
            return
        self.counts["replaced"] += 1
        self._spawn(h.index)
        if not tasks:
            return
        if self._restarts < self.cfg.max_restarts:
            # Blame only the culprit: each task that was in flight runs again alone on a fresh
            # worker; one that kills its worker when alone fails, the others go on.
            self._restarts += 1
            culprits = [t for t in tasks if t.isolated]
            retried = [t for t in tasks if not t.isolated]
            for t in retried:
                t.isolated = True
            self.counts["retried"] += len(retried)
            self._pending.extendleft(reversed(retried))
            if not culprits:
                return
            tasks = culprits
        ids = [t.id for t in tasks]
        hint = (
            f"its max_worker_restarts={self.cfg.max_restarts} retries were used up"
            if self.cfg.max_restarts
            else "pass max_worker_restarts=N to retry such tasks on a new worker"
        )
        alone = len(tasks) == 1 and tasks[0].isolated
        text = (
            f"{died_text(pid, code)} It died with {len(ids)} task(s) in flight (task ids {ids})"
            f"{', running that task alone' if alone else ''} and was replaced; "
            f"{'the task killed it' if alone else hint}"
        )
        for t in tasks:
            self._settle(t, error=WorkerDied(text, pid=pid, exitcode=code, tasks=ids))

    def _expire(self) -> None:
        now = time.monotonic()
        for h in list(self._handles):
            if not h.ready and not h.killed and now - h.spawned_at >= START_TIMEOUT_S:
                text = f"decode worker pid {h.pid} was not ready within {START_TIMEOUT_S} s"
                self._fail_pool(factory(WorkerTimeout, text, pid=h.pid, timeout=START_TIMEOUT_S))
                return
            timeout = self.cfg.timeout
            if timeout is None or h.killed:
                continue
            if h.sync_n and now - h.head_since >= timeout:
                head = next(t for t in h.inflight.values() if not t.is_async)
                self.counts["timeouts"] += 1
                text = (
                    f"decode worker pid {h.pid} spent more than timeout={timeout} s on one task "
                    f"(task id {head.id}); it was killed and is being replaced"
                )
                self._kill(h, head, WorkerTimeout(text, pid=h.pid, timeout=timeout))
            elif h.async_n:
                self._expire_async(h, now, timeout)

    def _expire_async(self, h: Handle, now: float, timeout: float) -> None:
        """Answer `h`'s async tasks older than `timeout` with `WorkerTimeout` and cancel them there;
        kill `h` if one of them has not ended `CANCEL_GRACE_S` after that."""
        for t in h.inflight.values():  # oldest first: stop at the first one in time
            age = now - t.sent_at
            if t.is_async and age < timeout:
                return
            if not t.is_async:
                continue
            if not t.expired:
                t.expired = t.abandoned = True
                h.expired_n += 1
                self.counts["timeouts"] += 1
                with contextlib.suppress(OSError):
                    h.send((wire.CANCEL, t.id))
                text = (
                    f"an async task (task id {t.id}) ran more than timeout={timeout} s in decode "
                    f"worker pid {h.pid}; it was cancelled there"
                )
                self._settle(t, error=WorkerTimeout(text, pid=h.pid, timeout=timeout))
            elif age >= timeout + CANCEL_GRACE_S:
                text = (
                    f"decode worker pid {h.pid} did not end a timed-out async task (task id {t.id}) "
                    f"within {CANCEL_GRACE_S} s of cancelling it (its event loop is blocked); it "
                    "was killed and is being replaced"
                )
                return self._kill(h, t, WorkerTimeout(text, pid=h.pid, timeout=timeout))

    def _async_deadlines(self, h: Handle) -> list[float]:
        """When `_expire_async` next has something to do for `h` (with `timeout` set)."""
        assert self.cfg.timeout is not None
        deadlines: list[float] = []
        for t in h.inflight.values():  # oldest first: the expired ones, then the others
            if not t.is_async or (t.expired and deadlines):
                continue
            deadlines.append(t.sent_at + self.cfg.timeout + (CANCEL_GRACE_S if t.expired else 0))
            if not t.expired:
                break  # those sent later expire later
        return deadlines

    def _kill(self, h: Handle, failed: Task, error: BaseException) -> None:
        """Kill a stalled worker and replace it: its other tasks are retried; `failed` gets `error`,
        unless `max_worker_restarts` allows one more try: it then runs again alone, and fails only
        if it stalls again alone (a worker that stalled for a cause of its own costs nothing)."""
        h.killed = True
        with contextlib.suppress(OSError, ValueError):
            h.process.kill()
        tasks = h.take_all()
        for t in tasks:  # it may still write to them until it is reaped
            h.quarantine += t.take_slots()
        retry = [t for t in tasks if t is not failed]
        if not failed.isolated and not failed.is_async and self._restarts < self.cfg.max_restarts:
            self._restarts += 1
            failed.isolated = True
            self.counts["retried"] += 1
            retry.insert(0, failed)
        else:
            self._settle(failed, error=error)
        self._pending.extendleft(reversed(self._live(retry)))
        self._spawn(h.index)

    def _live(self, tasks: list[Task]) -> list[Task]:
        """Of `tasks` taken from a worker, those still wanted; the others are answered."""
        for t in tasks:
            if t.abandoned:
                self._settle(t, error=cancelled())
        return [t for t in tasks if not t.abandoned]

    def _cancel(self, task: Task) -> None:
        if task.abandoned or (task.loop is None and task.future.done()):
            return  # (a `run` future is done here: its caller cancelled it)
        task.abandoned = True
        h = task.worker
        if task.is_async and h is not None and task.id in h.inflight and h.open:
            with contextlib.suppress(OSError):
                h.send((wire.CANCEL, task.id))

    def _fail_pool(self, error: Callable[[], BaseException]) -> None:
        """Refuse new tasks with `error()` and stop the pool; every queued task fails with it."""
        self._failure = error
        self._stopping = True
        self._ready.set()

    # -- dispatch -----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Send what the workers have room for, in order; a task pinned to a busy worker waits
        without holding back the tasks behind it that may go elsewhere (only those pinned to the
        same worker wait behind it: a worker runs its tasks in the order they were submitted)."""
        passed: collections.deque[Task] = collections.deque()  # not sent yet, in order
        held: set[int] = set()  # workers whose next task waits
        while self._pending:
            task = self._pending.popleft()
            if not task.started:
                future = task.future
                if task.loop is None and not future.set_running_or_notify_cancel():  # type: ignore[union-attr]
                    continue  # cancelled while queued
                task.started = True
            if task.abandoned:
                self._settle(task, error=cancelled())
                continue
            h = None if task.pin in held else self._pick(task)
            try:
                if h is not None and self._send(h, task):
                    continue
            except OSError:  # it is dying; its sentinel will tell, and the task stays queued
                assert h is not None
                h.open = False
                for slot in task.take_slots():
                    self._free(slot)
                self._pending.appendleft(task)
                continue
            except BaseException:  # a bug: keep every task where `_shutdown` fails it
                self._pending.extendleft([task, *reversed(passed)])
                raise
            passed.append(task)
            if task.pin is None:
                break  # no worker has room for it: nor for those behind it
            held.add(task.pin)
        self._pending.extendleft(reversed(passed))
        if self._arena is not None:
            for slab_id in self._arena.take_dropped():
                for h in self._handles:
                    if slab_id in h.slabs and h.open:
                        h.slabs.discard(slab_id)
                        with contextlib.suppress(OSError):
                            h.send((wire.DROP, slab_id))

    def _pick(self, task: Task) -> Handle | None:
        """The ready worker with the fewest tasks in flight that has room for `task`, if any."""
        best: Handle | None = None
        for h in self._handles:
            if not h.ready or not h.open or h.killed or task.pin not in (None, h.index):
                continue
            if (
                self._restarts
                and h.inflight
                and (task.isolated or any(t.isolated for t in h.inflight.values()))
            ):
                continue  # a suspect (there are some only after a restart) runs alone: `_reap`
            if task.is_async:  # none to a loop that has not ended a timed-out task yet
                room = h.async_n < self._async_room() and not h.expired_n
            else:  # a whole batch keeps a worker busy far longer than a round trip: one at a time
                room = h.sync_n < (1 if self.cfg.size_first else QUEUE_DEPTH)
            if room and (best is None or len(h.inflight) < len(best.inflight)):
                best = h
        return best

    def _out_slot(self, h: Handle, nbytes: int | None = None) -> Slot | None:
        """An output slot for a task sent to `h`. For whole batches (`size_first`), one of the
        slabs `h` has mapped, or a new one while it has fewer than `SLABS_PER_WORKER`; past that,
        it waits for its own while other tasks run, else takes any (never a deadlock)."""
        arena, nbytes = self._arena, nbytes or self._out_bytes
        assert arena is not None
        if not self.cfg.size_first:
            return arena.acquire(nbytes, h.slabs)
        room = arena.whole_slabs(h.slabs, nbytes) < SLABS_PER_WORKER
        slot = arena.acquire(nbytes, h.slabs, only=True, new=room)
        if slot is None and not self._busy():
            slot = arena.acquire(nbytes)
        return slot

    def _busy(self) -> bool:
        """Whether any worker has a task in flight (whose result will free, or fill, a slot)."""
        return any(h.inflight for h in self._handles)

    def _async_room(self) -> int:
        """Async tasks one worker may hold now. Until the first result tells how large results are,
        one: a first wave of `async_depth` tasks per worker would either fill the arena with slots of
        a guessed size or, without slots, send every result of that wave through the pipe."""
        return self.cfg.async_depth if self._out_known else 1

    def _send(self, h: Handle, task: Task) -> bool:
        """Send `task` to `h`; False when it must wait (a large message, and `h` is busy)."""
        arena, inline_max = self._arena, self.cfg.inline_max
        assert arena is not None
        if task.fn_id not in h.fns:
            blob = self._fn_blobs[task.fn_id]
            if isinstance(blob, bytes) and len(blob) > inline_max and h.inflight:
                return False
            h.send((wire.FN, task.fn_id, blob, task.is_async))
            h.fns.add(task.fn_id)
        inline: bytes | None = task.arg
        in_ref = out_ref = None
        if len(task.arg) > inline_max:
            if task.in_slot is None:
                task.in_slot = arena.acquire(len(task.arg))
                if task.in_slot is not None:
                    task.in_slot.write(task.arg)
            if task.in_slot is not None:
                h.share(arena, task.in_slot.slab_id)
                inline, in_ref = None, (task.in_slot.slab_id, task.in_slot.offset, len(task.arg))
                self.counts["inputs_in_shm"] += 1
            elif h.inflight:
                return False  # no slot free: send it inline, but only to an idle worker
        row = None if task.row is None else task.row.batch.wire(task.row.row)
        if self._out_bytes and task.out_slot is None and row is None:
            self._slot_waits = self.cfg.size_first  # before: a slot freed meanwhile wakes us
            task.out_slot = self._out_slot(h)
            if task.out_slot is None and self.cfg.size_first and self._busy():
                return False  # no slot for it: wait for one (a result, or the consumer, frees it)
            self._slot_waits = False
        if task.out_slot is not None:
            h.share(arena, task.out_slot.slab_id)
            out_ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        if task.row is not None:
            h.share(arena, task.row.batch.slot.slab_id)
        now = time.monotonic()
        if not task.is_async and not h.sync_n:
            h.head_since = now
        grow = self.cfg.size_first and not task.is_async and row is None
        h.send((
            wire.TASK, task.id, task.fn_id, task.seed, task.kind, inline, in_ref, out_ref, row, grow,
        ))  # fmt: skip
        h.inflight[task.id] = task
        task.worker, task.sent_at = h, now
        h.async_n += task.is_async
        self.counts["tasks"] += 1
        self.counts["async_tasks"] += task.is_async
        return True

    # -- shutdown -----------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        with self._lock:
            self.closed = True
        handles, self._handles = self._handles, []
        self._selector.close()
        for h in handles:
            h.close_pipes()  # the lifeline's EOF makes each worker `os._exit` at once
        deadline = time.monotonic() + STOP_GRACE_S
        alive = [h for h in handles if h.process.exitcode is None]
        while alive and time.monotonic() < deadline:
            wait([h.process.sentinel for h in alive], deadline - time.monotonic())
            alive = [h for h in alive if h.process.exitcode is None]
        for h in handles:
            if h.process.exitcode is None:
                with contextlib.suppress(OSError):
                    h.process.kill()
            h.process.join(JOIN_TIMEOUT_S)
            with contextlib.suppress(ValueError):
                h.process.close()
        failure = self._failure or factory(LoaderClosedError, "the process executor was closed")
        tasks = [*self._pending, *self._inbox, *(t for h in handles for t in h.inflight.values())]
        self._pending.clear()
        self._inbox.clear()
        self._cancels.clear()
        for task in tasks:
            self._settle(task, error=failure())
        self._hand_over()
        if self._arena is not None:
            self._arena.close()
        if self._zygote is not None:
            self._zygote.close()
        with self._lock:
            wake_r, wake_w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = -1  # `_slot_freed` writes to it no more
            os.close(wake_r)
            os.close(wake_w)
        self._ready.set()


def _pickle_given(given: dict[int, Any], method: str) -> bytes:
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
