"""Tensors carved out of a task's output slot, so that a worker's batch is made where it travels.

A process worker that collates a whole batch (`DataLoader(num_workers=N)`) would otherwise stack the
samples into fresh memory (about 11 µs a page here: 0.4 s for a 150 MB batch) and then copy the batch
into its output slot. Instead, the worker hands the task a `Carver` over the slot (`current`), the
default collate takes its batch tensors from it (`take`, the `BufferPool` protocol of
`_pipeline/collate.make_collate`), and the answer names the carved tensors by their offsets (`placed`): the
parent maps them where they were written, and nothing is copied after the stack.

A carver that runs out of room hands out ordinary tensors; `wire.pack` then copies them into the
rest of the slot, or pickles them when the slot is too small.

A task may come without its slot (`wire.py`: `ask`); its carver then asks the parent for one when it
is first needed (`ready`), and hands out ordinary tensors if none comes.
"""

from __future__ import annotations

import contextvars
import math
import mmap
from collections.abc import Callable

import torch

__all__ = ["ALIGN", "Carver", "align", "current"]

ALIGN = 64  # every carved tensor, and every array placed in a slot, starts on a cache line


def align(offset: int) -> int:
    """`offset` rounded up to the next multiple of `ALIGN`."""
    return -(-offset // ALIGN) * ALIGN


# Set by a process worker around each synchronous task that has an output slot.
current: contextvars.ContextVar[Carver | None] = contextvars.ContextVar(
    "aioloader_carver", default=None
)


def _outside(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A tensor for a batch that does not fit the slot (the first ones, before the pool knows their
    size): in memory of its own mapping, not the allocator's. A block that large from malloc would
    raise glibc's mmap threshold to its size once freed, and the worker's heap would keep that much
    freed memory for good (measured: about 20 MB more per worker for 19 MB batches)."""
    if nbytes < OWN_MAPPING_MIN:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


OWN_MAPPING_MIN = 1 << 20


class Carver:
    """A bump allocator over `buf`: tensors in its memory, each remembered by address and offset.

    Example:
        >>> carver = Carver(memoryview(bytearray(1024)))
        >>> t = carver.take((4, 2), torch.float64)
        >>> carver.placed[t.data_ptr()], carver.used
        ((0, 64), 64)
    """

    def __init__(
        self,
        buf: memoryview | None,
        ask: Callable[[bool], memoryview | None] | None = None,
        grow: Callable[[int], memoryview | None] | None = None,
    ) -> None:
        self.buf = buf
        self._ask = ask  # `buf` None: asks the parent for the slot (see `ready`)
        self._grow = grow  # asks the parent for a slot of n bytes, once, before anything is carved
        self.used = 0  # bytes from the start of `buf` that carved tensors may occupy
        self.placed: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, nbytes)

    def ready(self, patient: bool = False) -> bool:
        """Whether it has its slot, asking the parent for it first if it has none. A `patient` ask
        takes only a slot that is free now, and may be made again; the other is the last."""
        if self.buf is None and self._ask is not None:
            self.buf = self._ask(patient)
            if self.buf is not None or not patient:
                self._ask = None
        return self.buf is not None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` in the slot, or a fresh one when the slot is full."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = math.prod(shape)
        nbytes = count * itemsize
        offset = align(self.used)
        small = self.buf is None or offset + nbytes > len(self.buf)
        if count and small and self._grow is not None and not self.placed:
            # a slot of this size, in place of the one it had (which the parent frees: never
            # written again), or none; asked once, and instead of `ready`'s ask
            grow, self._grow, self._ask = self._grow, None, None
            self.buf = grow(offset + nbytes)
        buf = self.buf if count and self.ready() else None
        if buf is None or offset + nbytes > len(buf):
            return _outside(shape, dtype, nbytes)
        out = torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape)
        self.used = offset + nbytes
        self.placed[out.data_ptr()] = (offset, nbytes)
        return out

    def where(self, t: torch.Tensor) -> int | None:
        """The offset of `t` in the slot if it is a whole carved tensor (not a view of part of one)."""
        found = self.placed.get(t.data_ptr())
        if found is None or not t.is_contiguous():
            return None
        offset, nbytes = found
        return offset if t.numel() * t.element_size() == nbytes else None
