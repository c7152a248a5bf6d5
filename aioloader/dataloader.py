"""The torch-compatible front door: `aioloader.DataLoader`, built on `Loader`.

Switching a training script is one import: `from aioloader import DataLoader`. The same arguments mean
the same things and fail the same way, and for the same dataset, sampler and generator the batches
come in the same order as torch's DataLoader. torch's contract with the dataset holds too: no dataset
object is entered by two threads at once, unless it declares `thread_safe = True`, its `__getitem__`
is a coroutine function, or it is a container in memory (see `_torch/copies.py`). What changes is
how reads that wait are waited for: side by side, each thread on its own copy of the dataset.

What `num_workers` means here: with 0, `for` reads and collates each batch in the consumer's own
thread, as torch does (no pipeline); a dataset that may be shared is read in `concurrency` threads
(default 16), which pays when it waits on disk or network. With N > 0, batch i is read and collated
by worker i % N of N persistent worker processes (aioloader's process pool), with threads of its
own where the reads block (`threads_per_worker`); the batch comes back in shared memory (see
`_torch/workers`), and `torch.utils.data.get_worker_info()` and `worker_init_fn` behave as in
torch's workers. `worker_mode="thread"` keeps threads instead: N of them read at once from the
start, more (up to `concurrency`) while they wait. `worker_mode="auto"`, the default, is processes
on a build with the GIL; on a free-threaded build (the GIL off) it is threads, unless the script
may count on worker processes: an IterableDataset, a `worker_init_fn` or a `multiprocessing_context`
keep processes. An IterableDataset is iterated as torch does it: with N > 0 each worker process
iterates its own replica (shard it with `get_worker_info()`) and makes whole batches of its items,
taken round robin from the workers whose stream goes on; with 0, or in threads, in the main process.

`state_dict()` / `load_state_dict()` keep torchdata's StatefulDataLoader contract: a dataset, its
iterator or a sampler with a state of its own has it saved as of the last batch handed over and
restored where it was taken (`_torch/stateful.py`); `StatefulDataLoader` is this class under
torchdata's name, with its two stricter points.

Async datasets: a map-style dataset whose `__getitem__` is a coroutine function
(`async def __getitem__(self, index)`) is fetched on the loader's event loop, `concurrency` at a time.
"""

from __future__ import annotations

import inspect
import math
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

import torch
from torch.utils.data import (
    Dataset,
    IterableDataset,
    IterDataPipe,
    Sampler,
    graph_settings,
)

from ._arguments import origin
from ._exceptions import StateError, WorkerDied
from ._executors.base import Executor
from ._executors.process.executor import ProcessExecutor
from ._loader import Loader
from ._parts import Parts, Read, executor_kind
from ._pipeline.collate import DEFAULT_COLLATE, BufferPool, make_collate
from ._pipeline.order import Plan
from ._pipeline.transfer import make_device_stage
from ._torch.arguments import (
    check_arguments,
    check_context,
    warn_if_many_workers,
    warn_pin_memory_device,
    worker_mode_of,
)
from ._torch.copies import DatasetCopies, read_in_place, safe_to_share
from ._torch.defaults import collates, samplers
from ._torch.reads import WorkerIds, batch_reader, converting, reads_batches
from ._torch.sampler import SamplerPlan, draw_seed
from ._torch.stateful import (
    OwnItems,
    OwnStates,
    ReadOwn,
    holds_states,
    restore_into,
    stateful,
)
from ._torch.streams import ReadStream, StreamExecutor, WorkerStreams
from ._torch.workers import ReadItem, ReadSamples, RoundRobin, WorkerSetup, check_threads
from ._tuning.memory import AUTO, MemoryBudget

__all__ = ["DataLoader", "StatefulDataLoader"]

T = TypeVar("T")

_DEFAULT_CONCURRENCY = 16
# set after construction, these raise ValueError (as in torch: the plan is made from them)
_FIXED = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


async def _same(item: Any) -> Any:
    return item


