"""One byte budget, `max_bytes_in_flight`, and how it is split among the parts that hold memory.

- Recycled batch buffers (`BufferPool`) keep at most half of it; the rest is for samples in flight
  (`ByteBudget`, from fetch to hand-over), less what the buffers keep.
- A process pool the loader makes for itself gets a shared-memory arena as large as the share of
  samples in flight (they live there; once workers write batch rows in place, the batch buffers
  do instead of the pool's), never more than half the free /dev/shm (see `loader_arena`).
- `concurrency="auto"` climbs no higher than the budget holds samples of the mean size.
- A buffer pool keeps, per shape, one buffer for each batch that may wait (made ahead of the
  consumer: `prefetch` batches and the samples of `concurrency` fetches), plus `SPARE_BUFFERS`.

None (no budget) bounds none of these by bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._executors.process.arena import loader_arena
from .._util.validate import check_int
from .bounds import DEFAULT_MAX_BYTES

__all__ = ["SPARE_BUFFERS", "MemoryBudget"]

# Batch buffers kept per shape beyond those that may wait: the consumer's, one being stacked, a spare.
SPARE_BUFFERS = 3


@dataclass(frozen=True)
class MemoryBudget:
    """`max_bytes_in_flight` (None: no byte bound), and its shares."""

    max_bytes: int | None = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes is not None:
            check_int("max_bytes_in_flight", self.max_bytes, minimum=1)

    @property
    def buffer_pool_bytes(self) -> int | None:
        """What recycled batch buffers may keep: half the budget (the rest: samples in flight)."""
        return None if self.max_bytes is None else self.max_bytes // 2

    def in_flight_bytes(self, pool_bytes: int) -> int | None:
        """What samples in flight may hold, when the batch buffers may keep `pool_bytes`."""
        return None if self.max_bytes is None else self.max_bytes - pool_bytes

    def arena_bytes(self, pool_bytes: int = 0) -> int | None:
        """The shared-memory arena of a process pool made for the loader, when the batch buffers
        may keep `pool_bytes` (None: the pool's default)."""
        return loader_arena(self.in_flight_bytes(pool_bytes))

    @staticmethod
    def buffers_per_shape(waiting: int) -> int:
        """Batch buffers a pool keeps per shape, when `waiting` batches may wait at most."""
        return waiting + SPARE_BUFFERS

    @staticmethod
    def waiting_batches(prefetch: int, group_size: int, concurrency: int) -> int:
        """Batches that may wait at most: `prefetch` batches and `concurrency` samples, rounded up."""
        return -(-(prefetch * group_size + concurrency) // group_size)
