"""Fetch stage: key -> raw sample, with at most `concurrency` fetches in flight.

Coroutine functions run on the pipeline's event loop; plain functions run in a pool of up to
`concurrency` threads named "aioloader-fetch", which grows only while its threads are blocked
(`_util/threads.py`). The bound itself is kept by the pipeline (`_pipeline/admission.py`), which
acquires a slot before it calls the fetcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._util.loops import is_async_callable
from .._util.threads import LazyThreadPool

__all__ = ["Fetcher"]


class Fetcher:
    """Calls the user's fetch function the right way for its kind.

    Args:
        fn: key -> raw sample; a coroutine function or a plain function.
        concurrency: the most threads the pool for a plain function may grow to.
        initializer: run once in each fetch thread as it starts (plain functions only).
        now: where the keys carry their samples (a source's `fetch_now`: `HandsOver`), `fn` for
            such a key done at once, without a wait: the pipeline then calls it in place of `fn`
            (`assemble.py`, `Assembler.at_once`).
        threads: the pool's threads that start as soon as calls wait for one, whatever the calls
            do (the front door's `num_workers` in threads); the rest only while they are blocked.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        concurrency: int,
        initializer: Callable[[], None] | None = None,
        now: Callable[[Any], Any] | None = None,
        threads: int = 1,
    ) -> None:
        self.fn = fn
        self.now = now
        self.is_async = is_async_callable(fn)
        self._threads = LazyThreadPool(concurrency, "aioloader-fetch", initializer, floor=threads)

    async def __call__(self, key: Any) -> Any:
        if self.is_async:
            return await self.fn(key)
        return await self._threads.run(self.fn, key)

    def close(self) -> None:
        """Stop the fetch threads (idempotent; a later call starts new ones)."""
        self._threads.close()
