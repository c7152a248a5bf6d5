"""Recycled `bytearray`s, for bodies and copies of one size arriving over and over.

Fresh memory is slow on the machines this runs on: every 4 KiB page costs a fault the first time it is
written (about 11 µs here, see DESIGN.md), and glibc hands large blocks back to the kernel when they are
freed, so a 256 KiB body received into a new `bytearray` pays 64 faults (and a zero fill) each time,
more than receiving it. `Bytearrays.take(n)` returns a kept buffer of length `n` that nothing refers to
any more, and makes (and keeps) a new one only when every kept one is still in use.

Whether a buffer is in use is read from its reference count, as `_pipeline/collate.BufferPool` does for
tensors: a consumer that still holds the body, a slice of it, a `memoryview` or a numpy array made
from it, holds a reference, and the buffer is not handed out again.

Example:
    >>> pool = Bytearrays(max_bytes=1 << 20)
    >>> a = pool.take(65536)
    >>> b = pool.take(65536)  # `a` is still referenced: a second buffer
    >>> a is b
    False
    >>> del a
    >>> len(pool.take(65536))  # the first one again, its old contents left in it
    65536
"""

from __future__ import annotations

import contextvars
import ctypes
import sys
import threading
from collections.abc import Callable

__all__ = ["Bytearrays", "give_back_freed_memory", "landing", "size_class", "task_output"]

# Set by a process worker, in the context of each async task, to the task's output slot (a writable
# memoryview of shared memory) ...
task_output: contextvars.ContextVar[memoryview | None] = contextvars.ContextVar(
    "aioloader_task_output", default=None
)
# ... and by a task whose result is the fetched body itself (`fetch_in_workers` without a decode) to
# that slot: the fast HTTP engine then receives the body straight into it, and the worker answers
# without copying (`process/wire.place_single`). A body that does not fit goes to a recycled bytearray.
landing: contextvars.ContextVar[memoryview | None] = contextvars.ContextVar(
    "aioloader_landing", default=None
)

MIN_BYTES = 64 * 1024  # below this the allocator recycles blocks itself: not worth a scan
_PAGE = 4096


def size_class(nbytes: int) -> int:
    """The size a recycled buffer for `nbytes` is made in: 1, 1.25, 1.5 or 1.75 times a power of
    two, whole pages. Buffers for lengths that vary then come in a few sizes that serve them all
    (the process arena's slots, the parquet source's chunk buffers)."""
    if nbytes <= _PAGE:
        return _PAGE
    step = 1 << max(nbytes.bit_length() - 3, 10)
    return -(-nbytes // step) * step if step >= _PAGE else -(-nbytes // _PAGE) * _PAGE


def _refs_when_free() -> int:
    kept = [bytearray(1)]
    return sys.getrefcount(kept[0])  # the same expression `take` tests: the list's reference only


def _refs_in_a_loop_when_free() -> int:
    kept = [bytearray(1)]
    for buf in kept:  # the same loop `fit` tests in: the list's reference and the loop variable's
        return sys.getrefcount(buf)
    raise AssertionError("unreachable")


# measured, not written down: how many references a call's argument and a loop's variable take
# depends on the interpreter (3.14 takes fewer than 3.11)
_FREE = _refs_when_free()
_FREE_IN_A_LOOP = _refs_in_a_loop_when_free()


class Bytearrays:
    """Recycled bytearrays by exact length; at most `max_bytes` of them kept. Thread-safe.

    A taken buffer holds whatever it held before: callers overwrite all of it. A kept buffer whose
    length its user changed is forgotten once free.
    """

    def __init__(self, max_bytes: int, min_bytes: int = MIN_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.min_bytes = min_bytes
        self.kept_bytes = 0
        self.made = 0
        self.reused = 0
        self._kept: dict[int, list[bytearray]] = {}
        self._next: dict[int, int] = {}  # where the next scan of a length starts (oldest first)
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        """A bytearray of length `n` that nothing else refers to."""
        if n < self.min_bytes:
            return bytearray(n)
        with self._lock:
            kept = self._kept.setdefault(n, [])
            start = self._next.get(n, 0)
            for i in range(len(kept)):
                j = (start + i) % len(kept)
                if sys.getrefcount(kept[j]) != _FREE:
                    continue
                if len(kept[j]) != n:  # resized by its user: not this length any more
                    del kept[j]
                    self.kept_bytes -= n
                    return self._make(n, kept)
                self._next[n] = j + 1
                self.reused += 1
                return kept[j]
            return self._make(n, kept)

    def fit(self, n: int) -> bytearray:
        """A bytearray of at least `n` bytes (under twice `n`) that nothing else refers to: a
        free kept one of the smallest length that serves, else a new one of `size_class(n)`.
        For callers that use a prefix of it (a body received into it): one kept set of buffers
        then serves lengths that vary, where `take` keeps a set per length, and a set past
        `max_bytes` is made afresh each time."""
        if n < self.min_bytes:
            return bytearray(n)
        want = size_class(n)
        with self._lock:
            for length in sorted(k for k in self._kept if want <= k < 2 * n):  # want < 2n
                for buf in self._kept[length]:
                    if sys.getrefcount(buf) == _FREE_IN_A_LOOP and len(buf) == length:
                        self.reused += 1
                        return buf
            return self._make(want, self._kept.setdefault(want, []))

    def _make(self, n: int, kept: list[bytearray]) -> bytearray:
        self.made += 1
        fresh = bytearray(n)
        if self.kept_bytes + n <= self.max_bytes:
            kept.append(fresh)
            self.kept_bytes += n
        return fresh

    def clear(self) -> None:
        """Forget every kept buffer (those still in use stay valid)."""
        with self._lock:
            self._kept.clear()
            self._next.clear()
            self.kept_bytes = 0


def give_back_freed_memory() -> None:
    """The opposite of recycling, where memory must be bounded more than it must be fast: glibc's
    malloc_trim(0) hands the free pages of every heap arena back to the system (no-op elsewhere)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _find_malloc_trim()
