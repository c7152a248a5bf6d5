"""The bounds an epoch keeps: fetches in flight (a limit that may change), bytes held, skips allowed.

Every object here is owned by the thread of the event loop that runs the loader's epochs: only that
thread changes them (their `asyncio.Event`s are that loop's), so they take no lock; `stats()` on
another thread only reads numbers from them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from .._util.bytearrays import give_back_freed_memory

__all__ = [
    "ByteBudget",
    "ErrorPolicy",
    "FixedConcurrency",
    "Gate",
    "HeldBound",
    "Tuner",
]

ON_ERROR = ("raise", "skip")


class Tuner:
    """Decides the fetch concurrency while the loader runs. `limit` is read at every launch."""

    limit: int

    def completed(self, now: float) -> None:
        """One fetch finished at `now` (perf_counter seconds)."""

    def throttled(self) -> None:
        """The source said to slow down (HTTP 503 SlowDown, 429, timeouts)."""


class FixedConcurrency(Tuner):
    """The concurrency the user chose."""

    def __init__(self, limit: int) -> None:
        self.limit = limit


class HeldBound(Tuner):
    """The samples an epoch may hold: `base` (its prefetched batches) plus the fetch limit of now."""

    def __init__(self, fetch: Tuner, base: int) -> None:
        self._fetch, self._base = fetch, base

    @property
    def limit(self) -> int:  # type: ignore[override]
        return self._base + self._fetch.limit


class Gate:
    """At most `tuner.limit` holders at once; the limit may change between acquisitions.

    Only the epoch's launcher acquires, so one waiter at a time is all it serves.
    """

    def __init__(self, tuner: Tuner) -> None:
        self.tuner = tuner
        self.busy = 0
        self._changed = asyncio.Event()

    async def acquire(self, at_least: int = 1) -> None:
        """Wait until fewer than the limit (or `at_least`, if larger) hold it, then hold it."""
        while self.busy >= max(at_least, self.tuner.limit):
            self._changed.clear()
            await self._changed.wait()
        self.busy += 1

    def release(self) -> None:
        self.busy -= 1
        self._changed.set()


class SampleSizes:
    """The sizes of the samples a loader has fetched, and what decode added to those it gave back,
    for `ByteBudget`'s estimate; kept across epochs, so only a loader's very first samples wait for
    a first size."""

    __slots__ = ("count", "decoded", "decoded_fetched", "fetched", "grown")

    def __init__(self) -> None:
        self.count = 0  # samples fetched
        self.fetched = 0  # their bytes as fetched
        self.decoded = 0  # samples decode has given back
        self.decoded_fetched = 0  # their bytes as fetched
        self.grown = 0  # what decode added to them

    @property
    def growth(self) -> float:
        """What decode adds to a sample, on average (0 before the first is back)."""
        return self.grown / self.decoded if self.decoded else 0.0

    def mean(self) -> int:
        """What a sample holds on average: as fetched, plus what decode adds."""
        return int(self.fetched / self.count + self.growth) if self.count else 0

    def expect(self, known: int) -> int:
        """What a sample that a source says is `known` bytes will hold, decode's growth included."""
        if not self.decoded_fetched:
            return known
        return max(known, int(known * (self.decoded_fetched + self.grown) / self.decoded_fetched))


