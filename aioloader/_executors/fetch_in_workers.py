"""Fetch in the workers: each process worker runs its own event loop and fetches its share of the keys.

One event loop saturates one core: past a few thousand requests a second, the loop that sends them is
the bottleneck, not the network. With `Loader(source, executor="process", fetch_in_workers=True)` the
parent keeps what needs one place (order, batching, the shared-memory arena, the concurrency bound)
and hands out the requests themselves:

- the parent's fetch stage passes each key through (`pass_key`);
- its decode stage sends `FetchDecode(fetch, decode)`, that is `decode(await fetch(key))`, to the
  process pool with the key as argument;
- a process worker runs such a coroutine callable on its own event loop
  (`process/worker_loop.WorkerLoop`, uvloop when installed), many at once, and returns the result in shared
  memory like any other decode result.

Fetching so scales with the workers. Each worker unpickles its own copy of the fetch callable (a
source's copy carries no connection: see `Transport.__getstate__`) and opens its own connections, on
its own loop, on first use; they close when the worker exits (the pool's `close()`, or the loader's when
it owns the pool). The loader's `concurrency` still bounds the fetches in flight in all: a pool the
loader makes lets each of its `workers` hold `ceil(concurrency / workers)` (its `async_depth`), and gives
each next key to the worker with the fewest in flight. With a `ProcessExecutor` of your own, its
`async_depth` per worker applies (the pipeline's own bound, `prefetch * batch_size + concurrency`
samples held, still holds).

A plain (sync) fetch works too: each worker then runs `decode(fetch(key))` in up to
`ceil(concurrency / workers)` threads of its own, started as the calls block (`_util/threads.LazyThreadPool`,
counting only the time calls wait), so a user function that blocks on a read and then computes is
held neither to one core by the GIL nor to one call per process.

Seen from the parent, the "fetch" stage of `stats()` then only passes keys, and the "decode" stage
times fetch and decode together; the source's own counters (`stats()["requests"]`, ...) stay in the
workers.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from .._protocol import HasAclose, HasSetEpoch
from .._util.bytearrays import landing, task_output
from .._util.loops import is_async_callable
from .._util.threads import LazyThreadPool, default_workers
from .._util.validate import check_int
from .base import KeyedDecode
from .process.executor import ProcessExecutor

__all__ = ["FetchDecode", "Wiring", "in_workers", "pass_key"]


async def pass_key(key: Any) -> Any:
    """The parent's fetch stage under `fetch_in_workers`: the key is the raw sample."""
    return key


class FetchDecode:
    """`decode(await fetch(key))` (the fetched sample itself when `decode` is None).

    Runs on a worker's event loop; pickles when `fetch` and `decode` do (a source, a module-level
    function or an instance of a module-level class). `decode` runs on that loop too: while it runs,
    that worker's other fetches wait (its process has one GIL either way).
    """

    def __init__(
        self,
        fetch: Callable[[Any], Any],
        decode: Callable[[Any], Any] | None,
        source: object = None,
        threads: int = 1,
    ) -> None:
        self.fetch = fetch
        self.decode = decode  # a `KeyedDecode` is given (key, raw)
        self.source = source  # whose `aclose()` closes the fetch's connections
        self.threads = threads  # a plain fetch: at most this many threads in each worker
        self.sync = not is_async_callable(fetch)

    async def __call__(self, key: Any) -> Any:
        if self.sync:  # in a thread, with this task's context (its sample seed)
            pool = _worker_threads(self.threads)
            return await pool.run(contextvars.copy_context().run, self._both, key)
        if self.decode is None:  # the body is the result: let it land in the output slot
            landing.set(task_output.get())
            return await self.fetch(key)
        return self._decoded(key, await self.fetch(key))

    def _both(self, key: Any) -> Any:
        raw = self.fetch(key)
        return raw if self.decode is None else self._decoded(key, raw)

    def _decoded(self, key: Any, raw: Any) -> Any:
        assert self.decode is not None
        return self.decode((key, raw) if isinstance(self.decode, KeyedDecode) else raw)

    async def aclose(self) -> None:
        """Close the source's connections (a worker calls this as it stops). Idempotent."""
        if isinstance(self.source, HasAclose):
            await self.source.aclose()

    def __repr__(self) -> str:
        return f"FetchDecode({self.fetch!r}, {self.decode!r})"


_threads: dict[int, LazyThreadPool] = {}  # in a worker process: its fetch threads, by size
_threads_lock = threading.Lock()


def _worker_threads(size: int) -> LazyThreadPool:
    with _threads_lock:
        pool = _threads.get(size)
        if pool is None:
            pool = _threads[size] = LazyThreadPool(size, "aioloader-fetch", spare_cores=True)
        return pool


class Wiring(NamedTuple):
    """The loader's stages under `fetch_in_workers=True`."""

    fetch: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    executor: ProcessExecutor
    owned: bool  # the loader made the executor, and closes it


def in_workers(
    fetch: Callable[[Any], Any],
    decode: Callable[[Any], Any] | None,
    executor: object,
    workers: int | str | None,
    concurrency: int | str,
    source: object = None,
) -> Wiring:
    """Wire a loader to fetch in its process workers (see the module docstring).

    Raises:
        ValueError: naming `fetch_in_workers` and what does not fit: an executor other than
            "process" or a `ProcessExecutor`, a source that keeps per-epoch state (`set_epoch`,
            e.g. tar shards), or `concurrency="auto"`.
    """
    if executor is None or executor == "auto":
        executor = "process"  # the one that can fetch in workers
    if not (executor == "process" or isinstance(executor, ProcessExecutor)):
        raise ValueError(
            'fetch_in_workers=True needs executor="process" or a ProcessExecutor, '
            f"got executor={executor!r}"
        )
    if isinstance(source, HasSetEpoch):
        raise ValueError(
            f"fetch_in_workers=True cannot be used with {source!r}: it keeps per-epoch state "
            "(set_epoch) that copies in the workers would not see"
        )
    if concurrency == "auto":
        raise ValueError('fetch_in_workers=True needs an int concurrency, not "auto"')
    limit = check_int("concurrency", concurrency, minimum=1)
    if isinstance(executor, ProcessExecutor):
        task = FetchDecode(fetch, decode, source, threads=executor.async_depth)
        return Wiring(pass_key, task, executor, owned=False)
    if workers is not None and workers != "auto":
        check_int("workers", workers, minimum=1)
    count = workers if isinstance(workers, int) else default_workers()
    depth = -(-limit // count)  # `concurrency` in all
    task = FetchDecode(fetch, decode, source, threads=depth)
    return Wiring(pass_key, task, ProcessExecutor(count, async_depth=depth), owned=True)
