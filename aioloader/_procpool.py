"""The process decode executor: persistent worker processes, shared-memory results, watched liveness.

`ProcessExecutor(workers)` starts `workers` processes once (in parallel, in the background) and keeps
them across epochs until `close()`. Each decode callable is pickled once and sent once to each worker;
a task then carries only its argument (in the pipe up to `inline_max` bytes, in a shared-memory slot
above) and its seed. Arrays in the result come back in place in slots of the parent's `Arena`
(`_shm.py`): the parent views them without a copy, and a slot is reused only once nothing views it.

Start method. Workers are never forked from a process in which CUDA is initialised: the child
inherits a CUDA context it cannot use. Nor from a process running other threads: a lock one of them
holds at the fork (the event loop's, a fetch thread's, an allocator's) stays locked forever in the
child. So the default is:
- "zygote" (`_zygote.py`) when this process has one thread and no CUDA when the executor is made
  (a Loader makes it in its constructor, before its own threads start): a fork server forked from
  this process then, which forks the workers. They share this process's imported modules
  copy-on-write: ready in ~0.05 s, and no second copy of torch (~150 MB) in memory.
- else "forkserver": the stdlib's clean, single-threaded server that imports aioloader, torch and
  numpy once (`set_forkserver_preload`); workers fork from it in milliseconds once it runs, but its
  first start imports torch again (seconds) and keeps that second copy in memory.
"spawn" and "fork" can be asked for; "fork" and "zygote" are refused once CUDA is initialised.

One thread per executor, "aioloader-procpool", does all the waiting: it blocks in
`multiprocessing.connection.wait` on every worker's socket and process sentinel, so a worker that
dies (SIGKILL, `os._exit`, a segfault) is noticed at once, not by polling. A thread rather than the
event loop's `add_reader`, because one executor serves several loops (the loader's own loop thread,
the caller's loop under `use_caller_loop`, a new loop per `asyncio.run`) and must keep watching
between epochs and be closable from any thread.

Faults:
- a worker dies: it is replaced. Its tasks in flight are retried on the pool while fewer than
  `max_worker_restarts` deaths have been absorbed (each once: results it already sent are kept);
  past that they fail with `WorkerDied` (naming the pid, the exit, the tasks in flight).
- a worker runs one task longer than `timeout` seconds: it is killed and replaced; that task fails
  with `WorkerTimeout`, its other queued tasks are retried elsewhere.
- decode raises: the parent re-raises the same exception type (when it pickles both ways), else
  `DecodeError`; always with a note naming the worker pid and the remote traceback as `__cause__`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import math
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

import torch

from . import _worker as wire
from ._exceptions import LoaderClosedError, WorkerDied, WorkerTimeout
from ._shm import Arena, Slot, arena_budget, parent_only
from ._validate import check_callable, check_int, check_timeout
from ._worker import Unpacker, rebuild_error, serve
from ._zygote import Zygote, ZygoteProcess, zygote_allowed

__all__ = ["INLINE_MAX", "BatchBuffer", "ProcessExecutor", "RowTarget"]

T = TypeVar("T")

INLINE_MAX = 64 << 10
"""Arguments up to this many bytes (raw or pickled) travel in the pipe; larger ones in shared memory."""
# Tasks sent ahead to one worker: one running, one waiting in its socket (hides the round trip).
# With `INLINE_MAX` this keeps what a worker has not read yet far below a socket's buffer, so the
# pool's thread never blocks on a send.
QUEUE_DEPTH = 2
FIRST_OUTPUT_BYTES = 1 << 20  # output slot for tasks before the first result tells the real size
START_TIMEOUT_S = 60.0  # a worker not ready by then (hung worker_init_fn) fails the pool
STOP_GRACE_S = 0.5  # close(): how long workers get to exit before SIGKILL
JOIN_TIMEOUT_S = 2.0
_PRELOAD = ("aioloader._worker",)  # imports torch, numpy and aioloader once, in the forkserver


def _default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _start_method(method: str | None) -> tuple[str, BaseContext | None]:
    """(method, its multiprocessing context; None for "zygote"). None picks as the docstring says."""
    methods = [*mp.get_all_start_methods(), "zygote"]
    if method is None:
        method = "zygote" if zygote_allowed() is None else "forkserver"
        method = method if method in methods else "spawn"
    if method not in methods:
        raise ValueError(f"start_method must be one of {methods}, got {method!r}")
    cuda_live: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if method in ("fork", "zygote") and cuda_live:
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


def _encode_arg(arg: Any) -> tuple[str, bytes]:
    if type(arg) is bytes:
        return wire.RAW, arg
    if type(arg) is bytearray:
        return wire.RAW_BYTEARRAY, bytes(arg)
    if type(arg) is memoryview:
        return wire.RAW, arg.tobytes()
    try:
        return wire.PICKLED, pickle.dumps(arg, protocol=5)
    except Exception as exc:
        raise TypeError(
            f"executor='process' cannot send this decode argument to a worker: {exc}"
        ) from exc


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def _settle(
    future: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


@dataclass(frozen=True)
class _Config:
    workers: int
    method: str
    context: BaseContext | None
    timeout: float | None
    max_restarts: int
    init: bytes | None
    arena_bytes: int
    inline_max: int


class BatchBuffer:
    """A batch-sized tensor in the executor's shared memory, whose rows workers write in place.

    Made by `ProcessExecutor.batch_buffer`; pass `into=buffer.row(i)` to `run`/`submit`. A result
    that is one plain tensor (or numpy array) of the row's dtype and shape is written straight into
    row i and `run` returns `buffer.tensor[i]`; any other result comes back as usual (copy it into the
    row yourself). The shared memory is reused once `tensor` and every view of it are gone.
    """

    def __init__(
        self, arena: Arena, slot: Slot, shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self.slot = slot
        self.shape = shape
        self.dtype = dtype
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.tensor = torch.frombuffer(arena.view(slot, 0, nbytes), dtype=dtype).view(shape)
        self._row_bytes = nbytes // shape[0]

    def row(self, index: int) -> RowTarget:
        """Where sample `index` of the batch goes."""
        if not 0 <= index < self.shape[0]:
            raise IndexError(f"row {index} of a batch of {self.shape[0]}")
        return RowTarget(self, index)

    def wire(self, index: int) -> tuple[int, int, int, str, tuple[int, ...]]:
        offset = self.slot.offset + index * self._row_bytes
        dtype = str(self.dtype).removeprefix("torch.")
        return self.slot.slab_id, offset, self._row_bytes, dtype, self.shape[1:]


class RowTarget(NamedTuple):
    """Row `row` of `batch` (see `BatchBuffer.row`)."""

    batch: BatchBuffer
    row: int


class _Task:
    __slots__ = (
        "arg",
        "fn_id",
        "future",
        "id",
        "in_slot",
        "kind",
        "out_slot",
        "row",
        "seed",
        "started",
    )

    def __init__(self, task_id: int, fn_id: int, seed: int | None, kind: str, arg: bytes) -> None:
        self.id = task_id
        self.fn_id = fn_id
        self.seed = seed
        self.kind = kind
        self.arg = arg
        self.future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.in_slot: Slot | None = None
        self.out_slot: Slot | None = None
        self.row: RowTarget | None = None
        self.started = False


class _Handle:
    """The parent's side of one worker process."""

    def __init__(self, index: int, process: Any, conn: Connection, lifeline: Connection) -> None:
        self.index = index
        self.process = process
        self.pid: int = process.pid
        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.lifeline = lifeline
        self._fds = [conn.fileno(), self.sock.fileno(), lifeline.fileno()]
        for fd in self._fds:
            parent_only(fd)
        self.open = True  # its socket has not reached EOF
        self.ready = False
        self.killed = False
        self.spawned_at = self.head_since = time.monotonic()
        self.inflight: dict[int, _Task] = {}  # in the order the worker runs them
        self.fns: set[int] = set()
        self.slabs: set[int] = set()
        self.quarantine: list[Slot] = []  # slots it may still write to until it is reaped

    def send(self, msg: tuple[Any, ...]) -> None:
        self.conn.send_bytes(pickle.dumps(msg, protocol=5))

    def share(self, arena: Arena, slab_id: int) -> None:
        if slab_id not in self.slabs:
            fd, size = arena.slab_fd(slab_id)
            self.send((wire.SLAB, slab_id, size))
            socket.send_fds(self.sock, [b"F"], [fd])
            self.slabs.add(slab_id)

    def close_pipes(self) -> None:
        """Close this side of its socket and its lifeline (idempotent)."""
        self.open = False
        for fd in self._fds:
            parent_only(fd, keep=False)
        self._fds = []
        for end in (self.lifeline, self.conn, self.sock):
            with contextlib.suppress(OSError):
                end.close()


