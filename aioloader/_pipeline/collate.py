"""Batch stage: the default collate, and the recycled buffers it stacks samples into.

`default_collate` returns what `torch.utils.data.default_collate` returns for the same samples (it walks
the structure with torch's own `collate` so dicts, namedtuples, sequences, numbers and strings behave the
same), with one difference: where every tensor or array of a leaf has the same shape and dtype, it stacks
into a buffer taken from a `BufferPool` instead of allocating a batch-sized tensor per batch. Fresh pages
cost ~11 µs each on the project's machines, so a 150 MB batch written into new memory takes ~0.5 s and
into a recycled one ~10 ms (shared/DESIGN.md).

A buffer is handed out again only when nothing outside the pool refers to it: no Python reference to the
batch tensor, and no view or numpy array over its storage. A consumer that keeps batches therefore makes
the pool allocate, never overwrite.
"""

from __future__ import annotations

import array
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from .._exceptions import CollateError
from .._executors.base import RowWriter
from .._util.deps import storage_uses, torch_collate

__all__ = [
    "DEFAULT_COLLATE",
    "BufferPool",
    "Buffers",
    "RowPlan",
    "StackAsRead",
    "default_collate",
    "make_collate",
    "stacks",
]


_torch_collate, _torch_fn_map = torch_collate()


class _DefaultCollate:
    def __repr__(self) -> str:
        return "DEFAULT_COLLATE"


DEFAULT_COLLATE: Any = _DefaultCollate()
"""Collate like torch's default_collate, into recycled batch buffers (the default)."""

_CollateFnMap = dict[type | tuple[type, ...], Callable[..., Any]]


