"""The wire format between the process executor and its workers: messages, results in shared memory.

A worker answers a task with metadata only. Arrays in the result (torch tensors
and numpy arrays, wherever they sit in dicts, lists, tuples or objects) are written into the output
slot the task came with; the answer is the result pickled with each array replaced by a persistent
id `(kind, offset, nbytes, dtype, shape, strides)`; a result that is one array alone (the common
case) skips the pickler: the answer carries its persistent id as is. An array that does not fit is
pickled in-band.
A task may instead name a batch row `(slab, offset, nbytes, dtype, shape)`: a result that is one
tensor (or array) of that dtype and shape is written there and the answer carries nothing at all.
Large `bytes` and `bytearray` objects in a result travel in the slot too (the parent copies them out:
one copy, instead of pickling them through the pipe).

An async task (see `worker.py`) may be cancelled (CANCEL); it then answers FAILED.

Messages are pickled tuples, first item the kind:

    parent -> worker                               worker -> parent
    (FN, fn_id, blob, is_async)                    (READY, pid)
    (SLAB, slab_id, size, whole) + fd (SCM_RIGHTS) (INIT_FAILED, error)
    (DROP, slab_id)                                (DONE, task_id, data, how, needed)
    (TASK, task_id, fn_id, seed, kind, inline,     (FAILED, task_id, error)
     in_ref, out_ref, row, grow, ask)              (NEED, task_id, needed)
    (CANCEL, task_id)                              (WANT, task_id, patient, nbytes)
    (GROWN, task_id, out_ref)
    (SLOT, task_id, out_ref)

A `blob` that is an int names an object the worker was given as it started (`GIVEN`: inherited by
a fork, or the first message), not pickled: a dataset holding a `multiprocessing.Value` or a
lambda then works, and `worker_init_fn` and the tasks see the very same objects.

With `grow`, a plain task whose result does not fit its output slot keeps the result and answers
NEED with the bytes it needs; the parent answers GROWN with a slot that large (or None: the result is
then pickled), and the worker packs the result there. How a pool that hands over whole batches learns
their size without pickling the first ones through the pipe. A `grow` task whose batch tensor is
larger than its slot asks before it stacks it (WANT with the bytes it needs): the parent frees the
small slot and answers SLOT as for the last ask below, so that the first batches, whose size nobody
knew, are admitted against the arena's budget like any other, and none is made in a worker's heap
while the budget is spent (inside a container's memory limit, eight workers each stacking a 150 MB
batch of their own would be killed by it).

With `ask`, a whole-batch task comes without an output slot (none of the worker's own was free when it
was sent: the consumer still held the batch it wrote last), and the worker asks for one when it first
needs it (WANT); the parent answers SLOT with a slot or None. A `patient` ask is answered at once and
takes only a free slot of the worker's own slabs (or its first); the worker then keeps the samples it
has read in its own memory a while longer and asks again later. The last ask, as the batch is
stacked, waits for a free slot, a short while at most before a slab is made for it (`config`:
`SLOT_WAIT_S`). So a worker keeps one batch of shared memory, not two, whenever the consumer takes
each batch before the next is stacked.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
import struct
import traceback
from typing import Any

import numpy as np
import torch

from ..._exceptions import DecodeError
from ..._util.bytearrays import Bytearrays
from .arena import Arena, Slot
from .slot_carver import Carver, align

__all__ = [
    "RemoteTraceback",
    "Unpacker",
    "carved_in",
    "encode_error",
    "frame_header",
    "load_placed",
    "measure",
    "pack",
    "place_single",
    "rebuild_error",
]

READY, INIT_FAILED, DONE, FAILED, NEED = "ready", "init-failed", "done", "failed", "need"
WANT = "want"
FN, SLAB, DROP, TASK, CANCEL, GROWN = "fn", "slab", "drop", "task", "cancel", "grown"
SLOT = "slot"
RAW, RAW_BYTEARRAY, PICKLED = "raw", "bytearray", "pickled"  # how a task's argument travels
# how a result travels: in its output slot (pickled with persistent ids), alone in its output slot
# (the answer carries its persistent id), or written into a batch row
SHM, SINGLE, ROW = "shm", "single", "row"
BYTES_IN_SLOT_MIN = 16 << 10  # bytes/bytearray objects from this size travel in the output slot

_Byte = ctypes.c_char
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
            if (
                pid is not None
            ):  # made in the slot already (`process/slot_carver`): named, not copied
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
            # an empty tensor may keep a stride of 0 (an expanded one), which `view` refuses
            raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
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
        if not raw:
            return torch.empty(shape, dtype=getattr(torch, dtype))
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
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
        return (
            "B",
            0,
            result.nbytes,
            "",
            (),
            (),
        )  # received there (`_util/bytearrays.landing`): no copy
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


def carved_in(carver: Carver | None, result: Any) -> bool:
    """Whether `result` is a tensor `carver` made in the task's slot (not in the worker's heap)."""
    return carver is not None and type(result) is torch.Tensor and carver.where(result) is not None


def _overflow(result: Any, out: memoryview | None, carver: Carver | None) -> int:
    """The bytes `result`'s arrays need in one slot when `out` cannot hold them, else 0."""
    if carved_in(carver, result):
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