class ByteBudget:
    """Bytes held from fetch to hand-over, against `max_bytes` (None: no byte bound).

    A launch reserves what its sample will hold: from the size its source knows before fetching it
    (a file's or an object's size: `Source.size`), grown as decode has grown samples so far; else
    the mean size seen so far (what samples were fetched as, plus what decode added); a sample being
    decoded reserves what decode adds on average until it is back (and until a first sample is back
    from decode, no more go to decode than it runs at once, `first_decodes`: none waits queued).
    Until a first size is measured, samples of unknown size are admitted one at a time (a first wave
    of `concurrency` samples of unknown size could hold many times the budget). The oldest batch
    still being assembled is never held back, so a batch larger than the whole budget still
    completes (the bound is then exceeded by that one batch, and a warning names the sizes once).
    """

    def __init__(
        self,
        max_bytes: int | None,
        sizes: SampleSizes | None = None,
        first_decodes: int = 1,
        give_back_every: int | None = None,
    ) -> None:
        self.max_bytes = max_bytes
        # bytes released between two hand-backs of the allocator's slack (`_give_back`); None: never
        self.give_back_every = give_back_every
        self.first_decodes = first_decodes  # decodes at once before what decode adds is known
        self.held = 0
        self.pending = 0  # launched, size not yet known
        self.pending_known = 0  # bytes reserved for launched samples whose size their source knew
        self.decoding = 0  # fetched, not decoded yet: each reserves what decode adds on average
        self.sizes = SampleSizes() if sizes is None else sizes  # the loader's, kept across epochs
        self._warned = False
        self._changed = asyncio.Event()
        self._released = 0  # bytes released since the allocator last gave back (`_give_back`)

    @property
    def reserved(self) -> int:
        """Bytes reserved for the samples launched and not measured yet (known sizes as expected,
        the others at the mean)."""
        sizes = self.sizes
        return self.pending_known + self.pending * sizes.mean() + int(self.decoding * sizes.growth)

    def expect(self, known: int | None) -> int | None:
        """What to reserve for a sample its source says is `known` bytes (None: not known)."""
        return None if known is None else self.sizes.expect(known)

    def _full(self, expected: int | None) -> bool:
        if self.max_bytes is None:
            return False
        sizes = self.sizes
        if self.decoding >= self.first_decodes and not sizes.decoded:
            return True  # what decode adds is not known yet: as many as decode runs at once
        if expected is None:
            if not sizes.count:  # nothing measured yet: one sample at a time
                return self.pending > 0
            expected = sizes.mean()
        return self.held + self.reserved + expected > self.max_bytes

    async def room(self, oldest: Callable[[], bool], expected: int | None = None) -> None:
        """Wait until one more sample fits (`expected` bytes: see `expect`; None: the mean), or
        until it belongs to the oldest batch (`oldest()`, asked again whenever the budget or the
        batches change: see `poke`)."""
        while self._full(expected) and not oldest():
            self._give_back()
            self._changed.clear()
            await self._changed.wait()

    def _give_back(self) -> None:
        """The budget binds: hand the allocator's slack back to the system, at most once per
        `give_back_every` bytes released (`MemoryBudget.give_back_every`). Samples freed by one
        thread go back to the heap arena of the thread that allocated them, and a fetch on another
        thread allocates anew: each arena keeps a sample or two that nothing uses, and the process
        outgrows the budget by them."""
        if self.give_back_every is None or self._released < self.give_back_every:
            return
        self._released = 0
        give_back_freed_memory()

    def poke(self) -> None:
        """The oldest batch changed: waiting launches look again."""
        self._changed.set()

    def launched(self, expected: int | None = None) -> None:
        if expected is None:
            self.pending += 1
        else:
            self.pending_known += expected

    def measured(self, n: int | None, expected: int | None = None) -> None:
        """A sample launched with `expected` turned out to be `n` bytes (None: it failed)."""
        if expected is None:
            self.pending -= 1
        else:
            self.pending_known -= expected
        if n is not None:
            self.sizes.fetched += n
            self.sizes.count += 1
        self._changed.set()

    def decode_started(self) -> None:
        """A fetched sample goes to decode: until it is back, it reserves what decode adds to a
        sample on average (held as fetched, a sample of a few bytes, a key or a path, would
        otherwise let every launch through while its decode, queued or running, makes it large)."""
        self.decoding += 1

    def decode_ended(self) -> None:
        self.decoding -= 1
        self._changed.set()

    def grew(self, n: int, fetched: int) -> None:
        """A sample fetched as `fetched` bytes came back from decode holding `n` more: the
        estimate a launch reserves grows with it."""
        sizes = self.sizes
        sizes.grown += n
        sizes.decoded += 1
        sizes.decoded_fetched += fetched

    def add(self, n: int) -> None:
        self.held += n

    def over(self, batch_bytes: int) -> str | None:
        """A warning's text, once, when one batch alone holds more than the whole budget."""
        if self._warned or self.max_bytes is None or batch_bytes <= self.max_bytes:
            return None
        self._warned = True
        return (
            f"one batch holds {batch_bytes:,} bytes, more than max_bytes_in_flight's "
            f"{self.max_bytes:,} left for samples in flight: each such batch is admitted alone, "
            "so memory exceeds the budget by up to one batch; raise max_bytes_in_flight or make "
            "batches smaller"
        )

    def release(self, n: int) -> None:
        self.held -= n
        self._released += n
        self._changed.set()


@dataclass(frozen=True)
class ErrorPolicy:
    """What a failed sample does: "raise" ends the epoch; "skip" drops it, within `max_skipped`.

    `max_skipped`: a count (an int, or a whole float >= 1 such as 20.0), a fraction of the epoch's
    samples (a float < 1), or None (no limit).
    """

    on_error: str = "raise"
    max_skipped: int | float | None = 0.05

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        m = self.max_skipped
        if m is not None and (isinstance(m, bool) or not isinstance(m, int | float) or not m >= 0):
            raise ValueError(f"max_skipped must be a count, a fraction or None, got {m!r}")
        if isinstance(m, float) and m >= 1:
            if not m.is_integer():
                raise ValueError(
                    f"max_skipped must be a count (a whole number) or a fraction < 1, got {m!r}"
                )
            object.__setattr__(self, "max_skipped", int(m))  # 20.0 means 20 samples

    def allows(self, skipped: int, epoch_samples: int | None) -> bool:
        """Whether `skipped` samples (this one included) are still within the budget."""
        m = self.max_skipped
        if self.on_error != "skip":
            return False
        if m is None:
            return True
        if isinstance(m, float):
            return epoch_samples is None or skipped <= m * epoch_samples
        return skipped <= m
