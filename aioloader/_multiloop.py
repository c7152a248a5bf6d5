"""Fetch in the workers: each process worker runs its own event loop and fetches its share of the keys.

One event loop saturates one core: past a few thousand requests a second, the loop that sends them is
the bottleneck, not the network. With `Loader(source, executor="process", fetch_in_workers=True)` the
parent keeps what needs one place (order, batching, the shared-memory arena, the concurrency bound)
and hands out the requests themselves:

- the parent's fetch stage passes each key through (`pass_key`);
- its decode stage sends `FetchDecode(fetch, decode)`, that is `decode(await fetch(key))`, to the
  process pool with the key as argument;
- a process worker runs such a coroutine callable on its own event loop (`WorkerLoop`, uvloop when
  installed), many at once, and returns the result in shared memory like any other decode result.

Fetching so scales with the workers. Each worker unpickles its own copy of the fetch callable (a
source's copy carries no connection: see `Transport.__getstate__`) and opens its own connections, on
its own loop, on first use; they close when the worker exits (the pool's `close()`, or the loader's when
it owns the pool). The loader's `concurrency` still bounds the fetches in flight in all: a pool the
loader makes lets each of its `workers` hold `ceil(concurrency / workers)` (its `async_depth`), and gives
each next key to the worker with the fewest in flight. With a `ProcessExecutor` of your own, its
`async_depth` per worker applies (the pipeline's own bound, `prefetch * batch_size + concurrency`
samples held, still holds).

Seen from the parent, the "fetch" stage of `stats()` then only passes keys, and the "decode" stage
times fetch and decode together; the source's own counters (`stats()["requests"]`, ...) stay in the
workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from ._decode import default_workers
from ._fetch import is_async_callable
from ._procpool import ProcessExecutor
from ._rng import call_seeded
from ._sync import new_event_loop
from ._validate import check_int

__all__ = ["FetchDecode", "Wiring", "WorkerLoop", "in_workers", "pass_key"]

Done = Callable[[Any, BaseException | None], None]  # (result, error): how a task ended
CLOSE_S = 0.25  # a stopping worker's time to close its connections (the parent waits 0.5 s)


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
    ) -> None:
        self.fetch = fetch
        self.decode = decode
        self.source = source  # whose `aclose()` closes the fetch's connections

    async def __call__(self, key: Any) -> Any:
        raw = await self.fetch(key)
        return raw if self.decode is None else self.decode(raw)

    async def aclose(self) -> None:
        """Close the source's connections (a worker calls this as it stops). Idempotent."""
        aclose = getattr(self.source, "aclose", None)
        if aclose is not None:
            await aclose()

    def __repr__(self) -> str:
        return f"FetchDecode({self.fetch!r}, {self.decode!r})"


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
        ValueError, TypeError: naming `fetch_in_workers` and what does not fit: an executor other than
            "process" or a `ProcessExecutor`, a fetch that is not a coroutine function, a source that
            keeps per-epoch state (`set_epoch`, e.g. tar shards), or `concurrency="auto"`.
    """
    if executor is None or executor == "auto":
        executor = "process"  # the one that can fetch in workers
    if not (executor == "process" or isinstance(executor, ProcessExecutor)):
        raise ValueError(
            'fetch_in_workers=True needs executor="process" or a ProcessExecutor, '
            f"got executor={executor!r}"
        )
    if not is_async_callable(fetch):
        raise TypeError(
            "fetch_in_workers=True needs an async fetch (a Source, or a coroutine function) to run "
            f"on the workers' event loops; got {fetch!r}"
        )
    if callable(getattr(source, "set_epoch", None)):
        raise ValueError(
            f"fetch_in_workers=True cannot be used with {source!r}: it keeps per-epoch state "
            "(set_epoch) that copies in the workers would not see"
        )
    if concurrency == "auto":
        raise ValueError('fetch_in_workers=True needs an int concurrency, not "auto"')
    limit = check_int("concurrency", concurrency, minimum=1)
    task = FetchDecode(fetch, decode, source)
    if isinstance(executor, ProcessExecutor):
        return Wiring(pass_key, task, executor, owned=False)
    if workers is not None and workers != "auto":
        check_int("workers", workers, minimum=1)
    count = workers if isinstance(workers, int) else default_workers()
    pool = ProcessExecutor(count, async_depth=-(-limit // count))  # `concurrency` in all
    return Wiring(pass_key, task, pool, owned=True)


class WorkerLoop:
    """A worker process's event loop, on its own thread, running async tasks many at once.

    `start` and `cancel` are called by the worker's main thread (which keeps reading the pipe and
    runs the plain decode tasks); each task's `done(result, error)` is called on the loop thread
    when the task ends, however it ends (a cancelled task reports its `CancelledError`). `close`
    ends it all when the parent hangs up; a worker stopped by its lifeline ends with `os._exit`
    instead, and the kernel closes its connections.
    """

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        threading.Thread(
            target=self.loop.run_forever, name="aioloader-worker-loop", daemon=True
        ).start()

    def start(
        self, task_id: int, fn: Callable[[Any], Any], arg: Any, seed: int | None, done: Done
    ) -> None:
        """Run `await fn(arg)` with `seed` as the sample's seed; never blocks."""
        self.start_many([(task_id, fn, arg, seed, done)])

    def start_many(
        self, starts: list[tuple[int, Callable[[Any], Any], Any, int | None, Done]]
    ) -> None:
        """`start` each of `starts` (one wake-up of the loop for them all)."""
        self.loop.call_soon_threadsafe(self._spawn_many, starts)

    def _spawn_many(
        self, starts: list[tuple[int, Callable[[Any], Any], Any, int | None, Done]]
    ) -> None:
        for start in starts:
            self._spawn(*start)

    def cancel(self, task_id: int) -> None:
        """Cancel task `task_id` if it still runs (its `done` then gets `CancelledError`)."""
        self.loop.call_soon_threadsafe(self._cancel, task_id)

    def close(self, closers: list[Callable[[], Awaitable[Any]]]) -> None:
        """Cancel the tasks, await each of `closers` (connections), stop the loop; blocks up to
        `CLOSE_S`. Call once, from another thread."""
        with contextlib.suppress(Exception):  # past the deadline: the process exits regardless
            asyncio.run_coroutine_threadsafe(self._close(closers), self.loop).result(CLOSE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _close(self, closers: list[Callable[[], Awaitable[Any]]]) -> None:
        async with asyncio.timeout(CLOSE_S):
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for aclose in closers:
                with contextlib.suppress(Exception):
                    await aclose()

    def _spawn(
        self, task_id: int, fn: Callable[[Any], Any], arg: Any, seed: int | None, done: Done
    ) -> None:
        # the task copies the current context, in which `call_seeded` has made `seed` current
        spawn = lambda a: self.loop.create_task(self._run(task_id, fn, a, done))  # noqa: E731
        self._tasks[task_id] = call_seeded(spawn, arg, seed)

    def _cancel(self, task_id: int) -> None:
        task = self._tasks.get(task_id)
        if task is not None:
            task.cancel()

    async def _run(self, task_id: int, fn: Callable[[Any], Any], arg: Any, done: Done) -> None:
        outcome: tuple[Any, BaseException | None]
        try:
            outcome = (await fn(arg), None)
        except BaseException as exc:  # CancelledError too: the parent asked for it, and is told
            outcome = (None, exc)
        finally:
            self._tasks.pop(task_id, None)
        del arg
        with contextlib.suppress(OSError, ValueError):  # the parent is gone: its lifeline ends us
            done(*outcome)
