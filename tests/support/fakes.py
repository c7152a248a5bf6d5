"""Fake fetchers for the loader tests: slow, failing, blocking and concurrency-tracking ones.

Each fake is injected through the loader's constructor (as its `fetch`, `decode` or `collate`), records
what it saw in a thread-safe way, and never sleeps where an event can say when to go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from aioloader import Loader

# Every wait in a fake ends by this deadline, so a broken loader fails a test instead of hanging it.
WAIT_S = 10.0
# What the loader promises: every task and thread stopped within 2 s of close/break/error/exit.
STOP_DEADLINE_S = 2.0
# Interval of `wait_until`, for conditions that nothing signals (a thread seen from outside, a task
# on another loop, a child process).
POLL_INTERVAL_S = 0.005


async def square(key: int) -> int:
    """The simplest async fetch: a key's square."""
    return key * key


def plain_square(key: int) -> int:
    """The simplest plain fetch (run in fetch threads): a key's square."""
    return key * key


class Boom(Exception):
    """The error the failing fakes raise (a type the loader cannot know)."""


class Tracker:
    """Counts calls in flight and samples made; thread-safe.

    Attributes:
        limit: the most calls that may be in flight; a call past it is recorded in `violations`.
        in_flight, peak: calls running now, and the most at once.
        started, finished: calls begun and ended (returned, raised or cancelled).
        threads: names of the threads the calls ran on.
        loops: the event loops the calls ran on (async calls only).
        keys: the keys, in the order their calls began.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self.started = 0
        self.finished = 0
        self.violations: list[int] = []
        self.threads: set[str] = set()
        self.loops: set[asyncio.AbstractEventLoop] = set()
        self.keys: list[Any] = []
        self.reached = threading.Event()
        self.changed = threading.Condition()

    def enter(self, key: Any) -> None:
        with self.changed:
            self.in_flight += 1
            self.started += 1
            self.keys.append(key)
            self.peak = max(self.peak, self.in_flight)
            if self.limit is not None and self.in_flight > self.limit:
                self.violations.append(self.in_flight)
            if self.in_flight == self.limit:
                self.reached.set()
            self.threads.add(threading.current_thread().name)
            with contextlib.suppress(RuntimeError):  # not on an event loop
                self.loops.add(asyncio.get_running_loop())
            self.changed.notify_all()

    def exit(self) -> None:
        with self.changed:
            self.in_flight -= 1
            self.finished += 1
            self.changed.notify_all()

    def wait_for(self, predicate: Callable[[Tracker], bool], timeout: float = WAIT_S) -> bool:
        """Block until `predicate(self)` holds (re-checked on every change); False on timeout."""
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout)


class _Fetch:
    """What both fakes share: the tracker, the per-key delay, the transform, the hold option."""

    def __init__(
        self,
        tracker: Tracker | None = None,
        *,
        delay: Callable[[Any], float] | float = 0.0,
        transform: Callable[[Any], Any] = lambda key: key,
        hold_until_limit: bool = False,
    ) -> None:
        self.tracker = tracker or Tracker()
        self.delay = delay if callable(delay) else (lambda _key, d=delay: d)
        self.transform = transform
        self.hold_until_limit = hold_until_limit


class AsyncFetch(_Fetch):
    """An async fetch: `key -> transform(key)` after `delay(key)` seconds, tracked.

    With `hold_until_limit`, each call waits (without blocking the loop) until `limit` calls are in
    flight at once, so a test proves the limit is reached rather than hoping for it.
    """

    def __init__(self, tracker: Tracker | None = None, **options: Any) -> None:
        super().__init__(tracker, **options)
        self._reached: asyncio.Event | None = None  # made on the loop the calls run on

    async def __call__(self, key: Any) -> Any:
        self.tracker.enter(key)
        try:
            if self.hold_until_limit:
                if self._reached is None:
                    self._reached = asyncio.Event()
                if self.tracker.reached.is_set():
                    self._reached.set()
                try:
                    await asyncio.wait_for(self._reached.wait(), WAIT_S)
                except TimeoutError:  # never reached: stop holding calls (the peak check fails)
                    self.tracker.reached.set()
                    self._reached.set()
            await asyncio.sleep(self.delay(key))
            return self.transform(key)
        finally:
            self.tracker.exit()


class SyncFetch(_Fetch):
    """A plain (blocking) fetch, run by the loader in its fetch threads; see `AsyncFetch`."""

    def __call__(self, key: Any) -> Any:
        self.tracker.enter(key)
        try:
            if self.hold_until_limit and not self.tracker.reached.wait(WAIT_S):
                self.tracker.reached.set()  # never reached: stop holding calls (the peak check fails)
            time.sleep(self.delay(key))
            return self.transform(key)
        finally:
            self.tracker.exit()


class Failing:
    """A callable (for fetch, decode or collate) that raises `Boom` for `bad` arguments.

    `bad` is a set of arguments, or a predicate. Arguments it accepts are returned unchanged.
    """

    def __init__(self, bad: Iterable[Any] | Callable[[Any], bool]) -> None:
        if callable(bad):
            self.is_bad = bad
        else:
            bad_set = set(bad)
            self.is_bad = lambda arg: arg in bad_set

    def __call__(self, arg: Any) -> Any:
        if self.is_bad(arg):
            raise Boom(f"cannot take {arg!r}")
        return arg


class AsyncFailing(Failing):
    """`Failing` as a coroutine function."""

    async def __call__(self, arg: Any) -> Any:  # type: ignore[override]
        await asyncio.sleep(0)
        return super().__call__(arg)


class Gate:
    """An async fetch that returns the keys in `free` at once and holds every other one.

    A held call waits until cancelled. `started` is set (thread-safely) once `count` calls are held;
    `cancelled` counts held calls that ended by cancellation, so a test sees the loader cancel them.
    """

    def __init__(self, count: int = 1, free: Iterable[Any] = ()) -> None:
        self.count = count
        self.free = set(free)
        self.tracker = Tracker()
        self.started = threading.Event()
        self.cancelled = 0

    async def __call__(self, key: Any) -> Any:
        if key in self.free:
            return key
        self.tracker.enter(key)
        if self.tracker.in_flight >= self.count:
            self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.tracker.exit()
        return key  # pragma: no cover - never released

    def idle(self, timeout: float = WAIT_S) -> bool:
        """Wait until no call is held (every one was cancelled); False on timeout."""
        return self.tracker.wait_for(lambda t: t.in_flight == 0, timeout)


def key_delay(delays: dict[Any, float], default: float = 0.0) -> Callable[[Any], float]:
    """A `delay` for the fetch fakes: `delays[key]`, else `default`."""
    return lambda key: delays.get(key, default)


class TickingFetch:
    """An async fetch that needs the event loop `ticks` times (`tick_s` apart) to finish.

    `ticks_done` counts every tick and `fetch_s` the wall time of each call; ticks that run while
    `busy` is set count in `ticks_while_busy` too: with the consumer setting `busy` around a
    blocking step, they tell whether fetching went on during the step.
    """

    def __init__(self, busy: threading.Event, ticks: int = 10, tick_s: float = 0.005) -> None:
        self.busy = busy
        self.ticks = ticks
        self.tick_s = tick_s
        self.ticks_done = 0
        self.ticks_while_busy = 0
        self.fetch_s: list[float] = []
        self.loops: set[asyncio.AbstractEventLoop] = set()

    async def __call__(self, key: Any) -> Any:
        self.loops.add(asyncio.get_running_loop())
        start = time.perf_counter()
        for _ in range(self.ticks):
            await asyncio.sleep(self.tick_s)
            self.ticks_done += 1
            if self.busy.is_set():
                self.ticks_while_busy += 1
        self.fetch_s.append(time.perf_counter() - start)
        return key


class FakeSource:
    """A `Source` of `n` integer keys whose fetch returns `key * 10`; records `aclose` calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.fetched: list[int] = []
        self.closed = 0

    def keys(self) -> list[int]:
        return list(range(self.n))

    async def fetch(self, key: int) -> int:
        self.fetched.append(key)
        await asyncio.sleep(0)
        return key * 10

    async def aclose(self) -> None:
        self.closed += 1


class Keys:
    """An iterable of keys with no length and no random access (re-iterable, unlike a generator)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def consume(loader: Loader[Any], mode: str, step: Callable[[Any], None] = lambda _: None) -> None:
    """Iterate one epoch with the face `mode`, calling `step(batch)` on each batch."""
    if mode == "sync":
        for batch in loader:
            step(batch)
        return

    async def main() -> BaseException | None:
        try:
            async for batch in loader:
                step(batch)
        except (KeyboardInterrupt, SystemExit) as exc:
            return exc  # raised below: escaping the task, asyncio would log it "never retrieved"
        return None

    error = asyncio.run(main())
    if error is not None:
        raise error


async def cancel_after_first(batches: Any, deadline_s: float = 10.0) -> None:
    """Iterate `batches` (`async for`) in a task, cancel the task once the first item has come,
    and check that it ends with CancelledError (what a training loop's cancellation does)."""
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in batches:
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), deadline_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return
    raise AssertionError("the cancelled consumer ended without CancelledError")
