"""Named thread pools that start lazily and stop within a deadline."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["LazyThreadPool", "default_workers"]

T = TypeVar("T")


def default_workers() -> int:
    """The default size of a decode pool (threads or processes): the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LazyThreadPool:
    """A thread pool of `size` threads named `name`, created on first use, reusable until closed.

    `run` is safe to cancel: the awaiting task stops waiting at once; the call itself finishes in its
    thread (Python cannot interrupt it) and its result is dropped.
    """

    def __init__(self, size: int, name: str, initializer: Callable[[], None] | None = None) -> None:
        self.size = size
        self.name = name
        self._initializer = initializer
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.size, thread_name_prefix=self.name, initializer=self._initializer
                )
            return self._pool

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the pool and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._get(), fn, *args)

    def close(self, timeout: float = 2.0) -> None:
        """Cancel queued calls and join the threads, waiting at most `timeout` seconds. Idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is None:
            return
        pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + timeout
        for thread in list(pool._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
