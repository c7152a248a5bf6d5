"""The `Climber`: one limit moved by the throughput measured over short windows (AIMD).

Throughput is measured over windows of a quarter of a second, or three mean latencies when those are
longer; after a change, one latency is left to settle before the next window starts. Then:
- slow start: while throughput improves by more than `GAIN`, the limit doubles; after the first time
  it does not, growth is additive (steps of a quarter of the limit);
- a step that neither gains nor loses is kept (`keep_flat`, the fetch limit) or undone (decode
  workers); a later probe waits `HOLD_WINDOWS` windows and is undone if it gains nothing;
- a step after which throughput drops by more than `DROP` in two windows in a row cuts the limit
  multiplicatively (x0.7); throttling and timeouts (`cut`, by the tuner) halve it at once;
- the limit only grows while it is what holds the stage back (`mean in flight >= BOUND x limit`): a
  fetch stage starved by a slow decode or consumer is left where it is;
- when throughput or latency moves by more than `CHANGE` at an unchanged limit in two windows in a
  row, the source changed: the measure starts afresh, and a slower source (latency up) gets its limit
  multiplied by the latency ratio at once (Little's law: the same rate needs that many more in
  flight), then slow start resumes;
- the limit stays within [minimum, maximum] and under the caller's `ceiling` (the byte budget).
Each change is logged on the "aioloader" logger at INFO.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

__all__ = ["Climber"]

logger = logging.getLogger("aioloader")

MIN_WINDOW_S = 0.25
MIN_ITEMS = 16  # completions a window needs at least
WINDOW_LATENCIES = 3.0  # a window lasts at least this many mean latencies
SETTLE_LATENCIES = 1.0  # after a change, wait this many latencies before measuring
GAIN = 0.05  # a step counts as a gain above +5% throughput
DROP = 0.2  # ... and as a loss below -20%
CHANGE = 0.3  # at an unchanged limit, a move this large means the source itself changed
BOUND = 0.5  # the limit binds when the mean in flight reaches this share of it
HOLD_WINDOWS = 4
DROP_DECREASE = 0.7
ADD_SHARE = 1 / 4
CONFIRM_WINDOWS = 2  # windows in a row that must agree (a drop, a changed source)
MAX_JUMP = 4.0  # the most a slower source multiplies the limit by at once


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
        self._hold = self._moves = self._drops = 0  # windows to wait; windows that saw a change
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
        self._restart(now + max(MIN_WINDOW_S, SETTLE_LATENCIES * self._latency))

    def _decide(self, now: _Point, bound: bool, ceiling: int) -> None:
        base = self._base
        if base is None or now.limit < base.limit:
            self._base, self._moves, self._drops = now, 0, 0
            return self._grow(bound, ceiling, "measuring") if self._hold <= 0 else None
        if now.limit > base.limit:  # the last step was a try
            return self._judge(base, now, bound, ceiling)
        rate = now.rate / base.rate - 1
        latency = now.latency / base.latency - 1 if base.latency > 0 else 0.0
        if abs(rate) > CHANGE or abs(latency) > CHANGE:  # the source changed, if confirmed
            self._moves += 1
            if self._moves < CONFIRM_WINDOWS:
                return None
            self._base, self._moves, self._hold = None, 0, 0
            why = f"throughput {rate:+.0%}, latency {latency:+.0%}"
            if latency > CHANGE and bound:  # slower: Little's law wants more in flight
                self.slow_start = True
                jump = min(MAX_JUMP, now.latency / base.latency)
                return self._set(math.ceil(now.limit * jump), why)
            return self._grow(bound, ceiling, why)
        self._base, self._moves = _Point(now.limit, (base.rate + now.rate) / 2, now.latency), 0
        self._hold -= 1
        if self._hold <= 0:
            self._grow(bound, ceiling, "probing")
            self._probing = self.limit > now.limit

    def _judge(self, base: _Point, now: _Point, bound: bool, ceiling: int) -> None:
        """After a step up: go on if it paid, cut if it hurt (twice in a row); else stay, or undo
        a probe."""
        if now.rate <= base.rate * (1 - DROP):
            self._drops += 1
            if self._drops < CONFIRM_WINDOWS:
                return None  # one bad window may be noise: measure this limit again
            self.slow_start, self._hold, self._base, self._drops = False, HOLD_WINDOWS, None, 0
            self._probing = False
            return self._set(int(now.limit * DROP_DECREASE), "throughput fell")
        probing, self._probing, self._drops = self._probing, False, 0
        if now.rate >= base.rate * (1 + GAIN):
            self._base = now
            return self._grow(bound, ceiling, f"throughput +{now.rate / base.rate - 1:.0%}")
        self.slow_start, self._hold = False, HOLD_WINDOWS
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
