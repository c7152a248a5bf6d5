"""`concurrency="auto"` and `workers="auto"`: limits that follow the measured throughput.

Both use one `Climber`: throughput is measured over short windows (a fifth of a second, or four
latencies when those are longer); the first window after a change is left to settle. Then:
- slow start: while throughput keeps improving, the limit doubles; after the first time it does not,
  growth is additive (steps of a quarter of the limit);
- a step that gains nothing is undone, and the next try waits `HOLD_WINDOWS` windows;
- a step after which throughput drops, and any throttling or timeout (`throttled()`), cut the limit
  multiplicatively (x0.5 for throttling, x0.7 for a drop);
- the limit only grows while it is what holds the stage back (`mean in flight >= BOUND x limit`): a
  fetch stage starved by a slow decode or consumer is left where it is;
- when throughput changes by more than `CHANGE` at an unchanged limit (the store got slower or faster),
  the measure starts afresh and growth resumes at once: a slower store needs more requests in flight
  for the same rate (Little's law).
Fetch concurrency never exceeds what the byte budget can hold (`max_bytes / mean fetched bytes`).
Each change is logged on the "aioloader" logger at INFO.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ._decode import Executor, ThreadExecutor, default_workers, make_executor
from ._limits import Tuner
from ._stats import NullRecorder, Recorder
from ._validate import check_int

__all__ = ["AutoConcurrency", "AutoWorkers", "Climber", "resolve_concurrency", "resolve_decoder"]

T = TypeVar("T")
logger = logging.getLogger("aioloader")

AUTO_INITIAL = 16  # fetches in flight to start from
AUTO_MAX_ASYNC = 256  # the ceiling for an async fetch (requests on the event loop)
AUTO_MAX_THREADS = 64  # ... and for a plain fetch (each request holds a thread)
MIN_WINDOW_S = 0.15
MIN_ITEMS = 16  # completions a window needs at least
WINDOW_LATENCIES = 2.0  # a window lasts at least this many mean latencies
SETTLE_LATENCIES = 1.0  # after a change, wait this many latencies before measuring
GAIN = 0.05  # a step counts as a gain above +5% throughput
DROP = 0.2  # ... and as a loss below -20%
CHANGE = 0.3  # at an unchanged limit, a move this large means the source itself changed
BOUND = 0.8  # the limit binds when the mean in flight reaches this share of it
HOLD_WINDOWS = 8
THROTTLE_DECREASE = 0.5
DROP_DECREASE = 0.7
ADD_SHARE = 1 / 4
CONFIRM_WINDOWS = 2  # windows in a row that must agree that the source changed
MAX_JUMP = 4.0  # the most a slower source multiplies the limit by at once
THROTTLE_CHECK_S = 0.05  # how often the source's throttle count is read


@dataclass(frozen=True)
class _Point:
    limit: int
    rate: float  # items/s
    latency: float  # s, by Little's law: mean in flight / rate


class Climber:
    """One limit between `minimum` and a ceiling, moved by throughput windows (see the module doc).

    Not thread-safe: feed it from one thread (the event loop).
    """

    def __init__(
        self, what: str, initial: int, minimum: int, maximum: int, keep_flat: bool = True
    ) -> None:
        self.what, self.minimum, self.maximum = what, minimum, maximum
        self.limit = max(minimum, min(initial, maximum))
        self.keep_flat = keep_flat  # keep a growth step that neither gained nor lost
        self.slow_start = True
        self._base: _Point | None = None  # the operating point accepted so far
        self._hold = self._moved = 0
        self._probing = False
        self._latency = 0.0
        self._restart(0.0)

    def _restart(self, settle_until: float) -> None:
        self._settle_until, self._t, self._n, self._area = settle_until, -1.0, 0, 0.0

    def settling(self, now: float) -> bool:
        """Whether the last change is still settling (what finishes now was sent before it)."""
        return now < self._settle_until

    def tick(self, now: float, area: float, ceiling: int | None = None) -> None:
        """One item finished at `now`; `area`: the integral of items in flight up to `now`."""
        if now < self._settle_until:
            return
        if self._t < 0:  # a window starts
            self._t, self._area = now, area
            return
        self._n += 1
        dt = now - self._t
        if dt < max(MIN_WINDOW_S, WINDOW_LATENCIES * self._latency) or self._n < MIN_ITEMS:
            return
        rate, in_flight = self._n / dt, (area - self._area) / dt
        point = _Point(self.limit, rate, in_flight / rate)
        self._latency = point.latency
        cap = self.maximum if ceiling is None else max(self.minimum, min(self.maximum, ceiling))
        self._decide(point, in_flight >= BOUND * self.limit, cap)
        if self.limit > cap:
            self._set(cap, "memory budget")
        changed = self.limit != point.limit
        self._restart(now + SETTLE_LATENCIES * point.latency if changed else 0.0)

    def cut(self, factor: float, why: str, now: float) -> None:
        """Decrease the limit multiplicatively now and measure afresh."""
        self.slow_start = False
        self._base = None
        self._set(max(self.minimum, int(self.limit * factor)), why)
        self._restart(now + SETTLE_LATENCIES * self._latency)

    def _decide(self, now: _Point, bound: bool, ceiling: int) -> None:
        base = self._base
        if base is None or now.limit < base.limit:
            self._base, self._moved = now, 0
            return self._grow(bound, ceiling, "measuring") if self._hold <= 0 else None
        if now.limit > base.limit:  # the last step was a try
            return self._judge(base, now, bound, ceiling)
        moved = now.rate / base.rate - 1
        if abs(moved) > CHANGE:  # the same limit, another world, if the next window agrees
            self._moved += 1 if moved > 0 else -1
            if abs(self._moved) < CONFIRM_WINDOWS:
                return None
            self._base, self._moved = now, 0
            if moved < 0 and now.latency > base.latency * (1 + CHANGE) and bound:
                # a slower source: Little's law wants more in flight for the same rate
                jump = min(MAX_JUMP, now.latency / base.latency)
                self.slow_start, self._base, self._hold = True, None, 0
                return self._set(math.ceil(now.limit * jump), f"throughput {moved:+.0%}, slower")
            return self._grow(bound, ceiling, f"throughput {moved:+.0%}")
        self._base, self._moved = _Point(now.limit, (base.rate + now.rate) / 2, now.latency), 0
        self._hold -= 1
        if self._hold <= 0:
            self._grow(bound, ceiling, "probing")
            self._probing = self.limit > now.limit

    def _judge(self, base: _Point, now: _Point, bound: bool, ceiling: int) -> None:
        """After a step up: go on if it paid, cut if it hurt; if neither, stay (undo a probe)."""
        probing, self._probing = self._probing, False
        if now.rate >= base.rate * (1 + GAIN):
            self._base = now
            return self._grow(bound, ceiling, f"throughput +{now.rate / base.rate - 1:.0%}")
        self.slow_start, self._hold = False, HOLD_WINDOWS
        if now.rate <= base.rate * (1 - DROP):
            self._base = None
            return self._set(max(self.minimum, int(now.limit * DROP_DECREASE)), "throughput fell")
        if probing or not self.keep_flat:
            self._base = None  # measure afresh at the old limit: the source may have changed
            return self._set(base.limit, "no gain")
        self._base = now

    def _grow(self, bound: bool, ceiling: int, why: str) -> None:
        if not bound or self.limit >= ceiling:
            return
        step = self.limit if self.slow_start else max(1, math.ceil(self.limit * ADD_SHARE))
        self._set(min(ceiling, self.limit + step), why)

    def _set(self, limit: int, why: str) -> None:
        limit = max(self.minimum, min(limit, self.maximum))
        if limit != self.limit:
            logger.info("%s %d -> %d (%s)", self.what, self.limit, limit, why)
            self.limit = limit


class AutoConcurrency(Tuner):
    """`concurrency="auto"`: fetches in flight chosen by a `Climber` while the loader runs.

    Args:
        recorder: the loader's counters (fetches in flight, bytes per sample).
        maximum: the ceiling; `max_bytes` lowers it to what the byte budget holds.
        throttles: returns a running count of throttled or retried requests (e.g. from the
            source's stats); a rise is treated like `throttled()`. Read a few times a second.
    """

    def __init__(
        self,
        recorder: Recorder,
        *,
        initial: int = 16,
        maximum: int = 256,
        max_bytes: int | None = None,
        throttles: Callable[[], int] | None = None,
    ) -> None:
        self.climber = Climber("fetch concurrency", initial, 1, maximum)
        self.limit = self.climber.limit
        self._rec, self._max_bytes, self._throttles = recorder, max_bytes, throttles
        self._seen = throttles() if throttles is not None else 0
        self._checked = self._t = time.perf_counter()
        self._area = 0.0

    def _in_flight_area(self, now: float) -> float:
        """The integral of fetches in flight, from the recorder (or, without stats, estimated)."""
        if isinstance(self._rec, NullRecorder):
            self._area += self.limit * (now - self._t)  # stats off: assume the limit is full
            self._t = now
            return self._area
        s = self._rec.stages["fetch"]
        return s.area + s.busy * max(0.0, now - s.last)

    def _ceiling(self) -> int | None:
        s = self._rec.stages["fetch"]
        if self._max_bytes is None or not s.items or not s.bytes:
            return None
        return max(1, self._max_bytes // max(1, s.bytes // s.items))

    def completed(self, now: float) -> None:
        now = time.perf_counter()  # the recorder's clock does not move with stats off
        if self._throttles is not None and now - self._checked >= THROTTLE_CHECK_S:
            self._checked, seen = now, self._throttles()
            if seen > self._seen:
                self._seen = seen
                return self.throttled()
        self.climber.tick(now, self._in_flight_area(now), self._ceiling())
        self._changed()

    def _changed(self) -> None:
        self.limit = self._rec.stages["fetch"].cap = self.climber.limit

    def throttled(self) -> None:
        now = time.perf_counter()
        if not self.climber.settling(now):  # requests sent before the last cut say nothing new
            self.climber.cut(THROTTLE_DECREASE, "throttled", now)
            self._changed()


class AutoWorkers:
    """`workers="auto"` with executor="thread": a pool of up to `maximum` threads (the cores), of
    which a `Climber` decides how many decode at once. `run` is safe to cancel.
    """

    def __init__(self, maximum: int, initial: int = 1) -> None:
        self.climber = Climber("decode workers", initial, 1, maximum, keep_flat=False)
        self._pool = ThreadExecutor(maximum)
        self._in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._area, self._t = 0.0, time.perf_counter()

    @property
    def workers(self) -> int:
        return self.climber.limit

    def _move(self, delta: int) -> float:
        now = time.perf_counter()
        self._area += self._in_use * (now - self._t)
        self._t, self._in_use = now, self._in_use + delta
        return now

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        if self._in_use < self.climber.limit and not self._waiters:
            self._move(+1)
        else:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter  # `_wake` counted the worker as ours before it woke us
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._move(-1)  # handed a worker we will not use: pass it on
                    self._wake()
                else:
                    self._waiters.remove(waiter)
                raise
        try:
            return await self._pool.run(fn, arg, seed)
        finally:
            now = self._move(-1)
            self.climber.tick(now, self._area)
            self._wake()

    def _wake(self) -> None:
        while self._waiters and self._in_use < self.climber.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._move(+1)
                waiter.set_result(None)

    def close(self) -> None:
        self._pool.close()


def resolve_concurrency(
    concurrency: int | str,
    *,
    is_async: bool,
    recorder: Recorder,
    max_bytes: int | None,
    source: object = None,
) -> tuple[int, Tuner | None]:
    """(the most fetches ever in flight, the tuner) for `concurrency` (an int or "auto")."""
    if concurrency == "auto":
        maximum = AUTO_MAX_ASYNC if is_async else AUTO_MAX_THREADS
        tuner = AutoConcurrency(
            recorder, initial=AUTO_INITIAL, maximum=maximum, max_bytes=max_bytes,
            throttles=_source_throttles(source),
        )  # fmt: skip
        return maximum, tuner
    if isinstance(concurrency, str):
        raise TypeError(f"concurrency must be an int or 'auto', got {concurrency!r}")
    return check_int("concurrency", concurrency, minimum=1), None


def resolve_decoder(executor: str, workers: int | str | None) -> Executor:
    """The decode executor for `executor` and `workers` (an int, None or "auto")."""
    if workers == "auto":
        if executor == "thread":
            return AutoWorkers(default_workers())
        return make_executor(executor, None)  # inline: no pool; process: one per core
    if isinstance(workers, str):
        raise TypeError(f"workers must be an int, None or 'auto', got {workers!r}")
    if workers is not None:
        check_int("workers", workers, minimum=1)
    return make_executor(executor, workers)


def _source_throttles(source: object) -> Callable[[], int] | None:
    """A running count of the source's throttled and retried requests, if it reports them."""
    stats = getattr(source, "stats", None)
    if not callable(stats):
        return None

    def count() -> int:
        s = stats()
        return int(s.get("throttles", 0)) + int(s.get("retries", 0))

    return count
