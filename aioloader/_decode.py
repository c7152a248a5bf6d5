"""Decode stage: raw sample -> sample, inline on the loop or in a pool of threads.

One interface, `Executor.run(fn, arg)`, whatever runs the call. "inline" calls the function on the
event loop (right for cheap decodes: no hand-off cost); "thread" runs it in `workers` threads, which
pays where the decoder releases the GIL (numpy, torch, Pillow, most codecs) or the GIL is off.
"process" runs it in `workers` persistent processes and returns arrays in shared memory
(`_procpool.py`): the choice where decode holds the GIL.
"""

from __future__ import annotations

import logging
import pickle
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from ._procpool import ProcessExecutor
from ._util.rng import call_seeded
from ._util.threads import LazyThreadPool, default_workers

__all__ = [
    "EXECUTORS",
    "Executor",
    "InlineExecutor",
    "KeyedDecode",
    "ThreadExecutor",
    "make_executor",
]

T = TypeVar("T")

EXECUTORS = ("inline", "thread", "process", "auto")


def auto_executor(decode: Callable[[Any], Any] | None = None) -> str:
    """What executor="auto" (the default when there is a decode) picks: threads where the GIL is off
    (free-threaded Python, e.g. 3.13t); where it is on, processes, unless `decode` cannot be sent to
    a process (a lambda, a closure, a bound method of an object that does not pickle): then threads,
    and the "aioloader" logger says why. A decoder that releases the GIL (numpy, Pillow, most codecs)
    does well in threads either way: name executor="thread" for it; executor="inline" runs a cheap
    decode on the event loop itself."""
    gil = getattr(sys, "_is_gil_enabled", lambda: True)()
    if not gil:
        return "thread"
    if decode is not None:
        try:
            pickle.dumps(decode, protocol=5)
        except Exception as exc:
            logging.getLogger("aioloader").info(
                'executor="auto" runs decode %r in threads: it cannot be sent to a worker '
                "process (%s); make it a module-level function to decode in processes",
                decode, exc,
            )  # fmt: skip
            return "thread"
    return "process"


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
    """Where decode (and collate) calls run."""

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        """Run `fn(arg)` with `seed` as the sample's seed (see `_util/rng.py`); safe to cancel."""
        ...

    def close(self) -> None:
        """Release threads or processes; idempotent."""
        ...


class InlineExecutor:
    """Runs each call directly on the event loop."""

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        return call_seeded(fn, arg, seed)

    def close(self) -> None:
        pass


class ThreadExecutor:
    """Runs each call in a pool of `workers` threads."""

    def __init__(self, workers: int, name: str = "aioloader-decode") -> None:
        self.workers = workers
        self._threads = LazyThreadPool(workers, name, grow_after=0.0)  # decode is CPU-bound

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        return await self._threads.run(call_seeded, fn, arg, seed)

    def close(self) -> None:
        self._threads.close()


def make_executor(name: str, workers: int | None, arena_bytes: int | None = None) -> Executor:
    """Build the executor called `name` ("inline", "thread" or "process"; `arena_bytes` is the
    process pool's shared-memory budget, None its default)."""
    if name == "auto":
        name = auto_executor()
    if name == "inline":
        return InlineExecutor()
    if name == "thread":
        return ThreadExecutor(workers or default_workers())
    if name == "process":
        return ProcessExecutor(workers or default_workers(), arena_bytes=arena_bytes)
    raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
