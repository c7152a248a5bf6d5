"""Loader: wires the stages from its parts (`_parts.py`) and owns their lifecycle.

Its epochs run in `Epochs` (`_epochs.py`: `for`, `async for`, the loop thread); where each epoch
stands, and its saved state, is kept by `Ledger` (`_resume/resume.py`). Both are the loader's own
collaborators, not its bases.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
import warnings
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from typing import Any, Generic, Self, TypeVar

import numpy as np
import torch

from ._arguments import buffer_pool, executor_named, is_map_style, keyed, origin
from ._epochs import Epochs
from ._executors.base import Executor, ThreadExecutor, stats_of
from ._executors.fetch_in_workers import in_workers
from ._observe.diagnose import Diagnosis, diagnose
from ._observe.progress import with_progress
from ._observe.stats import LoaderStats, NullRecorder, Recorder
from ._observe.trace import ENV_VAR as TRACE_ENV
from ._observe.trace import Trace, env_trace_path
from ._parts import KeyPlanState, LoaderDescriber, Parts, Read
from ._pipeline.beside import Beside, TraceBeside, beside_asked
from ._pipeline.collate import DEFAULT_COLLATE, make_collate
from ._pipeline.fetch import Fetcher
from ._pipeline.inline import InlineRead
from ._pipeline.order import KeyOrder, KeyPlan
from ._pipeline.own_order import OrdersItself, OwnPlan, StreamPlan
from ._pipeline.stages import Stages
from ._pipeline.transfer import make_device_stage
from ._protocol import (
    Bindable,
    HandsOver,
    HasSize,
    HasStats,
    ReadsAhead,
    SaysHowItShuffles,
    SharesItsKeys,
    ShufflesItself,
)
from ._resume.resume import Ledger
from ._resume.state import check_config
from ._torch.copies import never_waits, read_in_place, safe_to_share
from ._tuning.auto import resolve_concurrency, resolve_decoder
from ._tuning.bounds import ErrorPolicy
from ._tuning.memory import AUTO, MemoryBudget
from ._util.loops import is_async_callable
from ._util.ranges import Ranges
from ._util.ranks import resolve_rank
from ._util.validate import check_callable, check_int, check_timeout
from .sources import Source

__all__ = ["DEFAULT_COLLATE", "BesideLoader", "Loader"]

T = TypeVar("T")
logger = logging.getLogger("aioloader")


class Loader(Generic[T]):
    """Fetch, decode and batch samples concurrently; iterate with `for` or `async for`.

    Args:
        keys: a sequence, iterable or async iterable of keys; a `Source` (its keys and its
            `fetch`); or, without `fetch`, a map-style dataset or samples in memory (a list, a
            tuple, an array: keys `range(len(dataset))`, fetched with `dataset[i]`). A dataset is
            read one call at a time, as torch's workers read theirs, unless it declares
            `thread_safe = True` or its `__getitem__` is a coroutine function; with `for`, these
            reads (and samples in memory) run in the consumer's own thread, as its batch is
            asked for, without the pipeline (unless a decode, a device or a timeout is given).
        fetch: key -> raw sample; a coroutine function (runs on the event loop, `concurrency` at a time)
            or a plain function (runs in up to `concurrency` threads, started as they block). Defaults
            to the source's fetch.
        decode: raw -> sample, run by `executor`; None keeps the raw sample.
        decode_with_key: call decode as `decode(key, raw)`, so that what the key says (a label in
            a path such as "cat/001.jpg") reaches it; in every executor, `fetch_in_workers` too.
            With a process executor, decode must pickle (a module-level function); so must keys.
        collate: list of samples -> batch. The default matches torch's default_collate and stacks
            into recycled buffers; None yields the list itself; any other callable is used as given.
        batch_size: samples per batch; None yields samples one by one.
        drop_last: drop a last batch smaller than `batch_size`.
        shuffle, seed: permute the keys per epoch with a generator seeded from (seed, epoch). A
            shard source (`sources.tar_shards`) shuffles itself (by default): with one,
            `shuffle=True` raises ValueError.
        rank, world_size: this process's share of every epoch (default: from an initialised
            torch.distributed process group, else RANK / WORLD_SIZE, else 0 and 1). Every rank
            gets the same number of batches: the epoch is padded by wrapping around, or cut with
            `drop_last`.
        mesh: instead of rank and world_size, the data-parallel part of a DeviceMesh
            (`world_mesh["dp"]`, or `world_mesh["dp_replicate", "dp_shard"]`): its ranks share
            the data; processes that differ only in its other dimensions (tensor, pipeline,
            context parallel) read the same batches in the same order, and save the same state.
        concurrency: fetches in flight at most; "auto" moves it while running, on measured
            throughput, within the byte budget (see `_tuning/auto.py`; `stats().concurrency` shows it).
        prefetch: batches made ready ahead of the consumer. Samples held at most:
            `prefetch * batch_size + concurrency`.
        in_order: deliver batches in key order (True) or whole batches as they complete (False).
        executor: where decode runs: "inline" (on the event loop), "thread", "process" (worker
            processes returning arrays in shared memory), "auto" (the default with a decode: threads
            where the GIL is off, processes where it is on, threads for a decode that cannot be
            pickled; see `auto_executor`), or an object that follows `aioloader.Executor`, such as
            `aioloader.ProcessExecutor(2, timeout=30, max_worker_restarts=3)` (then yours to close).
        workers: decode threads for executor="thread" (default: the usable cores); "auto" uses
            as many of the cores as raise throughput (processes: one per core).
        timeout: seconds to wait for one batch before raising `LoaderTimeout` (None: no limit).
        device: move each batch to this device ("cuda", "cuda:1", a torch.device): pinned staging,
            a copy on a side stream, and a hand-over that makes the consumer's stream wait for it.
            None or "cpu": no transfer stage.
        device_prefetch: batches on the device ahead of the consumer at most.
        memory_format: torch.channels_last to store 4-D tensors so on the device.
        pin_memory: stage through pinned memory (default: when a device is given); True without a
            device pins each batch on the host (where an accelerator is present), as torch does.
        use_caller_loop: for `async for`, run the pipeline in the caller's event loop instead of the
            loader's own loop thread. Cheaper hand-over, but a consumer that blocks its loop (a model
            step that does not await) then stalls fetching; keep the default unless your steps await.
        stats: keep the counters behind `stats()`, `diagnose()` and `trace()` (False: a no-op
            recorder; the counters read zero).
        fetch_in_workers: with executor="process" (or a ProcessExecutor) and an async fetch, each
            worker process fetches its share of the keys on its own event loop and decodes them,
            so fetching scales past one core; order, batching and `concurrency` (in total) stay
            here. See `_executors/fetch_in_workers.py`.
        beside: run the whole pipeline (event loop, fetch, decode, collate) in a process of its
            own beside this one, which maps each finished batch out of shared memory: a training
            step that launches many kernels then keeps its process's GIL (see
            `_pipeline/beside.py`). The device stage stays here. Forked as torch forks its workers:
            the arguments need not pickle. None: `AIOLOADER_BESIDE=1` in the environment says so.

    `repr(loader)` shows what it was made with. See inside: `stats()` (numbers per stage),
    `diagnose()` (the bottleneck, in words), `trace(path)` (a Perfetto/Chrome trace; or set
    AIOLOADER_TRACE=path), `iter(progress=True)`.

    The loader's threads and connections live across epochs until `close()`/`aclose()` or the end of a
    `with`/`async with` block. Each full iteration is one epoch; `set_epoch(n)` picks the next one.

    Example:
        >>> async def fetch(i: int) -> int:
        ...     return i * i
        >>> with Loader(range(6), fetch, batch_size=3, collate=None) as loader:
        ...     [batch for batch in loader]
        [[0, 1, 4], [9, 16, 25]]
    """

    def __init__(
        self,
        keys: Source | Sequence[Any] | Iterable[Any] | AsyncIterable[Any],
        fetch: Callable[[Any], Any] | None = None,
        *,
        decode: Callable[..., Any] | None = None,
        decode_with_key: bool = False,
        collate: Callable[[list[Any]], Any] | None = DEFAULT_COLLATE,
        batch_size: int | None = None,
        drop_last: bool = False,
        shuffle: bool = False,
        seed: int = 0,
        concurrency: int | str = 16,
        prefetch: int = 2,
        in_order: bool = True,
        executor: str | Executor | None = None,
        workers: int | str | None = None,
        timeout: float | None = None,
        use_caller_loop: bool = False,
        stats: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        mesh: Any = None,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        memory_format: torch.memory_format | None = None,
        pin_memory: bool | None = None,
        on_error: str = "raise",
        max_skipped: int | float | None = 0.05,
        max_bytes_in_flight: int | str | None = AUTO,
        fetch_in_workers: bool = False,
        beside: bool | None = None,
    ) -> None:
        source: Source | None = None
        described: str | None = None
        inline = False
        key_list: Sequence[Any] | Iterable[Any] | AsyncIterable[Any]
        if isinstance(keys, Source):
            source, key_list = keys, keys.keys()
            fetch = fetch or keys.fetch
        elif fetch is None and (is_map_style(keys) or never_waits(keys)):
            key_list, fetch = range(len(keys)), keys.__getitem__  # type: ignore[arg-type,index]
            described = origin(keys)  # a dataset, or samples in memory
            # reads one at a time, in `for`'s own thread, unless threads may share the dataset
            # (torch's contract, see `_torch/copies.py`); samples in memory, all the same there
            if not safe_to_share(keys):
                concurrency = 1
            inline = timeout is None and read_in_place(keys)
        else:
            key_list = keys
            owner = getattr(fetch, "__self__", None)
            source = owner if isinstance(owner, Source) else None  # closed with the loader
        if fetch is None:
            raise TypeError("fetch: a fetch function is required unless keys is a Source")
        if shuffle and source is not None and isinstance(source, ShufflesItself) and keys is source:
            how = (source.shuffles_how if isinstance(source, SaysHowItShuffles) else None) or (
                "its shard order every epoch unless shuffle=False, its samples with shuffle_buffer=N"
            )  # a source that says how it shuffles (a mix)
            raise ValueError(
                f"shuffle=True: {source!r} shuffles itself ({how}); leave the Loader's shuffle unset"
            )
        if batch_size is not None:
            check_int("batch_size", batch_size, minimum=1)
        check_int("seed", seed, minimum=0)
        rank, world_size = resolve_rank(rank, world_size, mesh)
        if isinstance(source, Bindable):  # the source shards its own data
            source.bind(rank=rank, world_size=world_size)
            rank, world_size = 0, 1
        order = KeyOrder(
            key_list, shuffle=bool(shuffle), seed=seed, rank=rank, world_size=world_size,
            drop_last=drop_last,
        )  # fmt: skip
        decode = keyed(decode, decode_with_key)
        owned = False
        if fetch_in_workers:
            fetch, decode, executor, owned = in_workers(
                fetch, decode, executor, workers, concurrency, source
            )
        plan = KeyPlan(order, batch_size, drop_last)
        budget = MemoryBudget.of(max_bytes_in_flight)
        if isinstance(source, ReadsAhead):  # e.g. sources.tar_shards: its share of the budget
            source.max_bytes_ahead = budget.read_ahead_bytes
        if keys is source and isinstance(source, OrdersItself):  # e.g. sources.parquet
            plan = OwnPlan(source, batch_size, drop_last, budget.read_ahead_bytes)
        elif keys is source and isinstance(source, SharesItsKeys):  # tar shards, a mix
            plan = StreamPlan(order, source, batch_size, drop_last)
        self.assemble(Parts(
            plan, Read(fetch, decode, executor, workers, own_executor=owned), collate=collate,
            concurrency=concurrency, prefetch=prefetch, in_order=in_order, timeout=timeout,
            use_caller_loop=use_caller_loop, source=source, seed=seed, device=make_device_stage(
                device, pin_memory=pin_memory, device_prefetch=device_prefetch,
                memory_format=memory_format, stacklevel=3,
            ), errors=ErrorPolicy(on_error, max_skipped), budget=budget, stats=stats,
            origin=described or origin(keys, source, fetch), inline=inline and on_error == "raise",
        ))  # fmt: skip

    def __new__(cls, *args: Any, beside: bool | None = None, **kwargs: Any) -> Loader[T]:
        """A `BesideLoader` where `beside` asks for the pipeline in a process of its own, unless
        it is given an executor object: that one's workers belong to this process (a warning
        says so, and the loader runs here)."""
        if cls is Loader and beside_asked(beside):
            executor = kwargs.get("executor")
            if executor is None or isinstance(executor, str):
                return super().__new__(BesideLoader)
            if beside:  # asked in the call, not by the environment
                warnings.warn(
                    f"aioloader: beside=True with executor={executor!r}: an executor object's "
                    "workers belong to this process; the loader runs here. Pass executor as a "
                    'name ("process", "thread", ...) to run it beside.',
                    stacklevel=2,
                )
        return super().__new__(cls)

    def assemble(self, parts: Parts) -> None:
        """Wire the stages from `parts` (the one way parts come into a Loader): `__init__` makes
        them from its arguments; a front door built on `Loader` (`DataLoader`) makes its own and
        calls this instead. Called once, before the loader is used."""
        plan, read = parts.plan, parts.read
        fetch, decode, collate = read.fetch, read.decode, parts.collate
        check_callable("fetch", fetch)
        check_callable("decode", decode, optional=True)
        check_int("prefetch", parts.prefetch, minimum=1)
        budget = parts.budget or MemoryBudget.of(AUTO)
        recorder = Recorder() if parts.stats else NullRecorder()
        concurrency, tuner = resolve_concurrency(
            parts.concurrency, is_async=is_async_callable(fetch), recorder=recorder,
            budget=budget,
            source=parts.source,
        )  # fmt: skip
        executor = executor_named(read.executor, decode)
        self._pool = buffer_pool(collate, budget, budget.waiting_batches(
            parts.prefetch, plan.group_size, concurrency
        ))  # fmt: skip
        if self._pool is not None:
            collate = make_collate(self._pool)
        check_callable("collate", collate, optional=True)
        self._plan = plan
        pool_bytes = self._pool.max_bytes or 0 if self._pool is not None else 0
        self._stages = Stages(
            fetch=Fetcher(fetch, concurrency, read.fetch_initializer, now=(
                parts.source.fetch_now
                if isinstance(parts.source, HandsOver) and fetch == parts.source.fetch else None
            ), threads=read.fetch_threads),
            size_of=parts.source.size if isinstance(parts.source, HasSize) else None,
            decode=decode,
            decoder=resolve_decoder(executor, read.workers, budget.arena_bytes(pool_bytes))
            if isinstance(executor, str)
            else executor,
            collate=collate, collator=ThreadExecutor(1, "aioloader-collate"),
            concurrency=concurrency, prefetch=parts.prefetch, in_order=bool(parts.in_order),
            group_size=plan.group_size, seed=parts.seed, recorder=recorder, tuner=tuner,
            errors=parts.errors or ErrorPolicy(), batch_errors=parts.batch_errors, budget=budget,
            pool_bytes=pool_bytes,
        )  # fmt: skip
        if self._stages.rows is not None and self._pool is not None:
            self._stages.rows.on_first_buffer = self._pool.retire  # rows replace its buffers
        self._owns_decoder = isinstance(executor, str) or read.own_executor
        in_order = bool(parts.in_order)
        timeout = check_timeout("timeout", parts.timeout)
        self._describer = parts.describer or LoaderDescriber(
            parts.origin, plan, self._stages, parts.concurrency, executor, timeout
        )
        self._hooks, self._state = parts.hooks, parts.state or KeyPlanState(plan)
        self._ledger = Ledger(plan, in_order)
        self._trace: Trace | None = None
        inline = None
        if parts.inline and parts.device is None and decode is None:
            inline = InlineRead(fetch, collate)
        self._epochs = Epochs(
            self._stages, self._ledger, self._hooks, self._describer, source=parts.source,
            device=parts.device, timeout=timeout, use_caller_loop=parts.use_caller_loop,
            inline=inline, begin_at_iter=parts.begin_at_iter,
        )  # fmt: skip
        traced = env_trace_path()
        if traced is not None and parts.stats:
            self.trace(traced)

    def __repr__(self) -> str:
        """The configuration: source (or keys and fetch), decode, batching, concurrency, executor."""
        try:
            parts, closed = self._describer.config(), self._epochs.closed
        except AttributeError:  # a loader whose construction failed
            return f"<{type(self).__name__}, not set up>"
        if closed:
            parts.append("closed")
        return f"{type(self).__name__}({', '.join(parts)})"

    # -- epochs ------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[T]:
        return self._epochs.iter(self)

    def __aiter__(self) -> AsyncIterator[T]:
        return self._epochs.aiter(self)

    def __len__(self) -> int:
        """Batches per epoch (samples when unbatched); TypeError when the keys have no length."""
        return self._describer.length()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will run."""
        return self._ledger.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch` (which decides its shuffle)."""
        check_int("epoch", epoch, minimum=0)
        self._ledger.set_epoch(epoch)
        self._hooks.set_epoch(epoch)

    # -- closing -----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._epochs.closed

    def close(self) -> None:
        """Stop every epoch, thread and connection of this loader. Idempotent; blocks up to ~2 s."""
        if self._epochs.closed:
            return
        self._epochs.close()  # closed: its epochs cancelled, its loop thread and source stopped
        self._stages.fetch.close()
        if self._owns_decoder:  # an Executor the user passed is theirs to close
            self._stages.decoder.close()
        self._stages.collator.close()
        if self._epochs.device is not None:
            self._epochs.device.close()
        if self._pool is not None:
            self._pool.clear()
        if self._trace is not None:
            try:
                self._trace.close()
            except OSError:
                logger.exception("aioloader: could not write the trace %s", self._trace.path)

    async def aclose(self) -> None:
        """`close()` without blocking the caller's event loop. Idempotent."""
        if self._epochs.closed:
            return
        here = asyncio.get_running_loop()
        await self._epochs.close_here(here)
        done: asyncio.Future[None] = here.create_future()

        def close_then_wake() -> None:
            try:
                self.close()
            finally:
                with contextlib.suppress(RuntimeError):
                    here.call_soon_threadsafe(_wake, done)

        threading.Thread(target=close_then_wake, name="aioloader-close").start()
        await done

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        epochs = getattr(self, "_epochs", None)  # None: a half-built loader, nothing to close
        if epochs is not None and not epochs.closed:
            try:  # noqa: SIM105 - at interpreter exit `contextlib` may already be gone
                self.close()
            except Exception:  # a finalizer must not raise
                pass

    # -- exact resume ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands: the epoch and what of it was delivered (small, JSON-ready).

        Safe to call at any step, from the consumer's thread or task; see `_resume/state.py` for the rule.
        """
        return self._ledger.state_dict(
            type(self).__name__, self._state.state_config, self._state.own_state()
        )

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from a saved state (or from every rank's states, for another world size).

        The next iteration continues the saved epoch. Raises StateError naming the field when a
        state does not fit this loader.
        """
        self._ledger.load_state_dict(
            state, type(self).__name__, self._state.state_config, self._state.load_own_state
        )

    # -- composing loaders: what a mix (`_mix/`) asks of the loaders it interleaves -----------------
    # Public and stable: a mix resumes each of its loaders at its own epoch, and on another world
    # size shares out what every old rank of each loader delivered (`_mix/elastic.py`).

    def start_epoch_afresh(self, epoch: int) -> None:
        """`set_epoch(epoch)`, the iteration from the epoch's start even where a loaded state
        pointed into it (a mix starting its next epoch, its loaders' states taken mid-way)."""
        self.set_epoch(epoch)
        self._ledger.set_epoch(epoch, afresh=True)

    def place(self) -> tuple[int, int]:
        """(rank, world size) of this loader's share, as its state records them."""
        return self._plan.rank_and_world()

    def check_state(self, state: Mapping[str, Any]) -> None:
        """StateError naming the field where `state` (of any rank) does not fit this loader."""
        check_config(state, type(self).__name__, self._state.state_config())

    def indices(
        self, epoch: int, rank: int, world_size: int, consumed: Ranges,
        groups: Iterable[int] | None,
    ) -> np.ndarray:  # fmt: skip
        """The permutation indices of `epoch` (less `consumed`) that rank `rank` of `world_size`
        is dealt in its `groups` (None: all of them); see `Ledger.indices`."""
        return self._ledger.indices(epoch, rank, world_size, consumed, groups)

    def resume_at(self, epoch: int, consumed: Ranges) -> None:
        """`set_epoch(epoch)`, the epoch without the permutation indices in `consumed`: what a
        mix counted delivered by every old rank, the rest shared among this loader's ranks."""
        self.set_epoch(epoch)
        self._ledger.resume_at(epoch, consumed)

    # -- what it is doing ---------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """A snapshot of every stage since the loader started: rates, latencies, occupancy, skips.

        Cheap (no lock, no wait); safe from any thread. See `LoaderStats`.
        """
        return self._stages.snapshot(self._extra_stats())

    def diagnose(self) -> Diagnosis:
        """Which stage sets the pace, in plain words, with the numbers that say so.

        Reads `stats()`: cheap, safe from any thread, most telling after a few batches. Example:
        `print(loader.diagnose())`; `loader.diagnose().bottleneck` is one of "fetch", "decode",
        "collate", "transfer", "consumer" (the model is slower than the loader) or "loop".
        """
        return diagnose(
            self.stats(),
            executor=self._describer.executor_kind(),
            workers_argument=self._describer.workers_argument,
        )

    def trace(self, path: str | os.PathLike[str]) -> Trace:
        """Record every fetch, decode, collate, transfer and consumer wait into a trace at `path`.

        Returns the `Trace`: `with loader.trace("t.json"): ...` writes the file at the end of the
        block; otherwise it is written at `close()` (or by `Trace.write()`). The file opens in
        https://ui.perfetto.dev or chrome://tracing. A trace started before ends (and is written).
        Scripts you cannot edit: set AIOLOADER_TRACE=path in the environment.
        """
        if isinstance(self._stages.recorder, NullRecorder):
            raise ValueError("trace() needs the loader's stats: create it with stats=True")
        if self._trace is not None:
            self._trace.close()
        self._trace = Trace(path, self._stages.recorder)
        return self._trace

    def iter(self, *, progress: bool = False) -> Iterator[T]:
        """`iter(loader)`, with a live progress line on stderr when `progress` (needs tqdm):
        batches/s, samples/s, MB/s fetched and the share of time the consumer waited for data.

        Example: `for batch in loader.iter(progress=True): ...`. Raises ImportError (with the
        install hint) when tqdm is missing: pip install 'aioloader[profile]'.
        """
        return with_progress(self, iter(self)) if progress else iter(self)

    def _extra_stats(self) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        source = self._epochs.source
        if isinstance(source, HasStats) and callable(source.stats):
            extra.update(source.stats())
        pool_stats = stats_of(self._stages.decoder)
        if pool_stats is not None:
            extra["decode_pool"] = pool_stats
        if self._epochs.device is not None:
            extra["transfer"] = self._epochs.device.stats()
        if self._epochs.inline is not None:
            extra["inline_reads"] = self._epochs.inline.stats()
        return extra


def _wake(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def _made_beside(*args: Any, **kwargs: Any) -> Loader[Any]:
    """(In the worker beside the trainer.) The loader, made in-process there; the trainer's
    `BesideLoader` traces it when AIOLOADER_TRACE says so (it numbers its process's loaders)."""
    os.environ.pop(TRACE_ENV, None)
    return Loader(*args, beside=False, **kwargs)


class BesideLoader(Loader[T]):
    """`Loader(..., beside=True)`: the same loader, built and run in a process of its own beside the
    training process (`_pipeline/beside.py`); every method answers as the in-process loader's does.

    What the training process does per batch: wait for the worker's answer and map the batch out
    of shared memory (and, with a device, hand it over from the transfer thread). `state_dict()` is
    as of the last batch handed over, whatever the worker made ahead. A worker that dies fails the
    batch with `WorkerDied`; the next iteration goes on from the last batch handed over, in a new
    worker.
    """

    def __init__(
        self,
        keys: Any,
        fetch: Callable[[Any], Any] | None = None,
        *,
        beside: bool | None = True,
        prefetch: int = 2,
        timeout: float | None = None,
        device: str | torch.device | None = None,
        device_prefetch: int = 2,
        memory_format: torch.memory_format | None = None,
        pin_memory: bool | None = None,
        use_caller_loop: bool = False,
        **kwargs: Any,
    ) -> None:
        check_int("prefetch", prefetch, minimum=1)
        if kwargs.get("mesh") is not None:  # its place, read here (the worker's copy of the
            mesh = kwargs.pop("mesh")  # process group is not to be used)
            kwargs["rank"], kwargs["world_size"] = resolve_rank(
                kwargs.pop("rank", None), kwargs.pop("world_size", None), mesh
            )
        recipe = functools.partial(
            _made_beside, keys, fetch, prefetch=prefetch, timeout=timeout, **kwargs
        )  # fmt: skip
        stage = make_device_stage(
            device, pin_memory=pin_memory, device_prefetch=device_prefetch,
            memory_format=memory_format, stacklevel=4,
        )  # fmt: skip
        self._beside = Beside(
            recipe, ahead=max(prefetch, 2), timeout=check_timeout("timeout", timeout), device=stage
        )  # fmt: skip
        self._traced: TraceBeside | None = None
        traced = env_trace_path()  # numbered here, among this process's loaders
        if traced is not None and kwargs.get("stats", True):
            self.trace(traced)

    def __repr__(self) -> str:
        if self._beside.closed:
            return "Loader(beside=True, closed)"
        shown: str = self._beside.ask("__repr__")
        return shown[:-1] + ", beside=True)"

    def __iter__(self) -> Iterator[T]:
        return self._beside.iter(self)

    def __aiter__(self) -> AsyncIterator[T]:
        return self._beside.aiter(self)

    def __len__(self) -> int:
        length: int = self._beside.ask("__len__")
        return length

    @property
    def epoch(self) -> int:
        epoch: int = self._beside.ask("epoch")
        return epoch

    def set_epoch(self, epoch: int) -> None:
        check_int("epoch", epoch, minimum=0)
        self._beside.ask("set_epoch", epoch)

    @property
    def closed(self) -> bool:
        return self._beside.closed

    def close(self) -> None:
        self._beside.close()  # the worker's loader writes its trace as it closes
        if self._traced is not None:
            self._traced.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __del__(self) -> None:
        beside = getattr(self, "_beside", None)
        if beside is not None and not beside.closed:
            try:  # noqa: SIM105 - at interpreter exit `contextlib` may already be gone
                beside.close()
            except Exception:  # a finalizer must not raise
                pass

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self._beside.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        self._beside.ask("load_state_dict", state)

    def start_epoch_afresh(self, epoch: int) -> None:
        self._beside.ask("start_epoch_afresh", epoch)

    def place(self) -> tuple[int, int]:
        place: tuple[int, int] = self._beside.ask("place")
        return place

    def check_state(self, state: Mapping[str, Any]) -> None:
        self._beside.ask("check_state", state)

    def indices(
        self, epoch: int, rank: int, world_size: int, consumed: Ranges,
        groups: Iterable[int] | None,
    ) -> np.ndarray:  # fmt: skip
        chosen: np.ndarray = self._beside.ask(
            "indices", epoch, rank, world_size, consumed, None if groups is None else list(groups)
        )
        return chosen

    def resume_at(self, epoch: int, consumed: Ranges) -> None:
        self._beside.ask("resume_at", epoch, consumed)

    def stats(self) -> LoaderStats:
        """The worker's `stats()`, with this process's side in `extra["beside"]` (`Beside.stats`:
        batches handed over, the time the trainer waited for them, the worker's pid, ...)."""
        stats: LoaderStats = self._beside.ask("stats")
        stats.ready_batches += self._beside.waiting()  # made ahead, waiting in this process
        stats.extra["beside"] = self._beside.stats()
        if self._beside.device is not None:
            stats.extra["transfer"] = self._beside.device.stats()
        return stats

    def diagnose(self) -> Diagnosis:
        diagnosis: Diagnosis = self._beside.ask("diagnose")
        return diagnosis

    def trace(self, path: str | os.PathLike[str]) -> TraceBeside:  # type: ignore[override]
        if self._traced is not None:
            self._traced.close()  # as in-process: a trace started before ends, and is written
        self._traced = TraceBeside(self._beside, path)
        return self._traced
