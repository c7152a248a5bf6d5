"""A slab's memory and descriptor: mapped with libc's mmap (keeping no fd), closed in forked processes.

Python's `mmap.mmap` keeps a duplicate of the descriptor while the mapping lives (before 3.13); libc's
mmap(2) keeps none, so a slab holds exactly one descriptor, its own (see `arena.py`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import weakref
from typing import Any

__all__ = ["Buffer", "forget_parent_only", "map_shared", "parent_only", "parent_only_fds"]

_parent_only: set[int] = set()
_parent_only_lock = threading.Lock()


def parent_only(fd: int, keep: bool = True) -> None:
    """Mark `fd` as one that a process forked later from this one must close (see `zygote.py`).

    keep=False forgets it (call it before closing `fd`). Slab descriptors, workers' sockets and
    lifelines are marked, so that a zygote never keeps another pool's memory or pipes alive.
    """
    with _parent_only_lock:
        (_parent_only.add if keep else _parent_only.discard)(fd)


def parent_only_fds() -> set[int]:
    """The descriptors marked by `parent_only`."""
    with _parent_only_lock:
        return set(_parent_only)


def forget_parent_only() -> None:
    """(In a forked process that closed them.) Forget every mark: those numbers are free here, and a
    descriptor opened later may take one, which a process forked from this one must not close (a
    pool made in a worker, as beside the trainer: its zygote closed its own socket)."""
    with _parent_only_lock:
        _parent_only.clear()


_libc = ctypes.CDLL(None, use_errno=True)  # a private handle: its prototypes are ours alone
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long
]  # fmt: skip
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value

Buffer = ctypes.Array[ctypes.c_char]  # a ctypes array over a mapping


def map_shared(fd: int, size: int) -> tuple[Buffer, weakref.finalize[Any, Any]]:
    """Map `size` bytes of `fd` read-write and shared; the mapping keeps no descriptor.

    Returns a ctypes array over the mapping and the finalizer that unmaps it: it runs once the
    array is garbage (every numpy array made over it holds it as its base), or when called.
    """
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED
    addr = _libc.mmap(None, size, prot, flags, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of a {size}-byte slab failed: {os.strerror(err)}")
    buf = (ctypes.c_char * size).from_address(addr)
    unmap = weakref.finalize(buf, _libc.munmap, addr, size)
    unmap.atexit = False  # at exit the process unmaps it: a view may still be read until then
    return buf, unmap
