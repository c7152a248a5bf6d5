"""The DataLoader's argument checks: torch's errors for torch's mistakes, warnings where torch warns."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings
from multiprocessing.context import BaseContext
from typing import Any

from torch.utils.data import IterableDataset

from .._util.threads import gil_enabled

__all__ = [
    "WORKER_MODES", "check_arguments", "check_context", "warn_if_many_workers",
    "warn_pin_memory_device", "worker_mode_of",
]  # fmt: skip

WORKER_MODES = ("auto", "process", "thread")


def check_arguments(
    dataset: Any, batch_size: int | None, shuffle: bool | None, sampler: Any,
    batch_sampler: Any, num_workers: int, drop_last: bool, timeout: float,
    prefetch_factor: int | None, persistent_workers: bool,
) -> None:  # fmt: skip
    """Raise the errors torch's DataLoader raises, with its words."""
    if num_workers < 0:
        raise ValueError(
            "num_workers option should be non-negative; use num_workers=0 to disable multiprocessing."
        )
    if timeout < 0:
        raise ValueError("timeout option should be non-negative")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if isinstance(dataset, IterableDataset):
        if shuffle not in {False, None}:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified shuffle option, "
                f"but got shuffle={shuffle}"
            )
        if sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified sampler option, "
                f"but got sampler={sampler}"
            )
        if batch_sampler is not None:
            raise ValueError(
                "DataLoader with IterableDataset: expected unspecified batch_sampler option, "
                f"but got batch_sampler={batch_sampler}"
            )
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None:
        if batch_size != 1 or shuffle or sampler is not None or drop_last:
            raise ValueError(
                "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, "
                "and drop_last"
            )
    elif batch_size is None and drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )


def warn_pin_memory_device(pin_memory: bool, pin_memory_device: str) -> None:
    """torch's warning for `pin_memory_device` (the one for no accelerator: `make_device_stage`)."""
    if pin_memory and pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the "
            f"device, ignore pin_memory_device='{pin_memory_device}'.",
            stacklevel=3,
        )


def warn_if_many_workers(num_workers: int) -> None:
    """torch's warning when a loader makes more workers than this process may use CPUs."""
    if num_workers <= 0:
        return
    affinity = getattr(os, "sched_getaffinity", None)
    cpus = len(affinity(0)) if affinity is not None else os.cpu_count()
    if cpus is None or num_workers > cpus:
        known = (
            f"Our suggested max number of worker in current system is {cpus}"
            f"{'' if affinity is not None else ' (`cpuset` is not taken into account)'}, "
            "which is smaller than what this DataLoader is going to create."
            if cpus is not None
            else "DataLoader is not able to compute a suggested max number of worker in "
            "current system."
        )
        warnings.warn(
            f"This DataLoader will create {num_workers} worker processes in total. {known} "
            "Please be aware that excessive worker creation might get DataLoader running slow "
            "or even freeze, lower the worker number to avoid potential slowness/freeze if "
            "necessary.",
            stacklevel=3,
        )


def check_context(context: Any, num_workers: int) -> str | None:
    """The start method `multiprocessing_context` names (None: the default), checked as torch's."""
    if context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading "
            f"(num_workers > 0), but got num_workers={num_workers}"
        )
    if isinstance(context, str):
        valid = mp.get_all_start_methods()
        if context not in valid:
            raise ValueError(
                f"multiprocessing_context option should specify a valid start method in "
                f"{valid!r}, but got multiprocessing_context={context!r}"
            )
        return context
    if not isinstance(context, BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string "
            f"specifying the start method, but got multiprocessing_context={context!r}"
        )
    return str(context.get_start_method())


def worker_mode_of(
    worker_mode: Any, dataset: Any, worker_init_fn: Any, multiprocessing_context: Any
) -> str:
    """Where `num_workers > 0` reads: "process" or "thread". "auto" is "process" on a build with
    the GIL, and on a free-threaded one wherever the script may count on worker processes (an
    IterableDataset, which each worker iterates a replica of, sharding it by `get_worker_info()`; a
    `worker_init_fn`, which sets up each worker by its id; a `multiprocessing_context` given);
    else "thread": with the GIL off, threads run `__getitem__` on every core without copies,
    pickling or the workers' memory."""
    if worker_mode not in WORKER_MODES:
        raise ValueError(
            f"worker_mode: expected one of {', '.join(map(repr, WORKER_MODES))}, got {worker_mode!r}"
        )
    if worker_mode != "auto":
        return str(worker_mode)
    per_process = (
        isinstance(dataset, IterableDataset)
        or worker_init_fn is not None
        or multiprocessing_context is not None
    )
    return "process" if per_process or gil_enabled() else "thread"
