"""Sets of non-negative ints kept as sorted, disjoint half-open ranges (compact in saved state)."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

__all__ = ["Ranges", "ranges_of"]


class Ranges:
    """A set of ints stored as sorted disjoint [start, stop) pairs.

    Example:
        >>> r = Ranges.of([0, 1, 2, 5, 7, 6])
        >>> r.pairs
        [[0, 3], [5, 8]]
        >>> 6 in r, 4 in r, len(r)
        (True, False, 6)
    """

    __slots__ = ("_starts", "_stops")

    def __init__(self, pairs: Iterable[Iterable[int]] = ()) -> None:
        self._starts: list[int] = []
        self._stops: list[int] = []
        for start, stop in sorted(tuple(p) for p in pairs):
            self._append(int(start), int(stop))

    @classmethod
    def of(cls, values: Iterable[int]) -> Ranges:
        r = cls()
        for v in sorted(set(values)):
            r._append(v, v + 1)
        return r

    def _append(self, start: int, stop: int) -> None:
        if start < 0 or stop < start:
            raise ValueError(f"invalid range [{start}, {stop})")
        if start == stop:
            return
        if self._stops and start <= self._stops[-1]:
            self._stops[-1] = max(self._stops[-1], stop)
        else:
            self._starts.append(start)
            self._stops.append(stop)

    def add(self, value: int) -> None:
        """Put `value` in: at once where it joins or follows the last range (ints added in
        order, as a loader delivers its groups), else by a search."""
        if value < 0:
            raise ValueError(f"invalid range [{value}, {value + 1})")
        starts, stops = self._starts, self._stops
        if not stops or value > stops[-1]:
            starts.append(value)
            stops.append(value + 1)
            return
        if value == stops[-1]:
            stops[-1] += 1
            return
        i = bisect.bisect_right(starts, value) - 1
        if i >= 0 and value < stops[i]:
            return
        left = i >= 0 and stops[i] == value
        right = i + 1 < len(starts) and starts[i + 1] == value + 1
        if left and right:
            stops[i] = stops.pop(i + 1)
            del starts[i + 1]
        elif left:
            stops[i] += 1
        elif right:
            starts[i + 1] = value
        else:
            starts.insert(i + 1, value)
            stops.insert(i + 1, value + 1)

    @property
    def pairs(self) -> list[list[int]]:
        """The ranges as JSON-friendly [start, stop] lists."""
        return [[a, b] for a, b in zip(self._starts, self._stops, strict=True)]

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        i = bisect.bisect_right(self._starts, value) - 1
        return i >= 0 and value < self._stops[i]

    def __len__(self) -> int:
        return sum(b - a for a, b in zip(self._starts, self._stops, strict=True))

    def __iter__(self) -> Iterator[int]:
        for a, b in zip(self._starts, self._stops, strict=True):
            yield from range(a, b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ranges) and self.pairs == other.pairs

    def __repr__(self) -> str:
        return f"Ranges({self.pairs})"

    def union(self, values: Iterable[int]) -> Ranges:
        return Ranges.of([*self, *values])

    def array(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """The ints of this set, ascending, as an int64 array (no Python step per int)."""
        parts = [
            np.arange(a, b, dtype=np.int64) for a, b in zip(self._starts, self._stops, strict=True)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def difference(self, other: Ranges) -> Ranges:
        """The ints in this set and not in `other` (a walk over both sets' ranges, not their ints).

        Example:
            >>> Ranges([[0, 10]]).difference(Ranges([[2, 4], [6, 7]])).pairs
            [[0, 2], [4, 6], [7, 10]]
        """
        out = Ranges()
        first = 0  # the first range of `other` that may overlap the range at hand
        for a, b in zip(self._starts, self._stops, strict=True):
            while first < len(other._stops) and other._stops[first] <= a:
                first += 1
            start, j = a, first
            while j < len(other._starts) and other._starts[j] < b:
                if other._starts[j] > start:
                    out._append(start, other._starts[j])
                start, j = max(start, other._stops[j]), j + 1
            if start < b:
                out._append(start, b)
        return out

    def complement(self, n: int) -> list[int]:
        """The ints in [0, n) not in this set, ascending."""
        out: list[int] = []
        prev = 0
        for a, b in zip(self._starts, self._stops, strict=True):
            out.extend(range(prev, min(a, n)))
            prev = max(prev, b)
        out.extend(range(prev, n))
        return out


def ranges_of(values: np.ndarray[Any, Any]) -> Ranges:
    """The ints of `values` (any order, repeats allowed) as Ranges, without a Python step per int."""
    if not len(values):
        return Ranges()
    values = np.sort(values)  # (not np.unique: its hashing took 1.6 s for 2 M ints here)
    values = values[np.concatenate([[True], np.diff(values) != 0])]
    cuts = np.flatnonzero(np.diff(values) != 1) + 1
    starts = values[np.concatenate([[0], cuts])]
    stops = values[np.concatenate([cuts - 1, [len(values) - 1]])] + 1
    return Ranges(zip(starts.tolist(), stops.tolist(), strict=True))
