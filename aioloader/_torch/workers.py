"""`aioloader.DataLoader(num_workers=N)`: the dataset read in N worker processes, as torch does.

The callables here are sent once to each worker of a `ProcessExecutor` (they pickle the dataset).
Inside a worker, `torch.utils.data.get_worker_info()` answers as it does in torch's workers (id,
num_workers, seed, dataset), so sharding code written for torch's DataLoader keeps working; the
worker's torch and `random` generators are seeded from the loader's base seed plus the worker id.

The unit of work is torch's: a whole batch. Batch i goes to worker i % N (`RoundRobin`), which reads
its samples (`ReadSamples`: in up to `threads_per_worker` threads when the reads block, in the
sampler's order whatever the completion order), runs the collate_fn itself, and answers with one
small message: the default collate stacks straight into the task's output slot
(`_executors/process/slot_carver.py`), and the arrays of what a user collate_fn returns are copied there,
so the parent only maps views.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import functools
import itertools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterDataPipe, MapDataPipe, graph_settings

from .._exceptions import WorkerDied
from .._executors.process import slot_carver
from .._executors.process.executor import ProcessExecutor
from .._pipeline.collate import StackAsRead, make_collate
from .._util.deps import publish_worker_info, worker_info_published, worker_numpy_seed
from .._util.threads import (
    GROW_AFTER_S,
    IDLE_TO_GROW,
    SLOW_CALL_S,
    LazyThreadPool,
    cores_idle,
    idle_ticks,
    runnable_clock,
    yield_cpu_to_trainer,
)
from .copies import DatasetCopies, thread_safe
from .stateful import OwnStates, Stamped, own_state, restore_into

__all__ = [
    "AUTO_THREADS", "ReadItem", "ReadSamples", "RoundRobin", "WorkerSetup", "check_threads",
    "collate_here", "keep_freed_memory", "publish",
]  # fmt: skip

# threads_per_worker="auto": one to begin with, more while reads block, up to this many in all the
# workers together (at least 2 each): threads beyond what keeps the cores busy only add switches
# (measured, 8 workers on 2 cores: 0.157 s/batch with 16 threads each, 0.121 with 4)
AUTO_THREADS = 32

_worker: dict[str, int] = {}  # in a worker process: its id, the number of workers, its seed
_copies: dict[int, DatasetCopies] = {}  # in a worker process: its read threads' dataset copies


class WorkerSetup:
    """`worker_init_fn` of the process pool: seeds the worker as torch seeds its workers (torch,
    `random` and numpy from `base_seed` + id), makes `get_worker_info()` answer, then calls the
    user's hook (which may read the worker info, as in torch)."""

    def __init__(
        self, num_workers: int, base_seed: int, user_fn: Callable[[int], Any] | None,
        dataset: Any = None,
    ) -> None:  # fmt: skip
        self.num_workers, self.base_seed, self.user_fn = num_workers, base_seed, user_fn
        self.dataset = dataset

    def __call__(self, worker_id: int) -> None:
        seed = (self.base_seed + worker_id) % 2**64
        _worker.update(id=worker_id, num_workers=self.num_workers, seed=seed)
        yield_cpu_to_trainer()  # the training step's thread first, where the cores are all busy
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(worker_numpy_seed(self.base_seed, worker_id))  # as torch's workers
        publish(self.dataset)
        if isinstance(self.dataset, IterDataPipe | MapDataPipe):  # each worker its shard, as torch
            world, rank = _world()
            graph_settings.apply_sharding(
                self.dataset, self.num_workers * world, worker_id * world + rank
            )
        if self.user_fn is not None:
            self.user_fn(worker_id)


