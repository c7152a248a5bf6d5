"""The rule of a mix: which source each position draws, and the checks of `weights` and `stop`."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["BLOCK", "STOPS", "Choices", "check_stop", "check_weights"]

STOPS = ("first_exhausted", "all_exhausted", "cycle")
BLOCK = 4096  # positions drawn at once; a block's generator is seeded from (seed, epoch, block)
_CHOICE_SALT = 0x6D6978  # keeps the choice draws apart from the parts' permutations
_NONE = np.zeros(0, dtype=np.intp)


class Choices:
    """Which source each position of one epoch draws: a pure function of (seed, epoch, position)."""

    def __init__(self, weights: Sequence[float], seed: int, epoch: int) -> None:
        cum = np.cumsum(np.asarray(weights, dtype=np.float64) / math.fsum(weights))
        last = max(i for i, w in enumerate(weights) if w > 0)
        cum[last:] = 1.0  # rounding never lets a draw past the last source that has weight
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

    def counts(self, n: int) -> list[int]:
        """How often each source is drawn by positions 0..n-1 (block by block, not one by one)."""
        total = np.zeros(len(self._cum), dtype=np.int64)
        for block in range(-(-n // BLOCK)):
            picks = self._draw(block)[: n - block * BLOCK]
            total += np.bincount(picks, minlength=len(self._cum))
        return [int(c) for c in total]

    def _draw(self, block: int) -> np.ndarray[Any, np.dtype[np.intp]]:
        rng = np.random.default_rng([self._seed, self._epoch, block, _CHOICE_SALT])
        return np.searchsorted(self._cum, rng.random(BLOCK), side="right")


def check_weights(weights: Any, names: Sequence[str | None]) -> list[float]:
    """The weights as floats, one per source (a mapping: by the sources' names); errors name them."""
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
