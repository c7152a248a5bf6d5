"""A Loader's arguments read: what its keys are, which executor and collate they name, its repr."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

from ._executors.base import Executor, KeyedDecode
from ._executors.choose import EXECUTORS, auto_executor
from ._pipeline.collate import DEFAULT_COLLATE, BufferPool
from ._tuning.memory import MemoryBudget
from ._util.validate import check_callable
from .sources import Source

__all__ = ["buffer_pool", "executor_named", "is_map_style", "keyed", "origin"]


def origin(keys: object, source: Source | None = None, fetch: object = None) -> str:
    """Where a loader's samples come from, for its repr: its source, or its keys and fetch."""
    if source is not None and keys is source:
        return f"source={source!r}"
    what = repr(keys) if isinstance(keys, range) else f"<{type(keys).__name__}>"
    with contextlib.suppress(TypeError):
        if not isinstance(keys, range):
            what = f"<{type(keys).__name__} of {len(keys)}>"  # type: ignore[arg-type]
    if fetch is None:
        return f"dataset={what}"
    return f"keys={what}, fetch={_name(fetch)}"


def _name(fn: object) -> str:
    """A callable's qualified name (a decode given the key says so), else its repr."""
    if isinstance(fn, KeyedDecode):
        return f"{_name(fn.fn)} (with key)"
    if isinstance(fn, functools.partial):
        return f"partial({_name(fn.func)})"
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else type(fn).__name__ if callable(fn) else repr(fn)


def keyed(decode: Callable[..., Any] | None, with_key: bool) -> Callable[[Any], Any] | None:
    """`decode`, or with `decode_with_key=True` the decode that is given `(key, raw)`."""
    if not isinstance(with_key, bool):
        raise TypeError(f"decode_with_key must be True or False, got {with_key!r}")
    check_callable("decode", decode, optional=True)
    if not with_key:
        return decode
    if decode is None:
        raise ValueError("decode_with_key=True needs a decode, called as decode(key, raw)")
    return KeyedDecode(decode)


def is_map_style(obj: object) -> bool:
    """A map-style dataset: indexable with a length, but not itself a sequence of keys."""
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, Sequence)


def executor_named(
    executor: str | Executor | None, decode: Callable[..., Any] | None
) -> str | Executor:
    """The executor to run decode: a name of `EXECUTORS` ("auto" resolved) or an `Executor`."""
    if executor is None:
        executor = "inline" if decode is None else "auto"
    if executor == "auto":
        executor = auto_executor(decode)
    if isinstance(executor, str) and executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS} or an Executor, got {executor!r}")
    if not isinstance(executor, str) and not callable(getattr(executor, "run", None)):
        raise TypeError(f"executor must be a name or an Executor, got {executor!r}")
    return executor


def buffer_pool(collate: object, budget: MemoryBudget, waiting: int) -> BufferPool | None:
    """The recycled batch buffers of the default collate (None for any other collate)."""
    if collate is not DEFAULT_COLLATE:
        return None
    return BufferPool(
        per_shape=budget.buffers_per_shape(waiting), max_bytes=budget.buffer_pool_bytes
    )