def _world() -> tuple[int, int]:
    """(world size, rank) of torch.distributed, else (1, 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def publish(dataset: Any) -> None:
    """Make `get_worker_info()` describe this worker, with the dataset the reads run on."""
    if _worker and not worker_info_published():
        publish_worker_info(_worker["id"], _worker["num_workers"], _worker["seed"], dataset)


class ReadItem:
    """index -> `dataset[index]` (then `convert`, torch's per-sample collate_fn without batching)."""

    def __init__(self, dataset: Any, convert: Callable[[Any], Any] | None = None) -> None:
        self.dataset, self.convert = dataset, convert

    def __call__(self, index: Any) -> Any:
        publish(self.dataset)
        item = self.dataset[index]
        return item if self.convert is None else self.convert(item)


def check_threads(threads_per_worker: int | str, workers: int) -> tuple[int, bool]:
    """(the most threads each of `workers` reads with, whether they start only as reads block):
    `threads_per_worker`, checked. An int starts its threads as calls find none free."""
    if threads_per_worker == "auto":
        return max(2, AUTO_THREADS // max(1, workers)), True
    if type(threads_per_worker) is not int or threads_per_worker < 1:
        raise ValueError(
            f'threads_per_worker must be "auto" or an int >= 1, got {threads_per_worker!r}'
        )
    return threads_per_worker, False


def collate_here(collate: Callable[[Any], Any] | None, samples: Any) -> Any:
    """`collate(samples)` in a worker; None is the default collate, which stacks each batch tensor
    straight into the task's output slot (`slot_carver.current`) when it has one."""
    if collate is None:
        collate = make_collate(slot_carver.current.get())
    return collate(samples)


class ReadSamples:
    """(batch number, indices) -> the collated batch, read and collated in one worker process.

    Reads with `dataset.__getitems__(indices)` when the dataset has it (one call, as torch makes
    it), else `dataset[i]` for each index: one after another with `threads` = 1 (torch's calls),
    else in up to `threads` threads of this worker, which start as calls find none free. No two
    threads enter one dataset object (torch's contract, see `_torch/copies.py`): each read thread
    reads a copy of its own, and where none can be made the worker reads one after another; a
    dataset that declares `thread_safe = True` is read by its threads as it is. With `lazy`, a
    worker reads one after another on its own thread (no thread, no event loop, no malloc arena
    more than torch's worker) until a batch's reads are seen to block (`_Blocking`); only then do
    threads start, and only while the reads block and cores are idle
    (`_util/threads.LazyThreadPool`'s `spare_cores`). The batch keeps the sampler's order; the
    first failing read, in that order, raises. `collate` None is the default collate (see
    `collate_here`).
    """

    def __init__(
        self,
        dataset: Any,
        collate: Callable[[Any], Any] | None,
        threads: int,
        lazy: bool = True,
    ) -> None:
        self.dataset, self.collate, self.threads, self.lazy = dataset, collate, threads, lazy

    def __call__(self, key: tuple[Any, ...]) -> Any:
        _, indices, *restore = key
        publish(self.dataset)
        if restore:  # a resume: the dataset's own state as it was after its last batch handed over
            restore_into(self.dataset, restore[0])
        batch = self._read(indices)
        state = own_state(self.dataset, worker=True)
        return Stamped(batch, state) if state else batch

    def _read(self, indices: Any) -> Any:
        if not isinstance(indices, list):  # unbatched: one sample, converted
            assert self.collate is not None
            return self.collate(self.dataset[indices])
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            samples = getitems(indices)
        else:
            getitem, threads = self._reads()
            if threads == 1 or len(indices) == 1 or (self.lazy and not _Blocking.seen):
                reading = self._one_by_one(indices, threads)  # kept until collated (its tensors)
            else:
                reading = self._collector(len(indices))
                _Readers.here(threads, self.lazy).read(getitem, indices, reading)
            samples = reading if isinstance(reading, list) else reading.samples
        keep_freed_memory(samples)
        return collate_here(self.collate, samples)

    def one_at_a_time(self) -> str | None:
        """Why a worker reads its batches one call at a time, whatever its reads wait (the dataset
        cannot be copied for its threads), else None; asked of the dataset as it is now, in this
        process (a worker's copy may differ: its `worker_init_fn` may have opened a handle)."""
        if self.threads == 1 or thread_safe(self.dataset):
            return None
        if hasattr(self.dataset, "__getitems__"):
            return None  # one call per batch, as torch makes it
        copies = DatasetCopies(self.dataset, self.threads)
        copies.snapshot()
        return copies.why

    def _reads(self) -> tuple[Callable[[Any], Any], int]:
        """(what a read thread calls, the threads that may read at once) in this worker: the
        dataset itself where it is `thread_safe`, else each thread's own copy of it, made from
        the dataset as it was before this worker's first read (`DatasetCopies`); one thread where
        no copy can be made."""
        if thread_safe(self.dataset):
            return self.dataset.__getitem__, self.threads
        copies = _copies.get(id(self))
        if copies is None:  # this worker's first batch: nothing read yet
            copies = _copies[id(self)] = DatasetCopies(self.dataset, self.threads)
            copies.snapshot()
        return copies.getitem, copies.threads

    def _collector(self, size: int) -> list[Any] | StackAsRead:
        """Where a batch's samples go as they are read, in order: with the default collate and an
        output slot, each is stacked into the batch (`StackAsRead`), else kept in a list."""
        carver = slot_carver.current.get()
        if self.collate is None and carver is not None:
            return StackAsRead(carver, size)
        return []

    def _one_by_one(self, indices: list[Any], threads: int) -> list[Any] | StackAsRead:
        """The samples read on this thread, in order; with the default collate and an output slot,
        each is stacked into the batch as it is read (`StackAsRead`)."""
        out = self._collector(len(indices))
        if threads == 1 or len(indices) == 1:
            for i in indices:
                out.append(self.dataset[i])
        else:
            _Blocking.watch(self.dataset.__getitem__, indices, out)
        return out


class _Blocking:
    """Whether a worker's reads block: a batch read one by one whose calls took `SLOW_CALL_S` or
    more at the median, and which was blocked (neither ran nor waited for a core) as long as half
    its calls took that, while cores sat idle. Set once per process; calls that compute (a JPEG
    decode) never set it, and need no thread, however long other processes keep them from a core.

    The batch's blocked time is its wall time less the time it ran or waited in a run queue
    (`runnable_clock`), read twice a batch: read around every call, it cost ~0.9 ms a batch of 64
    here, more than reading 64 ints."""

    seen = False

    @classmethod
    def watch(cls, getitem: Callable[[Any], Any], indices: list[Any], samples: Any) -> None:
        """Read `indices` one by one into `samples` (`append`), watching how the calls wait."""
        took = []
        start, idle, runnable = time.monotonic(), idle_ticks(), runnable_clock()
        for i in indices:
            began = time.monotonic()
            samples.append(getitem(i))
            took.append(time.monotonic() - began)
        took.sort()
        if took[len(took) // 2] < SLOW_CALL_S:
            return  # quick calls: no thread would help
        wall = time.monotonic() - start
        blocked = wall - (runnable_clock() - runnable)
        spare = cores_idle(idle, idle_ticks(), wall)
        cls.seen = blocked >= SLOW_CALL_S * len(took) / 2 and spare >= IDLE_TO_GROW


def keep_freed_memory(samples: list[Any]) -> None:
    """In a worker process that reads large samples: let glibc keep freed blocks for reuse, in one
    arena. Decided once per process, from the first batch it reads.

    A 1 MB sample is above glibc's mmap threshold until a free raises it; the top of the heap is
    then handed back to the kernel after every batch, and each reading thread allocates from an
    arena of its own that does the same: every sample then costs its pages' faults again (about
    11 µs each here; measured, 0.7 CPU-s per batch of 128 x 1.2 MB against 0.2 once kept). One
    arena, so that the threads reuse one batch's memory rather than each keeping its own peak.
    Samples under `LARGE_SAMPLE` (a decoded image) leave glibc's defaults alone: they gain nothing
    and a kept heap costs memory. The worker process is aioloader's, so its allocator policy is
    ours to set; the main process's is left alone.
    """
    global _kept
    if _kept:
        return
    _kept = True
    if not samples or _nbytes(samples[0]) < LARGE_SAMPLE:
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_ARENA_MAX, 1)
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BLOCKS_BELOW)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED)