def _item(item: Any) -> Any:
    return item


class DataLoader(Loader[T]):
    """A drop-in for `torch.utils.data.DataLoader` whose reads that wait are waited for side by side.

    Takes torch's arguments (see the module docstring for `num_workers`) plus:

    Args:
        concurrency: dataset reads in flight at most (default `max(16, num_workers * prefetch_factor)`);
            with `num_workers > 0` and batches, whole batches in flight (default
            `num_workers * prefetch_factor`, torch's bound).
        threads_per_worker: with `num_workers > 0`, the threads each worker reads a batch's samples
            with, each on its own copy of the dataset (see `_torch/copies.py`). "auto" (the
            default): none until a batch read one by one shows reads that wait while cores sit
            idle, then more while they go on waiting; 1: one read at a time, as torch's workers
            do; k: up to k at once.
        worker_mode: with `num_workers > 0`, "process", "thread" or "auto" (the default: see the
            module docstring); the attribute `worker_mode` says which it resolved to.
        device, device_prefetch: move batches to this device through pinned memory and a side
            stream (see `Loader`); with `pin_memory=True` the copy is staged through pinned buffers.
            Without a device, `pin_memory=True` pins each batch on the host, as torch does, so that
            `batch.to(device, non_blocking=True)` in the loop does not wait for the copy.

    Map-style datasets (with `__getitems__` too), IterableDataset, any Sampler or BatchSampler
    (DistributedSampler included: call its `set_epoch`, or this loader's) and async datasets work.

    Example:
        >>> ds = list(range(10))
        >>> [b.tolist() for b in DataLoader(ds, batch_size=4)]
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    """

    # torch's arguments, kept as given (`_keep`)
    dataset: Dataset[Any]
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    pin_memory_device: str
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    generator: torch.Generator | None
    persistent_workers: bool
    in_order: bool
    # `iter()` waits for the worker processes to start (`StatefulDataLoader`)
    workers_ready_at_iter = False

    def __init__(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | Iterable[Any] | None = None,
        batch_sampler: Sampler[list[Any]] | Iterable[list[Any]] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        concurrency: int | None = None,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        worker_mode: str = "auto",
        threads_per_worker: int | str = "auto",
    ) -> None:
        threads, lazy = check_threads(threads_per_worker, num_workers)
        self._start_method = check_context(multiprocessing_context, num_workers)
        if isinstance(dataset, IterDataPipe) and shuffle is not None:
            dataset = graph_settings.apply_shuffle_settings(dataset, shuffle=shuffle)
            shuffle = None  # the pipe shuffles itself, as in torch
        check_arguments(
            dataset, batch_size, shuffle, sampler, batch_sampler, num_workers, drop_last,
            timeout, prefetch_factor, persistent_workers,
        )  # fmt: skip
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2
        if batch_sampler is not None:
            batch_size, drop_last = None, False
        self._keep(
            dataset=dataset, num_workers=num_workers, prefetch_factor=prefetch_factor,
            pin_memory=pin_memory, pin_memory_device=pin_memory_device, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, persistent_workers=persistent_workers, in_order=in_order,
        )  # fmt: skip
        self._workers: ProcessExecutor | None = None  # the worker processes, if any
        self._inline = False  # `for` reads each batch in its own thread (num_workers=0)
        self._copies: _CopiesAsDataset | None = None  # threads as workers: their dataset copies
        self._worker_setup: WorkerSetup | None = None  # how they are seeded and set up
        if device is None:
            warn_pin_memory_device(pin_memory, pin_memory_device)
        iterable = isinstance(dataset, IterableDataset)
        self.batch_size, self.drop_last = batch_size, drop_last
        self.sampler, self.batch_sampler = samplers(
            dataset, iterable, shuffle, sampler, batch_sampler, batch_size, drop_last, generator
        )
        auto_collation = self.batch_sampler is not None or (iterable and batch_size is not None)
        self.collate_fn, collate_fn = collates(collate_fn, auto_collation)
        self.worker_mode = worker_mode_of(
            worker_mode, dataset, worker_init_fn, multiprocessing_context
        )  # as resolved: "process" or "thread"
        processes = (
            num_workers > 0 and self.worker_mode == "process"
            and not inspect.iscoroutinefunction(dataset.__getitem__)
        )  # fmt: skip
        self._budget = MemoryBudget.of(AUTO)  # its workers' batches are admitted against it
        # the dataset's and sampler's own states, kept with the loader's (`_torch/stateful.py`)
        self._own = OwnStates(num_workers, persistent_workers)
        fetch, decode, executor, plan, auto_collation, concurrency, prefetch = self._wiring(
            processes, iterable, auto_collation, collate_fn, concurrency, threads, lazy
        )
        read = Read(
            fetch, decode, executor, own_executor=True,
            fetch_initializer=WorkerIds(worker_init_fn) if worker_init_fn and not processes
            else None,
            fetch_threads=1 if processes else max(1, num_workers),  # threads for the workers
        )  # fmt: skip
        torch_parts = _TorchParts(
            self,
            plan,
            processes,
            executor,
            concurrency,
            self._workers,
            self._worker_setup,
            self._copies.copies if self._copies is not None else None,
            self._own,
        )
        self.assemble(Parts(
            plan, read, collate=collate_fn if auto_collation and not reads_batches(plan) else None,
            concurrency=concurrency, prefetch=prefetch, in_order=in_order, timeout=timeout or None,
            device=make_device_stage(
                device, pin_memory=pin_memory, device_prefetch=device_prefetch, stacklevel=3
            ),
            batch_errors=True, budget=self._budget, inline=self._inline, begin_at_iter=True,
            hooks=torch_parts, describer=torch_parts, state=torch_parts,
        ))  # fmt: skip
        warn_if_many_workers(num_workers)
        self._initialized = True

    def _keep(self, **arguments: Any) -> None:
        """Keep torch's arguments as the attributes torch's DataLoader has (as given)."""
        for name, value in arguments.items():
            setattr(self, name, value)

    def _wiring(
        self,
        processes: bool,
        iterable: bool,
        auto_collation: bool,
        collate_fn: Callable[..., Any],
        concurrency: int | None,
        threads: int,
        lazy: bool,
    ) -> tuple[Callable[[Any], Any], Callable[[Any], Any] | None, Any, Plan, bool, int, int]:
        """(fetch, decode, executor, plan, auto_collation, concurrency, prefetch): where the dataset
        is read (whole batches or streams in worker processes, items in them, or here)."""
        num_workers, prefetch_factor = self.num_workers, self.prefetch_factor
        given_concurrency = concurrency
        if concurrency is None:
            concurrency = max(_DEFAULT_CONCURRENCY, num_workers * (prefetch_factor or 0))
        decode: Callable[[Any], Any] | None = None
        prefetch = max(2, prefetch_factor or 2)
        executor: str | ProcessExecutor | StreamExecutor | RoundRobin = "inline"
        if processes and iterable:
            fetch, decode, executor, plan = self._streams(collate_fn, auto_collation)
            auto_collation = False  # the workers collate
        elif processes and (auto_collation or stateful(self.dataset)):
            if stateful(self.dataset):  # its own state: read by the worker itself, in turn
                threads, lazy = 1, False
            fetch, decode, executor, plan = self._whole_batches(
                collate_fn, threads, lazy, auto_collation
            )
            auto_collation = False  # the workers collate
            # torch's bound: `prefetch_factor` batches asked of each worker at most
            concurrency = given_concurrency or num_workers * max(1, prefetch_factor or 0)
            prefetch = 1  # batches asked for count those done: torch's bound, not twice it
        else:
            reader: Any = self.dataset
            # torch's main-process reads, in `for`'s own thread where nothing can wait for them:
            # reads that never wait (a list), or that must not overlap (see `_torch/copies.py`);
            # a dataset with a state of its own, and an IterableDataset (whose iterator may be the
            # dataset itself, and may keep one), are read only as `next()` asks, as torch does
            self._inline = (
                num_workers == 0 and not self.timeout
                and (iterable or read_in_place(self.dataset) or stateful(self.dataset))
            )  # fmt: skip
            if not processes and not iterable and stateful(self.dataset):
                # its own state: read whole batches one at a time, on the dataset itself
                plan = SamplerPlan(
                    self.batch_sampler if auto_collation else self.sampler,  # type: ignore[arg-type]
                    False, self.generator, self._own,
                )  # fmt: skip
                plan.read_batches(numbered=True)
                collate = make_collate(None) if collate_fn is DEFAULT_COLLATE else collate_fn
                fetch = ReadOwn(self.dataset, collate, auto_collation, self._own)
                return fetch, None, executor, plan, False, 1, prefetch
            if not processes and not iterable and not safe_to_share(self.dataset):
                if num_workers == 0:  # one at a time (in `async for` too)
                    concurrency = 1
                else:  # threads as workers: each reads its own copy
                    reader = self._copies = _CopiesAsDataset(
                        DatasetCopies(self.dataset, concurrency)
                    )
            fetch, plan = self._plan_for(reader, iterable, auto_collation, collate_fn, concurrency)
            if processes:
                fetch, decode, executor = self._per_item(collate_fn)
        return fetch, decode, executor, plan, auto_collation, concurrency, prefetch

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIXED and self.__dict__.get("_initialized"):
            raise ValueError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized"
            )
        super().__setattr__(name, value)

    def _per_item(
        self, collate_fn: Callable[..., Any]
    ) -> tuple[Callable[[Any], Any], Callable[[Any], Any], ProcessExecutor]:
        """Without auto-collation, read each index in one of `num_workers` processes (then
        `collate_fn`, torch's per-sample convert): the index travels, the sample comes back in
        shared memory."""
        read = ReadItem(self.dataset, collate_fn)
        return _same, read, self._worker_pool(read)

    def _whole_batches(
        self, collate_fn: Callable[..., Any], threads: int, lazy: bool, batched: bool = True
    ) -> tuple[Callable[[Any], Any], Callable[[Any], Any], RoundRobin, Plan]:
        """Whole batches in `num_workers` processes, as torch makes them: batch i's indices go to
        worker i % N, which reads them (in up to `threads` threads) and collates; the batch comes
        back in shared memory (see `_torch/workers`). Unbatched (a dataset with its own state),
        sample i goes to worker i % N, which converts it."""
        plan = SamplerPlan(
            self.batch_sampler if batched else self.sampler,  # type: ignore[arg-type]
            False, self.generator, self._own, readers=self.num_workers,
        )  # fmt: skip
        plan.read_batches(numbered=True)
        collate = None if collate_fn is DEFAULT_COLLATE else collate_fn
        read = ReadSamples(self.dataset, collate, threads, lazy)
        pool = self._worker_pool(read, size_first=True)
        return _same, read, RoundRobin(pool, read, self._own), plan

    def _streams(
        self, collate_fn: Callable[..., Any], auto_collation: bool
    ) -> tuple[Callable[[Any], Any], Callable[[Any], Any], StreamExecutor, Plan]:
        """Iterate an IterableDataset in `num_workers` processes, one replica each, as torch does:
        each worker makes whole batches of its own items; they are taken round robin."""
        collate = None if collate_fn is DEFAULT_COLLATE else collate_fn
        batch_size = self.batch_size if auto_collation else None
        read = ReadStream(self.dataset, batch_size, self.drop_last, collate, uuid.uuid4().hex)
        plan = WorkerStreams(self.num_workers, self._own, self.generator)
        return _same, read, StreamExecutor(self._worker_pool(read, size_first=True), plan), plan

    def _worker_pool(self, read: Callable[[Any], Any], size_first: bool = False) -> ProcessExecutor:
        """The worker processes, seeded and set up as torch's are; their arena as large as a
        Loader's default byte budget (whole batches travel in it). They are forked as torch's are
        (by default, whatever threads run), when the first epoch starts, and inherit `read`
        (the dataset) and the worker_init_fn, which are not pickled."""
        # the base seed is the epoch's draw, set by `_TorchParts.started` before the workers fork
        # (as torch's)
        self._worker_setup = WorkerSetup(self.num_workers, 0, self.worker_init_fn, self.dataset)
        self._workers = ProcessExecutor(
            self.num_workers, start_method=self._start_method,
            worker_init_fn=self._worker_setup,
            arena_bytes=self._budget.arena_bytes(), size_first=size_first, given=(read,),
            fork_like_torch=True,
        )  # fmt: skip
        return self._workers

    def _plan_for(
        self,
        dataset: Any,
        iterable: bool,
        auto_collation: bool,
        collate_fn: Callable[..., Any],
        concurrency: int,
    ) -> tuple[Callable[[Any], Any], Plan]:
        plan: Plan
        if iterable:
            # Items come from the dataset's own iterator, in order; "fetching" one is taking it.
            plan = OwnItems(dataset, self.batch_size, self.drop_last, self._own)
            if not auto_collation:
                return converting(collate_fn), plan
            return (_item if self._inline else _same), plan  # (inline: called, not awaited)
        index_sampler = self.batch_sampler if auto_collation else self.sampler
        getitems = getattr(dataset, "__getitems__", None)
        if auto_collation and getitems:
            # One call per batch, as torch makes it; batches run concurrently.
            plan = SamplerPlan(index_sampler, False, self.generator, self._own)  # type: ignore[arg-type]
            if collate_fn is DEFAULT_COLLATE:  # batches are collated in fetch threads, many at once
                collate_fn = make_collate(
                    BufferPool(per_shape=MemoryBudget.buffers_per_shape(concurrency))
                )
            plan.read_batches()
            return batch_reader(getitems, collate_fn), plan
        plan = SamplerPlan(index_sampler, auto_collation, self.generator, self._own)  # type: ignore[arg-type]
        getitem = dataset.__getitem__
        if auto_collation or inspect.iscoroutinefunction(getitem):
            return getitem, plan
        return converting(collate_fn, getitem), plan


