"""The `Climber`: one limit moved by the throughput and latency measured over short windows.

Throughput is measured over windows of a quarter of a second (a tenth in slow start), or three mean
latencies when those are longer; after a change, one latency is left to settle before the next window
starts. The latency is the mean in flight over the throughput (Little's law). Then:
- slow start: the limit doubles while each doubling raises throughput by `SLOW_START_GAIN` (25%, as
  in BBR's full-pipe test); a doubling short of that is measured once more before slow start ends,
  so one noisy window does not end it; after it, growth is additive (steps of a quarter of the limit);
- a step that neither gains nor loses is kept (`keep_flat`, the fetch limit) or undone (decode
  workers); a later probe waits `HOLD_WINDOWS` windows and is undone if it gains nothing;
- queueing (TCP Vegas): when a step leaves the latency more than `QUEUE` (50%) above its least since
  the source last changed, the items beyond what the store needs only wait; the limit drops at once
  to what the throughput needs at the least latency, plus `HEADROOM` (Little's law: rate x least
  latency x 1.25), and it does not grow while that queue lasts;
- a step after which throughput drops by more than `DROP`, or the latency rises by more than the added
  items in flight explain, in two windows in a row, is undone: back to the limit before it, still
  compared with what that gave (if it gives less now too, the source changed: below);
- throttling and timeouts (`cut`, by the tuner) halve the limit at once;
- the limit only grows while it is what holds the stage back (`mean in flight >= BOUND x limit`): a
  fetch stage starved by a slow decode or consumer is left where it is;
- when throughput or latency moves by more than `CHANGE`, or items queue, at an unchanged limit in
  three windows in a row, the source changed: the measure (and the least latency) starts afresh, and a
  slower source (latency up) gets its limit multiplied by the latency ratio at once (Little's law: the
  same rate needs that many more in flight; a jump that only queues is drained at the next window),
  then slow start resumes;
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
SLOW_START_WINDOW_S = 0.1  # ... and in slow start, where a doubling shows far above the noise
MIN_ITEMS = 16  # completions a window needs at least
WINDOW_LATENCIES = 3.0  # a window lasts at least this many mean latencies
SETTLE_LATENCIES = 1.0  # after a change, wait this many latencies before measuring
GAIN = 0.05  # a step counts as a gain above +5% throughput
SLOW_START_GAIN = 0.25  # slow start doubles again only after a gain this large (BBR's full pipe)
DROP = 0.2  # ... and as a loss below -20%
CHANGE = 0.5  # at an unchanged limit, a move this large means the source itself changed
BOUND = 0.5  # the limit binds when the mean in flight reaches this share of it
HOLD_WINDOWS = 4
ADD_SHARE = 1 / 4
CONFIRM_WINDOWS = 2  # windows in a row that must agree that a step hurt
CHANGE_WINDOWS = 3  # ... that the source changed (a stall of the host lasts one or two)
MAX_JUMP = 4.0  # the most a slower source multiplies the limit by at once
QUEUE = 0.5  # latency this far above its least since the source last changed: items queue
HEADROOM = 0.25  # ... then the limit goes to this much above rate x least latency (Little's law)


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
        self._doubt: float | None = None  # slow start: a first window's rate short of a doubling
        self._probing = False
        self._latency = 0.0
        self._least: float | None = None  # the least latency since the source last changed
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
        shortest = SLOW_START_WINDOW_S if self.slow_start else MIN_WINDOW_S
        if dt < max(shortest, WINDOW_LATENCIES * self._latency) or self._n < MIN_ITEMS:
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
        self.slow_start, self._base, self._doubt = False, None, None
        self._set(max(self.minimum, int(self.limit * factor)), why)
        self._restart(now + max(MIN_WINDOW_S, SETTLE_LATENCIES * self._latency))

    def _queued(self, now: _Point) -> bool:
        least = self._least
        return least is not None and least > 0 and now.latency > (1 + QUEUE) * least

    def _drain(self, now: _Point, rate: float) -> bool:
        """Items queue (latency well above its least): lower the limit to what `rate` needs at the
        least latency, plus `HEADROOM` (Little's law). Whether it was lowered."""
        assert self._least is not None
        target = math.ceil(rate * self._least * (1 + HEADROOM))
        if not self._queued(now) or target >= now.limit:
            return False
        self.slow_start, self._hold, self._base, self._drops = False, HOLD_WINDOWS, None, 0
        self._probing, self._doubt = False, None
        self._set(target, f"queueing: latency {now.latency / self._least:.1f}x its least")
        return True

    def _decide(self, now: _Point, bound: bool, ceiling: int) -> None:
        base = self._base
        if self._least is None or now.latency < self._least:
            self._least = now.latency
        grow = bound and not self._queued(now)  # more in flight would only queue
        if base is None or now.limit < base.limit:
            self._base, self._moves, self._drops, self._doubt = now, 0, 0, None
            return self._grow(grow, ceiling, "measuring") if self._hold <= 0 else None
        # the latency beyond what the added items in flight explain: > 1, the source got slower
        slower = now.latency / base.latency * base.limit / now.limit if base.latency > 0 else 1.0
        if now.limit > base.limit:  # the last step was a try
            self._moves = 0
            if slower <= 1 + CHANGE and self._drain(now, max(now.rate, base.rate)):
                return None
            return self._judge(base, now, grow, ceiling, slower)
        queued = self._queued(now)
        if queued:  # items queue at a limit we did not raise: the source (or host) got slower
            assert self._least is not None
            slower = max(slower, now.latency / (self._least * (1 + HEADROOM)))
        if queued or abs(now.rate / base.rate - 1) > CHANGE or abs(slower - 1) > CHANGE:
            return self._source_changed(base, now, bound, grow, ceiling, slower)
        self._base, self._moves = _Point(now.limit, (base.rate + now.rate) / 2, now.latency), 0
        self._hold -= 1
        if self._hold <= 0:
            self._grow(grow, ceiling, "probing")
            self._probing = self.limit > now.limit

    def _source_changed(
        self, base: _Point, now: _Point, bound: bool, grow: bool, ceiling: int, slower: float
    ) -> None:
        """Throughput or latency moved by more than the limit explains: once confirmed, measure
        afresh; a slower source gets its limit multiplied by the latency ratio (Little's law: the
        same rate needs that many more in flight), and slow start resumes from there."""
        self._moves += 1
        if self._moves < CHANGE_WINDOWS:
            return None
        self._moves, self._hold, self._drops, self._doubt = 0, 0, 0, None
        self._least, self._probing = now.latency, False
        rate, latency = now.rate / base.rate - 1, now.latency / base.latency - 1
        why = f"throughput {rate:+.0%}, latency {latency:+.0%}"
        if slower > 1 + CHANGE and bound:  # a jump, judged against this point like a probe
            self.slow_start, self._base, self._probing = False, now, True
            return self._set(math.ceil(now.limit * min(MAX_JUMP, slower)), why)
        self._base = None
        return self._grow(grow, ceiling, why)

    def _judge(self, base: _Point, now: _Point, bound: bool, ceiling: int, slower: float) -> None:
        """After a step up: go on if it paid, cut if it hurt (twice in a row); else stay, or undo
        a probe. In slow start, a doubling that gained less than `SLOW_START_GAIN` is measured
        once more (the mean of both windows decides) before slow start ends."""
        if now.rate <= base.rate * (1 - DROP) or slower > 1 + CHANGE:
            self._drops += 1
            if self._drops < CONFIRM_WINDOWS:
                return None  # one bad window may be noise: measure this limit again
            # back to the limit before the step, still compared with what it gave then: if that
            # is worse now too, the source changed (see `_decide`), else the step was too far
            self.slow_start, self._hold, self._drops = False, HOLD_WINDOWS, 0
            self._probing, self._doubt = False, None
            why = "throughput fell" if slower <= 1 + CHANGE else "latency rose"
            return self._set(base.limit, why)
        if self.slow_start and now.rate < base.rate * (1 + SLOW_START_GAIN):
            if self._doubt is None:
                self._doubt = now.rate
                return None  # short of a doubling's gain: may be noise, measure once more
            now = _Point(now.limit, (self._doubt + now.rate) / 2, now.latency)
        probing, self._probing, self._drops, self._doubt = self._probing, False, 0, None
        gain = now.rate / base.rate - 1
        if gain >= GAIN:
            self._base = now
            if self.slow_start and gain < SLOW_START_GAIN:  # the pipe is nearly full
                self.slow_start, self._hold = False, HOLD_WINDOWS
                return None
            return self._grow(bound, ceiling, f"throughput +{gain:.0%}")
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
