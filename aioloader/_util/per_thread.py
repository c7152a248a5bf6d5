"""A small cache each thread keeps of its own: what one thread made for itself, kept for its next call.

Decode threads keep objects that cost something to make and must not be shared between threads at
once (a pyarrow reader, a file's mapping, a scratch buffer). Each thread's entries are its own dict,
so no lock is taken; a thread that ends drops its entries with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["PerThread"]

K = TypeVar("K")
V = TypeVar("V")


class PerThread(Generic[K, V]):
    """Each thread's own entries, at most `limit` of them (None: no bound): when a new key finds
    them full, the one put first goes (its value is let go, for the garbage collector to close).

    Not blocking, and safe from any thread: a thread sees and changes only its own entries.

    Example:
        >>> readers: PerThread[str, int] = PerThread(limit=2)
        >>> readers.put("a.parquet", 1)
        >>> readers.get("a.parquet"), readers.get("b.parquet")
        (1, None)
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._local = threading.local()

    def _entries(self) -> dict[K, V]:
        entries: dict[K, V] = self._local.__dict__.setdefault("entries", {})
        return entries

    def get(self, key: K) -> V | None:
        """This thread's entry for `key` (None: it has none)."""
        return self._entries().get(key)

    def put(self, key: K, value: V) -> None:
        """Keep `value` as this thread's entry for `key` (replacing the one it had, in its place)."""
        self._make_room(key)
        self._entries()[key] = value

    def make(self, key: K, make: Callable[[], V]) -> V:
        """This thread's new entry for `key`: room made first (so that what the oldest entry held
        is let go before `make()` takes more), then `make()` kept and returned. Where `make`
        raises, nothing is kept for `key`."""
        self._make_room(key)
        value = make()
        self._entries()[key] = value
        return value

    def _make_room(self, key: K) -> None:
        entries = self._entries()
        if self.limit is not None and key not in entries and len(entries) >= self.limit:
            del entries[next(iter(entries))]  # the oldest put