class StatefulDataLoader(DataLoader[T]):
    """`DataLoader` under torchdata's name, for trainers written for torchdata's
    `StatefulDataLoader`: the same arguments, with `snapshot_every_n_steps`, and its contract.

    `DataLoader` keeps that contract already (`state_dict()`/`load_state_dict()`, a dataset's,
    its iterator's and a sampler's own states saved and restored, in worker processes too; see
    `_torch/stateful.py`). Two points are stricter here, as torchdata has them: a state loaded
    into a loader with another `num_workers` is refused (`NumWorkersChanged`, at the next
    `iter()`), where `DataLoader` goes on if the state allows it; and `iter()` waits for the
    worker processes to start, so that a failing `worker_init_fn` raises there.

    Args:
        snapshot_every_n_steps: accepted and kept as given (an int >= 0, or None). The states
            are taken at every batch whatever it says, so that a state saved at any step resumes
            exactly without running batches again; what that costs is one `state_dict()` call of
            the dataset (or sampler) per batch, where it has one.
    """

    workers_ready_at_iter = True

    def __init__(self, *args: Any, snapshot_every_n_steps: int | None = 1, **kwargs: Any) -> None:
        if snapshot_every_n_steps is not None and (
            type(snapshot_every_n_steps) is not int or snapshot_every_n_steps < 0
        ):
            raise ValueError(
                "snapshot_every_n_steps must be an int >= 0 or None, got "
                f"{snapshot_every_n_steps!r}"
            )
        super().__init__(*args, **kwargs)
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._own.strict_workers = True


