"""`concurrency="auto"` and `workers="auto"`: limits that follow the measured throughput.

`AutoConcurrency` is the fetch stage's `Tuner`: a `Climber` (see `_tuning/climber.py`: slow start doubling
while throughput follows, then additive increase while it improves; a step that costs throughput is
undone; a queue beyond what the store needs is drained to rate x least latency plus headroom, Little's
law; a slower store gets its limit multiplied by the latency ratio) fed by every finished fetch, whose
limit the pipeline's gate reads at every launch. Throttling and timeouts (`throttled()`, or a rise in
the source's "throttles"/"retries" counts) halve it at once. It never exceeds what the byte budget can
hold (`max_bytes / mean fetched bytes`) nor `AUTO_MAX_ASYNC` (`AUTO_MAX_THREADS` for a plain fetch,
where each request holds a thread).

`AutoWorkers` is a decode executor for executor="thread": a pool of one thread per core, of which a
`Climber` lets as many decode at once as raise throughput (a decoder that holds the GIL gains nothing
from a second thread, and keeps one). Process pools are sized once, to the cores.

Both are owned by the thread of the event loop that runs the epochs (no lock: nothing else changes
them). Every change is logged on the "aioloader" logger at INFO; `loader.stats().concurrency` and
`stats().stages["decode"].limit` show the values in force.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from .._executors.base import Executor, ThreadExecutor
from .._executors.choose import make_executor
from .._observe.stats import NullRecorder, Recorder
from .._protocol import HasStats
from .._util.threads import default_workers
from .._util.validate import check_int
from .aimd import Slots
from .bounds import Tuner
from .climber import Climber
from .memory import MemoryBudget

__all__ = ["AutoConcurrency", "AutoWorkers", "Climber", "resolve_concurrency", "resolve_decoder"]

T = TypeVar("T")
logger = logging.getLogger("aioloader")

AUTO_INITIAL = 16  # fetches in flight to start from
AUTO_MAX_ASYNC = 256  # the ceiling for an async fetch (requests on the event loop)
AUTO_MAX_THREADS = 64  # ... and for a plain fetch (each request holds a thread)
THROTTLE_DECREASE = 0.5  # the cut on throttling and timeouts
THROTTLE_CHECK_S = 0.05  # how often the source's throttle count is read


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
        budget: MemoryBudget | None = None,
        throttles: Callable[[], int] | None = None,
    ) -> None:
        self.climber = Climber("fetch concurrency", initial, 1, maximum)
        self.limit = self.climber.limit
        self._rec, self._budget, self._throttles = recorder, budget or MemoryBudget(), throttles
        self._seen = throttles() if throttles is not None else 0
        self._checked = self._t = time.perf_counter()
        self._area = 0.0

    def _in_flight_area(self, now: float) -> float:
        """The integral of fetches in flight, from the recorder (or, without stats, estimated)."""
        if isinstance(self._rec, NullRecorder):
            self._area += self.limit * (now - self._t)  # stats off: assume the limit is full
            self._t = now
            return self._area
        return self._rec.stages["fetch"].area

    def _ceiling(self) -> int | None:
        s = self._rec.stages["fetch"]
        if not s.items or not s.bytes:
            return None
        return self._budget.samples_held(s.bytes // s.items)

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


class AutoWorkers(Slots):
    """`workers="auto"` with executor="thread": a pool of up to `maximum` threads (the cores), of
    which a `Climber` decides how many decode at once. `run` is safe to cancel.
    """

    def __init__(self, maximum: int, initial: int = 1) -> None:
        super().__init__()
        self.climber = Climber("decode workers", initial, 1, maximum, keep_flat=False)
        self._pool = ThreadExecutor(maximum)
        self._in_use = 0
        self._area, self._t = 0.0, time.perf_counter()

    @property
    def workers(self) -> int:
        return self.climber.limit

    def _move(self, delta: int) -> float:
        now = time.perf_counter()
        self._area += self._in_use * (now - self._t)
        self._t, self._in_use = now, self._in_use + delta
        return now

    def _free(self) -> bool:
        return self._in_use < self.climber.limit

    def _count(self, delta: int) -> None:
        self._move(delta)

    async def run(self, fn: Callable[[Any], T], arg: Any, seed: int | None = None) -> T:
        await self._enter()
        try:
            return await self._pool.run(fn, arg, seed)
        finally:
            now = self._move(-1)
            self.climber.tick(now, self._area)
            self._wake()

    def close(self) -> None:
        self._pool.close()


def resolve_concurrency(
    concurrency: int | str,
    *,
    is_async: bool,
    recorder: Recorder,
    budget: MemoryBudget,
    source: object = None,
) -> tuple[int, Tuner | None]:
    """(the most fetches ever in flight, the tuner) for `concurrency` (an int or "auto")."""
    if concurrency == "auto":
        maximum = AUTO_MAX_ASYNC if is_async else AUTO_MAX_THREADS
        tuner = AutoConcurrency(
            recorder, initial=AUTO_INITIAL, maximum=maximum, budget=budget,
            throttles=_source_throttles(source),
        )  # fmt: skip
        return maximum, tuner
    if isinstance(concurrency, str):
        raise TypeError(f"concurrency must be an int or 'auto', got {concurrency!r}")
    return check_int("concurrency", concurrency, minimum=1), None


def resolve_decoder(
    executor: str, workers: int | str | None, arena_bytes: int | None = None
) -> Executor:
    """The decode executor for `executor` and `workers` (an int, None or "auto")."""
    if workers == "auto":
        if executor == "thread":
            return AutoWorkers(default_workers())
        return make_executor(executor, None, arena_bytes)  # inline: no pool; process: one per core
    if isinstance(workers, str):
        raise TypeError(f"workers must be an int, None or 'auto', got {workers!r}")
    if workers is not None:
        check_int("workers", workers, minimum=1)
    return make_executor(executor, workers, arena_bytes)


def _source_throttles(source: object) -> Callable[[], int] | None:
    """A running count of the source's throttled and retried requests, if it reports them."""
    if not isinstance(source, HasStats):
        return None
    stats = source.stats

    def count() -> int:
        s = stats()
        return int(s.get("throttles", 0)) + int(s.get("retries", 0))

    return count
