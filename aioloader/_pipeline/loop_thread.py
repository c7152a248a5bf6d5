"""The event-loop thread behind `for batch in loader`, and the hand-over to the consumer's thread.

One `LoopThread` per loader runs an event loop (uvloop when installed) on a daemon thread named
"aioloader-loop". The consumer's thread submits coroutines to it and waits on their futures; that wait
is interruptible (KeyboardInterrupt lands in the consumer, which then closes the epoch). `run`, the
wait of every `for` step, hands its result over with a lock of its own rather than a
`concurrent.futures.Future` and its chained callbacks: half the CPU of a step's hand-over.
Every live loop thread is stopped before the interpreter joins its threads at exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from .._exceptions import LoaderClosedError, LoaderTimeout
from .._util.deps import before_threads_joined
from .._util.loops import new_event_loop

__all__ = ["LoopThread"]

T = TypeVar("T")
S = TypeVar("S")

STOP_TIMEOUT_S = 2.0

_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()


class LoopThread:
    """An event loop running forever on its own thread, until `stop()`.

    Example:
        >>> async def answer() -> int:
        ...     return 42
        >>> lt = LoopThread()
        >>> lt.run(answer())
        42
        >>> lt.stop()
    """

    def __init__(self, name: str = "aioloader-loop") -> None:
        self.loop = new_event_loop()
        # Futures handed out by `submit`: those still pending when the loop ends are cancelled, so
        # that a coroutine submitted while the loop was stopping never leaves its waiter hanging.
        self._futures: weakref.WeakSet[concurrent.futures.Future[Any]] = weakref.WeakSet()
        self._waits: set[_Wait] = set()  # `run` calls waiting, likewise released when the loop ends
        self._submit_lock = threading.Lock()
        self._ended = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def _main(self) -> None:
        loop = self.loop
        asyncio.set_event_loop(loop)
        try:
            while True:
                try:
                    loop.run_forever()
                    break
                except (KeyboardInterrupt, SystemExit):
                    # raised in a task by user code: the task holds it for whoever awaits it (the
                    # consumer), so keep serving the loader until stop() instead of dying mid-epoch
                    continue
            with self._submit_lock:
                self._ended = True  # from here on, submit() refuses
            # a coroutine submitted just before becomes a task only now: repeat until none is left
            while tasks := asyncio.all_tasks(loop):
                for task in tasks:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
            with self._submit_lock:
                self._ended = True
                pending = [f for f in self._futures if not f.done()]
                waits, self._waits = self._waits, set()
            for future in pending:
                future.cancel()
            for wait in waits:
                wait.cancelled = True
                wait.done.release()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; returns a thread-safe future (cancelling it cancels the task).

        Raises `LoaderClosedError` (a RuntimeError) once the loop has been stopped and closed.
        """

        def schedule() -> concurrent.futures.Future[T]:
            future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            self._futures.add(future)
            return future

        return self._schedule(coro, schedule)

    def _schedule(self, coro: Coroutine[Any, Any, Any], schedule: Callable[[], S]) -> S:
        """`schedule()` (which hands `coro` to the loop) under the submit lock; once the loop has
        ended, `coro` is closed (not left unawaited) and `LoaderClosedError` raised instead."""
        with self._submit_lock:
            try:
                if self._ended:
                    raise RuntimeError("ended")
                return schedule()
            except RuntimeError:  # the loop is closed
                coro.close()
                raise LoaderClosedError("the loader's event loop thread was stopped") from None

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout: float | None = None,
        now: Callable[[], T | None] | None = None,
    ) -> T:
        """Run `coro` on the loop and block until it ends.

        `now`, if given, is called on the loop first: what it returns, unless None, is the result,
        and `coro` is closed unrun (a batch already waiting needs no task made for it).

        Raises `LoaderTimeout` (a TimeoutError) when `timeout` passes first; a TimeoutError that
        `coro` itself raises comes through as it is; `concurrent.futures.CancelledError` when the
        loop ends first. Raises `LoaderClosedError` once the loop has been stopped and closed.
        """
        wait = _Wait()

        def start() -> None:  # on the loop
            if now is not None:
                try:
                    value = now()
                except BaseException as exc:  # the consumer's to raise, as the task's would be
                    coro.close()
                    return settle(None, exc)
                if value is not None:
                    coro.close()
                    return settle(value, None)
            wait.task = self.loop.create_task(coro)
            wait.task.add_done_callback(finish)

        def finish(task: asyncio.Task[T]) -> None:  # on the loop
            if task.cancelled():
                settle(None, None, cancelled=True)
            else:
                error = task.exception()
                settle(None if error is not None else task.result(), error)

        def settle(  # on the loop
            value: T | None, error: BaseException | None, cancelled: bool = False
        ) -> None:
            with self._submit_lock:
                if wait not in self._waits:  # released already: the loop is ending
                    return
                self._waits.discard(wait)
            wait.cancelled, wait.error, wait.value = cancelled, error, value
            wait.done.release()

        def schedule() -> None:
            self.loop.call_soon_threadsafe(start)
            self._waits.add(wait)

        self._schedule(coro, schedule)
        try:
            done = wait.done.acquire(timeout=-1 if timeout is None else timeout)
        except BaseException:  # KeyboardInterrupt in the wait: the coroutine is not needed
            self.call_soon(wait.cancel)
            raise
        if not done:
            self.call_soon(wait.cancel)
            raise LoaderTimeout(f"no result within timeout={timeout} s")
        if wait.cancelled:
            raise concurrent.futures.CancelledError()
        if wait.error is not None:
            raise wait.error
        return cast(T, wait.value)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop soon; a no-op once the loop has stopped."""
        if not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # closed between the check and the call
                self.loop.call_soon_threadsafe(fn)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Cancel every task, stop the loop and join the thread. Idempotent."""
        self.call_soon(self.loop.stop)
        if not self.in_loop_thread():
            self._thread.join(timeout)
        _live.discard(self)


class _Wait:
    """One `run` call: its task, and what it ended with, handed over under the `done` lock."""

    __slots__ = ("cancelled", "done", "error", "task", "value")

    def __init__(self) -> None:
        self.done = threading.Lock()
        self.done.acquire()  # released once the outcome is in
        self.task: asyncio.Task[Any] | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.cancelled = False

    def cancel(self) -> None:  # on the loop, after `start` (callbacks run in order)
        if self.task is not None:
            self.task.cancel()


def _stop_all() -> None:
    for loop_thread in list(_live):
        loop_thread.stop()


# Runs before the interpreter joins non-daemon threads (as concurrent.futures does for its pools), so
# a loader left open at exit never keeps the process alive.
before_threads_joined(_stop_all)
