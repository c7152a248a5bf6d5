"""The worker process of the process executor: its main loop, its tasks, its death with its parent.

A worker serves one socket from the parent (`wire.py` says what travels on it): it receives decode
callables, slab file descriptors (SCM_RIGHTS) and tasks, runs each task's callable with the task's
seed current (`_util/rng.call_seeded`), and answers with metadata only.

A callable the parent marks async (a coroutine function, or an object whose `__call__` is one) runs
on the worker's own event loop (`worker_loop.WorkerLoop`, on a thread started with the first such
task), many at once: the main thread goes on reading the pipe, and each task answers when it ends. The
parent may cancel one (CANCEL); it then answers FAILED with its `CancelledError`. Answers are sent
whole under a lock, from either thread.

A worker dies with its parent: PR_SET_PDEATHSIG (Linux; its parent is the forkserver, which exits
when the main process does) and a thread that waits for EOF on a "lifeline" pipe whose only write
end the main process holds, and calls `os._exit` at once, even in the middle of a decode.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import gc
import mmap
import os
import pickle
import random
import select
import signal
import socket
import sys
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from ..._protocol import HasAclose
from ..._util.bytearrays import give_back_freed_memory
from ..._util.rng import call_seeded
from . import slot_carver
from .slot_carver import Carver
from .wire import (
    CANCEL,
    DONE,
    DROP,
    FAILED,
    FN,
    GROWN,
    INIT_FAILED,
    NEED,
    PICKLED,
    RAW_BYTEARRAY,
    READY,
    ROW,
    SHM,
    SINGLE,
    SLAB,
    SLOT,
    TASK,
    WANT,
    _into_row,
    _overflow,
    carved_in,
    encode_error,
    frame_header,
    pack,
    place_single,
)
from .worker_loop import WorkerLoop

__all__ = ["GIVEN", "die_with_parent", "serve", "threads_running"]

# A result this large, made in this worker's heap and copied into shared memory (or pickled), is
# garbage once answered: its pages go back to the system rather than stay in the heap, where the
# loader's byte budget does not see them. Smaller ones (a decoded image) and batches made in place in
# their slot are left alone: the allocator reuses that memory without a page fault.
GIVE_BACK_FROM = 4 << 20


def _large(result: Any) -> bool:
    if type(result) is torch.Tensor:
        return result.numel() * result.element_size() >= GIVE_BACK_FROM
    return type(result) is np.ndarray and result.nbytes >= GIVE_BACK_FROM


_PR_SET_PDEATHSIG = 1
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass


# Threads a fork may run beside: the lifeline watcher waits in one read and holds no lock a forked
# child could need, so a worker that builds a process pool of its own (a loader beside the trainer
# with `executor="process"`) may still fork that pool's zygote (`zygote.zygote_allowed`).
_QUIET: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def threads_running() -> int:
    """This process's threads, the caller's included, but those `_QUIET` (see there)."""
    return sum(1 for thread in threading.enumerate() if thread not in _QUIET)


def _watch_lifeline(lifeline: Connection) -> None:
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv_bytes()
    os._exit(0)  # the main process is gone (or closed us): stop now, even mid-decode


Row = tuple[memoryview, str, tuple[int, ...]]  # a batch row: where, dtype, shape


class _Worker:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.fns: dict[int, Callable[[Any], Any] | BaseException] = {}
        self.async_fns: set[int] = set()
        self.slabs: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self.worker_loop: WorkerLoop | None = None  # started with the first async task
        self._send_lock = threading.Lock()
        self._posted: list[bytes] = []  # answers of async tasks, written once per loop iteration
        self._starts: list[tuple[Any, ...]] = []  # async tasks read, handed to the loop together
        self._readable = select.poll()  # is another message waiting?
        self._readable.register(conn.fileno(), select.POLLIN)
        self._waiting: dict[int, Any] = {}  # results that asked for a larger slot (NEED)
        self._later: collections.deque[tuple[Any, ...]] = collections.deque()  # read while asking

    def send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=5)
        with self._send_lock:  # the main thread and the loop thread both answer
            self.conn.send_bytes(data)

    def post(self, msg: tuple[Any, ...]) -> None:
        """`send`, from the worker loop's thread: the answers of one loop iteration go in one write."""
        data = pickle.dumps(msg, protocol=5)
        with self._send_lock:
            self._posted.append(data)
            first = len(self._posted) == 1
        if first:
            assert self.worker_loop is not None
            self.worker_loop.loop.call_soon(self._flush_posted)

    def _flush_posted(self) -> None:
        with self._send_lock:
            posted, self._posted = self._posted, []
            frames = bytearray()
            for data in posted:
                frames += frame_header(len(data))
                frames += data
            with contextlib.suppress(OSError):  # the parent is gone: its lifeline ends us
                self.sock.sendall(frames)

    def loop(self) -> None:
        """Serve until the parent hangs up (EOF, or a broken pipe when it closes mid-task)."""
        with contextlib.suppress(EOFError, BrokenPipeError, ConnectionResetError):
            self._serve()

    def _serve(self) -> None:
        while True:
            msg = self._later.popleft() if self._later else pickle.loads(self.conn.recv_bytes())
            kind = msg[0]
            if kind != TASK:
                self._start_async()  # a CANCEL must find the tasks read before it started
            if kind == TASK:
                self.task(*msg[1:])
                if self._starts and not self._later and not self._readable.poll(0):
                    self._start_async()  # nothing more to read now: hand them over in one call
            elif kind == CANCEL:
                if self.worker_loop is not None:
                    self.worker_loop.cancel(msg[1])
            elif kind == GROWN:
                out = None if msg[2] is None else self.region(msg[2])
                self.answer(msg[1], out, None, self._waiting.pop(msg[1]))
                del out  # keep nothing of it while the next message is awaited
            else:
                self._setup(msg)

    def _setup(self, msg: tuple[Any, ...]) -> None:
        """FN, SLAB or DROP: what the worker holds, not a task's turn (handled even while a task
        asks for its slot)."""
        kind = msg[0]
        if kind == FN:
            self.fns[msg[1]] = _load_fn(msg[2])
            if msg[3]:
                self.async_fns.add(msg[1])
        elif kind == SLAB:
            _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
            mm = mmap.mmap(fds[0], msg[2])
            os.close(fds[0])
            if msg[3]:  # a batch buffer: every page of it will be written
                _populate(mm)
            self.slabs[msg[1]] = (mm, memoryview(mm))
        elif kind == DROP:
            self.slabs.pop(msg[1], None)  # unmapped once no array of ours views it

    def _ask(self, task_id: int, patient: bool, nbytes: int = 0) -> memoryview | None:
        """The output slot of the running task, asked of the parent now (`wire.py`: WANT); with
        `nbytes`, one at least that large, in place of the one it came with. Messages read meanwhile
        that are not the answer wait their turn, but a slab's is mapped at once (the answer may
        name it)."""
        self.send((WANT, task_id, patient, nbytes))
        while True:
            msg = pickle.loads(self.conn.recv_bytes())
            if msg[0] == SLOT and msg[1] == task_id:
                return None if msg[2] is None else self.region(msg[2])
            if msg[0] in (FN, SLAB, DROP):
                self._setup(msg)
            else:
                self._later.append(msg)

    def region(self, ref: tuple[int, int, int]) -> memoryview:
        slab_id, offset, size = ref
        return self.slabs[slab_id][1][offset : offset + size]

    def task(self, task_id: int, fn_id: int, seed: int | None, kind: str, inline: Any,
             in_ref: tuple[int, int, int] | None, out_ref: tuple[int, int, int] | None,
             row: tuple[int, int, int, str, tuple[int, ...]] | None,
             grow: bool = False, ask: bool = False) -> None:  # fmt: skip
        try:
            fn = self.fns[fn_id]
            if isinstance(fn, BaseException):
                raise fn
            data = inline if in_ref is None else self.region(in_ref)
            arg = pickle.loads(data) if kind == PICKLED else _raw(data, kind)
            del data
            out = None if out_ref is None else self.region(out_ref)
            into = None if row is None else (self.region(row[:3]), row[3], row[4])
            if fn_id in self.async_fns:
                answer = functools.partial(self.answer, task_id, out, into, send=self.post)
                self.async_loop()
                self._starts.append((task_id, fn, arg, seed, out, answer))
                return
            carver = None
            if into is None and (out is not None or ask):
                carver = Carver(
                    out, functools.partial(self._ask, task_id) if ask else None,
                    functools.partial(self._ask, task_id, False) if grow else None,
                )  # fmt: skip
            token = slot_carver.current.set(carver)
            try:
                result = call_seeded(fn, arg, seed)
            finally:
                slot_carver.current.reset(token)
            del arg
            if carver is not None:
                carver.ready()  # a result not carved (a user's collate) travels in the slot too
                out = carver.buf
        except Exception as exc:
            self.send((FAILED, task_id, encode_error(exc)))
            return
        needed = _overflow(result, out, carver) if grow and into is None else 0
        if needed:
            self._waiting[task_id] = result  # until GROWN names a slot that holds it
            self.send((NEED, task_id, needed))
            return
        self.answer(task_id, out, into, result, carver=carver)
        if _large(result) and not carved_in(carver, result):
            del result  # it was copied out of this worker's heap, and is garbage now
            give_back_freed_memory()

    def _start_async(self) -> None:
        if self._starts:
            assert self.worker_loop is not None
            starts, self._starts = self._starts, []
            self.worker_loop.start_many(starts)

    def close(self) -> None:
        """The parent hung up: close what the async callables hold (their `aclose()`), if any."""
        if self.worker_loop is not None:
            fns: list[object] = [self.fns[i] for i in self.async_fns]
            self.worker_loop.close([fn.aclose for fn in fns if isinstance(fn, HasAclose)])

    def async_loop(self) -> WorkerLoop:
        if self.worker_loop is None:
            self.worker_loop = WorkerLoop()
        return self.worker_loop

    def answer(
        self,
        task_id: int,
        out: memoryview | None,
        into: Row | None,
        result: Any,
        error: BaseException | None = None,
        *,
        send: Callable[[tuple[Any, ...]], None] | None = None,
        carver: Carver | None = None,
    ) -> None:
        """Write `result` into its batch row or output slot and tell the parent (or send `error`)."""
        send = send or self.send
        if error is None:
            try:
                if into is not None and _into_row(result, *into):
                    send((DONE, task_id, b"", ROW, 0))
                    return
                pid = place_single(result, out, carver)
                if pid is not None:
                    send((DONE, task_id, pid, SINGLE, pid[1] + pid[2]))
                    return
                blob, in_slot, needed = pack(result, out, carver)
            except Exception as exc:
                error = exc
            else:
                send((DONE, task_id, blob, SHM if in_slot else PICKLED, needed))
                return
        send((FAILED, task_id, encode_error(error)))


