"""What a source is: something that lists keys and fetches the raw bytes of one key."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Source"]


@runtime_checkable
class Source(Protocol):
    """A place samples come from.

    `keys()` lists the keys (a Sequence when their number is known; an AsyncIterable for a streamed
    listing). `fetch(key)` is a coroutine that returns the raw sample and is safe to cancel.
    `aclose()` releases connections and is idempotent.

    Optional hooks the loader calls when a source has them: `set_epoch(epoch)` before each epoch,
    and `bind(rank=, world_size=)` once at construction, for a source that shards its own data
    (the loader then leaves the keys unsharded); `size(key)`, the bytes `fetch(key)` will return
    where the source knows them without I/O (from its listing; else None), which a byte budget
    reserves before the fetch starts; `stats()`, a dict of counters shown in `loader.stats().extra`,
    of which the loader reads: "throttles" and "retries" (running counts: a rise makes
    `concurrency="auto"` back off, and `diagnose()` names throttling) and, for a source that reads
    its samples ahead itself (tar shards), "shard_readers", "shard_reading", "shard_samples",
    "shard_bytes", "shard_read_s", "shard_all_reading_s" and "shard_read_p50_s" / "_p95_s" /
    "_p99_s", which then stand for the fetch stage.
    """

    def keys(self) -> Sequence[Any] | Iterable[Any] | AsyncIterable[Any]: ...

    async def fetch(self, key: Any) -> Any: ...

    async def aclose(self) -> None: ...
