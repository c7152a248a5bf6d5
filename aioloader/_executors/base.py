"""The executor contract, and the executors that need no process: inline on the loop, or threads.

One interface, `Executor.run(fn, arg)`, whatever runs the call; its optional capabilities (`workers`,
`stats()`, writing batch rows) are declared here too, and read only through `workers_of`,
`stats_of` and `writes_rows`. "inline" calls the function on the
event loop (right for cheap decodes: no hand-off cost); "thread" runs it in `workers` threads, which
pays where the decoder releases the GIL (numpy, torch, Pillow, most codecs) or the GIL is off.
"process" runs it in `workers` persistent processes and returns arrays in shared memory
(`_executors/process/executor.py`): the choice where decode holds the GIL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeGuard, TypeVar, runtime_checkable

import torch

from .._protocol import HasStats
from .._util.heap import keep_freed_blocks
from .._util.rng import call_seeded
from .._util.threads import LazyThreadPool

__all__ = [
    "Executor",
    "HasWorkers",
    "InlineExecutor",
    "KeyedDecode",
    "RowWriter",
    "ThreadExecutor",
    "stats_of",
    "workers_of",
    "writes_rows",
]

T = TypeVar("T")


class KeyedDecode:
    """A decode that is given the key too: called with `(key, raw)`, it returns `fn(key, raw)`.

    What `Loader(..., decode_with_key=True)` runs, so that a label in the key (a path such as
    "cat/001.jpg") reaches decode in every executor. It pickles when `fn` does, and the pair
    travels to a worker process as any other argument.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        self.fn = fn

    def __call__(self, pair: tuple[Any, Any]) -> Any:
        key, raw = pair
        return self.fn(key, raw)

    def __reduce__(self) -> tuple[type[KeyedDecode], tuple[Callable[[Any, Any], Any]]]:
        return KeyedDecode, (self.fn,)

    def __repr__(self) -> str:
        return f"{self.fn!r} (decode_with_key)"


class Executor(Protocol):
    """Where decode (and collate) calls run: what `Loader(executor=...)` accepts.

    Required: `run` and `close`. Optional, each read where the loader needs it:

    - `workers: int` (`HasWorkers`): calls that run at once (the decode stage's limit in `stats()`,
      the repr, `diagnose()`); without it, one. Read with `workers_of`.
    - `stats() -> dict[str, int]` (`_protocol.HasStats`): counters shown as
      `stats().extra["decode_pool"]`. Read with `stats_of`.
    - writing batch rows in place: `batch_buffer(shape, dtype)` and `run(..., into=row)`, as
      `RowWriter` declares. With one, the default collate's batches are made by the workers.
      Checked with `writes_rows`.
    """

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        """Run `fn(arg)` with `seed` as the sample's seed (see `_util/rng.py`); safe to cancel."""
        ...

    def close(self) -> None:
        """Release threads or processes; idempotent."""
        ...


@runtime_checkable
class HasWorkers(Protocol):
    """An executor that says how many calls it runs at once."""

    workers: int | None


class BatchRows(Protocol):
    """A batch made by a `RowWriter`: its tensor, and a target for each of its rows."""

    def row(self, index: int) -> Any: ...


class RowWriter(Executor, Protocol):
    """An executor whose workers write decoded samples straight into a batch's rows."""

    def batch_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> BatchRows | None:
        """A batch of `shape` (rows first) whose rows `run(..., into=)` fills; None: no room."""
        ...

    async def run(
        self, fn: Callable[[Any], T], arg: Any, seed: int | None = None, into: Any = None
    ) -> T:
        """As `Executor.run`; with `into` (a `BatchRows.row`), the result is written there."""
        ...


def workers_of(executor: Executor, default: int | None = 1) -> int | None:
    """How many calls `executor` runs at once (its `workers`), else `default`."""
    return executor.workers if isinstance(executor, HasWorkers) else default


def stats_of(executor: Executor) -> dict[str, Any] | None:
    """`executor.stats()` where it keeps counters, else None."""
    return dict(executor.stats()) if isinstance(executor, HasStats) else None


def writes_rows(executor: Executor) -> TypeGuard[RowWriter]:
    """Whether `executor`'s workers write batch rows in place (`RowWriter`)."""
    return hasattr(executor, "batch_buffer")


class InlineExecutor:
    """Runs each call directly on the event loop."""

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        return call_seeded(fn, arg, seed)

    def close(self) -> None:
        pass


class ThreadExecutor:
    """Runs each call in a pool of `workers` threads.

    Its results are freed by another thread (collate's) once they are stacked: the C heap is made to
    keep what they free for the next results, rather than hand it back to the kernel and fault it in
    again (`_util.heap.keep_freed_blocks`, once per process)."""

    def __init__(self, workers: int, name: str = "aioloader-decode") -> None:
        self.workers = workers
        keep_freed_blocks()
        self._threads = LazyThreadPool(workers, name, grow_after=0.0)  # decode is CPU-bound

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        return await self._threads.run(call_seeded, fn, arg, seed)

    def close(self) -> None:
        self._threads.close()
