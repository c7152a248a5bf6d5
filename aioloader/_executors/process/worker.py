"""The worker process of the process executor: its main loop, and the wire format both sides use.

A worker serves one socket from the parent: it receives decode callables (pickled once by the
parent), slab file descriptors (SCM_RIGHTS) and tasks, runs each task's callable with the task's
seed current (`_rng.call_seeded`), and answers with metadata only. Arrays in the result (torch tensors
and numpy arrays, wherever they sit in dicts, lists, tuples or objects) are written into the output
slot the task came with; the answer is the result pickled with each array replaced by a persistent
id `(kind, offset, nbytes, dtype, shape, strides)`; a result that is one array alone (the common
case) skips the pickler: the answer carries its persistent id as is. An array that does not fit is
pickled in-band.
A task may instead name a batch row `(slab, offset, nbytes, dtype, shape)`: a result that is one
tensor (or array) of that dtype and shape is written there and the answer carries nothing at all.
Large `bytes` and `bytearray` objects in a result travel in the slot too (the parent copies them out:
one copy, instead of pickling them through the pipe).

A callable the parent marks async (a coroutine function, or an object whose `__call__` is one) runs
on the worker's own event loop (`_workerloop.WorkerLoop`, on a thread started with the first such
task), many at once: the main thread goes on reading the pipe, and each task answers when it ends. The
parent may cancel one (CANCEL); it then answers FAILED with its `CancelledError`. Answers are sent
whole under a lock, from either thread.

Messages are pickled tuples, first item the kind:

    parent -> worker                               worker -> parent
    (FN, fn_id, blob, is_async)                    (READY, pid)
    (SLAB, slab_id, size, whole) + fd (SCM_RIGHTS) (INIT_FAILED, error)
    (DROP, slab_id)                                (DONE, task_id, data, how, needed)
    (TASK, task_id, fn_id, seed, kind, inline,     (FAILED, task_id, error)
     in_ref, out_ref, row, grow)                   (NEED, task_id, needed)
    (CANCEL, task_id)
    (GROWN, task_id, out_ref)

A `blob` that is an int names an object the worker was given as it started (`GIVEN`: inherited by
a fork, or the first message), not pickled: a dataset holding a `multiprocessing.Value` or a
lambda then works, and `worker_init_fn` and the tasks see the very same objects.

With `grow`, a plain task whose result does not fit its output slot keeps the result and answers
NEED with the bytes it needs; the parent answers GROWN with a slot that large (or None: the result is
then pickled), and the worker packs the result there. How a pool that hands over whole batches learns
their size without pickling the first ones through the pipe.

A worker dies with its parent: PR_SET_PDEATHSIG (Linux; its parent is the forkserver, which exits
when the main process does) and a thread that waits for EOF on a "lifeline" pipe whose only write
end the main process holds, and calls `os._exit` at once, even in the middle of a decode.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import io
import mmap
import os
import pickle
import random
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from ..._exceptions import DecodeError
from ..._util.bytearrays import Bytearrays
from ..._util.rng import call_seeded
from . import carve as _carve
from .arena import Arena, Slot
from .carve import Carver, align
from .worker_loop import WorkerLoop

__all__ = [
    "RemoteTraceback",
    "Unpacker",
    "die_with_parent",
    "encode_error",
    "frame_header",
    "measure",
    "pack",
    "rebuild_error",
    "serve",
]

READY, INIT_FAILED, DONE, FAILED, NEED = "ready", "init-failed", "done", "failed", "need"
FN, SLAB, DROP, TASK, CANCEL, GROWN = "fn", "slab", "drop", "task", "cancel", "grown"
RAW, RAW_BYTEARRAY, PICKLED = "raw", "bytearray", "pickled"  # how a task's argument travels
# how a result travels: in its output slot (pickled with persistent ids), alone in its output slot
# (the answer carries its persistent id), or written into a batch row
SHM, SINGLE, ROW = "shm", "single", "row"
BYTES_IN_SLOT_MIN = 16 << 10  # bytes/bytearray objects from this size travel in the output slot
_PR_SET_PDEATHSIG = 1
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux's value

Error = tuple[bytes | None, str, str]  # (pickled exception or None, "Type: message", traceback)


def frame_header(nbytes: int) -> bytes:
    """The length prefix `Connection.send_bytes` puts before a message of `nbytes` (so that
    messages written in one batch read back with `Connection.recv_bytes`)."""
    if nbytes <= 0x7FFFFFFF:
        return struct.pack("!i", nbytes)
    return struct.pack("!iQ", -1, nbytes)


def encode_error(exc: BaseException) -> Error:
    """The exception pickled (if it survives a round trip), its summary and its traceback text."""
    text = "".join(traceback.format_exception(exc))
    try:
        blob = pickle.dumps(exc, protocol=5)
        pickle.loads(blob)
    except Exception:
        return None, f"{type(exc).__qualname__}: {exc}", text
    return blob, f"{type(exc).__qualname__}: {exc}", text


class _Packer(pickle.Pickler):
    """Pickles a result, writing each plain tensor or array into `buf` instead (when it fits)."""

    def __init__(self, file: io.BytesIO, buf: memoryview | None, carver: Carver | None) -> None:
        super().__init__(file, protocol=5)
        self.buf = buf
        self.carver = carver
        self.needed = 0 if carver is None else carver.used  # carved tensors come first
        self.used = False
        self._seen: dict[int, tuple[Any, ...]] = {}
        self._raw: list[bytes] = []  # arrays that did not fit, as bytes (see `_in_band`)

    def persistent_id(self, obj: Any) -> Any:
        if type(obj) is bytes and self._raw and any(obj is raw for raw in self._raw):
            return None  # an array's bytes in the pickle (`_in_band`): counted already
        found = _kind(obj)
        if found is None:
            return None
        if id(obj) in self._seen:
            return self._seen[id(obj)]
        kind, nbytes = found
        if kind == "t" and self.carver is not None:
            pid = _carved(self.carver, obj)
            if pid is not None:  # made in the slot already (`_carve`): named, not copied
                self.used = True
                return pid
        offset = align(self.needed)
        self.needed = offset + nbytes
        if self.buf is None or nbytes == 0 or self.needed > len(self.buf):
            return self._in_band(obj, kind)
        pid = _place(self.buf, offset, obj, kind, nbytes)
        self._seen[id(obj)] = pid
        self.used = True
        return pid

    def _in_band(self, obj: Any, kind: str) -> Any:
        """An array that does not fit the slot, as its raw bytes in the pickle: its own pickling (a
        tensor's storage becomes a large bytes object) would count its bytes twice in `needed`."""
        if kind == "t":
            flat = obj.detach().contiguous().reshape(-1)
            raw = flat.view(torch.uint8).numpy().tobytes()
            dtype = str(obj.dtype).removeprefix("torch.")
        elif kind == "n":
            raw, dtype = np.ascontiguousarray(obj).tobytes(), obj.dtype.str
        else:
            return None  # bytes and bytearray pickle as themselves
        self._raw.append(raw)
        return ("p", raw, kind, dtype, tuple(obj.shape))


class _Measure(_Packer):
    """Counts the bytes a result's arrays need in one slot, and writes nothing."""

    def persistent_id(self, obj: Any) -> Any:
        found = _kind(obj)
        if found is None:
            return None
        if id(obj) not in self._seen:
            carved = (
                found[0] == "t" and self.carver is not None and self.carver.where(obj) is not None
            )
            if not carved:  # a carved one lies in the slot already
                self.needed = align(self.needed) + found[1]
            self._seen[id(obj)] = ("m",)
        return ("m",)


def measure(result: Any, carver: Carver | None) -> int:
    """The bytes `pack` would need to place `result` (after what `carver` made in place)."""
    packer = _Measure(io.BytesIO(), None, carver)
    packer.dump(result)
    return packer.needed


def _from_band(pid: tuple[Any, ...]) -> Any:
    """Parent side of `_Packer._in_band`: the array again (writable: over a copy of the bytes)."""
    _, raw, kind, dtype, shape = pid
    if kind == "t":
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    return np.frombuffer(bytearray(raw), np.dtype(dtype)).reshape(shape)


def _kind(obj: Any) -> tuple[str, int] | None:
    """(kind, bytes) of an object that travels in the output slot; None for any other."""
    if type(obj) is bytes or type(obj) is bytearray:
        if len(obj) < BYTES_IN_SLOT_MIN:
            return None
        return "b" if type(obj) is bytes else "B", len(obj)
    if type(obj) is torch.Tensor:
        if obj.layout != torch.strided or obj.device.type != "cpu" or obj.requires_grad:
            return None
        if obj.is_quantized or obj.is_nested:
            return None
        return "t", obj.numel() * obj.element_size()
    if type(obj) is np.ndarray:
        if obj.dtype.hasobject or obj.dtype.fields is not None or obj.dtype.kind == "V":
            return None
        return "n", obj.nbytes
    return None


def _place(buf: memoryview, offset: int, obj: Any, kind: str, nbytes: int) -> tuple[Any, ...]:
    """Copy `obj` into `buf` at `offset`; its persistent id."""
    if kind == "t":
        return _write(buf, offset, obj)
    if kind == "n":
        return _write_np(buf, offset, obj)
    buf[offset : offset + nbytes] = obj
    return (kind, offset, nbytes, "", (), ())


def _carved(carver: Carver, t: torch.Tensor) -> tuple[Any, ...] | None:
    """The persistent id of `t` where `carver` made it in the slot; None if it did not."""
    offset = carver.where(t)
    return None if offset is None else _tensor_pid(t, offset)


def _tensor_pid(t: torch.Tensor, offset: int) -> tuple[Any, ...]:
    """The persistent id of tensor `t` lying at `offset` in its slot."""
    nbytes = t.numel() * t.element_size()
    return ("t", offset, nbytes, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.stride())


def place_single(
    result: Any, buf: memoryview | None, carver: Carver | None = None
) -> tuple[Any, ...] | None:
    """A result that is one array (or large bytes object) alone, copied to the start of `buf` (or
    made in it by `carver`): its persistent id, which the answer carries as is (no pickler on either
    side); None otherwise."""
    if carver is not None and type(result) is torch.Tensor:
        pid = _carved(carver, result)
        if pid is not None or carver.used:
            return pid  # not carved whole: `pack` places it after what was carved
    if type(result) is memoryview and buf is not None and _lies_at_start(result, buf):
        return ("B", 0, result.nbytes, "", (), ())  # received there (`_recycle.landing`): no copy
    found = _kind(result)
    if found is None or buf is None or not 0 < found[1] <= len(buf):
        return None
    return _place(buf, 0, result, *found)


def _lies_at_start(view: memoryview, buf: memoryview) -> bool:
    """Whether `view` is the first `len(view)` bytes of `buf` (the same memory, not a copy)."""
    if view.obj is not buf.obj or not view.contiguous or view.format != "B":
        return False
    if not 0 < view.nbytes <= buf.nbytes:
        return False
    try:
        return ctypes.addressof(_Byte.from_buffer(view)) == ctypes.addressof(_Byte.from_buffer(buf))
    except TypeError:  # read-only: not a slot
        return False


_Byte = ctypes.c_char


def _write(buf: memoryview, offset: int, t: torch.Tensor) -> tuple[Any, ...]:
    dst = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=offset).view(t.shape)
    dst.copy_(t)
    return _tensor_pid(dst, offset)


