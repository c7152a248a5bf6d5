"""The rule of a mix: which source each position draws, and the checks of `weights` and `stop`.

The weights are fixed, or a `Schedule`: weights in force from given positions of the epoch on,
held until the next breakpoint or interpolated linearly to it. Either way position `p` draws from
(seed, epoch, p) with the weights in force at `p`, so every resume stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "BLOCK", "STOPS", "Choices", "Schedule", "check_stop", "check_weights", "drawable", "own_weights",
    "schedule", "weights_config", "weights_of",
]  # fmt: skip

STOPS = ("first_exhausted", "all_exhausted", "cycle")
BLOCK = 4096  # positions drawn at once; a block's generator is seeded from (seed, epoch, block)
_CHOICE_SALT = 0x6D6978  # keeps the choice draws apart from the parts' permutations
_NONE = np.zeros(0, dtype=np.intp)


class Schedule:
    """Mixture weights that change over the positions of an epoch (`aioloader.schedule`).

    `points`: (position, weights) pairs, the first at position 0, positions increasing; each
    weights one non-negative number per source, not all zero (a {name: weight} mapping until
    `mix` checks them against its sources: `check_weights`). `interpolate`: "step" (each
    breakpoint's weights hold until the next) or "linear" (they move linearly to the next
    breakpoint's; the last holds from its position on).
    """

    def __init__(self, points: Sequence[tuple[int, Any]], interpolate: str) -> None:
        self.points_given = list(points)
        self.interpolate = interpolate
        rows = [w for _, w in points]
        numeric = all(isinstance(w, list) and all(isinstance(x, float) for x in w) for w in rows)
        self.points: list[tuple[int, list[float]]] = list(points) if numeric else []
        self.positions = np.asarray([p for p, _ in self.points], dtype=np.float64)
        self.table = np.asarray(rows if numeric else [], dtype=np.float64)  # [points, sources]

    def __repr__(self) -> str:
        return f"schedule({self.points or self.points_given}, interpolate={self.interpolate!r})"

    def __len__(self) -> int:
        return int(self.table.shape[1]) if self.table.ndim == 2 else 0

    def at(self, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
        """The weights in force at each of `positions`: [len(positions), sources]."""
        if self.interpolate == "linear":
            return np.stack(
                [np.interp(positions, self.positions, self.table[:, i]) for i in range(len(self))],
                axis=1,
            )
        index = np.searchsorted(self.positions, positions, side="right") - 1
        return self.table[index]

    def constant(self, start: int, end: int) -> bool:
        """Whether the weights are the same at every position in [start, end): no breakpoint
        after `start` and before `end`, and (interpolated) the same weights at both ends of the
        segment they lie in."""
        inside = np.searchsorted(self.positions, [start, end - 1], side="right")
        if inside[0] != inside[1]:
            return False  # a breakpoint after start, at or before the last position
        if self.interpolate != "linear" or inside[0] >= len(self.positions):
            return True  # steps, or past the last breakpoint: its weights hold
        return bool(np.array_equal(self.table[inside[0] - 1], self.table[inside[0]]))


def schedule(
    points: Sequence[tuple[int, Sequence[float] | Mapping[str, float]]],
    *,
    interpolate: str = "step",
) -> Schedule:
    """Mixture weights that change during an epoch, for `mix(..., weights=schedule(...))`.

    Args:
        points: (position, weights) pairs, positions increasing from 0: from `position` on (a
            position counts the mix's samples of the epoch; in a mix by rows, its rows), the
            weights are these (a list, or {name: weight} for named sources). A schedule over
            steps: position = step * batch_size. (Use stop="cycle" for one endless epoch, so the
            positions count the samples of the whole run.)
        interpolate: "step" (each breakpoint's weights hold until the next) or "linear" (they move
            linearly to the next one's).

    Returns:
        A `Schedule`, checked against the sources when `mix` is called. Position `p` still draws
        from (seed, epoch, p), with the weights in force at `p`: every resume stays exact. A saved
        state records the weights; a load under others (on the world size it was saved on) draws
        with them from its position on, and later states list the change (`"weights_changed"`).

    Example:
        >>> weights = schedule([(0, {"web": 0.9, "code": 0.1}), (900_000, {"web": 0.7, "code": 0.3})])
    """
    if interpolate not in ("step", "linear"):
        raise ValueError(f"interpolate: expected 'step' or 'linear', got {interpolate!r}")
    if isinstance(points, str | bytes) or not isinstance(points, Sequence) or not points:
        raise TypeError("points: expected a non-empty list of (position, weights) pairs")
    checked: list[tuple[int, Any]] = []
    for i, point in enumerate(points):
        if not isinstance(point, Sequence) or isinstance(point, str) or len(point) != 2:
            raise TypeError(f"points[{i}]: expected a (position, weights) pair, got {point!r}")
        position, weights = point
        if isinstance(position, bool) or not isinstance(position, int | np.integer):
            raise TypeError(f"points[{i}]: the position must be an int, got {position!r}")
        before = checked[-1][0] if checked else -1
        if (i == 0 and position != 0) or position <= before:
            raise ValueError(
                f"points[{i}]: positions start at 0 and increase, got {position} after {before}"
            )
        checked.append((int(position), weights))
    return Schedule(checked, interpolate)


def drawable(weights: Sequence[float] | Schedule) -> set[int]:
    """The sources a position may draw: weight above 0 (somewhere in a schedule)."""
    if isinstance(weights, Schedule):
        return {int(i) for i in np.flatnonzero(weights.table.max(axis=0) > 0)}
    return {i for i, w in enumerate(weights) if w > 0}


def own_weights(weights: Sequence[float] | Schedule) -> list[float] | Schedule:
    """A mix's own copy of its checked weights (a schedule as it is: it does not change)."""
    return weights if isinstance(weights, Schedule) else list(weights)


def weights_config(weights: Sequence[float] | Schedule) -> Any:
    """The weights as a saved state's configuration records them (JSON)."""
    if isinstance(weights, Schedule):
        return {"schedule": [[p, w] for p, w in weights.points], "interpolate": weights.interpolate}
    return list(weights)


def weights_of(config: Any) -> list[float] | Schedule:
    """The weights a saved state records (`weights_config`), as a mix holds them: ValueError or
    TypeError where they are not such a record."""
    if isinstance(config, Mapping):
        points = config.get("schedule")
        if not isinstance(points, list) or not all(
            isinstance(pair, list) and len(pair) == 2 for pair in points
        ):
            raise ValueError(f"expected {{'schedule': [[position, weights], ...]}}, got {config!r}")
        return schedule([(p, w) for p, w in points], interpolate=config.get("interpolate", ""))
    if not isinstance(config, list):
        raise TypeError(f"expected a list of weights or a schedule, got {config!r}")
    return config


class Choices:
    """Which source each position of one epoch draws: a pure function of (seed, epoch, position).

    `earlier`: where the weights changed during the epoch (a state loaded under other weights):
    (position, weights) pairs, positions increasing, each weights in force below its position (and
    from the pair before's on); `weights` hold from the last one's position on. Each position
    still draws from (seed, epoch, position), with the weights in force there.
    """

    def __init__(
        self, weights: Sequence[float] | Schedule, seed: int, epoch: int,
        earlier: Sequence[tuple[int, Sequence[float] | Schedule]] = (),
    ) -> None:  # fmt: skip
        self._earlier = [(int(until), Choices(w, seed, epoch)) for until, w in earlier]
        self._until = max((until for until, _ in self._earlier), default=0)
        self.live = set.union(drawable(weights), *(drawable(w) for _, w in earlier))
        self._schedule = weights if isinstance(weights, Schedule) else None
        n = len(weights)
        if not isinstance(weights, Schedule):
            cum = np.cumsum(np.asarray(weights, dtype=np.float64) / math.fsum(weights))
            last = max(i for i, w in enumerate(weights) if w > 0)
            cum[last:] = 1.0  # rounding never lets a draw past the last source that has weight
        else:
            cum = np.zeros(n)
        self._n = n
        self._cum, self._seed, self._epoch = cum, seed, epoch
        # the last block drawn, as an array and (once `at` asks) as a list: one draw serves both
        self._block, self._array = -1, _NONE
        self._list: list[int] | None = None

    def _block_of(self, block: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        if block != self._block:
            self._block, self._array, self._list = block, self._draw(block), None
        return self._array

    def at(self, position: int) -> int:
        """The source that `position` draws."""
        block, offset = divmod(position, BLOCK)
        if block != self._block or self._list is None:
            self._list = self._block_of(block).tolist()
        return self._list[offset]

    def span(self, start: int, n: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The sources drawn by positions `start` .. `start + n - 1`, as an array."""
        out = []
        block, offset = divmod(start, BLOCK)
        while n > 0:
            picks = self._block_of(block)[offset : offset + n]
            out.append(picks)
            n, block, offset = n - len(picks), block + 1, 0
        return out[0] if len(out) == 1 else np.concatenate(out)

    def iter_from(self, start: int) -> Iterator[int]:
        """The sources drawn by positions `start`, `start + 1`, ... (endless)."""
        block, offset = divmod(start, BLOCK)
        while True:
            yield from self._draw(block).tolist()[offset:]
            block, offset = block + 1, 0

    def counts(self, stop: int, start: int = 0) -> list[int]:
        """How often each source is drawn by positions `start`..`stop - 1` (block by block, not
        one by one)."""
        total = np.zeros(self._n, dtype=np.int64)
        for block in range(start // BLOCK, -(-stop // BLOCK)):
            lo = block * BLOCK
            picks = self._draw(block)[max(start - lo, 0) : stop - lo]
            total += np.bincount(picks, minlength=self._n)
        return [int(c) for c in total]

    def _draw(self, block: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        picks = self._drawn(block)
        start = block * BLOCK
        if start >= self._until:
            return picks
        lo = 0  # the positions of the block that each earlier weights were in force at
        for until, earlier in self._earlier:
            a, b = max(lo, start) - start, min(until, start + BLOCK) - start
            if a < b:
                picks[a:b] = earlier._draw(block)[a:b]
            lo = max(lo, until)
        return picks

    def _drawn(self, block: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The block's picks under `weights` (the same draws as every earlier weights')."""
        rng = np.random.default_rng([self._seed, self._epoch, block, _CHOICE_SALT])
        if self._schedule is None:
            return np.searchsorted(self._cum, rng.random(BLOCK), side="right")
        start = block * BLOCK
        if self._schedule.constant(start, start + BLOCK):
            # the weights hold over the whole block (most blocks of a schedule): one row's bounds,
            # searched as fixed weights are (the count of bounds <= a draw is the search's
            # answer: the same picks as the rows', at a sixth of their cost)
            cum = _bounds(self._schedule.at(np.arange(start, start + 1)))[0]
            return np.searchsorted(cum, rng.random(BLOCK), side="right")
        return self._drawn_by_rows(rng, start)

    def _drawn_by_rows(
        self, rng: np.random.Generator, start: int
    ) -> np.ndarray[Any, np.dtype[np.intp]]:
        """The picks of the positions from `start` (a block) with each position's own weights."""
        assert self._schedule is not None
        cum = _bounds(self._schedule.at(np.arange(start, start + BLOCK)))
        picks: np.ndarray[Any, np.dtype[np.intp]] = (rng.random(BLOCK)[:, None] >= cum).sum(axis=1)
        return picks.astype(np.intp)


def _bounds(weights: np.ndarray[Any, Any]) -> np.ndarray[Any, np.dtype[np.float64]]:
    """Each row's cumulative bounds ([rows, sources]), up to 1.0 from its last source with weight
    on (as the fixed weights' rule)."""
    cum: np.ndarray[Any, np.dtype[np.float64]] = np.cumsum(weights, axis=1) / weights.sum(
        axis=1, keepdims=True
    )
    last = weights.shape[1] - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
    cum[np.arange(weights.shape[1]) >= last[:, None]] = 1.0
    return cum


def check_weights(weights: Any, names: Sequence[str | None]) -> list[float] | Schedule:
    """The weights as floats, one per source (a mapping: by the sources' names), or a `Schedule`
    with every breakpoint's checked so; errors name them."""
    if isinstance(weights, Schedule):
        points = []
        for i, (position, each) in enumerate(weights.points_given):
            try:
                points.append((position, _check_fixed(each, names)))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"points[{i}]: {exc}") from None
        return Schedule(points, weights.interpolate)
    return _check_fixed(weights, names)


def _check_fixed(weights: Any, names: Sequence[str | None]) -> list[float]:
    if isinstance(weights, Mapping):
        if list(names) == [None] * len(names) or set(weights) != set(names):
            raise ValueError(
                f"weights: a mapping needs the sources' names as keys ({list(names)}), got "
                f"{list(weights)}"
            )
        weights = [weights[name] for name in names]
    if isinstance(weights, str | bytes) or not isinstance(weights, Sequence):
        raise TypeError(f"weights: expected a sequence of numbers, got {type(weights).__name__}")
    if len(weights) != len(names):
        raise ValueError(
            f"weights: {len(weights)} weights for {len(names)} sources; give one per source"
        )
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, int | float | np.integer | np.floating):
            raise TypeError(f"weights[{i}]: expected a number, got {type(w).__name__} {w!r}")
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"weights[{i}]: must be finite and >= 0, got {w}")
        out.append(float(w))
    if not any(out):
        raise ValueError(f"weights: all are zero ({out}); at least one source needs weight > 0")
    return out


def check_stop(stop: Any) -> str:
    if stop not in STOPS:
        raise ValueError(f"stop: expected one of {STOPS}, got {stop!r}")
    return str(stop)