def _populate(mm: mmap.mmap) -> None:
    """Map every page of a batch buffer's slab for writing now, in one pass: else each page this
    worker writes for the first time faults, and the rows of recycled batch buffers go to whichever
    worker is free, so those faults go on for many batches (Linux 5.14+; elsewhere pages fault in as
    touched). Slabs of sample slots are left to fault in: most of their slots may never be used."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        mm.madvise(_MADV_POPULATE_WRITE)


# Objects a worker gets as it starts rather than through its pipe, by their id in the parent
# (`Given`): with a forked start (the zygote, "fork") this dict is inherited with the objects in it;
# otherwise the parent sends it pickled as the worker's first message.
GIVEN: dict[int, Any] = {}


def _load_fn(blob: bytes | int) -> Callable[[Any], Any] | BaseException:
    if isinstance(blob, int):
        return GIVEN[blob]  # type: ignore[no-any-return]
    try:
        fn: Callable[[Any], Any] = pickle.loads(blob)
    except Exception as exc:
        return exc
    return fn


def _raw(data: Any, kind: str) -> Any:
    if kind == RAW_BYTEARRAY:
        return bytearray(data)
    return data if type(data) is bytes else bytes(data)


def serve(
    conn: Connection, lifeline: Connection, worker_id: int, seed: int, init: int | None,
    given: bool = False,
) -> None:  # fmt: skip
    """The worker process's target: set up, run `worker_init_fn(worker_id)`, then serve tasks.

    `init`: the id of `worker_init_fn` in `GIVEN`. With `given`, the parent's first message is
    `GIVEN` pickled (a start that does not fork: the objects are not inherited).
    """
    gc.freeze()  # inherited objects: collections here never write to (and so copy) their pages
    die_with_parent()
    watcher = threading.Thread(
        target=_watch_lifeline, args=(lifeline,), name="lifeline", daemon=True
    )  # fmt: skip
    _QUIET.add(watcher)
    watcher.start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    worker = _Worker(conn)
    try:
        if given:
            GIVEN.update(pickle.loads(conn.recv_bytes()))
        if init is not None:
            GIVEN[init](worker_id)
    except Exception as exc:
        worker.send((INIT_FAILED, encode_error(exc)))
        return
    worker.send((READY, os.getpid()))
    worker.loop()
    worker.close()
