"""What this process holds, for the leak checks of the reliability tests and the soak runner.

`census()` takes a snapshot: resident memory, open file descriptors (and how many are sockets),
OS threads, live "aioloader*" threads, descendant processes and this process's shared-memory slabs:
its /dev/shm entries, and the anonymous (memfd) slabs it still holds a descriptor of or maps.
Two snapshots taken around a piece of work say what it left behind (`left_behind`).

Call `warm_up()` before the first snapshot: it makes the once-per-process state that any event loop
creates (uvloop keeps one pipe for the life of the process), so that it is not counted as a leak.
`settle()` gives aioloader threads the 2 s that `close()` promises to end.

Descendants exclude the stdlib's own helper processes (the multiprocessing forkserver and resource
tracker): they are started once per interpreter, on first use, by whoever uses them first, and live
until it exits by design; aioloader's own zygote and workers are counted.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import psutil

SHM_DIR = "/dev/shm"
SHM_PREFIX = "aioloader-"  # arena.NAME_PREFIX; slabs are named PREFIX<pid>-<random>
_STDLIB_HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")
STOP_DEADLINE_S = 2.0  # what close() promises: every thread and process gone within 2 s


def warm_up() -> None:
    """Make the once-per-process state an event loop creates (see the module docstring)."""
    from aioloader._util.loops import new_event_loop

    new_event_loop().close()


def settle(deadline_s: float = STOP_DEADLINE_S) -> None:
    """Join the aioloader threads still alive, for `deadline_s` at most in all."""
    end = time.monotonic() + deadline_s
    for thread in threading.enumerate():
        if thread.name.startswith("aioloader"):
            thread.join(max(0.0, end - time.monotonic()))


def fd_targets() -> dict[int, str]:
    """Each open descriptor of this process and what it points at (a path, "socket:[...]", ...)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # the listing's own descriptor, closed by now
    return out


MEMFD_LINK = f"/memfd:{SHM_PREFIX}"  # arena.SLAB_LINKS: what /proc shows of an anonymous slab


def shm_names(pid: int | None = None) -> list[str]:
    """/dev/shm names aioloader made (in process `pid` only, when given)."""
    prefix = SHM_PREFIX if pid is None else f"{SHM_PREFIX}{pid}-"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))


def shm_entries(pid: int | None = None) -> list[str]:
    """`shm_names`, and, for this process, the anonymous slabs it holds a descriptor of or maps:
    a slab is gone once both are."""
    names = set(shm_names(pid))
    if pid == os.getpid():
        names |= {t for t in fd_targets().values() if t.startswith(MEMFD_LINK)}
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) > 5 and fields[5].startswith(MEMFD_LINK):
                    names.add(fields[5].strip())
    return sorted(names)


def gone(pid: int) -> bool:
    """Process `pid` has ended (exited, or a zombie not yet reaped)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _is_stdlib_helper(proc: psutil.Process) -> bool:
    try:
        cmdline = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return False
    return any(helper in cmdline for helper in _STDLIB_HELPERS)


def descendants() -> list[int]:
    """Pids of this process's descendants (zombies included: an unreaped child is a leak too)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        if not _is_stdlib_helper(child):
            out.append(child.pid)
    return sorted(out)


def loader_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("aioloader"))


@dataclass(frozen=True)
class Census:
    """One snapshot of what the process holds."""

    rss: int
    fds: int
    sockets: int
    threads: int  # OS threads (torch's and the interpreter's included)
    loader_threads: list[str]
    children: list[int]
    shm: list[str]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def census() -> Census:
    proc = psutil.Process()
    targets = fd_targets()
    return Census(
        rss=proc.memory_info().rss,
        fds=len(targets),
        sockets=sum(t.startswith("socket:") for t in targets.values()),
        threads=proc.num_threads(),
        loader_threads=loader_threads(),
        children=descendants(),
        shm=shm_entries(os.getpid()),
    )


POLL_S = 0.01  # what is left is seen from outside (threads, /proc): nothing signals it


def left_behind_after(before: Census, deadline_s: float = STOP_DEADLINE_S) -> dict[str, Any]:
    """`left_behind(before, census())` once it is empty, or as it is after `deadline_s`.

    Collects garbage first: an epoch, its tasks and their frames form reference cycles that only
    the collector frees, and what they hold (samples viewing shared memory) goes with them.
    """
    settle(deadline_s)
    gc.collect()
    end = time.monotonic() + deadline_s
    while (left := left_behind(before, census())) and time.monotonic() < end:
        time.sleep(POLL_S)
    return left


def left_behind(before: Census, after: Census) -> dict[str, Any]:
    """What `after` holds that `before` did not: threads, processes, sockets, fds, /dev/shm entries.

    Empty when nothing was left behind. RSS is not compared (allocators keep freed memory).
    """
    out: dict[str, Any] = {}
    threads = sorted(set(after.loader_threads) - set(before.loader_threads))
    if threads:
        out["loader_threads"] = threads
    children = sorted(set(after.children) - set(before.children))
    if children:
        out["children"] = children
    if after.sockets > before.sockets:
        out["sockets"] = after.sockets - before.sockets
    if after.fds > before.fds:
        out["fds"] = after.fds - before.fds
    shm = sorted(set(after.shm) - set(before.shm))
    if shm:
        out["shm"] = shm
    return out
