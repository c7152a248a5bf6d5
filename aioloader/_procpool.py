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

One thread per executor, "aioloader-procpool", does all the waiting: it blocks in one selector
(epoll on Linux) on every worker's socket and process sentinel, so a worker that
dies (SIGKILL, `os._exit`, a segfault) is noticed at once, not by polling. A thread rather than the
event loop's `add_reader`, because one executor serves several loops (the loader's own loop thread,
the caller's loop under `use_caller_loop`, a new loop per `asyncio.run`) and must keep watching
between epochs and be closable from any thread.

Async tasks. A coroutine function (or an object whose `__call__` is one) runs on the worker's own
event loop (`_multiloop.py`), up to `async_depth` of them at once per worker: this is how
`fetch_in_workers` fetches in every worker. Each answers when it ends, in any order, and its result
comes back in its output slot like any other. Cancelling `run` cancels the coroutine in the worker.

Faults:
- a worker dies: it is replaced. Its tasks in flight are retried on the pool while fewer than
  `max_worker_restarts` deaths have been absorbed (each once: results it already sent are kept);
  past that they fail with `WorkerDied` (naming the pid, the exit, the tasks in flight).
- a worker runs one task longer than `timeout` seconds: it is killed and replaced; that task fails
  with `WorkerTimeout`, its other queued tasks are retried elsewhere.
- an async task is still running `timeout` seconds after the worker received it: it fails with
  `WorkerTimeout` at once and is cancelled in the worker, which goes on with its other tasks. Only
  if the cancelled task has not ended `CANCEL_GRACE_S` later (the worker's loop is blocked, by a
  decode that never returns, say) is the worker killed and replaced, as above: a loop that does not
  run cannot be told anything else. Until the cancelled task ends, that worker gets no new async
  task.
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
import selectors
import signal
import socket
import struct
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
from ._fetch import is_async_callable
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
ASYNC_DEPTH = 64  # async tasks one worker may hold at once, by default
FIRST_OUTPUT_BYTES = 1 << 20  # output slot for tasks before the first result tells the real size
CANCEL_GRACE_S = 1.0  # a timed-out async task not ended this long after its cancel: kill the worker
FRAME_BYTES = 4  # the length prefix of each message (`Connection.send_bytes`'s framing)
READ_BYTES = 256 << 10  # what one read from a worker's socket takes at most
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