def _wait_ready(workers: ProcessExecutor) -> None:
    """Block until every worker process started; a failing `worker_init_fn` raises its error."""
    try:
        workers.wait_ready()
    except WorkerDied as exc:
        cause = exc.__cause__
        if isinstance(cause, Exception):
            raise cause from None
        raise


class _CopiesAsDataset:
    """A dataset read through `DatasetCopies`: each thread on its own copy."""

    def __init__(self, copies: DatasetCopies) -> None:
        self.copies = copies
        self.__getitem__ = copies.getitem
        if hasattr(copies.dataset, "__getitems__"):
            self.__getitems__ = copies.getitems

    def __len__(self) -> int:
        return len(self.copies.dataset)


class _TorchParts:
    """What torch's DataLoader does at a Loader's set points: a DataLoader's epoch hooks, describer
    and state codec (see `_parts.py`).

    At an epoch's start its worker processes are forked (or renewed) and seeded, from the
    consumer's thread, as torch's are; each batch handed over is counted for torch's
    IterableDataset length warning; `set_epoch` goes on to a sampler that has one. `len()` counts
    as torch's does, the timeout says what torch's says, the repr shows torch's arguments and a
    state's config the dataset's length, the batching and the samplers.
    """

    workers_argument = "num_workers"

    def __init__(
        self,
        loader: DataLoader[Any],
        plan: Plan,
        processes: bool,
        executor: str | Executor,
        concurrency: int,
        workers: ProcessExecutor | None,
        worker_setup: WorkerSetup | None,
        copies: DatasetCopies | None,
        own: OwnStates,
    ) -> None:
        # the DataLoader's torch attributes, read as they are now (a script may set some after
        # init); through a weak proxy: its parts must not keep it alive (`Loader.__del__` closes it)
        self._torch = cast("DataLoader[Any]", weakref.proxy(loader))
        self._plan, self._processes, self._executor = plan, processes, executor
        self._concurrency = concurrency
        self._workers, self._worker_setup = workers, worker_setup
        self._copies = copies
        self._own = own
        self._len_called: int | None = None  # IterableDataset: len(dataset) when len(self) asked
        self._yielded = 0  # batches handed over this epoch
        self._epochs_started = 0

    # -- epoch hooks -------------------------------------------------------------------------------

    def started(self) -> None:
        # after the plan's groups were taken: a map-style plan draws the epoch's base seed there
        self._yielded = 0
        workers, torch_ = self._workers, self._torch
        if workers is not None:
            # torch's iterator draws a base seed per epoch; its workers seed from it (base + id)
            base_seed = getattr(self._plan, "base_seed", None)
            if base_seed is None:  # an IterableDataset's plan draws nothing: draw as torch does
                base_seed = draw_seed(torch_.generator)
            if isinstance(self._plan, WorkerStreams) and isinstance(torch_.dataset, IterDataPipe):
                self._plan.pipe_seed = draw_seed(torch_.generator)  # torch's shared seed
            # a loaded state: fresh workers, seeded as the saved ones were (the state's own
            # states are theirs as of the last batch handed over; see `_torch/stateful.py`)
            loaded = self._own.loaded
            if loaded and self._own.base_seed is not None:
                base_seed = self._own.base_seed
            fresh = not self._epochs_started or not torch_.persistent_workers or loaded
            if fresh:
                assert self._worker_setup is not None  # made with the workers
                self._worker_setup.base_seed = base_seed
                self._own.base_seed = base_seed
            if self._epochs_started and (not torch_.persistent_workers or loaded):
                workers.renew()  # torch forks them anew each epoch: they see the dataset as it is
            workers.start()  # forked here, from the consumer's thread, as torch's are
            if torch_.workers_ready_at_iter:
                _wait_ready(workers)
        self._own.loaded = False
        if self._copies is not None:  # threads as workers: copies of the dataset as it is now
            self._copies.snapshot()
        self._epochs_started += 1

    def handing_over(self) -> None:
        self._yielded += 1
        if self._len_called is not None and self._yielded > self._len_called:
            workers = (
                " For multiprocessing data-loading, this could be caused by not properly "
                "configuring the IterableDataset replica at each worker (shard it with "
                "torch.utils.data.get_worker_info())."
                if self._torch.num_workers > 0
                else ""
            )
            warnings.warn(
                f"Length of IterableDataset {self._torch.dataset} was reported to be "
                f"{self._len_called} (when accessing len(dataloader)), but {self._yielded} "
                f"samples have been fetched.{workers}",
                stacklevel=3,
            )

    def passed(self, index: int) -> None:
        self._own.passed(index)

    def finished(self) -> None:
        plan = self._plan
        self._own.ended(plan.sampler_state() if isinstance(plan, SamplerPlan) else None)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to a sampler that has `set_epoch` (DistributedSampler)."""
        torch_ = self._torch
        for sampler in (torch_.sampler, getattr(torch_.batch_sampler, "sampler", None)):
            set_sampler_epoch = getattr(sampler, "set_epoch", None)
            if set_sampler_epoch is not None:
                set_sampler_epoch(epoch)
                break

    # -- describer ---------------------------------------------------------------------------------

    def config(self) -> list[str]:
        """What `repr` shows: the arguments that shape the batches and the work, as given (and,
        with workers, `worker_mode` as resolved)."""
        torch_ = self._torch
        mode = [f"worker_mode={torch_.worker_mode!r}"] if torch_.num_workers else []
        return [
            origin(torch_.dataset), f"batch_size={torch_.batch_size}",
            f"sampler={type(torch_.sampler).__name__}", f"num_workers={torch_.num_workers}",
            *mode, f"concurrency={self._concurrency!r}",
        ]  # fmt: skip

    def executor_kind(self) -> str:
        return "process" if self._processes else executor_kind(self._executor)

    def timeout_message(self) -> str:
        return f"DataLoader timed out after {self._torch.timeout} seconds"

    def length(self) -> int:
        length = self._length()
        dataset = self._torch.dataset
        if isinstance(dataset, IterableDataset):
            self._len_called = len(dataset)  # type: ignore[arg-type]
        return length

    def epoch_samples(self) -> int | None:
        try:  # not length(): only the user's asking arms the IterableDataset length warning
            return self._length() * self._plan.group_size
        except TypeError:
            return None

    def _length(self) -> int:
        dataset = self._torch.dataset
        if not isinstance(dataset, IterableDataset):
            return len(self._plan)
        length = len(dataset)  # type: ignore[arg-type]
        batch_size = self._torch.batch_size
        if batch_size is None:
            return length
        return length // batch_size if self._torch.drop_last else math.ceil(length / batch_size)

    # -- state codec -------------------------------------------------------------------------------

    def state_config(self) -> dict[str, Any]:
        torch_ = self._torch
        dataset = torch_.dataset
        dataset_len = len(dataset) if hasattr(dataset, "__len__") else None
        return {
            "dataset_len": dataset_len, "batch_size": torch_.batch_size,
            "drop_last": torch_.drop_last, "sampler": type(torch_.sampler).__name__,
            "batch_sampler": type(torch_.batch_sampler).__name__,
        }  # fmt: skip

    def own_state(self) -> dict[str, Any]:
        return self._own.saved()

    def load_own_state(
        self, state: Mapping[str, Any] | None, elastic: list[Mapping[str, Any]]
    ) -> None:
        if any(holds_states(own) for own in elastic):
            raise StateError(
                "world_size: the saved ranks' datasets or samplers have states of their own, "
                "which cannot be shared out among another number of ranks",
                field="world_size",
            )
        self._own.load(state)
        dataset = self._torch.dataset
        if state and not int(state.get("next", 0)) and not isinstance(dataset, IterableDataset):
            # at an epoch's start the dataset here had its state before the epoch's order was
            # drawn (which may draw from the same generator): loaded now, before the plan's
            restore_into(dataset, state.get("main"))