class _Pool:
    """The workers, the task queue and the arena; one thread ("aioloader-procpool") runs it all.

    Other threads only append to the inbox and wake that thread (`submit`), or ask it to stop.
    """

    def __init__(self, config: _Config) -> None:
        self.cfg = config
        self.closed = False
        self._lock = threading.Lock()
        self._inbox: collections.deque[_Task] = collections.deque()
        self._pending: collections.deque[_Task] = collections.deque()
        self._handles: list[_Handle] = []
        self._fns: list[tuple[Callable[[Any], Any], int]] = []
        self._fn_blobs: dict[int, bytes] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._arena: Arena | None = None
        self._wake_r = self._wake_w = -1
        self._stopping = False
        self._ready = threading.Event()
        self._failure: Callable[[], BaseException] | None = None
        self._restarts = 0
        self._out_bytes, self._out_known = FIRST_OUTPUT_BYTES, False
        self._seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self._zygote = Zygote(serve) if config.method == "zygote" else None
        self.counts: collections.Counter[str] = collections.Counter()

    # -- any thread --------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._failure is not None:
                raise self._failure()
            if self.closed:
                raise LoaderClosedError("the process executor was closed")
            if self._thread is not None:
                return
            self._arena = Arena(self.cfg.arena_bytes)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
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
        self, fn: Callable[[Any], Any], arg: Any, seed: int | None, into: RowTarget | None = None
    ) -> concurrent.futures.Future[Any]:
        self.start()
        task = _Task(next(self._ids), self._register(fn), seed, *_encode_arg(arg))
        task.row = into
        with self._lock:
            if self.closed:
                raise LoaderClosedError("the process executor was closed")
            if self._failure is not None:
                raise self._failure()
            self._inbox.append(task)
            self._wake_locked()
        return task.future

    def _register(self, fn: Callable[[Any], Any]) -> int:
        with self._lock:
            for known, fn_id in self._fns:
                if known is fn or (isinstance(fn, types.MethodType) and known == fn):
                    return fn_id
        try:
            blob = pickle.dumps(fn, protocol=5)
        except Exception as exc:
            raise TypeError(
                f"executor='process' needs a decode callable that pickles (a module-level function "
                f"or an instance of a module-level class); {fn!r} does not: {exc}"
            ) from exc
        with self._lock:
            fn_id = len(self._fns)
            self._fns.append((fn, fn_id))
            self._fn_blobs[fn_id] = blob
        return fn_id

    def _wake_locked(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def close(self) -> None:
        with self._lock:
            thread, already = self._thread, self.closed
            self.closed = self._stopping = True
            if thread is not None and not already:
                self._wake_locked()
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
        try:
            return BatchBuffer(self._arena, slot, shape, dtype)
        finally:
            self._arena.release(slot)  # the tensor's view pins it from now on

    def pids(self) -> list[int]:
        return [h.pid for h in list(self._handles) if not h.killed]

    def stats(self) -> dict[str, int]:
        arena = self._arena
        return {
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
            self._fail_pool(_factory(LoaderClosedError, message, cause=exc))
        finally:
            self._shutdown()

    def _spawn(self, index: int) -> None:
        conn, child_conn = mp.Pipe(duplex=True)
        lifeline_r, lifeline_w = mp.Pipe(duplex=False)
        args = (index, self._seed + index, self.cfg.init is not None)
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
        handle = _Handle(index, process, conn, lifeline_w)
        self._handles.append(handle)
        if self.cfg.init is not None:
            handle.conn.send_bytes(self.cfg.init)

    def _step(self) -> None:
        table: dict[Any, tuple[str, _Handle | None]] = {self._wake_r: ("wake", None)}
        for h in self._handles:
            if h.open:
                table[h.conn] = ("conn", h)
            table[h.process.sentinel] = ("exit", h)
        for obj in wait(list(table), self._wait_timeout()):
            what, handle = table[obj]
            if handle is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            elif what == "conn":
                self._read(handle)
            elif handle in self._handles:
                self._reap(handle)
        while self._inbox:
            self._pending.append(self._inbox.popleft())
        self._expire()
        self._dispatch()

    def _wait_timeout(self) -> float | None:
        deadlines = [h.spawned_at + START_TIMEOUT_S for h in self._handles if not h.ready]
        if self.cfg.timeout is not None:
            deadlines += [h.head_since + self.cfg.timeout for h in self._handles if h.inflight]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _read(self, h: _Handle) -> None:
        while h.open:
            try:
                if not h.conn.poll():
                    return
                msg = pickle.loads(h.conn.recv_bytes())
            except (EOFError, OSError):
                h.open = False  # it is exiting; its sentinel says when it is gone
                return
            kind = msg[0]
            if kind == wire.DONE:
                self._done(h, *msg[1:])
            elif kind == wire.FAILED:
                self._failed(h, *msg[1:])
            elif kind == wire.READY:
                h.ready = True
                if all(x.ready for x in self._handles):
                    self._ready.set()
            elif kind == wire.INIT_FAILED:
                cause = rebuild_error(msg[1], h.pid, "worker_init_fn")
                text = f"worker_init_fn raised in decode worker pid {h.pid}: {cause!r}"
                self._fail_pool(
                    _factory(WorkerDied, text, cause=cause, pid=h.pid, exitcode=None, tasks=[])
                )

    def _finish(self, h: _Handle, task_id: int, needed: int = 0) -> _Task | None:
        task = h.inflight.pop(task_id, None)
        if task is None:
            return None  # it timed out meanwhile and was answered already
        h.head_since = time.monotonic()
        if needed or not self._out_known:
            self._out_bytes = needed if not self._out_known else max(self._out_bytes, needed)
            self._out_known = True
        self._free(task.in_slot)
        task.in_slot = None
        return task

    def _done(self, h: _Handle, task_id: int, data: bytes, how: str, needed: int) -> None:
        task = self._finish(h, task_id, needed)
        if task is None:
            return
        slot, task.out_slot = task.out_slot, None
        try:
            if how == wire.ROW and task.row is not None:
                result = task.row.batch.tensor[task.row.row]
                self.counts["results_in_rows"] += 1
            elif how == wire.SHM and slot is not None and self._arena is not None:
                result = Unpacker(data, self._arena, slot).load()
                self.counts["results_in_shm"] += 1
            else:
                result = pickle.loads(data)
                self.counts["results_pickled"] += 1
        except Exception as exc:
            exc.add_note(f"aioloader: while reading the result of decode worker pid {h.pid}")
            _settle(task.future, error=exc)
        else:
            _settle(task.future, result)
        finally:
            self._free(slot)

    def _failed(self, h: _Handle, task_id: int, error: Any) -> None:
        task = self._finish(h, task_id)
        if task is not None:
            self._free(task.out_slot)
            task.out_slot = None
            _settle(task.future, error=rebuild_error(error, h.pid))

    def _free(self, slot: Slot | None) -> None:
        if slot is not None and self._arena is not None:
            self._arena.release(slot)

    # -- faults --------------------------------------------------------------------------------------

    def _reap(self, h: _Handle) -> None:
        """`h`'s process has exited: keep what it sent, then replace it and retry or fail its tasks."""
        self._read(h)
        h.process.join(0)
        code, pid = h.process.exitcode, h.pid
        h.close_pipes()
        self._handles.remove(h)
        with contextlib.suppress(ValueError):
            h.process.close()
        tasks = list(h.inflight.values())
        h.inflight.clear()
        for slot in h.quarantine + [s for t in tasks for s in (t.in_slot, t.out_slot)]:
            self._free(slot)
        for t in tasks:
            t.in_slot = t.out_slot = None
        if self._stopping or h.killed:
            return
        if not h.ready:
            text = f"decode worker pid {pid} died while starting ({_exit_text(code)})"
            self._fail_pool(_factory(WorkerDied, text, pid=pid, exitcode=code, tasks=[]))
            return
        self.counts["replaced"] += 1
        self._spawn(h.index)
        if not tasks:
            return
        if self._restarts < self.cfg.max_restarts:
            self._restarts += 1
            self.counts["retried"] += len(tasks)
            self._pending.extendleft(reversed(tasks))
            return
        ids = [t.id for t in tasks]
        hint = (
            f"its max_worker_restarts={self.cfg.max_restarts} retries were used up"
            if self.cfg.max_restarts
            else "pass max_worker_restarts=N to retry such tasks on a new worker"
        )
        text = (
            f"decode worker pid {pid} died ({_exit_text(code)}) with {len(ids)} task(s) in flight "
            f"(task ids {ids}); it was replaced, {hint}"
        )
        for t in tasks:
            _settle(t.future, error=WorkerDied(text, pid=pid, exitcode=code, tasks=ids))

    def _expire(self) -> None:
        now = time.monotonic()
        for h in list(self._handles):
            if not h.ready and not h.killed and now - h.spawned_at >= START_TIMEOUT_S:
                text = f"decode worker pid {h.pid} was not ready within {START_TIMEOUT_S} s"
                self._fail_pool(_factory(WorkerTimeout, text, pid=h.pid, timeout=START_TIMEOUT_S))
                return
            timeout = self.cfg.timeout
            if timeout is None or h.killed or not h.inflight or now - h.head_since < timeout:
                continue
            h.killed = True
            with contextlib.suppress(OSError, ValueError):
                h.process.kill()
            tasks = list(h.inflight.values())
            h.inflight.clear()
            for t in tasks:  # it may still write to them until it is reaped
                h.quarantine += [s for s in (t.in_slot, t.out_slot) if s is not None]
                t.in_slot = t.out_slot = None
            self._pending.extendleft(reversed(tasks[1:]))
            self.counts["timeouts"] += 1
            text = (
                f"decode worker pid {h.pid} spent more than timeout={timeout} s on one task "
                f"(task id {tasks[0].id}); it was killed and is being replaced"
            )
            _settle(tasks[0].future, error=WorkerTimeout(text, pid=h.pid, timeout=timeout))
            self._spawn(h.index)

    def _fail_pool(self, error: Callable[[], BaseException]) -> None:
        """Refuse new tasks with `error()` and stop the pool; every queued task fails with it."""
        self._failure = error
        self._stopping = True
        self._ready.set()

    # -- dispatch -----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self._pending:
            task = self._pending[0]
            if not task.started:
                if not task.future.set_running_or_notify_cancel():
                    self._pending.popleft()  # cancelled while queued
                    continue
                task.started = True
            idle = [h for h in self._handles if h.ready and h.open and not h.killed]
            h = min(idle, key=lambda h: len(h.inflight), default=None)
            if h is None or len(h.inflight) >= QUEUE_DEPTH:
                break
            try:
                if not self._send(h, task):
                    break
            except OSError:  # it is dying; its sentinel will tell, and the task stays queued
                h.open = False
                for slot in (task.in_slot, task.out_slot):
                    self._free(slot)
                task.in_slot = task.out_slot = None
                continue
            self._pending.popleft()
        if self._arena is not None:
            for slab_id in self._arena.take_dropped():
                for h in self._handles:
                    if slab_id in h.slabs and h.open:
                        h.slabs.discard(slab_id)
                        with contextlib.suppress(OSError):
                            h.send((wire.DROP, slab_id))

    def _send(self, h: _Handle, task: _Task) -> bool:
        """Send `task` to `h`; False when it must wait (a large message, and `h` is busy)."""
        arena, inline_max = self._arena, self.cfg.inline_max
        assert arena is not None
        if task.fn_id not in h.fns:
            blob = self._fn_blobs[task.fn_id]
            if len(blob) > inline_max and h.inflight:
                return False
            h.send((wire.FN, task.fn_id, blob))
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
            task.out_slot = arena.acquire(self._out_bytes)
        if task.out_slot is not None:
            h.share(arena, task.out_slot.slab_id)
            out_ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        if task.row is not None:
            h.share(arena, task.row.batch.slot.slab_id)
        if not h.inflight:
            h.head_since = time.monotonic()
        h.send((wire.TASK, task.id, task.fn_id, task.seed, task.kind, inline, in_ref, out_ref, row))
        h.inflight[task.id] = task
        self.counts["tasks"] += 1
        return True

    # -- shutdown -----------------------------------------------------------------------------------

    def _shutdown(self) -> None:
        with self._lock:
            self.closed = True
        handles, self._handles = self._handles, []
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
        failure = self._failure or _factory(LoaderClosedError, "the process executor was closed")
        tasks = [*self._pending, *self._inbox, *(t for h in handles for t in h.inflight.values())]
        self._pending.clear()
        self._inbox.clear()
        for task in tasks:
            _settle(task.future, error=failure())
        if self._arena is not None:
            self._arena.close()
        if self._zygote is not None:
            self._zygote.close()
        with self._lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._ready.set()


def _factory(
    cls: type[BaseException], text: str, cause: BaseException | None = None, **attrs: Any
) -> Callable[[], BaseException]:
    """Makes a fresh `cls(text, **attrs)` per call (one exception object per failed task)."""

    def make() -> BaseException:
        exc = cls(text, **attrs)
        exc.__cause__ = cause
        return exc

    return make


class ProcessExecutor:
    """Runs decode calls in `workers` persistent processes; results come back in shared memory.

    Args:
        workers: worker processes (default: the usable cores).
        start_method: "zygote", "forkserver", "spawn" or "fork"; None picks "zygote" where that is
            safe now (one thread, no CUDA), else "forkserver" (see the module docstring). "zygote"
            and "fork" are refused once CUDA is initialised in this process.
        timeout: seconds one task may run in a worker before it is killed (None: no limit).
        max_worker_restarts: worker deaths whose tasks in flight are retried instead of failing with
            `WorkerDied` (a dead worker is always replaced).
        worker_init_fn: called as `worker_init_fn(worker_id)` once in each worker before any task.
        arena_bytes: shared-memory budget for inputs and results (default: 256 MiB or half of the
            free /dev/shm, whichever is less). Checked here: too little room in /dev/shm raises
            OSError naming /dev/shm and the size needed.
        inline_max: arguments larger than this go through shared memory instead of the pipe.

    `batch_buffer` makes a batch in shared memory whose rows workers write in place (no collate).
    `run` is safe to cancel (the worker finishes the task; its result is dropped). `close` is
    idempotent, stops every worker within about a second, and also runs on garbage collection and at
    interpreter exit; workers also exit by themselves when this process dies, even by SIGKILL.

    Example:
        >>> import operator
        >>> with ProcessExecutor(2) as pool:
        ...     pool.submit(operator.neg, 3).result()
        -3
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        start_method: str | None = None,
        timeout: float | None = None,
        max_worker_restarts: int = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        arena_bytes: int | None = None,
        inline_max: int = INLINE_MAX,
    ) -> None:
        self.workers = (
            _default_workers() if workers is None else check_int("workers", workers, minimum=1)
        )
        check_int("max_worker_restarts", max_worker_restarts, minimum=0)
        check_int("inline_max", inline_max, minimum=0)
        check_callable("worker_init_fn", worker_init_fn, optional=True)
        init = None if worker_init_fn is None else pickle.dumps(worker_init_fn, protocol=5)
        method, context = _start_method(start_method)
        self.start_method = method
        config = _Config(
            workers=self.workers, method=method, context=context,
            timeout=check_timeout("timeout", timeout), max_restarts=max_worker_restarts, init=init,
            arena_bytes=arena_budget(arena_bytes), inline_max=inline_max,
        )  # fmt: skip
        self._pool = _Pool(config)
        self._finalizer = weakref.finalize(self, self._pool.close)

    def start(self) -> None:
        """Begin starting the workers in the background (the first task does it too). Idempotent."""
        self._pool.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Start, then block until every worker is ready (True) or `timeout` passes (False).

        Raises:
            WorkerDied: a worker died while starting, or `worker_init_fn` raised (the cause).
        """
        self._pool.start()
        return self._pool.wait_ready(timeout)

    def submit(
        self,
        fn: Callable[[Any], T],
        arg: Any,
        seed: int | None = None,
        into: RowTarget | None = None,
    ) -> concurrent.futures.Future[T]:
        """Queue `fn(arg)` with `seed` as the sample's seed (see `_rng.py`); never blocks.

        Raises:
            LoaderClosedError: the executor was closed.
            TypeError: `fn` or `arg` cannot be pickled.
        """
        return self._pool.submit(fn, arg, seed, into)

    async def run(
        self,
        fn: Callable[[Any], T],
        arg: Any,
        seed: int | None = None,
        into: RowTarget | None = None,
    ) -> T:
        """Run `fn(arg)` in a worker and await its result; safe to cancel. See `batch_buffer`."""
        return await asyncio.wrap_future(self._pool.submit(fn, arg, seed, into))

    def batch_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> BatchBuffer | None:
        """A `BatchBuffer` of `shape` (rows first) in shared memory; None when the arena is full.

        Example (in a coroutine):
            batch = executor.batch_buffer((len(raws), 3, 224, 224), torch.float32)
            rows = [executor.run(decode, raw, into=batch.row(i)) for i, raw in enumerate(raws)]
            for i, sample in enumerate(await asyncio.gather(*rows)):
                if sample.data_ptr() != batch.tensor[i].data_ptr():
                    batch.tensor[i].copy_(sample)  # it did not fit the row
            # batch.tensor is the collated batch: no copy was made
        """
        return self._pool.batch_buffer(shape, dtype)

    def stats(self) -> dict[str, int]:
        """Counters: tasks, results in shared memory or pickled, retries, restarts, arena bytes."""
        return self._pool.stats()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return self._pool.pids()

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def close(self) -> None:
        """Stop every worker and free the arena; what is still queued fails with `LoaderClosedError`.

        Idempotent; blocks up to about 2 s. Arrays already handed out stay valid.
        """
        self._finalizer()

    def __enter__(self) -> ProcessExecutor:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
