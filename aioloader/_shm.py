"""The shared-memory arena of the process executor: slabs, slots, and who owns them.

The parent process alone creates and unlinks shared memory. A *slab* is a file in /dev/shm, created
with an unguessable name, mode 0600 and O_EXCL, mapped, and unlinked at once: its name exists for
microseconds, so nothing is left in /dev/shm whatever happens to the parent later (SIGKILL included).
Workers get the slab's file descriptor over their socket (SCM_RIGHTS) and map it themselves.

A slab is cut into equal *slots* of one size class (steps of a quarter of a power of two, so a slot
wastes at most 20%). A slot is leased for one task: the parent writes a large input into it, or the
worker writes the task's arrays into it. The parent then views the output in place (`Arena.view`):
each view is a numpy array over the slot, and the slot returns to its slab only when the lease and
every view — and every tensor or array made from a view — are gone.

The arena is bounded by `budget` bytes. Slabs are created on demand while the budget allows and kept
(their pages stay touched: recycling them costs no page faults); a slab that is wholly free may be
retired to make room for a slab of another class. When the consumer holds so many outputs that no
slot is free and the budget is spent, `acquire` returns None and the caller falls back to ordinary
memory (the worker pickles the result through its pipe): slower, never blocking, never overwriting.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
import weakref
from typing import Any

import numpy as np

__all__ = [
    "NAME_PREFIX",
    "SHM_DIR",
    "Arena",
    "Slot",
    "arena_budget",
    "check_room",
    "parent_only",
    "parent_only_fds",
    "size_class",
]

SHM_DIR = "/dev/shm"
NAME_PREFIX = "aioloader-"
# The most bytes one slab maps, and the most slots it holds: few file descriptors, small waste.
SLAB_BYTES = 16 << 20
SLOTS_PER_SLAB = 32
_PAGE = 4096


_parent_only: set[int] = set()
_parent_only_lock = threading.Lock()


def parent_only(fd: int, keep: bool = True) -> None:
    """Mark `fd` as one that a process forked later from this one must close (see `_zygote.py`).

    keep=False forgets it (call it before closing `fd`). Slab descriptors, workers' sockets and
    lifelines are marked, so that a zygote never keeps another pool's memory or pipes alive.
    """
    with _parent_only_lock:
        (_parent_only.add if keep else _parent_only.discard)(fd)


def parent_only_fds() -> set[int]:
    """The descriptors marked by `parent_only`."""
    with _parent_only_lock:
        return set(_parent_only)


def size_class(nbytes: int) -> int:
    """The slot size that holds `nbytes`: 1, 1.25, 1.5 or 1.75 times a power of two, whole pages."""
    if nbytes <= _PAGE:
        return _PAGE
    step = 1 << max(nbytes.bit_length() - 3, 10)
    return -(-nbytes // step) * step if step >= _PAGE else -(-nbytes // _PAGE) * _PAGE


def check_room(nbytes: int, path: str = SHM_DIR) -> None:
    """Raise OSError(ENOSPC) naming `path` unless it has `nbytes` free."""
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise OSError(
            errno.ENOSPC,
            f"{path} has {free / 2**20:.1f} MiB free but the process executor's shared-memory "
            f"arena needs {nbytes / 2**20:.1f} MiB: pass a smaller arena_bytes, or enlarge {path} "
            "(docker run --shm-size=...)",
        )


class _Slab:
    __slots__ = ("fd", "free", "id", "mm", "size", "slot_size")

    def __init__(self, slab_id: int, slot_size: int, count: int, directory: str) -> None:
        self.id = slab_id
        self.slot_size = slot_size
        self.size = slot_size * count
        path = os.path.join(directory, f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(12)}")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(path, flags, 0o600)
        try:
            os.ftruncate(self.fd, self.size)
            self.mm = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        finally:
            os.unlink(path)
        self.free = [Slot(self, i * slot_size) for i in reversed(range(count))]
        parent_only(self.fd)

    def close(self) -> None:
        parent_only(self.fd, keep=False)
        os.close(self.fd)
        self.mm.close()

    @property
    def idle(self) -> bool:
        """No slot of it is leased or viewed."""
        return len(self.free) * self.slot_size == self.size


# Each live slab holds two descriptors (its own, handed to workers started later, and the one mmap
# keeps); past this many slabs, results are copied out so that a consumer holding thousands of them
# cannot exhaust a small `ulimit -n`.
MAX_SLABS = 16


class Slot:
    """`capacity` bytes at `offset` in slab `slab_id`; leased to one task at a time."""

    __slots__ = ("__weakref__", "_refs", "offset", "pins", "slab")

    def __init__(self, slab: _Slab, offset: int) -> None:
        self.slab = slab
        self.offset = offset
        self.pins = 0
        self._refs: dict[int, weakref.ref[Any]] = {}  # the views' weakrefs, kept so they fire

    @property
    def slab_id(self) -> int:
        return self.slab.id

    @property
    def capacity(self) -> int:
        return self.slab.slot_size

    def write(self, data: bytes | bytearray) -> None:
        """Copy `data` to the start of the slot (parent side: a large input)."""
        self.slab.mm[self.offset : self.offset + len(data)] = data


class Arena:
    """Slabs of shared memory, at most `budget` bytes, leased out slot by slot. Thread-safe.

    Example:
        >>> arena = Arena(budget=1 << 20)
        >>> slot = arena.acquire(1000)
        >>> arr = arena.view(slot, 0, 8)
        >>> arena.release(slot)  # the lease ends; `arr` still pins the slot
        >>> del arr              # now it is free again
        >>> arena.close()
    """

    def __init__(self, budget: int, directory: str = SHM_DIR) -> None:
        check_room(budget, directory)
        self.budget = budget
        self.directory = directory
        self._slabs: dict[int, _Slab] = {}
        self._next_id = 0
        self._dropped: list[int] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def mapped_bytes(self) -> int:
        """Bytes of all live slabs."""
        return sum(s.size for s in self._slabs.values())

    def slab_fd(self, slab_id: int) -> tuple[int, int]:
        """(file descriptor, size) of a live slab, to pass to a worker."""
        slab = self._slabs[slab_id]
        return slab.fd, slab.size

    def acquire(self, nbytes: int) -> Slot | None:
        """Lease a slot of at least `nbytes`, or None when none is free and the budget is spent."""
        size = size_class(nbytes)
        with self._lock:
            if self._closed:
                return None
            for slab in self._slabs.values():
                if slab.slot_size == size and slab.free:
                    return self._lease(slab.free.pop())
            count = max(1, min(SLOTS_PER_SLAB, SLAB_BYTES // size))
            while (
                self.budget - self.mapped_bytes < size * count or len(self._slabs) >= MAX_SLABS
            ) and self._retire_one(keep=size):
                pass
            if len(self._slabs) >= MAX_SLABS:
                return None  # every slab is viewed: copy out rather than hold more descriptors
            count = min(count, (self.budget - self.mapped_bytes) // size)
            if count < 1:
                return None
            try:
                check_room(size * count, self.directory)
                slab = _Slab(self._next_id, size, count, self.directory)
            except OSError:
                return None
            self._slabs[slab.id] = slab
            self._next_id += 1
            return self._lease(slab.free.pop())

    def _lease(self, slot: Slot) -> Slot:
        slot.pins = 1
        return slot

    def _retire_one(self, keep: int) -> bool:
        for slab in self._slabs.values():
            if slab.slot_size != keep and slab.idle:
                del self._slabs[slab.id]
                slab.free = []
                slab.close()
                self._dropped.append(slab.id)
                return True
        return False

    def take_dropped(self) -> list[int]:
        """Ids of the slabs retired since the last call (workers should unmap them)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    def release(self, slot: Slot) -> None:
        """End a lease (or a view's pin); the slot is free again once nothing pins it."""
        with self._lock:
            slot.pins -= 1
            if slot.pins == 0 and slot.slab.id in self._slabs:
                slot.slab.free.append(slot)

    def view(self, slot: Slot, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A writable uint8 array over `nbytes` at `offset` in `slot`, pinning it while alive."""
        owner = np.frombuffer(slot.slab.mm, np.uint8, nbytes, slot.offset + offset)
        with self._lock:
            slot.pins += 1

        def unpin(ref: weakref.ref[Any], slot: Slot = slot) -> None:
            slot._refs.pop(id(ref), None)
            self.release(slot)

        ref = weakref.ref(owner, unpin)
        slot._refs[id(ref)] = ref
        return owner

    def close(self) -> None:
        """Unmap every slab no view pins (views keep theirs mapped until they go). Idempotent."""
        with self._lock:
            self._closed = True
            slabs, self._slabs = list(self._slabs.values()), {}
        for slab in slabs:
            parent_only(slab.fd, keep=False)
            os.close(slab.fd)
            if slab.idle:
                slab.mm.close()
            # else views still map it: it is unmapped when the last one goes (no cycle keeps it)
            slab.free = []


DEFAULT_ARENA_BYTES = 256 << 20
MIN_ARENA_BYTES = 16 << 20


def arena_budget(requested: int | None, directory: str = SHM_DIR) -> int:
    """The arena budget: `requested` if `directory` has room for it, else OSError naming both.

    None picks 256 MiB or half of the free space, whichever is less (at least 16 MiB).
    """
    if requested is not None:
        check_room(requested, directory)
        return requested
    st = os.statvfs(directory)
    budget = min(DEFAULT_ARENA_BYTES, st.f_bavail * st.f_frsize // 2)
    if budget < MIN_ARENA_BYTES:
        check_room(2 * MIN_ARENA_BYTES, directory)
    return max(budget, MIN_ARENA_BYTES)
