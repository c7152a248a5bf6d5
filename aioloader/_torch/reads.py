"""A dataset read in this process: fetch by item or by batch, and worker_init_fn's ids for threads."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from .._pipeline.order import Plan

__all__ = ["WorkerIds", "batch_reader", "converting", "reads_batches"]


class WorkerIds:
    """Calls `worker_init_fn(0)`, `worker_init_fn(1)`, ... once in each fetch thread as it starts."""

    def __init__(self, fn: Callable[[int], None]) -> None:
        self.fn = fn
        self._next = itertools.count()
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            worker_id = next(self._next)
        self.fn(worker_id)


def reads_batches(plan: Plan) -> bool:
    return bool(getattr(plan, "reads_batches", False))


def converting(
    convert: Callable[[Any], Any], read: Callable[[Any], Any] | None = None
) -> Callable[[Any], Any]:
    """Apply torch's per-sample `collate_fn` (default_convert) when auto-collation is off."""

    def fetch(key: Any) -> Any:
        return convert(read(key) if read is not None else key)

    return fetch


def batch_reader(
    getitems: Callable[[list[Any]], list[Any]], collate_fn: Callable[[list[Any]], Any]
) -> Callable[[list[Any]], Any]:
    def fetch(indices: list[Any]) -> Any:
        return collate_fn(getitems(indices))

    return fetch