def _settle_future(
    future: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


Outcome = tuple["asyncio.Future[Any]", Any, "BaseException | None"]


class _Mailbox:
    """Outcomes of `run` calls on its way to one event loop: at most one callback scheduled on that
    loop at a time, which settles every outcome posted until it runs (a loop that is busy is woken
    once for many results, not once per result)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[Outcome] = []
        self._scheduled = False

    def post(self, items: list[Outcome]) -> None:
        """From the pool's thread."""
        with self._lock:
            self._items += items
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # its loop is closed: nobody awaits these
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        _settle_all(items)


def _settle_all(outcomes: list[Outcome]) -> None:
    """Settle the asyncio futures of `run` calls (on their loop, one call for many results)."""
    for future, result, error in outcomes:
        if future.done():
            continue  # cancelled meanwhile
        if isinstance(error, concurrent.futures.CancelledError):
            future.cancel()
        elif error is None:
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
    async_depth: int


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
        "abandoned",
        "arg",
        "expired",
        "fn_id",
        "future",
        "id",
        "in_slot",
        "is_async",
        "kind",
        "loop",
        "out_slot",
        "pin",
        "row",
        "seed",
        "sent_at",
        "started",
        "worker",
    )

    def __init__(
        self,
        task_id: int,
        fn: tuple[int, bool],
        seed: int | None,
        kind: str,
        arg: bytes,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.id = task_id
        self.fn_id, self.is_async = fn
        self.seed = seed
        self.kind = kind
        self.arg = arg
        # `submit`: a concurrent future. `run`: an asyncio future of `loop`, which only that loop's
        # thread may touch: the pool's thread queues its outcome (`_Pool.settle`) and hands the
        # loop all outcomes of a step in one call (one wake-up, no lock, no Condition per task)
        self.future: concurrent.futures.Future[Any] | asyncio.Future[Any] = (
            concurrent.futures.Future() if loop is None else loop.create_future()
        )
        self.loop = loop
        self.in_slot: Slot | None = None
        self.out_slot: Slot | None = None
        self.row: RowTarget | None = None
        self.pin: int | None = None  # the index of the only worker it may run on
        self.started = False
        self.worker: _Handle | None = None  # where it was sent last
        self.sent_at = 0.0
        self.expired = False  # an async task past its timeout: answered, cancel sent
        self.abandoned = False  # answered or cancelled here: drop what the worker sends


def _cancelled() -> BaseException:
    return concurrent.futures.CancelledError()


class _Handle:
    """The parent's side of one worker process."""

    def __init__(
        self,
        index: int,
        process: Any,
        conn: Connection,
        lifeline: Connection,
        counts: collections.Counter[str],
    ) -> None:
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
        self.inflight: dict[int, _Task] = {}  # in the order sent (plain ones run in that order)
        self.async_n = 0  # of them, async tasks
        self.expired_n = (
            0  # of those, timed out and cancelled, not ended yet: its loop may be stuck
        )
        self.counts = counts  # the pool's: pipe bytes are counted here
        self._out = bytearray()  # messages queued for one write (`flush`)
        self._in = bytearray()  # bytes read, not yet whole messages
        self._chunk = memoryview(bytearray(READ_BYTES))
        self.fns: set[int] = set()
        self.slabs: set[int] = set()
        self.quarantine: list[Slot] = []  # slots it may still write to until it is reaped
        self.watched_conn = self.watched_exit = False  # registered with the pool's selector

    @property
    def sync_n(self) -> int:
        """Plain (not async) tasks in flight: they run one after the other."""
        return len(self.inflight) - self.async_n

    def send(self, msg: tuple[Any, ...]) -> None:
        self.send_bytes(pickle.dumps(msg, protocol=5))

    def send_bytes(self, data: bytes) -> None:
        """Queue one message, framed as `Connection.send_bytes` frames it; `flush` writes it."""
        if len(data) <= 0x7FFFFFFF:
            self._out += struct.pack("!i", len(data))
        else:
            self._out += struct.pack("!iQ", -1, len(data))
        self._out += data
        self.counts["pipe_bytes_sent"] += len(data) + FRAME_BYTES

    def flush(self) -> None:
        """Write every queued message in one call. Raises OSError when the worker is gone."""
        if self._out:
            data, self._out = self._out, bytearray()
            self.sock.sendall(data)

    def receive(self) -> list[Any]:
        """The messages that have arrived, without blocking; at EOF `open` turns False."""
        while True:
            try:
                n = self.sock.recv_into(self._chunk, READ_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if n == 0:
                self.open = False  # it is exiting; its sentinel says when it is gone
                break
            self._in += self._chunk[:n]
            if n < READ_BYTES:
                break
        msgs, pos, end = [], 0, len(self._in)
        with memoryview(self._in) as buf:
            while end - pos >= 4:
                (size,), start = struct.unpack_from("!i", buf, pos), pos + 4
                if size == -1:
                    if end - start < 8:
                        break
                    (size,), start = struct.unpack_from("!Q", buf, start), start + 8
                if end - start < size:
                    break
                msgs.append(pickle.loads(buf[start : start + size]))
                self.counts["pipe_bytes_received"] += start - pos + size
                pos = start + size
        del self._in[:pos]
        return msgs

    def share(self, arena: Arena, slab_id: int) -> None:
        if slab_id not in self.slabs:
            fd, size = arena.slab_fd(slab_id)
            self.send((wire.SLAB, slab_id, size))
            self.flush()  # the descriptor follows its message
            socket.send_fds(self.sock, [b"F"], [fd])
            self.counts["pipe_bytes_sent"] += 1
            self.slabs.add(slab_id)

    def take_all(self) -> list[_Task]:
        """Empty its tasks in flight; returns them in the order sent."""
        tasks = list(self.inflight.values())
        self.inflight.clear()
        self.async_n = self.expired_n = 0
        return tasks

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
        self._cancels: collections.deque[_Task] = collections.deque()
        self._pending: collections.deque[_Task] = collections.deque()
        self._handles: list[_Handle] = []
        self._fns: list[tuple[Callable[[Any], Any], tuple[int, bool]]] = []
        self._fn_blobs: dict[int, bytes] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._arena: Arena | None = None
        self._wake_r = self._wake_w = -1
        self._wake_pending = False  # a byte is in the wake pipe (see `_wake_locked`)
        # what the pool's thread waits on: each worker's socket and sentinel, and the wake pipe
        self._selector = selectors.DefaultSelector()
        self._stopping = False
        self._ready = threading.Event()
        self._failure: Callable[[], BaseException] | None = None
        self._restarts = 0
        self._out_bytes, self._out_known = FIRST_OUTPUT_BYTES, False
        self._seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self._zygote = Zygote(serve) if config.method == "zygote" else None
        self.counts: collections.Counter[str] = collections.Counter()
        self._outcomes: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}  # see `_settle`
        self._mailboxes: dict[asyncio.AbstractEventLoop, _Mailbox] = {}

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
    ) -> _Task:
        self.start()
        task = _Task(next(self._ids), self._register(fn), seed, *_encode_arg(arg), loop=loop)
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

    def cancel(self, task: _Task) -> None:
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
            blob = pickle.dumps(fn, protocol=5)
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
        handle = _Handle(index, process, conn, lifeline_w, self.counts)
        self._handles.append(handle)
        if self.cfg.init is not None:
            handle.send_bytes(self.cfg.init)
            handle.flush()

    def _watch(self, h: _Handle) -> None:
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

    def _unwatch(self, h: _Handle) -> None:
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

    def _read(self, h: _Handle) -> None:
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
        if task.is_async:
            h.async_n -= 1
            h.expired_n -= task.expired
        else:
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
        if task.abandoned:
            self._free(slot)
            self._settle(task, error=_cancelled())
            return
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
            self._settle(task, error=exc)
        else:
            self._settle(task, result)
        finally:
            self._free(slot)

    def _failed(self, h: _Handle, task_id: int, error: Any) -> None:
        task = self._finish(h, task_id)
        if task is not None:
            self._free(task.out_slot)
            task.out_slot = None
            if task.abandoned:
                self._settle(task, error=_cancelled())
                return
            where = "an async task" if task.is_async else "decode"
            self._settle(task, error=rebuild_error(error, h.pid, where))

    def _settle(self, task: _Task, result: Any = None, error: BaseException | None = None) -> None:
        """Give `task` its outcome: a concurrent future at once, an asyncio one at `_hand_over`."""
        if task.loop is None:
            _settle_future(task.future, result, error)  # type: ignore[arg-type]
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
                box = self._mailboxes[loop] = _Mailbox(loop)
            box.post(items)

    def _free(self, slot: Slot | None) -> None:
        if slot is not None and self._arena is not None:
            self._arena.release(slot)

    # -- faults --------------------------------------------------------------------------------------

    def _reap(self, h: _Handle) -> None:
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
        for slot in h.quarantine + [s for t in tasks for s in (t.in_slot, t.out_slot)]:
            self._free(slot)
        for t in tasks:
            t.in_slot = t.out_slot = None
        tasks = self._live(tasks)
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
            self._settle(t, error=WorkerDied(text, pid=pid, exitcode=code, tasks=ids))

    def _expire(self) -> None:
        now = time.monotonic()
        for h in list(self._handles):
            if not h.ready and not h.killed and now - h.spawned_at >= START_TIMEOUT_S:
                text = f"decode worker pid {h.pid} was not ready within {START_TIMEOUT_S} s"
                self._fail_pool(_factory(WorkerTimeout, text, pid=h.pid, timeout=START_TIMEOUT_S))
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

    def _expire_async(self, h: _Handle, now: float, timeout: float) -> None:
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

    def _async_deadlines(self, h: _Handle) -> list[float]:
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

    def _kill(self, h: _Handle, failed: _Task, error: BaseException) -> None:
        """Kill a stalled worker and replace it: `failed` gets `error`, its other tasks are retried."""
        h.killed = True
        with contextlib.suppress(OSError, ValueError):
            h.process.kill()
        tasks = h.take_all()
        for t in tasks:  # it may still write to them until it is reaped
            h.quarantine += [s for s in (t.in_slot, t.out_slot) if s is not None]
            t.in_slot = t.out_slot = None
        self._pending.extendleft(reversed(self._live([t for t in tasks if t is not failed])))
        self._settle(failed, error=error)
        self._spawn(h.index)

    def _live(self, tasks: list[_Task]) -> list[_Task]:
        """Of `tasks` taken from a worker, those still wanted; the others are answered."""
        for t in tasks:
            if t.abandoned:
                self._settle(t, error=_cancelled())
        return [t for t in tasks if not t.abandoned]

    def _cancel(self, task: _Task) -> None:
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
        while self._pending:
            task = self._pending[0]
            if not task.started:
                future = task.future
                if task.loop is None and not future.set_running_or_notify_cancel():  # type: ignore[union-attr]
                    self._pending.popleft()  # cancelled while queued
                    continue
                task.started = True
            if task.abandoned:
                self._pending.popleft()
                self._settle(task, error=_cancelled())
                continue
            h = self._pick(task)
            if h is None:
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

    def _pick(self, task: _Task) -> _Handle | None:
        """The ready worker with the fewest tasks in flight that has room for `task`, if any."""
        best: _Handle | None = None
        for h in self._handles:
            if not h.ready or not h.open or h.killed or task.pin not in (None, h.index):
                continue
            if task.is_async:  # none to a loop that has not ended a timed-out task yet
                room = h.async_n < self._async_room() and not h.expired_n
            else:
                room = h.sync_n < QUEUE_DEPTH
            if room and (best is None or len(h.inflight) < len(best.inflight)):
                best = h
        return best

    def _async_room(self) -> int:
        """Async tasks one worker may hold now. Until the first result tells how large results are,
        one: a first wave of `async_depth` tasks per worker would either fill the arena with slots of
        a guessed size or, without slots, send every result of that wave through the pipe."""
        return self.cfg.async_depth if self._out_known else 1

    def _send(self, h: _Handle, task: _Task) -> bool:
        """Send `task` to `h`; False when it must wait (a large message, and `h` is busy)."""
        arena, inline_max = self._arena, self.cfg.inline_max
        assert arena is not None
        if task.fn_id not in h.fns:
            blob = self._fn_blobs[task.fn_id]
            if len(blob) > inline_max and h.inflight:
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
            task.out_slot = arena.acquire(self._out_bytes)
        if task.out_slot is not None:
            h.share(arena, task.out_slot.slab_id)
            out_ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        if task.row is not None:
            h.share(arena, task.row.batch.slot.slab_id)
        now = time.monotonic()
        if not task.is_async and not h.sync_n:
            h.head_since = now
        h.send((wire.TASK, task.id, task.fn_id, task.seed, task.kind, inline, in_ref, out_ref, row))
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
        failure = self._failure or _factory(LoaderClosedError, "the process executor was closed")
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
        async_depth: async tasks (coroutine callables, see the module docstring) one worker may
            hold at once.

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
        async_depth: int = ASYNC_DEPTH,
    ) -> None:
        self.workers = (
            _default_workers() if workers is None else check_int("workers", workers, minimum=1)
        )
        check_int("max_worker_restarts", max_worker_restarts, minimum=0)
        check_int("inline_max", inline_max, minimum=0)
        self.async_depth = check_int("async_depth", async_depth, minimum=1)
        check_callable("worker_init_fn", worker_init_fn, optional=True)
        init = None if worker_init_fn is None else pickle.dumps(worker_init_fn, protocol=5)
        method, context = _start_method(start_method)
        self.start_method = method
        config = _Config(
            workers=self.workers, method=method, context=context,
            timeout=check_timeout("timeout", timeout), max_restarts=max_worker_restarts, init=init,
            arena_bytes=arena_budget(arena_bytes), inline_max=inline_max, async_depth=async_depth,
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
        worker: int | None = None,
    ) -> concurrent.futures.Future[T]:
        """Queue `fn(arg)` with `seed` as the sample's seed (see `_rng.py`); never blocks.

        `worker=i` runs it on worker i alone (or its replacement), after the tasks sent there before
        it: per-worker state (an iterator) then sees its tasks in order.

        `fn` may be a coroutine function (or an object whose `__call__` is one): it then runs on
        the worker's event loop, with other such tasks, and the future holds what it returns.

        Raises:
            LoaderClosedError: the executor was closed.
            TypeError: `fn` or `arg` cannot be pickled.
        """
        return self._pool.submit(fn, arg, seed, into, worker).future  # type: ignore[return-value]

    async def run(
        self,
        fn: Callable[[Any], T],
        arg: Any,
        seed: int | None = None,
        into: RowTarget | None = None,
    ) -> T:
        """Run `fn(arg)` in a worker and await its result; safe to cancel. See `batch_buffer`.

        Cancelling it cancels an async task in the worker too; a plain one runs to its end there
        (its result is dropped).
        """
        task = self._pool.submit(fn, arg, seed, into, loop=asyncio.get_running_loop())
        future: asyncio.Future[T] = task.future  # type: ignore[assignment]
        try:
            return await future
        except asyncio.CancelledError:
            self._pool.cancel(task)
            raise

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
        """Counters: tasks (async_tasks of them async), results in shared memory or pickled,
        retries, restarts, timeouts, arena bytes, and the bytes of every message that crossed the
        workers' pipes (`pipe_bytes_sent` to them, `pipe_bytes_received` from them)."""
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
