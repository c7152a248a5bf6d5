"""The errors aioloader raises.

The hierarchy::

    AioloaderError
    ├── LoaderClosedError     the loader was closed by its user; it cannot be iterated again
    ├── LoaderTimeout         no batch arrived within the `timeout` the user set (also a TimeoutError
    │                         and, as torch's DataLoader raises, a RuntimeError)
    ├── InvalidKeyError       a key names something outside its source (also a ValueError)
    ├── StateError            a saved state does not fit this loader; `.field` names where (ValueError)
    ├── WorkerDied            a worker process died; carries `.pid`, `.exitcode`, `.tasks` (also a
    │                         RuntimeError, worded as torch's: "DataLoader worker (pid N) is killed
    │                         by signal: ...")
    ├── WorkerTimeout         a decode worker spent longer than `timeout` on one task (TimeoutError)
    └── SampleError           one sample failed in a stage; carries `.key` and `.stage`
        ├── FetchError        the source could not produce the raw bytes
        ├── DecodeError       the decode callable failed and its error could not be kept as it was
        └── CollateError      the samples of one batch cannot be put together (also a TypeError)

Errors raised by user callables (fetch, decode, collate) reach the consumer with their own type and
traceback and a note naming the stage and the key; the classes above are for failures aioloader itself
detects. Closed by the user, end of data (plain `StopIteration`/`StopAsyncIteration`) and broken by a
peer are kept apart.

Every one of them survives pickling and `type(e)(str(e))` (how a parent process rebuilds a child's
error): the attributes are keyword arguments with defaults, kept in the instance's `__dict__`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AioloaderError",
    "CollateError",
    "DecodeError",
    "FetchError",
    "InvalidKeyError",
    "LoaderClosedError",
    "LoaderTimeout",
    "NumWorkersChanged",
    "SampleError",
    "StateError",
    "WorkerDied",
    "WorkerTimeout",
]


class AioloaderError(Exception):
    """Base class of every error aioloader raises on its own account."""


class LoaderClosedError(AioloaderError, RuntimeError):
    """The loader was closed (by `close()`/`aclose()` or its context manager) and cannot be used."""


class LoaderTimeout(AioloaderError, TimeoutError, RuntimeError):
    """No batch arrived within the configured `timeout`.

    Attributes:
        stage: the stage that held the epoch's oldest work ("fetch", "decode", "collate"; "" when
            nothing was in flight).
        keys: up to 5 keys in flight there, oldest first.
    """

    def __init__(
        self, message: str = "", *, stage: str = "", keys: list[Any] | None = None
    ) -> None:
        super().__init__(message)
        self.stage = stage
        self.keys = [] if keys is None else keys


class InvalidKeyError(AioloaderError, ValueError):
    """A key is not valid for its source, e.g. a path that escapes the source's root."""


class StateError(AioloaderError, ValueError):
    """A saved state cannot be loaded into this loader.

    Attributes:
        field: the state or config field that differs (e.g. "batch_size", "keys", "version").
    """

    def __init__(self, message: str = "", *, field: str = "") -> None:
        super().__init__(message)
        self.field = field


class NumWorkersChanged(StateError, AssertionError):
    """A `StatefulDataLoader`'s state was loaded into one with another `num_workers`: refused at
    the next `iter()`, as torchdata's StatefulDataLoader refuses it (with an AssertionError, which
    this is too, so that code written for it catches it). `DataLoader` goes on where it can."""


class SampleError(AioloaderError):
    """One sample failed in one stage of the pipeline.

    Attributes:
        key: the sample's key, as the order stage produced it.
        stage: the pipeline stage: "fetch", "decode" or "collate".
    """

    def __init__(self, message: str = "", *, key: Any = None, stage: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.stage = stage


class FetchError(SampleError):
    """The source failed to produce a sample's raw data."""


class DecodeError(SampleError):
    """The decode callable failed in a way that could not be re-raised with its own type."""


class CollateError(SampleError, TypeError):
    """The samples of one batch cannot be collated (mixed types, mismatched shapes)."""


class WorkerDied(AioloaderError, RuntimeError):
    """A decode worker process died (killed, crashed, exited) while tasks were in flight on it.

    Attributes:
        pid: the worker's process id.
        exitcode: its exit code; negative: the number of the signal that ended it.
        tasks: what was in flight on it (the sample keys where known, else task numbers).
    """

    def __init__(
        self, message: str = "", *, pid: int = 0, exitcode: int | None = None,
        tasks: list[Any] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.tasks = [] if tasks is None else tasks


class WorkerTimeout(AioloaderError, TimeoutError):
    """A decode worker ran one task for longer than the executor's `timeout`; it was killed.

    Attributes:
        pid: the worker's process id.
        timeout: the limit, in seconds.
    """

    def __init__(self, message: str = "", *, pid: int = 0, timeout: float = 0.0) -> None:
        super().__init__(message)
        self.pid = pid
        self.timeout = timeout
