"""Which executor runs decode: the names `executor=` accepts, what "auto" picks, and building one.

`REGISTRY` maps each name to what builds its executor from `workers` (None: the usable cores) and
`arena_bytes` (a process pool's shared-memory budget, None: its default). A new executor is a
module of its own under `_executors/` and one line here.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

from .._util.threads import default_workers, gil_enabled
from .base import Executor, InlineExecutor, ThreadExecutor
from .process.executor import ProcessExecutor

__all__ = ["EXECUTORS", "REGISTRY", "auto_executor", "make_executor"]

REGISTRY: dict[str, Callable[[int | None, int | None], Executor]] = {
    "inline": lambda workers, arena_bytes: InlineExecutor(),
    "thread": lambda workers, arena_bytes: ThreadExecutor(workers or default_workers()),
    "process": lambda workers, arena_bytes: ProcessExecutor(
        workers or default_workers(), arena_bytes=arena_bytes
    ),
}
EXECUTORS = (*REGISTRY, "auto")


def auto_executor(decode: Callable[[Any], Any] | None = None) -> str:
    """What executor="auto" (the default when there is a decode) picks: threads where the GIL is off
    (free-threaded Python, e.g. 3.13t); where it is on, processes, unless `decode` cannot be sent to
    a process (a lambda, a closure, a bound method of an object that does not pickle): then threads,
    and the "aioloader" logger says why. A decoder that releases the GIL (numpy, Pillow, most codecs)
    does well in threads either way: name executor="thread" for it; executor="inline" runs a cheap
    decode on the event loop itself. A decode whose `aioloader_executor` attribute is "thread"
    (`aioloader.tokenize`'s) gets threads without a word."""
    if not gil_enabled():
        return "thread"
    if getattr(decode, "aioloader_executor", None) == "thread":  # a decode made for threads
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


def make_executor(name: str, workers: int | None, arena_bytes: int | None = None) -> Executor:
    """Build the executor called `name` (a key of `REGISTRY`, or "auto")."""
    if name == "auto":
        name = auto_executor()
    build = REGISTRY.get(name)
    if build is None:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {name!r}")
    return build(workers, arena_bytes)
