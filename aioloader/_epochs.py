"""A loader's epochs: open one, iterate it (`for` and `async for`), close it; stop them all.

`Epochs`, which a `Loader` owns, is the consumer's side of the pipeline. What the consumer does with
each batch that comes over (the clock on its wait, the epoch's progress, the hooks, the device
stage's hand-over) is one step, `_Consumer`, with no waiting in it; two drivers wait for the batches
and feed it: `for batch in loader` waits on the loop thread's futures, `async for` awaits them (or
runs the epoch in the caller's loop with `use_caller_loop`). A batch that failed (`BatchFailed`) is
raised from `next()` in its place.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
)
from typing import Any, TypeVar

from ._exceptions import LoaderClosedError, LoaderTimeout
from ._observe.stats import Recorder
from ._parts import Describer, EpochHooks
from ._pipeline.epoch import Epoch, Unraised
from ._pipeline.feed import BatchStage, Feed
from ._pipeline.inline import InlineRead
from ._pipeline.loop_thread import STOP_TIMEOUT_S, LoopThread
from ._pipeline.order import Group
from ._pipeline.stages import END, SKIPPED, BatchFailed, Stages
from ._protocol import HasSetEpoch
from ._resume.resume import Ledger
from ._resume.state import Progress
from .sources import Source

__all__ = ["Epochs", "timeout_error"]

T = TypeVar("T")


_TOGETHER = 64  # the most batches one call on the loop hands a consumer in another thread


class Epochs:
    """A loader's epochs: open, iterate and close them; stop them all, with their loop thread and
    the source, when the loader closes (`close()`; the loader closes its stages after)."""

    def __init__(
        self,
        stages: Stages,
        ledger: Ledger,
        hooks: EpochHooks,
        describer: Describer,
        *,
        source: Source | None,
        device: BatchStage | None,
        timeout: float | None,
        use_caller_loop: bool,
        inline: InlineRead | None = None,
        begin_at_iter: bool = False,
    ) -> None:
        self._stages, self._ledger, self._hooks, self._describer = stages, ledger, hooks, describer
        self.inline = inline  # `for` makes each batch in the consumer's thread (see `_inline`)
        self._begin_at_iter = begin_at_iter  # `iter()` begins the epoch, not the first `next()`
        self.source = source  # told each epoch; closed here (None once closed in the caller's loop)
        self.device = device
        self._timeout = timeout
        self._use_caller_loop = use_caller_loop
        self._loop_thread: LoopThread | None = None
        self.live: set[Epoch | Feed] = set()  # the epochs running
        self._lock = threading.Lock()
        self.closed = False

    def _start(self) -> tuple[Progress, Iterable[Group] | AsyncIterable[Group]]:
        if self.closed:
            raise LoaderClosedError("this loader was closed; create a new one")
        progress, groups = self._ledger.begin()
        if isinstance(self.source, HasSetEpoch):
            self.source.set_epoch(progress.epoch)
        self._hooks.started()
        return progress, groups

    async def _open(
        self, groups: Iterable[Group] | AsyncIterable[Group], epoch: int
    ) -> Epoch | Feed:
        run: Epoch | Feed = Epoch(self._stages, groups, epoch, self._describer.epoch_samples())
        if self.device is not None:
            # staged on the device ahead of the consumer
            run = self.device.feed(run, self._stages.recorder)
        self.live.add(run)
        return run

    def _consumer(self, progress: Progress, gone: Callable[[int, int, bool], None]) -> _Consumer:
        """The consumer's step for the epoch `progress` began (`gone`: see `_Consumer`)."""
        recorder, ledger, hooks = self._stages.recorder, self._ledger, self._hooks
        return _Consumer(recorder, ledger, hooks, self.device, progress, gone)

    def _timed_out(self, run: Epoch | Feed) -> LoaderTimeout:
        return timeout_error(self._describer.timeout_message(), run)

    async def _close_epoch(self, run: Epoch | Feed) -> None:
        self.live.discard(run)
        await run.aclose()

    def _runner(self) -> LoopThread:
        with self._lock:
            if self._loop_thread is None:
                self._loop_thread = LoopThread()
            return self._loop_thread

    def iter(self, owner: object) -> Iterator[Any]:
        """The next epoch's batches, for `for`. The epoch's generator holds `owner` (the loader):
        `for batch in Loader(...)` holds nothing else of it, and a loader that is dropped is closed
        (its `__del__`); dropping the iterator ends the epoch first, then lets the loader go."""
        begun = self._start() if self._begin_at_iter else None
        if self.inline is not None:
            return _Batches(self._inline(owner, self.inline, begun))
        return _Batches(self._iter(owner, begun))

    def _inline(
        self, owner: object, read: InlineRead, begun: tuple[Progress, Any] | None
    ) -> Generator[Any, None, None]:
        """`_iter` without the pipeline: each batch read and collated here, when `next()` asks
        for it, as torch's main-process loading makes it (`owner`: see `iter`; `begun`: the
        epoch as `iter()` began it, else None)."""
        progress, groups = begun or self._start()
        rec, batch_errors = self._stages.recorder, self._stages.batch_errors
        if not isinstance(groups, Iterable):
            raise TypeError("an inline epoch needs groups it can iterate without an event loop")
        consumer = self._consumer(progress, _never)
        for group in groups:
            if self.closed:
                raise LoaderClosedError("the loader was closed")
            consumer.turn()  # (the wait is the read)
            try:
                batch = read(group)
            except Exception as exc:
                if not batch_errors:
                    raise
                batch = BatchFailed(exc)
            else:
                rec.batches += 1
                rec.samples += len(group.items)
            handed = consumer.take(group.index, batch)
            del batch  # not held here while the consumer has it: its buffers can be reused
            if handed:
                yield handed.pop()  # a BatchFailed is raised by `_Batches`
        consumer.turn()
        consumer.take(-1, END)

    def _iter(
        self, owner: object, begun: tuple[Progress, Any] | None
    ) -> Generator[Any, None, None]:  # `owner`, `begun`: see `iter`, `_inline`
        progress, groups = begun or self._start()
        runner = self._runner()
        run = runner.run(self._open(groups, progress.epoch))
        # the batches waiting come over together, in one call on the loop; each lets go of its
        # places as it is handed over (see `Epoch.ready_many`)
        ready: Callable[[], Any] = run.ready
        gone: Callable[[int, int, bool], None] = _never
        if isinstance(run, Epoch):  # (a device stage's batches come one at a time)
            ready, gone = functools.partial(run.ready_many, _TOGETHER), _handed_on(runner, run)
        consumer = self._consumer(progress, gone)
        try:
            while True:
                if self.closed:  # (also with batches that came over: none is handed after close)
                    raise LoaderClosedError("the loader was closed")
                if consumer.turn():
                    consumer.came_over(self._wait(runner, run, ready))
                handed = consumer.next()
                if handed is None:
                    return
                if handed:
                    yield handed.pop()  # a BatchFailed is raised by `_Batches`
        finally:
            consumer.drop()  # come over, never handed: dropped with the epoch
            if runner.alive and not runner.in_loop_thread():
                with contextlib.suppress(TimeoutError, LoaderClosedError):  # closed meanwhile
                    runner.run(self._close_epoch(run), STOP_TIMEOUT_S)
            else:
                self.live.discard(run)
                runner.call_soon(run.cancel)

    def _wait(self, runner: LoopThread, run: Epoch | Feed, ready: Callable[[], Any]) -> Any:
        """`for`'s wait: the next batch, or those waiting (see `_Consumer.came_over`), from the
        loop thread; `LoaderTimeout` after the loader's timeout."""
        try:
            return runner.run(run.get(), self._timeout, ready)
        except LoaderTimeout:
            raise self._timed_out(run) from None
        except concurrent.futures.CancelledError:
            if self.closed:  # close() from elsewhere won the race with this wait
                raise LoaderClosedError("the loader was closed") from None
            raise

    def aiter(self, owner: object) -> AsyncIterator[Any]:
        """The next epoch's batches, for `async for`; its generator holds `owner` (see `iter`)."""
        return _AsyncBatches(self._aiter(owner))

    async def _aiter(self, owner: object) -> AsyncGenerator[Any, None]:  # `owner`: see `iter`
        progress, groups = self._start()
        get: Callable[[], Awaitable[list[Any]]]
        gone: Callable[[int, int, bool], None]
        if self._use_caller_loop:
            run = await self._open(groups, progress.epoch)
            get, gone = functools.partial(_boxed, run.get), _never
            close = functools.partial(self._close_epoch, run)
        else:
            runner = self._runner()
            run = await asyncio.wrap_future(runner.submit(self._open(groups, progress.epoch)))
            get, gone = _from_thread(runner, run)
            close = functools.partial(self._close_in_thread, runner, run)
        consumer = self._consumer(progress, gone)
        try:
            while True:
                if self.closed:  # (also with batches that came over: none is handed after close)
                    raise LoaderClosedError("the loader was closed")
                if consumer.turn():
                    consumer.came_over(await self._await(get, run))
                handed = consumer.next()
                if handed is None:
                    return
                if handed:
                    yield handed.pop()  # a BatchFailed is raised by `_AsyncBatches`
        finally:
            consumer.drop()  # come over, never handed: dropped with the epoch
            await close()

    async def _await(self, get: Callable[[], Awaitable[list[Any]]], run: Epoch | Feed) -> list[Any]:
        """`async for`'s wait: `get()`, the next batches in a list (see `_boxed`, `_many`);
        `LoaderTimeout` after the loader's timeout."""
        try:
            async with asyncio.timeout(self._timeout) as deadline:
                return await get()
        except TimeoutError:
            if not deadline.expired():
                raise  # the pipeline's own, from a user callable
            raise self._timed_out(run) from None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.closed and task is not None and not task.cancelling():
                raise LoaderClosedError("the loader was closed") from None
            raise

    async def _close_in_thread(self, runner: LoopThread, run: Epoch | Feed) -> None:
        if runner.alive:
            with contextlib.suppress(LoaderClosedError):  # the loader was closed meanwhile
                await asyncio.wrap_future(runner.submit(self._close_epoch(run)))

    def close(self) -> None:
        """Stop every epoch and the loop thread; close the source (on that thread when it runs)."""
        self.closed = True
        runner, self._loop_thread = self._loop_thread, None
        for run in list(self.live):
            run.loop.call_soon_threadsafe(run.cancel)
        self.live.clear()
        if runner is not None and runner.alive and not runner.in_loop_thread():
            if self.source is not None:
                with contextlib.suppress(Exception):
                    runner.run(self.source.aclose(), STOP_TIMEOUT_S)
            runner.stop()
        elif self.source is not None and not _loop_running():
            with contextlib.suppress(Exception):
                asyncio.run(self.source.aclose())

    async def close_here(self, here: asyncio.AbstractEventLoop) -> None:
        """The first part of the loader's `aclose()`, in the caller's loop `here`: close the epochs
        that run in it, and the source when its connections live there (`use_caller_loop`)."""
        for run in [r for r in self.live if r.loop is here]:
            await self._close_epoch(run)
        if self._use_caller_loop and self.source is not None and self._loop_thread is None:
            await self.source.aclose()
            self.source = None


