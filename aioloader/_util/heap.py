"""The C heap's handling of freed blocks, for decode threads whose results another thread frees.

A decode thread allocates each result (a numpy array of 100 KB, say) in its own glibc arena, and the
collate thread frees it once it is stacked into the batch. glibc hands the top of an arena back to the
kernel whenever more than its trim threshold (128 KB until something raises it) lies free there, so
the next results are written into fresh pages again: in W5 (benchmarks/ft_threads.py) that was 6-9 page
faults per 100 KB sample on the decode threads, about 11 µs each on the project's machines.

glibc raises both thresholds itself when a block it had mapped is freed (mallopt(3), "dynamic mmap
threshold"): to that block's size for mmap, twice that for trim. Any program that once frees a 4 MB
array gets there on its own; `keep_freed_blocks` does it at once, by freeing one such block. glibc's
adjustment stays dynamic (a larger block freed later raises it further, to glibc's own ceiling of
32 MB), and nothing else about the process's allocator changes. An arena then keeps up to 8 MB free
at its top, above a decode thread's share of a batch in W5 (1.6 MB): 2 MB left a fault per two
samples, 16 MB did no better than 4 and would let each arena keep 32 MB. Elsewhere (musl, macOS) it
does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import threading

__all__ = ["KEEP_BLOCK", "keep_freed_blocks", "kept"]

KEEP_BLOCK = 4 << 20  # above a decode thread's share of a batch (W5: 1.6 MB)

_lock = threading.Lock()
_kept = False
_tried = False  # once per process either way (off glibc, `platform.libc_ver` reads the executable)


def keep_freed_blocks() -> bool:
    """Once per process, on glibc: raise the mmap threshold to `KEEP_BLOCK` (if it is lower) and
    the trim threshold to twice that, as glibc does when it frees a mapped block of that size.
    Whether they were raised (now or before)."""
    global _kept, _tried
    with _lock:
        if _tried:
            return _kept
        _tried = True
        if platform.libc_ver()[0] != "glibc":
            return False
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            libc.malloc.argtypes = [ctypes.c_size_t]
            libc.free.argtypes = [ctypes.c_void_p]
            block = libc.malloc(KEEP_BLOCK)  # above today's threshold: glibc maps it ...
            if block:
                libc.free(block)  # ... and, freeing it, raises its thresholds to its size
                _kept = True
        return _kept


def kept() -> bool:
    """Whether `keep_freed_blocks` has raised this process's thresholds."""
    return _kept
