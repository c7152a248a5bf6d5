"""The event-loop thread behind `for batch in loader`, and the hand-over to the consumer's thread.

One `LoopThread` per loader runs an event loop (uvloop when installed) on a daemon thread named
"aioloader-loop". The consumer's thread submits coroutines to it and waits on their futures; that wait
is interruptible (KeyboardInterrupt lands in the consumer, which then closes the epoch).
Every live loop thread is stopped before the interpreter joins its threads at exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .._exceptions import LoaderClosedError, LoaderTimeout
from .._util.loops import new_event_loop

__all__ = ["LoopThread"]

T = TypeVar("T")

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
            for future in pending:
                future.cancel()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; returns a thread-safe future (cancelling it cancels the task).

        Raises `LoaderClosedError` (a RuntimeError) once the loop has been stopped and closed.
        """
        with self._submit_lock:
            try:
                if self._ended:
                    raise RuntimeError("ended")
                future = asyncio.run_coroutine_threadsafe(coro, self.loop)
            except RuntimeError:  # the loop is closed: close `coro` so it is not left unawaited
                coro.close()
                raise LoaderClosedError("the loader's event loop thread was stopped") from None
            self._futures.add(future)
        return future

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and block until it ends.

        Raises `LoaderTimeout` (a TimeoutError) when `timeout` passes first; a TimeoutError that
        `coro` itself raises comes through as it is.
        """
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done() and not future.cancelled():
                raise  # the coroutine's own
            future.cancel()
            raise LoaderTimeout(f"no result within timeout={timeout} s") from None
        except BaseException:
            future.cancel()
            raise

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


def _stop_all() -> None:
    for loop_thread in list(_live):
        loop_thread.stop()


# Runs before the interpreter joins non-daemon threads (as concurrent.futures does for its pools), so
# a loader left open at exit never keeps the process alive.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_stop_all)
