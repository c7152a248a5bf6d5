"""Recycled pinned host slabs for the transfer stage: a slab returns only when its copy is done."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cuda import DeviceBackend, Event

__all__ = ["PinnedPool", "Slab", "round_up", "slab_size"]

SLAB_ROUND = 1 << 20  # slabs are whole MiB, so that batches of about the same size share them


@dataclass(eq=False)
class Slab:
    buffer: torch.Tensor  # pinned uint8
    event: Event | None = None  # recorded after the copy that last read it; None: never read

    def free(self) -> bool:
        return self.event is None or self.event.query()


class PinnedPool:
    """Recycled pinned slabs, least recently taken first. Not thread-safe: used under the stage's lock."""

    def __init__(self, backend: DeviceBackend, max_slabs: int) -> None:
        self._backend = backend
        self.max_slabs = max_slabs
        self.slabs: list[Slab] = []
        self.allocated = self.reused = self.waits = 0

    def take(self, nbytes: int) -> Slab:
        """A slab of at least `nbytes` that no copy still reads; waits for one only when all are busy."""
        free = [s for s in self.slabs if s.free()]
        fits = [s for s in free if s.buffer.numel() >= nbytes]
        if fits:
            return self._reuse(min(fits, key=slab_size))
        if len(self.slabs) >= self.max_slabs:
            if not free:  # all are being read: wait here (off the hot path) for the oldest copy
                oldest = self.slabs[0]
                assert oldest.event is not None
                oldest.event.synchronize()
                self.waits += 1
                if oldest.buffer.numel() >= nbytes:
                    return self._reuse(oldest)
                free = [oldest]
            self.slabs.remove(min(free, key=slab_size))
        self.allocated += 1
        slab = Slab(self._backend.empty_pinned(round_up(nbytes, SLAB_ROUND)))
        self.slabs.append(slab)
        return slab

    def _reuse(self, slab: Slab) -> Slab:
        self.reused += 1
        self.slabs.remove(slab)
        self.slabs.append(slab)
        return slab


def slab_size(slab: Slab) -> int:
    return slab.buffer.numel()


def round_up(n: int, step: int) -> int:
    return -(-n // step) * step
