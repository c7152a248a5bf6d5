"""What a source is: something that lists keys and fetches the raw bytes of one key; and the hooks
a source (or its keys, an executor, a mix's input) may have besides, which the loader looks for.

Each optional hook is a `Protocol` of its own, checked with `isinstance(obj, Hook)`: the object has
the attribute (for a method: one that is not None). A source implements a hook by having the
method; it need not name these classes. These are contracts only (they import nothing of the
loader's), so every layer of the package may check them.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ._util.ranges import Ranges

__all__ = [
    "Bindable",
    "EndsEarly",
    "HandsOver",
    "HandsOverRowRuns",
    "HasAclose",
    "HasDigest",
    "HasEtag",
    "HasSetEpoch",
    "HasSize",
    "HasStats",
    "ReadsAhead",
    "RecordsDraws",
    "SaysHowItShuffles",
    "SharesItsKeys",
    "SharesItsStream",
    "ShufflesItself",
    "Source",
]


@runtime_checkable
class Source(Protocol):
    """A place samples come from.

    `keys()` lists the keys (a Sequence when their number is known; an AsyncIterable for a streamed
    listing). `fetch(key)` is a coroutine that returns the raw sample and is safe to cancel.
    `aclose()` releases connections and is idempotent.

    Optional hooks the loader calls when a source has them (each a protocol below): `set_epoch(epoch)`
    before each epoch (`HasSetEpoch`), and `bind(rank=, world_size=)` once at construction, for a
    source that shards its own data (`Bindable`; the loader then leaves the keys unsharded);
    `size(key)` (`HasSize`), the bytes `fetch(key)` will return where the source knows them without
    I/O (from its listing; else None), which a byte budget reserves before the fetch starts;
    `stats()` (`HasStats`), a dict of counters shown in `loader.stats().extra`, of which the loader
    reads: "throttles" and "retries" (running counts: a rise makes `concurrency="auto"` back off, and
    `diagnose()` names throttling) and, for a source that reads its samples ahead itself (tar shards),
    "shard_readers", "shard_reading", "shard_samples", "shard_bytes", "shard_read_s",
    "shard_all_reading_s" and "shard_read_p50_s" / "_p95_s" / "_p99_s", which then stand for the
    fetch stage; a `shuffle` attribute (`ShufflesItself`): the source orders itself, and a `Loader`
    over it refuses its own `shuffle=True` (saying how the source shuffles, from `shuffles_how`,
    `SaysHowItShuffles`, when it has one); a `max_bytes_ahead` attribute (`ReadsAhead`): the source
    reads ahead by itself, and the loader gives it its budget's share for that.
    """

    def keys(self) -> Sequence[Any] | Iterable[Any] | AsyncIterable[Any]: ...

    async def fetch(self, key: Any) -> Any: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class HasSetEpoch(Protocol):
    """Told each epoch before it starts (a source; a sampler, as torch's `DistributedSampler`)."""

    def set_epoch(self, epoch: int) -> None: ...


@runtime_checkable
class Bindable(Protocol):
    """Shards its own data: given the loader's rank and world size once, at construction."""

    def bind(self, *, rank: int, world_size: int) -> None: ...


@runtime_checkable
class HasSize(Protocol):
    """Knows the bytes `fetch(key)` will return without I/O (None where it does not)."""

    def size(self, key: Any) -> int | None: ...


@runtime_checkable
class HandsOver(Protocol):
    """Its keys carry their samples (tar shards' streamed samples): `fetch_now(key)` is `fetch(key)`
    done at once, a plain call that never waits, so a loader fetches such a key in place, with no
    task of its own for it."""

    def fetch_now(self, key: Any) -> Any: ...


@runtime_checkable
class HasEtag(Protocol):
    """Knows each object's ETag from its listing (None where it does not): a cached copy must match."""

    def etag(self, key: Any) -> str | None: ...


@runtime_checkable
class HasStats(Protocol):
    """Reports counters: a source (`Source` says which ones the loader reads), or an executor (shown
    as `loader.stats().extra["decode_pool"]`)."""

    def stats(self) -> Mapping[str, Any]: ...


@runtime_checkable
class HasAclose(Protocol):
    """Holds something to release (connections, a read ahead): `aclose()`, idempotent. Every
    `Source` has it; a mix's other inputs (lists, datasets, iterables) and the streams they give may."""

    async def aclose(self) -> None: ...


@runtime_checkable
class HandsOverRowRuns(Protocol):
    """Yields Tables made of rows of other Tables (a mix by rows), and can hand over the pieces
    instead: `row_runs()` / `arow_runs()` iterate as `for` / `async for` do, each item a pair
    `(parts, order)`. Each part is `(input, serial, table, first, rows)`: rows `first` .. `first +
    rows` of `table`, which came from input `input` (a loader's index in the mix) and which
    `serial` names (the same number for every part of one table; an input's next table has
    another). `order` (an int array, one entry per row of the item) is the part each row comes
    from, each part's rows taken in turn. A reader of the rows (the packer) then converts each
    table once and joins nothing."""

    def row_runs(self) -> Iterator[tuple[Sequence[tuple[int, int, Any, int, int]], Any]]: ...

    def arow_runs(self) -> AsyncIterator[tuple[Sequence[tuple[int, int, Any, int, int]], Any]]: ...


@runtime_checkable
class HasDigest(Protocol):
    """Keys without a length that say what they are (a mix's keys: its configuration), so that a
    saved state can check that it resumes the same keys."""

    def digest(self) -> str: ...


@runtime_checkable
class ReadsAhead(Protocol):
    """Reads ahead by itself (tar shards, Parquet row groups): a loader over it sets
    `max_bytes_ahead`, what it may hold read ahead, to its budget's share for that (None: no byte
    bound), at construction."""

    max_bytes_ahead: int | None


@runtime_checkable
class ShufflesItself(Protocol):
    """Orders its own samples (`shuffle`: whether it shuffles them); a Loader over it takes no
    `shuffle=True`."""

    shuffle: bool


@runtime_checkable
class SaysHowItShuffles(Protocol):
    """Says how it shuffles itself, for the error a refused `shuffle=True` raises."""

    shuffles_how: str


@runtime_checkable
class SharesItsKeys(Protocol):
    """Streams its keys and shares them among the readers itself, exactly (tar shards, a mix).

    `share_keys(epoch, consumed, drop_last)` streams this reader's keys of `epoch` once the
    positions in `consumed` are taken out, every reader the same number (padded by wrapping, or
    cut with `drop_last`); `positions(epoch, consumed, drop_last, rank, world_size, stop)` gives
    the positions the first `stop` keys of reader `rank` of `world_size` stand for (None: all of
    them), without reading: what a loader's state counts as consumed when it resumes on another
    world size. `rank_and_world()`: this reader's place, as a saved state records it.
    """

    def rank_and_world(self) -> tuple[int, int]: ...

    def share_keys(self, epoch: int, consumed: Ranges, drop_last: bool) -> AsyncIterable[Any]: ...

    def positions(
        self, epoch: int, consumed: Ranges, drop_last: bool, rank: int, world_size: int,
        stop: int | None,
    ) -> list[int]: ...  # fmt: skip


@runtime_checkable
class RecordsDraws(Protocol):
    """`SharesItsKeys` that draws its keys by weights a resume may change (a mix). A loader's state
    records `draws_state()` (JSON-ready); a load hands it back, `load_draws(saved, epoch, reached,
    consumed)`, before the resumed epoch's keys are counted or streamed: `reached` is how many keys
    the saved reader's stream had given of `epoch` (less `consumed`), None where the state is
    another reader's (a resume on another world size). Such a resume ends with `resume_draws(epoch,
    draw)`: the new readers' draws begin at `draw`, the furthest any old reader had drawn
    (`draw_reached(epoch, consumed, rank, world_size, keys)`: where reader `rank` stood after
    `keys` keys)."""

    def draws_state(self) -> dict[str, Any]: ...

    def load_draws(
        self, saved: Mapping[str, Any], epoch: int, reached: int | None, consumed: Ranges
    ) -> None: ...

    def draw_reached(
        self, epoch: int, consumed: Ranges, rank: int, world_size: int, keys: int
    ) -> int: ...

    def resume_draws(self, epoch: int, draw: int) -> None: ...


@runtime_checkable
class EndsEarly(Protocol):
    """`SharesItsKeys` over an epoch that may end before it reaches every position (a mix that
    stops when a source runs out): `left_out(epoch, consumed, world_size)` gives the positions
    `world_size` readers going on from `consumed` would never reach, which a resume on another
    world size counts as consumed, so that the resumed epoch ends where the uninterrupted one would
    have."""

    def left_out(self, epoch: int, consumed: Ranges, world_size: int) -> Ranges: ...


@runtime_checkable
class SharesItsStream(SharesItsKeys, Protocol):
    """`SharesItsKeys` over a fixed number of positions per epoch (`epoch_size()`, all readers'
    together): one part of a mix that resumes on another world size (tar shards)."""

    def epoch_size(self) -> int: ...