def _write_np(buf: memoryview, offset: int, a: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    dst: np.ndarray[Any, Any] = np.ndarray(a.shape, a.dtype, buffer=buf, offset=offset)
    np.copyto(dst, a, casting="no")
    return ("n", offset, a.nbytes, a.dtype.str, a.shape, dst.strides)


def pack(
    result: Any, buf: memoryview | None, carver: Carver | None = None
) -> tuple[bytes, bool, int]:
    """(pickled result, whether `buf` was written, bytes all its arrays need in one slot); arrays
    `carver` made in `buf` are named where they lie, the others copied after them."""
    out = io.BytesIO()
    packer = _Packer(out, buf, carver)
    packer.dump(result)
    return out.getvalue(), packer.used, packer.needed


class Unpacker(pickle.Unpickler):
    """Parent side of `pack`: rebuilds the result with each array a view of `slot` (no copy)."""

    def __init__(
        self, data: bytes, arena: Arena | None, slot: Slot | None, copies: Bytearrays | None = None
    ) -> None:
        super().__init__(io.BytesIO(data))
        self.arena = arena
        self.slot = slot
        self.copies = copies

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "p":
            return _from_band(pid)
        assert self.arena is not None
        assert self.slot is not None
        return load_placed(self.arena, self.slot, pid, self.copies)


def load_placed(
    arena: Arena, slot: Slot, pid: tuple[Any, ...], copies: Bytearrays | None = None
) -> Any:
    """Parent side of `_place`: a view of `slot` (a copy for `bytes` and `bytearray`, the latter
    into a recycled buffer of `copies` when given); an array that travelled in band, rebuilt."""
    if pid[0] == "p":
        return _from_band(pid)
    kind, offset, nbytes, dtype, shape, strides = pid
    owner = arena.view(slot, offset, nbytes)
    if kind == "b":  # a copy: `bytes` and `bytearray` cannot wrap shared memory
        return bytes(owner)
    if kind == "B":
        if copies is None:
            return bytearray(owner)
        out = copies.take(nbytes)
        np.frombuffer(out, np.uint8)[:] = owner  # in place: no resize, one copy
        return out
    if kind == "t":
        return torch.frombuffer(owner, dtype=getattr(torch, dtype)).as_strided(shape, strides)
    return np.ndarray(shape, np.dtype(dtype), buffer=owner, strides=strides)


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process (set as its `__cause__`)."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0]).rstrip()


def rebuild_error(error: Error, pid: int, where: str = "decode") -> BaseException:
    """The worker's exception with its own type where it unpickles, else `DecodeError`; noted."""
    blob, summary, text = error
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = DecodeError(
            f"{where} raised {summary} (its type cannot be rebuilt here)", stage="decode"
        )
        exc.remote_traceback = text  # type: ignore[attr-defined]
    exc.__cause__ = RemoteTraceback(text)
    exc.add_note(f"aioloader: raised in {where} in worker process pid {pid}")
    return exc


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass


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
            msg = pickle.loads(self.conn.recv_bytes())
            kind = msg[0]
            if kind != TASK:
                self._start_async()  # a CANCEL must find the tasks read before it started
            if kind == TASK:
                self.task(*msg[1:])
                if self._starts and not self._readable.poll(0):
                    self._start_async()  # nothing more to read now: hand them over in one call
            elif kind == FN:
                self.fns[msg[1]] = _load_fn(msg[2])
                if msg[3]:
                    self.async_fns.add(msg[1])
            elif kind == CANCEL:
                if self.worker_loop is not None:
                    self.worker_loop.cancel(msg[1])
            elif kind == SLAB:
                _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
                mm = mmap.mmap(fds[0], msg[2])
                os.close(fds[0])
                if msg[3]:  # a batch buffer: every page of it will be written
                    _populate(mm)
                self.slabs[msg[1]] = (mm, memoryview(mm))
            elif kind == DROP:
                self.slabs.pop(msg[1], None)  # unmapped once no array of ours views it
            elif kind == GROWN:
                out = None if msg[2] is None else self.region(msg[2])
                self.answer(msg[1], out, None, self._waiting.pop(msg[1]))
                del out  # keep nothing of it while the next message is awaited

    def region(self, ref: tuple[int, int, int]) -> memoryview:
        slab_id, offset, size = ref
        return self.slabs[slab_id][1][offset : offset + size]

    def task(self, task_id: int, fn_id: int, seed: int | None, kind: str, inline: Any,
             in_ref: tuple[int, int, int] | None, out_ref: tuple[int, int, int] | None,
             row: tuple[int, int, int, str, tuple[int, ...]] | None,
             grow: bool = False) -> None:  # fmt: skip
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
            carver = None if out is None or into is not None else Carver(out)
            token = _carve.current.set(carver)
            try:
                result = call_seeded(fn, arg, seed)
            finally:
                _carve.current.reset(token)
            del arg
        except Exception as exc:
            self.send((FAILED, task_id, encode_error(exc)))
            return
        needed = _overflow(result, out, carver) if grow and into is None else 0
        if needed:
            self._waiting[task_id] = result  # until GROWN names a slot that holds it
            self.send((NEED, task_id, needed))
            return
        self.answer(task_id, out, into, result, carver=carver)

    def _start_async(self) -> None:
        if self._starts:
            assert self.worker_loop is not None
            starts, self._starts = self._starts, []
            self.worker_loop.start_many(starts)

    def close(self) -> None:
        """The parent hung up: close what the async callables hold (their `aclose()`), if any."""
        if self.worker_loop is not None:
            closers = [getattr(self.fns[i], "aclose", None) for i in self.async_fns]
            self.worker_loop.close([aclose for aclose in closers if callable(aclose)])

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


def _overflow(result: Any, out: memoryview | None, carver: Carver | None) -> int:
    """The bytes `result`'s arrays need in one slot when `out` cannot hold them, else 0."""
    if carver is not None and type(result) is torch.Tensor and carver.where(result) is not None:
        return 0  # the common case, answered without a look at the rest
    needed = measure(result, carver)
    return needed if needed > (0 if out is None else len(out)) else 0


def _into_row(result: Any, buf: memoryview, dtype: str, shape: tuple[int, ...]) -> bool:
    """Write `result` into a batch row if it is one plain tensor (or array) of that dtype and shape."""
    if type(result) is np.ndarray and not result.dtype.hasobject and result.dtype.fields is None:
        with contextlib.suppress(TypeError):
            result = torch.from_numpy(result)
    if type(result) is not torch.Tensor or result.requires_grad or result.device.type != "cpu":
        return False
    if result.layout != torch.strided or str(result.dtype) != f"torch.{dtype}":
        return False
    if tuple(result.shape) != shape:
        return False
    _write(buf, 0, result)
    return True


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
    threading.Thread(target=_watch_lifeline, args=(lifeline,), name="lifeline", daemon=True).start()
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