def _nbytes(sample: Any) -> int:
    """The bytes of a sample's arrays (tensors, numpy arrays; one level of containers)."""
    if isinstance(sample, torch.Tensor):
        return sample.numel() * sample.element_size()
    if hasattr(sample, "nbytes") and hasattr(sample, "dtype"):
        return int(sample.nbytes)
    if isinstance(sample, dict):
        sample = list(sample.values())
    if isinstance(sample, list | tuple):
        return sum(_nbytes(x) for x in sample if not isinstance(x, list | tuple | dict))
    return 0


LARGE_SAMPLE = 1 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
_KEEP_BLOCKS_BELOW = 32 << 20  # glibc's own ceiling for its dynamic mmap threshold
_KEEP_FREED = 1 << 30  # freed memory at the top of the heap kept: a batch's samples, and more
_kept = False  # set once per worker process


class _Readers:
    """A worker's read threads and the event loop that waits for them (one per worker process)."""

    _mine: _Readers | None = None
    _lock = threading.Lock()

    def __init__(self, threads: int, lazy: bool) -> None:
        grow_after = GROW_AFTER_S if lazy else 0.0
        self.pool = LazyThreadPool(
            threads, "aioloader-read", grow_after=grow_after, spare_cores=lazy
        )
        self.loop = asyncio.new_event_loop()

    @classmethod
    def here(cls, threads: int, lazy: bool) -> _Readers:
        with cls._lock:
            mine = cls._mine
            if mine is None or (mine.pool.size, mine.pool.spare_cores) != (threads, lazy):
                mine = cls._mine = cls(threads, lazy)
            return mine

    def read(self, getitem: Callable[[Any], Any], indices: list[Any], out: Any) -> None:
        """Read `indices` in the pool's threads into `out` (`append`), in order; the first failing
        read, in that order, raises.

        At most as many reads as the pool has threads run ahead of the next sample to append: a
        worker holds that many samples of its own, not a batch of them (with `StackAsRead`, each is
        stacked into the batch's slot as its turn comes, and while the slot is asked for, reading
        pauses)."""
        self.loop.run_until_complete(self._read_into(getitem, indices, out))

    async def _read_into(self, getitem: Callable[[Any], Any], indices: list[Any], out: Any) -> None:
        ahead: collections.deque[asyncio.Future[Any]] = collections.deque()
        rest = iter(indices)
        for i in itertools.islice(rest, max(1, self.pool.size)):
            ahead.append(asyncio.ensure_future(self.pool.run(getitem, i)))
        try:
            while ahead:
                sample = await ahead.popleft()
                for i in itertools.islice(rest, 1):
                    ahead.append(asyncio.ensure_future(self.pool.run(getitem, i)))
                out.append(sample)
                del sample
        finally:  # a read failed: those after it are not waited for
            for run in ahead:
                run.cancel()
            await asyncio.gather(*ahead, return_exceptions=True)


