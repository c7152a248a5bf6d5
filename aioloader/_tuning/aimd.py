"""A concurrency limit that adapts to throttling: additive increase, multiplicative decrease (AIMD).

An object store that answers "503 SlowDown" asks the client to send fewer requests at once. Retrying
each throttled request on its own keeps the pressure up; halving the number of requests in flight, then
growing it back by about one per round of successes (as TCP does with its window), does not.

Only the first throttle of a round counts: requests that started before the last decrease were sent
under the old limit, and their throttles say nothing new (otherwise one burst would halve the limit
once per request in it).

A rank of a large job starts on a ramp instead of at its maximum (`ramp.py`): after a short jitter,
with few requests in flight, one more per answer until the first throttle or the maximum.
"""

from __future__ import annotations

import asyncio
import collections

from .ramp import Ramp

__all__ = ["Aimd", "Slots"]


class Slots:
    """A FIFO asyncio semaphore whose size may change while it is in use; subclasses say how.

    A subclass implements `_free()` (may one more slot be taken now?) and `_count(delta)` (take
    slots, or give them back). `_enter()` waits for a slot, in arrival order, and is safe to cancel;
    call `_wake()` after giving a slot back or growing the size. Use on one event loop; not
    thread-safe. (Shared by `Aimd` and the loader's `AutoWorkers`.)
    """

    def __init__(self) -> None:
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def _free(self) -> bool:
        raise NotImplementedError

    def _count(self, delta: int) -> None:
        raise NotImplementedError

    async def _enter(self) -> None:
        """Wait for a free slot and count it as taken. Safe to cancel."""
        if self._free() and not self._waiters:
            self._count(+1)
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # `_wake` counts the slot as ours before it wakes us
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._count(-1)  # handed a slot we will not use: pass it on
                self._wake()
            else:
                self._waiters.remove(waiter)
            raise

    def _wake(self) -> None:
        while self._waiters and self._free():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._count(+1)
                waiter.set_result(None)


class Aimd(Slots):
    """An asyncio semaphore whose size moves between `minimum` and `maximum`.

    `acquire()` returns a ticket (the decrease count when the request started); hand it back to
    `release(ticket, throttled=...)`. Use on one event loop; not thread-safe.

    Example:
        >>> import asyncio
        >>> async def demo() -> float:
        ...     limiter = Aimd(maximum=8)
        ...     ticket = await limiter.acquire()
        ...     limiter.release(ticket, throttled=True)
        ...     return limiter.limit
        >>> asyncio.run(demo())
        4.0
    """

    def __init__(
        self, maximum: int, minimum: int = 1, decrease: float = 0.5, ramp: Ramp | None = None
    ) -> None:
        """`ramp`: start at `ramp.start` after `ramp.delay_s`, growing by one per answer until the
        first throttle or `maximum` (see `ramp.py`); None: at `maximum`, at once."""
        if not 1 <= minimum <= maximum:
            raise ValueError(f"need 1 <= minimum <= maximum, got {minimum} and {maximum}")
        if not 0.0 < decrease < 1.0:
            raise ValueError(f"decrease must be in (0, 1), got {decrease}")
        super().__init__()
        self.maximum = maximum
        self.minimum = minimum
        self.decrease = decrease
        start = maximum if ramp is None else min(maximum, max(minimum, ramp.start))
        self.limit = float(start)
        self.slow_start = start < maximum  # one more per answer until the first throttle
        self._delay = 0.0 if ramp is None else ramp.delay_s
        self._opens_at: float | None = None
        self.in_flight = 0
        self.throttles = 0
        self.decreases = 0

    async def acquire(self) -> int:
        """Wait for a free slot (the first ones: the ramp's delay too); returns the ticket to pass
        to `release`. Safe to cancel."""
        if self._delay:
            await self._opening()
        await self._enter()
        return self.decreases

    async def _opening(self) -> None:
        now = asyncio.get_running_loop().time()
        if self._opens_at is None:
            self._opens_at = now + self._delay
        if now >= self._opens_at:
            self._delay = 0.0
            return
        await asyncio.sleep(self._opens_at - now)

    def _free(self) -> bool:
        return self.in_flight < int(self.limit)

    def _count(self, delta: int) -> None:
        self.in_flight += delta

    def release(self, ticket: int, *, throttled: bool = False) -> None:
        """Give the slot back; `throttled` says the server asked to slow down."""
        self.in_flight -= 1
        if throttled:
            self.throttles += 1
            self.slow_start = False
            if ticket == self.decreases:  # the first throttle of requests sent under this limit
                self.decreases += 1
                self.limit = max(float(self.minimum), self.limit * self.decrease)
        else:
            step = 1.0 if self.slow_start else 1.0 / self.limit
            self.limit = min(float(self.maximum), self.limit + step)
            self.slow_start = self.slow_start and self.limit < self.maximum
        self._wake()

    def stats(self) -> dict[str, float]:
        """The current limit, requests in flight, throttles seen and decreases made."""
        return {
            "concurrency_limit": self.limit,
            "in_flight": float(self.in_flight),
            "throttles": float(self.throttles),
            "decreases": float(self.decreases),
        }
