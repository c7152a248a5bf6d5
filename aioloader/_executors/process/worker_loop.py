"""A worker process's own event loop, on its own thread: how `fetch_in_workers` (`../fetch_in_workers.py`)
runs many fetch-then-decode coroutines at once in each process worker (`worker.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from ..._util.bytearrays import task_output
from ..._util.loops import new_event_loop
from ..._util.rng import call_seeded

__all__ = ["WorkerLoop"]

Done = Callable[[Any, BaseException | None], None]  # (result, error): how a task ended
# (task id, fn, arg, seed, output slot, done)
Start = tuple[int, Callable[[Any], Any], Any, "int | None", "memoryview | None", Done]
CLOSE_S = 0.25  # a stopping worker's time to close its connections (the parent waits 0.5 s)


class WorkerLoop:
    """A worker process's event loop, on its own thread, running async tasks many at once.

    `start_many` and `cancel` are called by the worker's main thread (which keeps reading the pipe and
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

    def start_many(self, starts: list[Start]) -> None:
        """For each `(task_id, fn, arg, seed, out, done)` of `starts`, run `await fn(arg)` with `seed`
        as the sample's seed and `out` (the task's output slot) as `_util/bytearrays.task_output`; one
        wake-up of the loop for them all, never blocks."""
        self.loop.call_soon_threadsafe(self._spawn_many, starts)

    def _spawn_many(self, starts: list[Start]) -> None:
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
        self,
        task_id: int,
        fn: Callable[[Any], Any],
        arg: Any,
        seed: int | None,
        out: memoryview | None,
        done: Done,
    ) -> None:
        # the task copies the current context, in which `call_seeded` has made `seed` current
        def spawn(a: Any) -> asyncio.Task[None]:
            token = task_output.set(out)
            try:
                return self.loop.create_task(self._run(task_id, fn, a, done))
            finally:
                task_output.reset(token)

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