# -- the parent's side of an IterableDataset read in workers ------------------------------------------


class RoundRobin:
    """Sends batch i (the key `(i, indices)` of `ReadSamples`) to worker i % N of `pool`, as torch's
    DataLoader hands out its batches."""

    def __init__(
        self, pool: ProcessExecutor, read: ReadSamples | None = None, own: OwnStates | None = None
    ) -> None:
        self.pool = pool
        self.workers = pool.workers
        self._read = read
        self.own = own

    async def run(self, fn: Callable[[Any], Any], key: Any, seed: int | None = None) -> Any:
        batch, indices = key[:2]
        worker = batch % self.workers
        try:
            result = await self.pool.run(fn, key, seed, worker=worker)
        except WorkerDied as exc:
            exc.add_note(
                f"aioloader: DataLoader worker {worker} (pid {exc.pid}) died making batch {batch} "
                f"(indices {_short(indices)})"
            )
            raise
        if type(result) is Stamped:  # the dataset's own state after the batch, kept by number
            if self.own is not None:
                self.own.record(batch, worker=(worker, result.state))
            return result.batch
        return result

    def stats(self) -> dict[str, Any]:
        """The pool's counters, and why each worker reads one call at a time, where it must
        ("reads_one_at_a_time": for `diagnose()`; worked out once, at the first call)."""
        out: dict[str, Any] = dict(self.pool.stats())
        if self._one_at_a_time:
            out["reads_one_at_a_time"] = self._one_at_a_time
        return out

    @functools.cached_property
    def _one_at_a_time(self) -> str | None:
        return None if self._read is None else self._read.one_at_a_time()

    def close(self) -> None:
        self.pool.close()


def _short(indices: Any, most: int = 16) -> str:
    if not isinstance(indices, list):
        return repr(indices)
    shown = ", ".join(map(repr, indices[:most]))
    return f"[{shown}, ... {len(indices)} in all]" if len(indices) > most else f"[{shown}]"
