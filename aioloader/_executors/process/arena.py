"""The shared-memory arena of the process executor: slabs, slots, and who owns them.

The parent process alone creates shared memory. A *slab* is anonymous memory made by
`memfd_create` (Linux): it has no name in any filesystem, is counted by the memory cgroup like any
other memory of the process, and is not bounded by the size of the /dev/shm mount (64 MB in a
Docker container or a Kubernetes pod by default, where torch's shared memory fails with "No space
left on device"). It is gone once its last descriptor and mapping are, whatever happens to the
parent (SIGKILL included): nothing is ever left behind. Where memfd_create is missing (not Linux),
or where a directory is given, a slab is a file there instead (/dev/shm), created with an
unguessable name, mode 0600 and O_EXCL, mapped, and unlinked at once: its name exists for
microseconds. Either way it is mode 0600, and workers get its descriptor over their socket
(SCM_RIGHTS) and map it themselves.

The parent maps a slab with libc's mmap(2), not Python's `mmap.mmap`, which on Python < 3.13 keeps a
duplicate of the descriptor for as long as the mapping lives. A mapping needs no descriptor, so a
slab holds exactly one (its own, to hand to workers started later) while the arena is open, and none
once it is closed: a consumer that keeps thousands of results past `close()` pins no descriptor,
only memory. Every view is a numpy array whose base is a ctypes array over the mapping; a retired or
closed slab is unmapped once no slot of it is leased or viewed (or, should the slab itself become
garbage first, by the ctypes array's finalizer): never while an array over it lives.

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
import os
import secrets
import threading
import weakref
from collections.abc import Callable, Container
from typing import Any

import numpy as np

from ..._util.bytearrays import size_class
from ..._util.system_memory import free_space, ram_bytes
from .slab_memory import Buffer, map_shared, parent_only

__all__ = [
    "MIN_ARENA_BYTES",
    "NAME_PREFIX",
    "SHM_DIR",
    "SLAB_LINKS",
    "Arena",
    "Slot",
    "arena_budget",
    "check_room",
    "shm_cap",
    "size_class",
]

SHM_DIR = "/dev/shm"
NAME_PREFIX = "aioloader-"
# Slabs live in anonymous memory (memfd) where the system has it; else in /dev/shm.
MEMFD = hasattr(os, "memfd_create")
# What a slab's descriptor links to in /proc/PID/fd, and its mapping is named in /proc/PID/maps.
SLAB_LINKS = (f"/memfd:{NAME_PREFIX}", f"{SHM_DIR}/{NAME_PREFIX}")
# The most bytes one slab maps, and the most slots it holds: few file descriptors, small waste.
SLAB_BYTES = 16 << 20
SLOTS_PER_SLAB = 32


def check_room(nbytes: int, path: str = SHM_DIR) -> None:
    """Raise OSError(ENOSPC) naming `path` unless it has `nbytes` free."""
    free = free_space(path)
    if free < nbytes:
        raise OSError(
            errno.ENOSPC,
            f"{path} has {free / 2**20:.1f} MiB free but the process executor's shared-memory "
            f"arena needs {nbytes / 2**20:.1f} MiB: pass a smaller arena_bytes, or enlarge {path} "
            "(docker run --shm-size=...)",
        )


def _new_file(directory: str | None) -> int:
    """A new, empty, unnamed file of mode 0600 for a slab: anonymous memory (`directory` None, where
    the system has memfd_create), else a file in `directory` unlinked as soon as it is made."""
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
    if directory is None and MEMFD:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.fchmod(fd, 0o600)  # (only its descriptor reaches it; its mode says so too)
        return fd
    path = os.path.join(directory or SHM_DIR, name)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    os.unlink(path)
    return fd


def _room(nbytes: int, directory: str | None) -> None:
    """`check_room` where slabs are files in a mounted directory; anonymous memory has no mount,
    and no more of it can be made than the machine has (OSError ENOMEM naming both)."""
    if directory is not None or not MEMFD:
        check_room(nbytes, directory or SHM_DIR)
        return
    ram = ram_bytes()
    if nbytes > ram:
        raise OSError(
            errno.ENOMEM,
            f"the process executor's shared-memory arena of {nbytes / 2**20:.1f} MiB is more than "
            f"this machine's {ram / 2**20:.1f} MiB of memory: pass a smaller arena_bytes",
        )


class _Slab:
    __slots__ = ("buf", "closed", "fd", "free", "id", "pinned", "size", "slot_size", "unmap")

    def __init__(self, slab_id: int, slot_size: int, count: int, directory: str | None) -> None:
        self.id = slab_id
        self.slot_size = slot_size
        self.size = slot_size * count
        self.fd = _new_file(directory)
        try:
            os.ftruncate(self.fd, self.size)
            self.buf: Buffer | None
            self.buf, self.unmap = map_shared(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise
        self.free = [Slot(self, i * slot_size) for i in reversed(range(count))]
        self.pinned = 0  # slots leased or viewed
        self.closed = False
        parent_only(self.fd)

    def close_fd(self) -> None:
        if self.fd >= 0:
            parent_only(self.fd, keep=False)
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        """Close its descriptor; unmap it now if no slot is pinned, else when the last one is freed.

        The caller holds the arena's lock.
        """
        self.closed = True
        self.close_fd()
        self.free = []  # no cycle through its slots keeps it
        if self.idle:
            self.unmap_now()

    def unmap_now(self) -> None:
        # Safe only once no slot is pinned: every array over the slab is made by `Arena.view` and
        # pins its slot (through the view it derives from) for as long as it lives.
        self.buf = None
        self.unmap()

    def buffer(self) -> Buffer:
        """The ctypes array over the mapping (ValueError once an idle slab was unmapped)."""
        buf = self.buf
        if buf is None:
            raise ValueError(f"slab {self.id} is unmapped")
        return buf

    @property
    def idle(self) -> bool:
        """No slot of it is leased or viewed."""
        return self.pinned == 0

    @property
    def whole(self) -> bool:
        """It is one slot (a batch buffer), not many (samples)."""
        return self.size == self.slot_size


# Each live slab holds one descriptor while the arena is open (handed to workers started later), none
# once it is closed; past this many slabs of either kind, results are copied out so that a consumer
# holding thousands of them cannot exhaust a small `ulimit -n` while the loader runs. Slabs of many
# slots (samples) and slabs of one large slot (batch buffers) are counted apart: samples held in the
# prefetch queue can pin every sample slab, and the batch buffers that would let workers write in
# place (and so free those slabs) must still find room.
MAX_SLABS = 16


class Slot:
    """`capacity` bytes at `offset` in slab `slab_id`; leased to one task at a time."""

    __slots__ = ("__weakref__", "offset", "pins", "slab")

    def __init__(self, slab: _Slab, offset: int) -> None:
        self.slab = slab
        self.offset = offset
        self.pins = 0

    @property
    def slab_id(self) -> int:
        return self.slab.id

    @property
    def capacity(self) -> int:
        return self.slab.slot_size

    def write(self, data: bytes | bytearray) -> None:
        """Copy `data` to the start of the slot (parent side: a large input)."""
        with memoryview(self.slab.buffer()) as raw, raw.cast("B") as mem:
            mem[self.offset : self.offset + len(data)] = data


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

    def __init__(self, budget: int, directory: str | None = None) -> None:
        _room(budget, directory)
        self.budget = budget
        self.directory = directory
        self._slabs: dict[int, _Slab] = {}
        self._next_id = 0
        self._dropped: list[int] = []
        # reentrant: a view collected by the garbage collector while this thread holds the lock
        # releases its slot from inside the locked section
        self._lock = threading.RLock()
        self._closed = False
        self.on_free: Callable[[], None] | None = None  # see `release`

    @property
    def mapped_bytes(self) -> int:
        """Bytes of all live slabs."""
        with self._lock:  # `stats()` reads it from any thread while the pool's thread adds slabs
            return sum(s.size for s in self._slabs.values())

    @property
    def batch_slabs(self) -> int:
        """Live slabs of one slot (whole batches)."""
        with self._lock:  # as `mapped_bytes`
            return sum(s.whole for s in self._slabs.values())

    def slab_fd(self, slab_id: int) -> tuple[int, int, bool]:
        """(file descriptor, size, whether it is one slot: a batch) of a live slab, for a worker."""
        slab = self._slabs[slab_id]
        return slab.fd, slab.size, slab.whole

    def acquire(
        self, nbytes: int, prefer: Container[int] = (), only: bool = False, new: bool = True
    ) -> Slot | None:
        """Lease a slot of at least `nbytes`, or None when none is free and the budget is spent.

        A free slot in a slab whose id is in `prefer` (those the worker it is for has mapped
        already) comes first: a worker that maps a slab of whole batches populates every page of it,
        so one that keeps to its own slabs pays that once, not once per slab of the arena. With
        `only`, a slot of another slab is never taken; with `new` False, no slab is made.
        """
        size = size_class(nbytes)
        with self._lock:
            if self._closed:
                return None
            fits = [slab for slab in self._slabs.values() if slab.slot_size == size and slab.free]
            mine = next((slab for slab in fits if slab.id in prefer), None)
            if mine is not None or (fits and not only):
                return self._lease((mine or fits[0]).free.pop())
            if not new:
                return None
            count = max(1, min(SLOTS_PER_SLAB, SLAB_BYTES // size))
            if count == 1 and not only:  # a batch: a free one up to twice as large will do
                for slab in self._slabs.values():
                    if slab.free and slab.whole and size < slab.size <= 2 * size:
                        return self._lease(slab.free.pop())
            while (
                self.budget - self.mapped_bytes < size * count or self._kin(count) >= MAX_SLABS
            ) and self._retire_one(keep=size):
                pass
            if self._kin(count) >= MAX_SLABS:
                return None  # every slab is viewed: copy out rather than hold more descriptors
            count = min(count, (self.budget - self.mapped_bytes) // size)
            if count < 1:
                return None
            try:
                _room(size * count, self.directory)
                slab = _Slab(self._next_id, size, count, self.directory)
            except OSError:
                return None
            self._slabs[slab.id] = slab
            self._next_id += 1
            return self._lease(slab.free.pop())

    def _kin(self, count: int) -> int:
        """Live slabs of the same kind as one of `count` slots (one slot, or many)."""
        return sum(slab.whole == (count == 1) for slab in self._slabs.values())

    def _lease(self, slot: Slot) -> Slot:
        slot.pins = 1
        slot.slab.pinned += 1
        return slot

    def _retire_one(self, keep: int) -> bool:
        for slab in self._slabs.values():
            if slab.slot_size != keep and slab.idle:
                self._retire(slab)
                return True
        return False

    def _retire(self, slab: _Slab) -> None:
        """Close an idle slab; workers unmap it once told (`take_dropped`). Holds the lock."""
        del self._slabs[slab.id]
        slab.close()
        self._dropped.append(slab.id)

    def whole_slabs(self, ids: Container[int], nbytes: int) -> int:
        """How many of the slabs `ids` hold one slot of `nbytes`' size class."""
        size = size_class(nbytes)
        with self._lock:
            return sum(
                s.whole and s.slot_size == size and s.id in ids for s in self._slabs.values()
            )

    def retire_idle_samples(self) -> None:
        """Retire every slab of many slots that no slot of pins: once workers write whole batches in
        place, the slots that held single samples before are memory held for nothing."""
        with self._lock:
            for slab in [s for s in self._slabs.values() if not s.whole and s.idle]:
                self._retire(slab)

    def take_dropped(self) -> list[int]:
        """Ids of the slabs retired since the last call (workers should unmap them)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    def release(self, slot: Slot) -> None:
        """End a lease (or a view's pin); the slot is free again once nothing pins it, and then
        `on_free` (when set) is called, outside the arena's lock."""
        freed = False
        with self._lock:
            slot.pins -= 1
            if slot.pins == 0:
                slab = slot.slab
                slab.pinned -= 1
                if not slab.closed:
                    slab.free.append(slot)
                    freed = True
                elif slab.idle:
                    slab.unmap_now()  # closed, and its last view is gone
        on_free = self.on_free
        if freed and on_free is not None:
            on_free()

    def view(self, slot: Slot, offset: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """A writable uint8 array over `nbytes` at `offset` in `slot`, pinning it while alive."""
        # its base is the slab's ctypes array: the mapping outlives every array made from `owner`
        owner: np.ndarray[Any, np.dtype[np.uint8]] = np.frombuffer(  # type: ignore[call-overload]
            slot.slab.buffer(), np.uint8, nbytes, slot.offset + offset
        )  # (numpy's stubs do not list ctypes arrays, which export the buffer protocol)
        with self._lock:
            slot.pins += 1
            if slot.pins == 1:  # not leased: a caller's misuse, counted all the same
                slot.slab.pinned += 1

        # A finalizer, not a bare weakref kept on the slot: nothing else holds a slot whose lease
        # has ended, so slot, weakref and callback would be garbage together and the callback
        # never run (the slot lost for good). The finalizer registry holds it, and it the slot.
        weakref.finalize(owner, self.release, slot).atexit = False
        return owner

    def close(self) -> None:
        """Close every slab's descriptor and unmap every slab no lease or view pins. Idempotent.

        A slab still viewed stays mapped, holding no descriptor, until its last view goes.
        """
        with self._lock:
            self._closed = True
            slabs, self._slabs = list(self._slabs.values()), {}
            for slab in slabs:
                slab.close()


DEFAULT_ARENA_BYTES = 256 << 20
MIN_ARENA_BYTES = 16 << 20


def shm_cap(directory: str | None) -> int | None:
    """Half the free space of the directory slabs are files in; None for anonymous memory (the
    /dev/shm mount does not bound it)."""
    if directory is None and MEMFD:
        return None
    return free_space(directory or SHM_DIR) // 2


def arena_budget(requested: int | None, directory: str | None = None) -> int:
    """The arena budget: `requested` if there is room for it, else OSError naming the directory.

    None picks 256 MiB (where slabs are files in /dev/shm: or half its free space, whichever is
    less; at least 16 MiB).
    """
    if requested is not None:
        _room(requested, directory)
        return requested
    cap = shm_cap(directory)
    if cap is None:
        return DEFAULT_ARENA_BYTES
    budget = min(DEFAULT_ARENA_BYTES, cap)
    if budget < MIN_ARENA_BYTES:
        check_room(2 * MIN_ARENA_BYTES, directory or SHM_DIR)
    return max(budget, MIN_ARENA_BYTES)
