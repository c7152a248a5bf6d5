"""What the machine has: its RAM, and the free space of a mounted directory (/dev/shm). Facts only:
how a loader shares its budget out, within these and a cgroup's limit, is `_tuning/memory.py`'s."""

from __future__ import annotations

import os

__all__ = ["free_space", "ram_bytes"]

FALLBACK_RAM = 8 << 30  # where the platform does not say


def ram_bytes() -> int:
    """The machine's physical memory, in bytes."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return FALLBACK_RAM


def free_space(directory: str) -> int:
    """Bytes an unprivileged writer may still put in the filesystem of `directory`."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize
