"""One byte budget, `max_bytes_in_flight`, where its default comes from, and how it is split among
the parts that hold memory.

The default ("auto") follows the memory this process may use: inside a memory cgroup (a container's
limit: v2 `memory.max`, v1 `memory.limit_in_bytes`, the tightest of the cgroup and those above it)
half of what the cgroup leaves free when the loader is made (its limit less what it already uses,
less page cache it may reclaim), else a quarter of RAM; at most 2 GiB either way (`default_budget`).
The budget says where it came from (`MemoryBudget.origin`), and `stats()` and `diagnose()` say it.

- Recycled batch buffers (`BufferPool`) keep at most half of it; the rest is for samples in flight
  (`ByteBudget`, from fetch to hand-over), less what the buffers keep.
- A process pool the loader makes for itself gets a shared-memory arena as large as the share of
  samples in flight (they live there; once workers write batch rows in place, the batch buffers
  do instead of the pool's); a DataLoader's workers get the whole budget for their batches. Slabs
  are anonymous memory, which the cgroup counts: whole batches in flight are admitted against it.
- `concurrency="auto"` climbs no higher than the budget holds samples of the mean size.
- A source that reads ahead by itself (Parquet row groups, tar shards) may read half the budget ahead.
- The allocator hands its slack back to the system each time a quarter of the share of samples in
  flight has been released while that share binds (`ByteBudget`).
- A buffer pool keeps, per shape, one buffer for each batch that may wait (made ahead of the
  consumer: `prefetch` batches and the samples of `concurrency` fetches), plus `SPARE_BUFFERS`.

None (no budget) bounds none of these by bytes. This module is the only one that divides the budget
(`tests/tuning/test_memory_shares.py` checks it); the limits it obeys are read here (the cgroup) and
in `_util/system_memory.py` (RAM, a directory's free space).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .._executors.process.arena import MIN_ARENA_BYTES, shm_cap
from .._util.system_memory import ram_bytes
from .._util.validate import check_int

__all__ = [
    "AUTO",
    "DEFAULT_CAP",
    "SPARE_BUFFERS",
    "MemoryBudget",
    "Room",
    "default_budget",
    "memory_room",
]

AUTO = "auto"
DEFAULT_CAP = 2 << 30  # the default budget is never more than this
_UNLIMITED = 1 << 60  # a cgroup limit at least this large is "max" (v1 writes 2**63 rounded down)
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class Room:
    """The memory this process tree may use (`limit`), what it uses now (`used`), and where the
    limit comes from (`origin`: "cgroup v2 PATH", "cgroup v1 PATH" or "RAM")."""

    limit: int
    used: int
    origin: str

    @property
    def free(self) -> int:
        return max(0, self.limit - self.used)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    """A counter of a cgroup's memory.stat (0 where missing)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The process's cgroup folder under `mount` and those above it, innermost first. Inside a
    container the cgroup's path is often not visible under the mount; then the mount's root is the
    container's own cgroup."""
    here = mount / path.lstrip("/")
    if not here.is_dir():
        return [mount]
    dirs = [here]
    while here != mount and mount in here.parents:
        here = here.parent
        dirs.append(here)
    return dirs


def _cgroup_room(proc_cgroup: str, root: str) -> Room | None:
    """The tightest memory limit of this process's cgroup (v2 or v1) and those above it, with what
    that cgroup uses now less its reclaimable page cache; None where no limit is set."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    best: Room | None = None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2 (unified; hybrid: under unified/)
            base = Path(root)
            if not (base / "cgroup.controllers").exists():
                base = base / "unified"
            limit_file, usage_file, cache, version = (
                "memory.max",
                "memory.current",
                "inactive_file",
                2,
            )
        elif "memory" in controllers.split(","):
            base = Path(root) / "memory"
            limit_file, usage_file = "memory.limit_in_bytes", "memory.usage_in_bytes"
            cache, version = "total_inactive_file", 1
        else:
            continue
        for folder in _cgroup_dirs(base, path):
            limit = _read_int(folder / limit_file)
            if limit is None or limit >= _UNLIMITED or (best is not None and limit >= best.limit):
                continue
            usage = _read_int(folder / usage_file) or 0
            used = max(0, usage - _stat(folder / "memory.stat", cache))
            best = Room(limit, used, f"cgroup v{version} {folder / limit_file}")
    return best


def memory_room(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_ROOT) -> Room:
    """The memory this process may use: its cgroup's where that limits it below RAM, else RAM."""
    ram = ram_bytes()
    room = _cgroup_room(proc_cgroup, root)
    if room is None or room.limit >= ram:
        return Room(ram, 0, "RAM")
    return room


def default_budget(room: Room | None = None) -> tuple[int, str]:
    """The default `max_bytes_in_flight` and where it comes from: half of what the cgroup leaves
    free, or a quarter of RAM outside a cgroup's limit; at most `DEFAULT_CAP`."""
    room = room or memory_room()
    if room.origin == "RAM":
        return min(DEFAULT_CAP, room.limit // 4), "a quarter of RAM, at most 2 GiB"
    share = max(1 << 20, room.free // 2)
    return min(DEFAULT_CAP, share), (
        f"half of the {room.free / 2**20:.0f} MiB that the memory limit of "
        f"{room.limit / 2**20:.0f} MiB ({room.origin}) left free, at most 2 GiB"
    )


# Batch buffers kept per shape beyond those that may wait: the consumer's, one being stacked, a spare.
SPARE_BUFFERS = 3


@dataclass(frozen=True)
class MemoryBudget:
    """`max_bytes_in_flight` (None: no byte bound; "auto": `default_budget`), and its shares."""

    max_bytes: int | None = None
    origin: str = field(default="given", compare=False)

    def __post_init__(self) -> None:
        if self.max_bytes is not None:
            check_int("max_bytes_in_flight", self.max_bytes, minimum=1)

    @classmethod
    def of(cls, max_bytes: int | str | None) -> MemoryBudget:
        """The budget a loader's `max_bytes_in_flight` argument asks for."""
        if max_bytes == AUTO:
            return cls(*default_budget())
        if isinstance(max_bytes, str):
            raise ValueError(
                f"max_bytes_in_flight must be an int, None or {AUTO!r}, got {max_bytes!r}"
            )
        return cls(max_bytes, "no byte budget" if max_bytes is None else "given")

    @property
    def buffer_pool_bytes(self) -> int | None:
        """What recycled batch buffers may keep: half the budget (the rest: samples in flight)."""
        return None if self.max_bytes is None else self.max_bytes // 2

    def in_flight_bytes(self, pool_bytes: int) -> int | None:
        """What samples in flight may hold, when the batch buffers may keep `pool_bytes`."""
        return None if self.max_bytes is None else self.max_bytes - pool_bytes

    def arena_bytes(self, pool_bytes: int = 0, directory: str | None = None) -> int | None:
        """The shared-memory arena of a process pool made for the loader, when the batch buffers
        may keep `pool_bytes`: as large as the share of samples in flight (so a few batches of any
        size fit, and workers write them in place), and, where slabs are files in a directory
        (/dev/shm), never more than half its free space; at least `MIN_ARENA_BYTES`. None (the
        pool's own default) without a budget. Slabs are made as they are needed: a large arena
        costs nothing until it is used."""
        share = self.in_flight_bytes(pool_bytes)
        if share is None:
            return None
        cap = shm_cap(directory)
        return max(MIN_ARENA_BYTES, share if cap is None else min(share, cap))

    def give_back_every(self, in_flight: int | None) -> int | None:
        """Bytes of samples released between two hand-backs of the allocator's slack, while the
        share of samples in flight (`in_flight`) binds: a quarter of it."""
        return None if in_flight is None else in_flight // 4

    def samples_held(self, mean_sample: int) -> int | None:
        """How many samples of `mean_sample` bytes the budget holds (at least one): the ceiling
        of `concurrency="auto"`; None without a budget."""
        return None if self.max_bytes is None else max(1, self.max_bytes // max(1, mean_sample))

    @property
    def read_ahead_bytes(self) -> int | None:
        """What a source that reads ahead by itself (Parquet row groups, tar shards) may hold: half
        the budget."""
        return None if self.max_bytes is None else self.max_bytes // 2

    @staticmethod
    def buffers_per_shape(waiting: int) -> int:
        """Batch buffers a pool keeps per shape, when `waiting` batches may wait at most."""
        return waiting + SPARE_BUFFERS

    @staticmethod
    def waiting_batches(prefetch: int, group_size: int, concurrency: int) -> int:
        """Batches that may wait at most: `prefetch` batches and `concurrency` samples, rounded up."""
        return -(-(prefetch * group_size + concurrency) // group_size)