class _Consumer:
    """The consumer's step of one epoch, for `for` and `async for` alike, with no waiting in it:
    its driver starts a `turn()`, waits for batches when it says so and gives them here
    (`came_over`), then hands over what `next()` returns (None: the epoch ended).

    What comes over is `(index, batch)`, or `(index, batch, samples, held_bytes)` for a batch
    whose places in the epoch go by `gone(samples, held_bytes, made)` as it is handed over, or an
    `Unraised` error (raised by `next()`); several at once where the loop hands over those waiting.
    """

    __slots__ = ("_came", "_device", "_gone", "_hooks", "_ledger", "_progress", "_recorder", "_t0")

    def __init__(
        self, recorder: Recorder, ledger: Ledger, hooks: EpochHooks, device: BatchStage | None,
        progress: Progress, gone: Callable[[int, int, bool], None],
    ) -> None:  # fmt: skip
        self._recorder, self._ledger, self._hooks, self._device = recorder, ledger, hooks, device
        self._progress = progress
        self._gone = gone
        self._came: collections.deque[Any] = collections.deque()
        self._t0 = 0.0

    def turn(self) -> bool:
        """A turn begins: the wait for the next batch is timed from now. True when none has come
        over: the driver waits for more and gives them to `came_over`."""
        self._t0 = time.perf_counter()
        return not self._came

    def came_over(self, got: Any) -> None:
        """What the driver's wait gave: one entry, or a list of them (emptied here: the future that
        gave it may outlive the hand-over)."""
        if type(got) is list:
            self._came.extend(got)
            got.clear()
        else:
            self._came.append(got)

    def next(self) -> list[Any] | None:
        """The next of the batches that came over, as `take` hands it over."""
        entry = self._came.popleft()
        if type(entry) is Unraised:
            raise entry.error
        if len(entry) == 2:
            return self.take(*entry)
        index, batch, samples, held_bytes = entry
        del entry
        self._gone(samples, held_bytes, batch is not SKIPPED)
        return self.take(index, batch)

    def take(self, index: int, batch: Any) -> list[Any] | None:
        """The step, once batch `index` came (`END`: the epoch's end): None at the end, else what
        to hand over (nothing for a batch whose samples were all skipped)."""
        self._recorder.waited(self._t0, time.perf_counter())
        if batch is END:
            self._ledger.finished(self._progress)
            self._hooks.finished()
            return None
        self._progress.delivered.add(index)
        self._hooks.passed(index)
        if batch is SKIPPED:
            return []
        self._hooks.handing_over()
        if self._device is None or type(batch) is BatchFailed:
            return [batch]
        return [self._device.hand_over(batch)]  # the consumer's stream waits for its copy

    def drop(self) -> None:
        """Let go of what came over and was never handed over (the epoch ends early)."""
        self._came.clear()


