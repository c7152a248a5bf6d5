"""Loaders of columnar items mixed row by row: `mix(loaders, weights, rows_per_item=N)`.

Each loader yields pyarrow RecordBatches or Tables (`sources.parquet(..., rows_per_sample=M)`:
many documents a sample, the fast path), and the mix follows the rule of `mix.py` per *row*:
position `p` of the mix's epoch is one row (one document), drawn from loader `i` by (seed, epoch,
p) alone; each loader's rows are taken in its own order. The mix yields Tables of `N` rows (the
last of an epoch may have fewer), each the rows of `N` positions in order: the proportions hold
per document, as a mix of one document per sample would give them, with no Python step per row
(a slice per run of rows drawn from one loader).

Exact resume: what a loader has delivered and the mix not yet used is the rest of its current
item. `state_dict()` holds, per loader, its state from before that item and how many of its rows
were used (and, when some were, the item's group in the loader's epoch and its rows);
`load_state_dict()` puts that state back, and the item, delivered again, is taken from that row
on. So a state is small (no rows in it) and the batches after a resume are those of the run it was
saved from.

On another world size (every old rank's state), the rows used of a partly used item are counted
delivered by their keys: the item's group has one index of its loader's epoch per row, in order
(a Parquet source of `rows_per_sample` rows per key), so its first `used` indices are consumed
and the rest are shared among the new ranks with whatever the old ranks were not delivered
(`elastic.py`). Each row of each loader's epoch so comes once, before the save or after it.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from .._exceptions import StateError
from .._loader import Loader
from .._util.ranges import Ranges
from .choices import Choices, Schedule, drawable
from .loaders import NO_ITEM, Holds, MixFace, Mixing, Progress

__all__ = ["Interleaved", "MixedRows", "RowRun"]


class _Need:
    """The core asks its driver for the next item of loader `i` (`again`: from its next epoch's
    fresh iteration)."""

    __slots__ = ("again", "i")

    def __init__(self, i: int, again: bool = False) -> None:
        self.i, self.again = i, again


class _First:
    """The core asks its driver for the first item of each of loaders `ids` at once (an epoch's
    start: one loader's first row group would otherwise wait for the other's)."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


class _Held:
    """A loader's current item: its rows as a Table, how many the mix used, the loader's state
    from before it was delivered, and its serial number (one per item held, in the mix's life)."""

    __slots__ = ("before", "rows", "serial", "table", "used")

    def __init__(self) -> None:
        self.table: Any = None
        self.rows = self.used = self.serial = 0
        self.before: Any = None


class RowRun(NamedTuple):
    """Rows `first` .. `first + rows` of `table`, an item of loader `loader` (its index in the
    mix); `serial` names that item (the same number for every run of it, another for every other
    item)."""

    loader: int
    serial: int
    table: Any
    first: int
    rows: int


class Interleaved(NamedTuple):
    """One item of a mix by rows, as pieces of its loaders' items: `parts` (each some rows of one
    loader's item, in that item's order) and `order`, the part each position of the item takes its
    next row from. A loader's parts come in its own order, so the rows of part `j` are taken by the
    positions where `order == j`, one after another."""

    parts: list[RowRun]
    order: np.ndarray[Any, np.dtype[np.intp]]

    def runs(self) -> list[RowRun]:
        """The item as its runs of rows, in order: each the rows that consecutive positions take
        from one part."""
        order = self.order
        cuts = (np.flatnonzero(order[1:] != order[:-1]) + 1).tolist()
        taken = [0] * len(self.parts)
        out = []
        for a, b in itertools.pairwise([0, *cuts, len(order)]):
            j = int(order[a])
            part = self.parts[j]
            out.append(RowRun(part.loader, part.serial, part.table, part.first + taken[j], b - a))
            taken[j] += b - a
        return out


def _joined(item: Interleaved) -> Any:
    """The Table an item's runs of rows make."""
    import pyarrow as pa

    pieces = [run.table.slice(run.first, run.rows) for run in item.runs()]
    return pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]


