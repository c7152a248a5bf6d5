"""Every private API of a dependency that the package calls, in one place, each behind a function.

A private name (`torch._C._storage_Use_Count`, `multiprocessing.forkserver._forkserver`, ...) may
change or go in any release of its owner, silently. Here each one has a function that says what it
is for; the rest of the package calls these, never the private names. `CHECKED` lists the versions
they were checked with, and `tests/util/test_deps.py` fails on any other version (and checks what
each function does), so an upgrade is looked at here first. At run time nothing checks versions:
where a private name is gone, the functions that can say so return None and their callers take the
public way (slower), as they did before.

What is private, and why it is used:
- torch's `collate` and `default_collate_fn_map` (`torch.utils.data._utils.collate`): the default
  collate walks samples with torch's own rules, with its own functions for tensors and arrays
  (torch documents `collate` there, under its private path).
- `torch._C._storage_Use_Count`: how many tensors use a storage, so a pooled batch buffer is
  handed out again only when nothing outside the pool holds it.
- torch's worker state (`torch.utils.data._utils.worker`: `_generate_state`, `_worker_info`,
  `WorkerInfo`): a DataLoader worker seeds numpy and answers `get_worker_info()` as torch's do.
- `multiprocessing.forkserver._forkserver._preload_modules`: the modules a fork server already
  preloads, kept when aioloader's are added; and its state (`__init__`, `_forkserver_alive_fd`),
  forgotten in a forked process that would start a fork server of its own (the loader beside the
  trainer): the one it inherited is its parent's, not its child.
- `threading._register_atexit`: a hook run at exit before the non-daemon threads are joined, so
  that a loader left open never keeps the process alive (concurrent.futures' pools use it).
- `sys._getframe`: the frames of this thread's stack, to find the script's own top-level code (a
  worker start method that would run the script again, `_executors/process/main_guard.py`).
- fsspec's `AsyncFileSystem._cat_file`: an async filesystem's read, awaited on the loader's loop
  (fsspec names its coroutines with a leading underscore; it documents them so).
- `torch.distributed.distributed_c10d._get_default_store`: the job's key-value store, over which
  ranks share one listing.
- `pyarrow._parquet.ParquetReader`: a Parquet reader that decodes into a given memory pool.
- `pyarrow._compute`: Arrow's `take`, without importing `pyarrow.compute` (~90 ms) in a first batch.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "CHECKED", "arrow_take", "before_threads_joined", "c10d_default_store", "caller_frame",
    "forget_inherited_forkserver",
    "forkserver_preloaded",
    "fsspec_cat_file", "parquet_reader", "publish_worker_info", "storage_uses", "torch_collate",
    "worker_info_published", "worker_numpy_seed",
]  # fmt: skip

# The versions the functions below were checked with (the free-threaded venv's torch builds, which
# `make ft-env` installs, by `make test-ft`); `tests/util/test_deps.py` fails on others.
CHECKED: dict[str, frozenset[str]] = {
    "python": frozenset({"3.11", "3.12", "3.13", "3.14"}),
    "torch": frozenset({"2.12.0", "2.13.0", "2.14.1"}),
    "pyarrow": frozenset({"26.0.1"}),
}


# -- torch --------------------------------------------------------------------------------------------


def torch_collate() -> tuple[Any, dict[Any, Any]]:
    """(torch's `collate(batch, collate_fn_map=...)`, a copy of its `default_collate_fn_map`)."""
    from torch.utils.data._utils.collate import collate, default_collate_fn_map

    return collate, dict(default_collate_fn_map)


def storage_uses(storage: Any) -> int:
    """How many uses torch counts of `storage` (an `UntypedStorage`): its tensors and views."""
    import torch

    return int(torch._C._storage_Use_Count(storage._cdata))


def worker_numpy_seed(base_seed: int, worker_id: int) -> Any:
    """The numpy seed torch's DataLoader worker `worker_id` draws from the loader's `base_seed`."""
    from torch.utils.data._utils import worker

    return worker._generate_state(base_seed, worker_id)  # type: ignore[no-untyped-call]


def worker_info_published() -> bool:
    """Whether `torch.utils.data.get_worker_info()` answers in this process."""
    from torch.utils.data._utils import worker

    return worker._worker_info is not None


def publish_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    """Make `torch.utils.data.get_worker_info()` answer in this process as in a torch worker."""
    from torch.utils.data._utils import worker

    worker._worker_info = worker.WorkerInfo(
        id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
    )


def c10d_default_store() -> Any:
    """The key-value store of torch.distributed's default process group, once one is up (None
    where this torch has no way to give it)."""
    import torch.distributed as dist

    get_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    return None if get_store is None else get_store()


# -- the standard library -------------------------------------------------------------------------------


def forkserver_preloaded() -> list[str]:
    """The modules the fork server of this process preloads now (its default: `__main__`)."""
    from multiprocessing import forkserver

    return list(getattr(forkserver._forkserver, "_preload_modules", ["__main__"]))


def forget_inherited_forkserver() -> None:
    """In a forked process: forget the fork server its parent had started (the stdlib would take it
    for its own child, and fail on it with ChildProcessError), so that one is started afresh here
    when wanted; the inherited end of its parent's lifeline is closed."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
    preload = forkserver_preloaded()
    server.__init__()  # type: ignore[misc]
    server.set_forkserver_preload(preload)


def before_threads_joined(fn: Callable[[], None]) -> bool:
    """Call `fn` at exit before the interpreter joins the non-daemon threads (as concurrent.futures
    stops its pools: `threading._register_atexit`); False where there is no such hook."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return False
    register(fn)
    return True


def caller_frame(depth: int) -> FrameType | None:
    """The frame `depth` calls above the caller of this function (None past the stack's end)."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


# -- fsspec -------------------------------------------------------------------------------------------


async def fsspec_cat_file(fs: Any, path: str, start: int | None, end: int | None) -> Any:
    """`fs.cat_file(path, start, end)` awaited, for an fsspec `AsyncFileSystem` made for the
    running loop."""
    return await fs._cat_file(path, start=start, end=end)


# -- pyarrow ----------------------------------------------------------------------------------------------


def parquet_reader(pool: Any) -> Any:
    """A pyarrow `ParquetReader` that decodes into `pool`; None where this pyarrow has none."""
    try:
        from pyarrow._parquet import ParquetReader

        return ParquetReader(memory_pool=pool)
    except (ImportError, TypeError):
        return None


@functools.cache
def arrow_take() -> tuple[Any, Any]:
    """(Arrow's `take` function, its options without bounds checks), from `pyarrow._compute`."""
    import pyarrow._compute as compute

    return compute.get_function("take"), compute.TakeOptions(boundscheck=False)