class _Batches(Iterator[T]):
    """`iter(loader)`: the epoch's batches; a batch that failed (`BatchFailed`, torch's DataLoader's
    semantics) raises its error from `next()`, and the next `next()` goes on with the next batch.
    Dropping it (or `close()`) ends the epoch, as for a generator."""

    __slots__ = ("_gen",)

    def __init__(self, gen: Generator[Any, None, None]) -> None:
        self._gen = gen

    def __iter__(self) -> _Batches[T]:
        return self

    def __next__(self) -> T:
        return _unbox(next(self._gen))  # type: ignore[no-any-return]

    def close(self) -> None:
        self._gen.close()


class _AsyncBatches(AsyncIterator[T]):
    """`aiter(loader)`: as `_Batches`, for `async for`."""

    __slots__ = ("_gen",)

    def __init__(self, gen: AsyncGenerator[Any, None]) -> None:
        self._gen = gen

    def __aiter__(self) -> _AsyncBatches[T]:
        return self

    async def __anext__(self) -> T:
        return _unbox(await self._gen.__anext__())  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        await self._gen.aclose()


def _unbox(batch: Any) -> Any:
    """`batch`, or the error of a batch that failed (`BatchFailed`) raised in its place."""
    if type(batch) is BatchFailed:
        error = batch.error
        del batch
        raise error
    return batch