class MixedRows(MixFace):
    """Loaders of RecordBatches or Tables mixed row by row; made by `aioloader.mix(...,
    rows_per_item=N)`. Iterate with `for` or `async for` (one epoch per iteration): Tables of
    `N` rows. `state_dict()` / `load_state_dict()` resume exactly (same loaders; on the same
    ranks, or on another world size from every old rank's state).

    Its epochs, draws and state are a `Mixing`'s (`loaders.py`), as a `MixedLoaders`'s are; it
    holds the rest of each loader's current item (`_Held`), declared to that `Mixing` as `Holds`.
    Closing it (`close()`, or the end of a `with` block) closes the loaders.
    """

    def __init__(
        self, loaders: Sequence[Loader[Any]], names: Sequence[str | None],
        weights: Sequence[float] | Schedule,
        *, seed: int, stop: str, rows_per_item: int,
    ) -> None:  # fmt: skip
        holds = Holds(clear=self._clear, load=self._load, part=self._part)
        self._mixing = mixing = Mixing(
            loaders, names, weights, seed=seed, stop=stop, kind=type(self).__name__,
            config={"rows_per_item": rows_per_item}, holds=holds,
        )  # fmt: skip
        self.loaders, self.names, self.weights = mixing.loaders, mixing.names, mixing.weights
        self.seed, self.stop, self.rows_per_item = seed, stop, rows_per_item
        self._held = [_Held() for _ in self.loaders]
        self._skip = [_UNUSED] * len(self.loaders)  # of the next item, after a load: _Used
        self._schema: Any = None
        self._serials = 0  # items held so far: each one's `serial`

    def __repr__(self) -> str:
        return repr(self._mixing)[:-1] + f", rows_per_item={self.rows_per_item})"

    # -- iteration -----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self._mixing.iterate(self._items)

    def __aiter__(self) -> AsyncIterator[Any]:
        """`async for table in mixed`: the same Tables, from the loaders' `async for`."""
        return self._mixing.aiterate(self._aitems)

    def row_runs(self) -> Iterator[Interleaved]:
        """`for` over the mix, each item as its pieces (`Interleaved`: its loaders' items' rows
        and the order they come in) rather than the Table they make: what `aioloader.pack`
        reads, which converts each loader's item once and joins nothing. The same items, epochs
        and state as `for item in mixed`."""
        return self._mixing.iterate(functools.partial(self._items, runs=True))

    def arow_runs(self) -> AsyncIterator[Interleaved]:
        """`async for` of `row_runs()`."""
        return self._mixing.aiterate(functools.partial(self._aitems, runs=True))

    def _items(self, progress: Progress, runs: bool = False) -> Iterator[Any]:
        core = self._core(progress)
        running: dict[int, Iterator[Any]] = {}
        try:
            ask = next(core)
            while True:
                if type(ask) is _Need:
                    if ask.again:
                        running.pop(ask.i).close()  # type: ignore[attr-defined]
                    it = running.get(ask.i) or running.setdefault(ask.i, iter(self.loaders[ask.i]))
                    ask = core.send(next(it, NO_ITEM))
                elif type(ask) is _First:
                    for i in ask.ids:
                        running[i] = iter(self.loaders[i])
                    pool = ThreadPoolExecutor(len(ask.ids), "aioloader-mix-first")
                    try:
                        firsts = list(pool.map(lambda i: next(running[i], NO_ITEM), ask.ids))
                    except BaseException:
                        pool.shutdown(wait=True)  # no loader is still being drawn from
                        raise
                    # every call has ended: its threads end by themselves, and the first batch
                    # does not wait for them (~10 ms on a busy machine)
                    pool.shutdown(wait=False)
                    ask = core.send(dict(zip(ask.ids, firsts, strict=True)))
                else:
                    box, ask = [ask if runs else _joined(ask)], None
                    yield box.pop()  # not held here while the consumer has it
                    ask = next(core)
        except StopIteration:
            return
        finally:
            core.close()
            for it in running.values():
                it.close()  # type: ignore[attr-defined]

    async def _aitems(self, progress: Progress, runs: bool = False) -> AsyncGenerator[Any, None]:
        core = self._core(progress)
        running: dict[int, AsyncIterator[Any]] = {}
        try:
            ask = next(core)
            while True:
                if type(ask) is _Need:
                    if ask.again:
                        await running.pop(ask.i).aclose()  # type: ignore[attr-defined]
                    it = running.get(ask.i) or running.setdefault(ask.i, aiter(self.loaders[ask.i]))
                    ask = core.send(await anext(it, NO_ITEM))
                elif type(ask) is _First:
                    for i in ask.ids:
                        running[i] = aiter(self.loaders[i])
                    firsts = await asyncio.gather(*(anext(running[i], NO_ITEM) for i in ask.ids))
                    ask = core.send(dict(zip(ask.ids, firsts, strict=True)))
                else:
                    box, ask = [ask if runs else _joined(ask)], None
                    yield box.pop()
                    ask = next(core)
        except StopIteration:
            return
        finally:
            core.close()
            for it in running.values():
                await it.aclose()  # type: ignore[attr-defined]

    def _core(self, progress: Progress) -> Generator[Any, Any, None]:
        """The epoch's items, as `Interleaved` pieces of the loaders' items, asking for the
        loaders' items (`_Need`) as it runs out of rows: the same steps for `for` and `async for`,
        which only differ in how they draw items. An item is worked out a stretch at a time, with
        no Python step per run of rows: each stretch ends where a loader's held item runs out."""
        choices = Choices(self.weights, self.seed, progress.epoch)
        size = self.rows_per_item
        ready: dict[int, Any] = {}  # loader -> its state, where its first pull found no item
        ids = sorted(drawable(self.weights))
        if len(ids) > 1:  # every loader's first item at once, each held from then on
            befores = {i: self.loaders[i].state_dict() for i in ids}
            firsts = yield _First(ids)
            for i in ids:
                if firsts[i] is NO_ITEM:  # (the epoch ends where it is drawn, as below)
                    ready[i] = befores[i]
                else:
                    self._hold(i, firsts[i], befores[i])
        while True:
            picks = choices.span(progress.position, size)
            order = np.empty(size, dtype=np.intp)
            parts: list[RowRun] = []
            pos, ended = 0, False
            while pos < size:
                rest = picks[pos:]
                # the first position from `pos` whose loader has no row left in its held item
                cut, short, where = size, -1, {}
                for i in ids:
                    at = where[i] = np.flatnonzero(rest == i)
                    held = self._held[i]
                    left = held.rows - held.used
                    if len(at) > left and pos + int(at[left]) < cut:
                        cut, short = pos + int(at[left]), i
                for i, at in where.items():  # positions pos .. cut: what is held serves them
                    at = at[: np.searchsorted(at, cut - pos)]
                    if len(at):
                        held = self._held[i]
                        order[pos + at] = len(parts)
                        parts.append(RowRun(i, held.serial, held.table, held.used, len(at)))
                        held.used += len(at)
                pos = cut
                if short < 0:
                    break
                i = short  # loader `i` needs its next item at `pos`
                if i in ready:
                    before, item = ready.pop(i), NO_ITEM
                else:
                    before = self.loaders[i].state_dict()
                    item = yield _Need(i)
                if item is NO_ITEM:
                    if self._mixing.ends(i, progress):
                        ended = True
                        break
                    before = self.loaders[i].state_dict()
                    item = self._mixing.first(i, progress, (yield _Need(i, again=True)))
                self._hold(i, item, before)
            if pos:
                progress.position += pos
                yield Interleaved(parts, order[:pos])
            if ended:
                return

    def _hold(self, i: int, item: Any, before: Any) -> None:
        """Make `item` loader `i`'s current one (its rows already used skipped, after a load)."""
        import pyarrow as pa

        if isinstance(item, pa.RecordBatch):
            item = pa.Table.from_batches([item])
        elif not isinstance(item, pa.Table):
            raise TypeError(
                f"rows_per_item: loader {self._mixing.label(i)} gave a {type(item).__name__}; a "
                "mix by rows takes loaders of pyarrow RecordBatches or Tables (sources.parquet("
                "..., rows_per_sample=N), batch_size=None, collate=None)"
            )
        if self._schema is None:
            self._schema = item.schema
        elif not item.schema.equals(self._schema):
            raise TypeError(
                f"rows_per_item: loader {self._mixing.label(i)} gave columns {item.schema.names} "
                f"({item.schema.types}), another {self._schema.names} ({self._schema.types}); "
                "a mix by rows needs the same columns from every loader"
            )
        held = self._held[i]
        held.table, held.rows, held.before = item, item.num_rows, before
        self._serials += 1
        held.serial = self._serials
        held.used, self._skip[i] = self._skip[i].count, _UNUSED

    # -- state and lifecycle -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """`MixedLoaders.state_dict()` with, per loader, its state from before its current item
        and the rows of that item used (`"used"`; where some were, the item's group in the
        loader's epoch, `"group"`, and its rows, `"rows"`). JSON-ready; safe between any two
        items."""
        state = self._mixing.state_dict()
        for own, held, skip in zip(state["sources"], self._held, self._skip, strict=True):
            if held.table is not None and held.used < held.rows:
                used = _Used(held.used, _group_of(held.before, own["state"]), held.rows)
                own["state"] = held.before
            else:
                used = skip  # (a loaded state not yet run: its rows to skip still)
            own["used"] = used.count
            if used.count and used.group is not None:
                own["group"] = used.group
            if used.count and used.rows is not None:
                own["rows"] = used.rows
        return state

    # what the mix holds of its loaders' items, declared to its `Mixing` (`Holds`)

    def _clear(self) -> None:
        """Hold nothing and skip nothing: a fresh epoch, or a load on another world size."""
        self._held = [_Held() for _ in self.loaders]
        self._skip = [_UNUSED] * len(self.loaders)

    def _load(self, saved: Sequence[Mapping[str, Any]]) -> None:
        """This rank's own saved entries: hold nothing, and skip the rows of each loader's next
        item that they say were used."""
        skip = [_used_of(own, self._mixing.label(i)) for i, own in enumerate(saved)]
        self._held = [_Held() for _ in self.loaders]
        self._skip = [_UNUSED if used is None else used for used in skip]

    def _part(self, i: int, own: Mapping[str, Any]) -> tuple[int, int, int] | None:
        """Loader `i`'s partly used item in an old rank's entry: (group, rows used, rows)."""
        label = self._mixing.label(i)
        used = _used_of(own, label)
        if used is None:
            return None
        if used.group is None or used.rows is None:
            raise StateError(
                f"sources: {label}: {used.count} rows of its item were used and the state "
                "does not say the item's group (saved by an older aioloader?), so it cannot "
                "resume on another world size; resume it on the saved one",
                field="group",
            )
        return used.group, used.count, used.rows


class _Used:
    """Rows of a loader's item the mix used: how many, the item's group in its loader's epoch
    and its rows (None where not known)."""

    __slots__ = ("count", "group", "rows")

    def __init__(self, count: int, group: int | None, rows: int | None) -> None:
        self.count, self.group, self.rows = count, group, rows


_UNUSED = _Used(0, None, None)


def _used_of(own: Mapping[str, Any], label: str) -> _Used | None:
    """The rows used of a loader's item in a saved entry (None: none), checked."""
    used, group, rows = own.get("used", 0), own.get("group"), own.get("rows")
    if type(used) is not int or used < 0:
        raise StateError(
            f"sources: {label}: 'used' must be an int >= 0, got {used!r}", field="used"
        )
    if not used:
        return None
    if rows is not None and (type(rows) is not int or rows <= used):
        raise StateError(
            f"sources: {label}: 'used' ({used}) must be fewer than the item's rows ({rows!r})",
            field="used",
        )
    return _Used(used, group if type(group) is int and group >= 0 else None, rows)


def _group_of(before: Mapping[str, Any], after: Mapping[str, Any]) -> int | None:
    """The group a loader delivered between its states `before` and `after` (the one item it
    handed over in between), or None where they do not say one."""
    if before.get("epoch") != after.get("epoch") or before.get("consumed") != after.get("consumed"):
        return None
    new = Ranges(after.get("delivered", [])).difference(Ranges(before.get("delivered", [])))
    return new.pairs[0][0] if len(new) == 1 else None