def _uses(buffers: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """For each pooled tensor: its Python references, its UntypedStorage object's, and the
    StorageImpl's uses, counted the same way every time (`take` and the calibration below both call
    this, so the references the counting itself holds are the same in both)."""
    return [_counts(buf) for buf in buffers]


def _counts(buf: torch.Tensor) -> tuple[int, int, int]:
    storage = buf.untyped_storage()  # torch hands out the same object while anyone keeps it
    return (
        sys.getrefcount(buf),
        sys.getrefcount(storage),
        storage_uses(storage),
    )


# The counts of a pooled tensor that nothing outside the pool refers to, measured at import on a fresh
# tensor rather than written down: they depend on the interpreter (3.14 takes fewer references
# for a call's arguments and a loop's variable than 3.11 does). A batch the consumer still holds, a
# view of it, a numpy array over it or a kept `untyped_storage()` each raises one of them.
_FREE: tuple[int, int, int] = _uses([torch.empty(1)])[0]


class Buffers(Protocol):
    """Where the default collate takes its batch tensors from: a `BufferPool`, or a
    `process/slot_carver.Carver` (the output slot of a process worker's task)."""

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...


class BufferPool:
    """Recycled batch buffers, keyed by shape and dtype.

    Thread-safe. `take` never blocks: it returns a free buffer of the shape, or allocates one (and keeps
    it for reuse while fewer than `per_shape` buffers of that shape exist and the kept buffers stay
    within `max_bytes`).

    Example:
        >>> pool = BufferPool(per_shape=2)
        >>> a = pool.take((4, 3), torch.float32)
        >>> b = pool.take((4, 3), torch.float32)  # `a` is still referenced: a new buffer
        >>> a is b
        False
    """

    def __init__(self, per_shape: int = 4, max_bytes: int | None = None) -> None:
        if per_shape < 0:
            raise ValueError(f"per_shape must be >= 0, got {per_shape}")
        self.per_shape = per_shape
        self.max_bytes = max_bytes  # kept buffers never add up to more than this
        self.kept_bytes = 0
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0
        self.reused = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Return a buffer of `shape` and `dtype` that nobody else refers to."""
        with self._lock:
            buffers = self._buffers.setdefault((shape, dtype), [])
            for i, uses in enumerate(_uses(buffers)):
                if uses == _FREE:
                    self.reused += 1
                    return buffers[i]
            self.allocated += 1
            fresh = torch.empty(shape, dtype=dtype)
            size = fresh.numel() * fresh.element_size()
            fits = self.max_bytes is None or self.kept_bytes + size <= self.max_bytes
            if len(buffers) < self.per_shape and fits:
                buffers.append(fresh)
                self.kept_bytes += size
            return fresh

    def clear(self) -> None:
        """Forget every pooled buffer (batches the consumer still holds stay valid)."""
        with self._lock:
            self._buffers.clear()
            self.kept_bytes = 0

    def retire(self) -> None:
        """`clear`, and keep no buffer from now on (`take` still allocates)."""
        with self._lock:
            self.per_shape = 0
        self.clear()


def _stackable(batch: Sequence[torch.Tensor]) -> bool:
    first = batch[0]
    if first.device.type != "cpu" or first.layout != torch.strided or first.is_nested:
        return False
    return all(
        t.shape == first.shape
        and t.dtype == first.dtype
        and t.device == first.device
        and t.layout == torch.strided
        and not t.requires_grad
        for t in batch
    )


def _check_shapes(batch: Sequence[torch.Tensor]) -> None:
    others = [
        f"[{i}]={type(t).__name__}" for i, t in enumerate(batch) if not isinstance(t, torch.Tensor)
    ]
    if others:
        raise CollateError(
            "cannot batch tensors with samples that are not tensors: " + ", ".join(others)
        )
    if any(t.is_nested for t in batch):
        raise RuntimeError(  # torch's words
            "Batches of nested tensors are not currently supported by the default collate_fn; "
            "please provide a custom collate_fn to handle them appropriately."
        )
    shapes = {tuple(t.shape) for t in batch}
    if len(shapes) > 1:
        listed = ", ".join(f"[{i}]={tuple(t.shape)}" for i, t in enumerate(batch))
        raise CollateError(f"cannot stack samples of different shapes into one batch: {listed}")


def _stack_into(batch: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Stack into `out` on this thread alone.

    numpy copies on the calling thread; torch.stack would use the process's intra-op thread team,
    which stalls whenever the cores are busy (as they are while decode threads run): measured here,
    0.04 s per 150 MB batch one-threaded against 0.4-0.9 s with the team under load.
    """
    try:
        np.stack([t.numpy() for t in batch], out=out.numpy())
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a view it cannot take
        torch.stack(list(batch), 0, out=out)
    return out


def _make_fn_map(pool: Buffers | None) -> _CollateFnMap:
    torch_tensor_fn = _torch_fn_map[torch.Tensor]

    def tensor_fn(batch: Sequence[torch.Tensor], *, collate_fn_map: Any = None) -> torch.Tensor:
        stacked = _stacked(batch)
        if stacked is not None:
            return stacked
        _check_shapes(batch)
        if not _stackable(batch):
            return torch_tensor_fn(batch, collate_fn_map=collate_fn_map)  # type: ignore[no-any-return]
        shape = (len(batch), *batch[0].shape)
        # Without a pool, into the process's own memory: torch's collate, called in a worker process,
        # would allocate the batch in /dev/shm (torch's shared memory), which a container's 64 MB
        # mount cannot hold, only for a process worker to copy it into its slot or pipe anyway.
        out = (
            torch.empty(shape, dtype=batch[0].dtype)
            if pool is None
            else pool.take(shape, batch[0].dtype)
        )
        return _stack_into(batch, out)

    def ndarray_fn(batch: Sequence[np.ndarray[Any, Any]], *, collate_fn_map: Any = None) -> Any:
        others = [
            f"[{i}]={type(b).__name__}"
            for i, b in enumerate(batch)
            if not isinstance(b, np.ndarray)
        ]
        if others:
            raise CollateError(
                "cannot batch arrays with samples that are not: " + ", ".join(others)
            )
        stacked = _stacked(batch)
        if stacked is not None:
            return stacked
        if batch[0].dtype.kind in "SaUO":
            raise CollateError(
                f"default_collate cannot batch numpy arrays of dtype {batch[0].dtype}"
            )
        return tensor_fn([torch.as_tensor(b) for b in batch], collate_fn_map=collate_fn_map)

    fn_map: _CollateFnMap = dict(_torch_fn_map)
    fn_map[torch.Tensor] = tensor_fn
    fn_map[np.ndarray] = ndarray_fn
    return fn_map


def make_collate(pool: Buffers | None) -> Callable[[Sequence[Any]], Any]:
    """Build a default collate that stacks into `pool`'s buffers (or allocates, when `pool` is None)."""
    fn_map = _make_fn_map(pool)

    def collate(batch: Sequence[Any]) -> Any:
        if batch and type(batch[0]) in _NUMBERS:  # indices, token ids, labels, scores
            numbers = _numbers(batch)
            if numbers is not None:
                return numbers
        try:
            return _torch_collate(batch, collate_fn_map=fn_map)
        except CollateError:
            raise
        except TypeError as exc:
            raise CollateError(str(exc), stage="collate") from exc

    collate.stacks = True  # type: ignore[attr-defined]
    return collate


# Python numbers as torch batches them (int64, float64), through an array: torch.tensor(list) reads
# each number on its own (measured: 11 µs for 64 ints, 1.9 µs through array.array)
_NUMBERS = {int: ("q", torch.int64), float: ("d", torch.float64)}


def _numbers(batch: Sequence[Any]) -> torch.Tensor | None:
    """`torch.tensor(batch)` for a batch of Python ints (or floats) as torch's default_collate makes
    it; None where another type among them (a float among ints) or a value out of range calls for
    torch's own."""
    code, dtype = _NUMBERS[type(batch[0])]
    try:
        values = array.array(code, batch)
    except (TypeError, OverflowError):
        return None
    return torch.frombuffer(values, dtype=dtype)


def stacks(collate: object) -> bool:
    """True for a default collate: a batch of same-shaped tensors is exactly their stack."""
    return getattr(collate, "stacks", False) is True


class RowPlan:
    """Has process workers write decoded samples straight into their batch's row (no collate copy).

    It watches what decode returns. While every sample so far was one tensor (or numpy array) of one
    shape and dtype, `buffer(n)` makes an n-row batch in the executor's shared memory (see
    `process/batch_buffer.BatchBuffer`) and the pipeline sends each sample's decode with `into=` its row; the
    collated batch is then that buffer, which the default collate would have produced by stacking.
    The first sample that differs turns the plan off for good, and batches collate as usual.
    """

    def __init__(self, executor: RowWriter) -> None:
        self._executor = executor
        self._row: tuple[tuple[int, ...], torch.dtype] | None = None
        self.off = False
        # called once, with the first batch buffer: what collated the batches before (a BufferPool's
        # recycled buffers) is not needed any more
        self.on_first_buffer: Callable[[], None] | None = None

    def buffer(self, rows: int) -> Any:
        """A batch buffer of `rows` rows, or None (shape not known yet, plan off, arena full)."""
        if self.off or self._row is None:
            return None
        shape, dtype = self._row
        buffer = self._executor.batch_buffer((rows, *shape), dtype)
        if buffer is not None and self.on_first_buffer is not None:
            first, self.on_first_buffer = self.on_first_buffer, None
            first()
        return buffer

    def observe(self, sample: Any) -> None:
        """Learn from one decoded sample."""
        if self.off:
            return
        if isinstance(sample, np.ndarray):
            try:
                sample = torch.from_numpy(sample)
            except (TypeError, ValueError):
                self.off = True
                return
        if isinstance(sample, torch.Tensor) and _stackable([sample]):
            row = (tuple(sample.shape), sample.dtype)
        else:
            self.off = True
            return
        if self._row is None:
            self._row = row
        elif row != self._row:
            self.off = True

    def batch(self, buffer: Any, samples: Sequence[Any]) -> torch.Tensor | None:
        """The collated batch: `buffer`'s tensor with every sample in its row; None if one does not
        fit its row (collate them as usual then)."""
        out: torch.Tensor = buffer.tensor
        if len(samples) != out.shape[0]:
            return None
        for i, sample in enumerate(samples):
            row = out[i]
            if isinstance(sample, torch.Tensor) and sample.data_ptr() == row.data_ptr():
                continue  # the worker wrote it there
            if isinstance(sample, np.ndarray):
                sample = torch.from_numpy(sample)
            if not isinstance(sample, torch.Tensor) or sample.shape != row.shape:
                return None
            if sample.dtype != row.dtype or not _stackable([sample]):
                return None
            row.copy_(sample)
        return out


class SlotBuffers(Buffers, Protocol):
    """`Buffers` that may first have to be asked for (a process worker's `Carver`)."""

    def ready(self, patient: bool = False) -> bool: ...


# Batch tensors that `StackAsRead` filled row by row, by address: the default collate returns one as it
# is when its batch is exactly its rows, in order (never a tensor of the user's own whose rows they are).
_STACKED: dict[int, weakref.ref[torch.Tensor]] = {}
# guards `forget`'s look-then-delete against a `_remember` on another thread; reentrant: the garbage
# collector may run a `forget` on a thread that holds it
_STACKED_LOCK = threading.RLock()


def _remember(batch: torch.Tensor) -> None:
    ptr = batch.data_ptr()

    def forget(ref: weakref.ref[torch.Tensor]) -> None:  # not a later batch's at the same address
        with _STACKED_LOCK:
            if _STACKED.get(ptr) is ref:
                del _STACKED[ptr]

    with _STACKED_LOCK:
        _STACKED[ptr] = weakref.ref(batch, forget)


def _address(x: Any) -> int:
    if type(x) is torch.Tensor:
        return x.data_ptr()
    return int(x.ctypes.data) if type(x) is np.ndarray else -1


def _stacked(batch: Sequence[Any]) -> torch.Tensor | None:
    """The batch tensor that `StackAsRead` made of `batch`'s rows, in order; else None."""
    first = batch[0]
    ref = _STACKED.get(_address(first))
    base = None if ref is None else ref()
    if base is None or base.shape[0] != len(batch):
        return None
    step, shape, kind = base[0].numel() * base.element_size(), tuple(base.shape[1:]), type(first)
    for j, t in enumerate(batch):
        if type(t) is not kind or _address(t) != base.data_ptr() + j * step or t.shape != shape:
            return None
        if kind is torch.Tensor and (t.dtype != base.dtype or not t.is_contiguous()):
            return None
        if kind is np.ndarray and (
            _TORCH_DTYPES.get(t.dtype) != base.dtype or not t.flags.c_contiguous
        ):
            return None
    return base


class StackAsRead:
    """The default collate's stack, done as each sample is read (`append`), so that a worker holds
    one sample at a time in its own memory and not a whole batch of them.

    The tensors of a sample (and its numeric numpy arrays), alone or in tuples, lists and dicts, are
    copied into their row of batch tensors taken from `buffers`, and the sample keeps views of those
    rows in their place; `make_collate(buffers)` over `samples` then finds each leaf already stacked
    and returns its batch tensor as it is: the batch equals the default collate's. The batch tensors
    are taken once the first sample is read and `buffers` is `ready` (a patient ask, made again
    after 2, 4, 8... samples; samples read before are placed then). A sample whose leaves differ from
    the first's (shape, dtype, structure) ends it: samples from there on are kept as they are, and
    the collate stacks or rejects them as usual.
    """

    def __init__(self, buffers: SlotBuffers, size: int) -> None:
        self.buffers, self.size = buffers, size
        self.samples: list[Any] = []
        self._plan: list[tuple[type, tuple[int, ...], torch.dtype]] | None = None
        self._batch: list[torch.Tensor] | None = None
        self._off = False
        self._ask_at = 1

    def append(self, sample: Any) -> None:
        k = len(self.samples)
        self.samples.append(sample)
        if self._off:
            return
        leaves = _leaves(sample)
        plan = [(type(t), tuple(t.shape), _dtype_of(t)) for t in leaves]
        if self._plan is None:
            self._plan = plan
        if not plan or plan != self._plan or k >= self.size:
            self._off = True
            return
        if self._batch is None:
            if k + 1 < min(self._ask_at, self.size):
                return
            self._ask_at *= 2
            if not self.buffers.ready(patient=True):
                return
            self._batch = [self.buffers.take((self.size, *shape), dt) for _, shape, dt in plan]
            for batch in self._batch:
                _remember(batch)
            for j in range(k):
                self.samples[j] = self._place(j, self.samples[j], _leaves(self.samples[j]))
        self.samples[k] = self._place(k, sample, leaves)

    def _place(self, j: int, sample: Any, leaves: list[Any]) -> Any:
        assert self._batch is not None
        rows = []
        for leaf, batch in zip(leaves, self._batch, strict=True):
            row: Any = batch[j]
            if isinstance(leaf, np.ndarray):  # the sample keeps an array, as it was
                row = row.numpy()
                row[...] = leaf
            else:
                row.copy_(leaf)
            rows.append(row)
        return _put(sample, iter(rows))


def _dtype_of(leaf: Any) -> torch.dtype:
    return leaf.dtype if isinstance(leaf, torch.Tensor) else _TORCH_DTYPES[leaf.dtype]


def _numeric(a: np.ndarray[Any, Any]) -> bool:
    if a.dtype not in _TORCH_DTYPES:
        try:
            _TORCH_DTYPES[a.dtype] = torch.from_numpy(np.empty(0, a.dtype)).dtype
        except (TypeError, ValueError):
            return False
    return True


_TORCH_DTYPES: dict[np.dtype[Any], torch.dtype] = {}


def _leaf(x: Any) -> bool:
    """A tensor or array the default collate stacks (its own type, not a subclass's)."""
    if type(x) is torch.Tensor:
        return _stackable([x])
    return type(x) is np.ndarray and x.dtype.kind in "biufc" and _numeric(x)


def _leaves(x: Any) -> list[Any]:
    """The stackable leaves of a sample, depth first (tuples, lists, dicts of their own types)."""
    if _leaf(x):
        return [x]
    if type(x) in (tuple, list):
        return [leaf for item in x for leaf in _leaves(item)]
    if type(x) is dict:
        return [leaf for item in x.values() for leaf in _leaves(item)]
    return []


def _put(x: Any, rows: Iterator[Any]) -> Any:
    """`x` with its leaves (in `_leaves`' order) replaced by `rows`."""
    if _leaf(x):
        return next(rows)
    if type(x) in (tuple, list):
        return type(x)(_put(item, rows) for item in x)
    if type(x) is dict:
        return {key: _put(item, rows) for key, item in x.items()}
    return x


default_collate = make_collate(None)
default_collate.__doc__ = (
    """Collate samples as `torch.utils.data.default_collate` does, without recycling."""
)