def timeout_error(message: str, run: Epoch | Feed) -> LoaderTimeout:
    """`LoaderTimeout(message)`, naming the stage that holds the epoch's oldest work and up to five
    of its keys with their ages (`stage`, `keys`); else saying that nothing is in flight."""
    stage, keys = run.stuck()
    if not stage:
        where = "; no sample is in flight: the keys are not coming (the order stage waits)"
    else:
        listed = ", ".join(f"{key!r} ({age:.1f} s)" for key, age in keys)
        where = f"; the oldest work is in stage {stage!r}, keys in flight there: {listed}"
    return LoaderTimeout(message + where, stage=stage, keys=[key for key, _ in keys])


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def _many(epoch: Epoch) -> list[Any]:
    """The batches waiting (`Epoch.ready_many`), else `[await epoch.get()]`."""
    many = epoch.ready_many(_TOGETHER)
    return many if many is not None else [await epoch.get()]


def _from_thread(
    runner: LoopThread, run: Epoch | Feed
) -> tuple[Callable[[], Awaitable[list[Any]]], Callable[[int, int, bool], None]]:
    """`async for`'s `get` and `gone` for an epoch on the loop thread: as for `for`, the batches
    waiting come over together, each letting go of its places as it is handed over (see
    `Epoch.ready_many`); a device stage's come one at a time."""
    if isinstance(run, Epoch):
        epoch = run

        def get() -> Awaitable[list[Any]]:
            return asyncio.wrap_future(runner.submit(_many(epoch)))

        return get, _handed_on(runner, epoch)
    return (lambda: asyncio.wrap_future(runner.submit(_boxed(run.get)))), _never


def _handed_on(runner: LoopThread, epoch: Epoch) -> Callable[[int, int, bool], None]:
    """`gone` for a consumer outside `epoch`'s loop thread: a batch's places go back on the loop
    (`Epoch.handed`) as it is handed over."""

    def gone(samples: int, held_bytes: int, made: bool) -> None:
        runner.call_soon(functools.partial(epoch.handed, samples, held_bytes, made))

    return gone


def _never(samples: int, held_bytes: int, made: bool) -> None:
    """(no batch comes with places to let go of)"""


async def _boxed(get: Callable[[], Awaitable[Any]]) -> list[Any]:
    """`[await get()]`, for a receiver that empties the list: a finished future that outlives the
    hand-over (asyncio keeps some a while) then holds an empty list, not the batch."""
    return [await get()]
