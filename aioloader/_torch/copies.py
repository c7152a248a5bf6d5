"""torch's contract with a dataset, kept where its reads run in threads: one thread to an object.

torch's workers each call `__getitem__` one at a time on their own copy of the dataset (forked or
unpickled), and datasets rely on it without saying so: a handle opened lazily "once per worker" (a
file read by seek + read, h5py, LMDB, sqlite3, an HTTP connection) is safe there, and shared by
every thread that enters the same object. Measured (2026-12-07): a dataset that seeks, waits 3 ms
and reads gave 1,998 of 2,000 samples wrong, with no error, when 16 threads shared it.

So a dataset object is entered by one thread at a time unless it says it may be entered by more
(`thread_safe`: a class attribute `thread_safe = True`). Reads that block still run side by side:
each reading thread reads its own copy of the dataset (`DatasetCopies`), made as a spawned torch
worker's is, by pickling, from the dataset as it was before any read of this process (so a handle
opened lazily is the thread's own). The copies cost memory: their pickled size is measured once,
and only as many threads read as fit `COPY_BYTES` in all (one: no copy, reads one at a time). A
dataset that does not pickle (a handle opened in `__init__` or by `worker_init_fn`, a lambda) is
read one at a time, as in torch; `why` says why.
"""

from __future__ import annotations

import inspect
import io
import pickle
import threading
from typing import Any

import numpy as np
import torch

__all__ = [
    "COPY_BYTES", "DatasetCopies", "never_waits", "read_in_place", "safe_to_share", "thread_safe",
]  # fmt: skip

# the pickled bytes of one process's dataset copies together: a dataset of a list of paths pickles
# to about 40 bytes a path, so a million paths (40 MB) are read one at a time rather than copied
COPY_BYTES = 32 << 20


def thread_safe(dataset: Any) -> bool:
    """Whether `dataset` declares that several threads may call it at once (`thread_safe = True`)."""
    return getattr(dataset, "thread_safe", False) is True


def never_waits(dataset: Any) -> bool:
    """Whether `dataset` is a container in memory (a list, a tuple, an array, a tensor): reading it
    never waits, and threads may read it at once."""
    return type(dataset) in (list, tuple) or isinstance(dataset, torch.Tensor | np.ndarray)


def safe_to_share(dataset: Any) -> bool:
    """Whether threads may read `dataset` at once: it says so (`thread_safe`), it is a container in
    memory, or its reads are coroutines (they run on one event loop)."""
    return (
        thread_safe(dataset) or never_waits(dataset)
        or inspect.iscoroutinefunction(dataset.__getitem__)
    )  # fmt: skip


def read_in_place(dataset: Any) -> bool:
    """Whether a front door reads `dataset` in the consumer's own thread (with `for`, when nothing
    calls for the pipeline): samples in memory, which never wait, or a dataset that may not be
    shared, which torch's main process reads one call at a time."""
    return never_waits(dataset) or not safe_to_share(dataset)


class _TooLarge(Exception):
    pass


class _Capped(io.RawIOBase):
    """A pickle's bytes, up to `most` (then `_TooLarge`: the pickling stops there)."""

    def __init__(self, most: int) -> None:
        self.most, self.size = most, 0
        self.parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = len(data)
        self.size += n
        if self.size > self.most:
            raise _TooLarge
        self.parts.append(bytes(data))
        return n


class DatasetCopies:
    """`dataset[index]` from many threads, no two of them in one object.

    `snapshot()` pickles the dataset as it is then (call it before any read, in the process that
    reads); `threads` then says how many copies may be made (1: none could be, and `why` says why).
    `getitem(index)` reads from the calling thread's own copy, made on its first call after a
    snapshot while fewer than `threads` are made; a thread beyond those (or every thread, where
    none can be made) reads the dataset itself, one call at a time. Thread-safe; `getitem` blocks
    as long as the read (and, on the dataset itself, the reads before it).
    """

    def __init__(self, dataset: Any, threads: int, most_bytes: int = COPY_BYTES) -> None:
        self.dataset, self.wanted, self.most_bytes = dataset, threads, most_bytes
        self.threads = 1
        self.why: str | None = "no snapshot taken yet"
        self.copy_bytes = 0  # the pickled size of one copy
        self.made = 0  # copies made since the snapshot
        self._blob: bytes | None = None
        self._taken = 0  # snapshots taken: a thread's copy of an earlier one is made anew
        self._local = threading.local()
        self._lock = threading.Lock()  # the dataset itself: one call at a time

    def snapshot(self) -> int:
        """Pickle the dataset as it is now; returns `threads`."""
        with self._lock:
            self._taken += 1
            self._blob, self.threads, self.made = None, 1, 0
            if self.wanted < 2:
                self.why = "one read at a time was asked for"
                return 1
            out = _Capped(self.most_bytes // 2)
            try:
                pickle.Pickler(out, pickle.HIGHEST_PROTOCOL).dump(self.dataset)
            except _TooLarge:
                self.why = (
                    f"it pickles to more than {self.most_bytes // 2 >> 20} MiB: copies for two "
                    "threads would pass the copies' bound"
                )
                return 1
            except Exception as exc:
                self.why = f"it does not pickle ({type(exc).__name__}: {exc})"
                return 1
            self._blob, self.copy_bytes = b"".join(out.parts), out.size
            self.threads = max(1, min(self.wanted, self.most_bytes // max(1, out.size)))
            self.why = None if self.threads > 1 else "its copies would pass the copies' bound"
            return self.threads

    def getitem(self, index: Any) -> Any:
        """`dataset[index]`, on the calling thread's own copy where it has one."""
        copy = self._own()
        if copy is not None:
            return copy[index]
        with self._lock:
            return self.dataset[index]

    def getitems(self, indices: list[Any]) -> Any:
        """`dataset.__getitems__(indices)`, on the calling thread's own copy where it has one."""
        copy = self._own()
        if copy is not None:
            return copy.__getitems__(indices)
        with self._lock:
            return self.dataset.__getitems__(indices)

    def _own(self) -> Any:
        """The calling thread's copy of the last snapshot (made now if it has none), or None."""
        local = self._local
        if getattr(local, "taken", 0) != self._taken:
            local.copy, local.taken = self._new_copy(), self._taken
        return local.copy

    def _new_copy(self) -> Any:
        """A copy for the calling thread, or None (it reads the dataset itself)."""
        with self._lock:
            blob = self._blob
            if blob is None or self.made >= self.threads:
                return None
            self.made += 1
        return pickle.loads(blob)
