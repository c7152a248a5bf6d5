"""A batch in the arena whose rows workers write in place, and the target of one row."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .arena import Arena, Slot

__all__ = ["BatchBuffer", "RowTarget"]


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
