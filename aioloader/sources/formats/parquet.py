"""Parquet files as a source: rows (or record batches) read by row group from disk, HTTP(S) or S3.

The footers are read when the source is made (see `parquet_bytes.py`); a row group is fetched when the
epoch first needs it, with only the chosen columns' column chunks, and decoded by pyarrow in a thread.
The epoch's order (`parquet_order.py`) follows from the footers alone: row groups shuffled from
(seed, epoch), rows mixed within `shuffle_buffer` places, one contiguous share per rank.

A `Loader` over this source runs that order as its order stage (batches of whole samples, equal step
counts on every rank, `state_dict()` / `load_state_dict()` and elastic resume as for any keys): the keys
are `RowRef`s (one row) or `RowsRef`s (`rows_per_sample` rows) that name their row group and rows, and
`fetch` turns one into its sample. A row group is held while the order has rows of it to hand out and
while any sample of it is in flight; at most `row_groups_in_flight` are read ahead of the rows handed
out, fewer when their decoded bytes would pass half of the loader's `max_bytes_in_flight`, asked for a
quarter of them at a time (the reads and the read-ahead: `parquet_readahead.py`). From a remote
store, a walk's first row group is read (fetched and decoded) before those read ahead fetch, so
that the first batch does not wait for their bytes.

From its second epoch on, a reader that has asked for every row group of its epoch reads the first
row groups of the next epoch (as a fresh epoch of this reader would begin it) in the room left,
so that the next epoch's first batch does not wait for a request and its decode; they are kept for
that epoch alone, and dropped when another epoch, or another event loop, comes next.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._util.loops import run_to_end
from ..._util.ranges import Ranges
from ..._util.validate import check_int
from . import parquet_lists
from .options import ShardOptions
from .parquet_bytes import (
    Bytes,
    FileMeta,
    ParquetError,
    decode_pool,
    decode_row_group,
    decode_row_group_in_parts,
    fetch_row_group,
    need_pyarrow,
    read_footer,
    read_local_footer,
    store_for,
)
from .parquet_order import epoch_rows, remaining, share
from .parquet_readahead import Ahead, RowGroup, Runs, Turns, cores, runs_of
from .parquet_take import take_rows

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["Parquet", "ParquetError", "RowRef", "RowsRef", "parquet"]

# Local files up to this many have their footers read in the calling thread, one after another
# (about 0.4 ms each from the page cache, where a loop and threads of its own cost ~20 ms); more
# (or any remote one) are read at once on a loop.
_LOCAL_FOOTERS_HERE = 64
# The fewest rows a row group of RecordBatch samples is decoded in at a time (`Parquet._decode`).
_PART_ROWS = 256
# Each loop's decode turns (`Parquet._decode_turns`), gone with the loop.
_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Turns] = weakref.WeakKeyDictionary()


def _turns_per_loop() -> int:
    """A loop's share of the cores for decodes: the cores split among the loops that decode
    (several loaders mixed each run on a loop of their own; each taking a decode per core, their
    row groups would evict each other from the caches and all go slower), one at least. Each
    loop orders its own row groups; no loop hands a turn to another."""
    try:
        loops = sum(1 for loop in list(_TURNS) if not loop.is_closed())
    except RuntimeError:  # another loop took its turns as they were counted
        loops = len(_TURNS)
    return max(1, cores() // max(1, loops))


class RowRef:
    """The key of one row: its file, row group and row (and, while the epoch runs, its row group)."""

    __slots__ = ("group", "label", "row", "row_group")

    def __init__(self, group: RowGroup, label: str, row_group: int, row: int) -> None:
        self.group, self.label, self.row_group, self.row = group, label, row_group, row

    def __repr__(self) -> str:
        return f"<row {self.row} of row group {self.row_group} of {self.label}>"

    def __reduce__(self) -> tuple[Any, ...]:  # to a decode in a worker: where, without the data
        return (tuple, ((self.label, self.row_group, self.row),))


class RowsRef:
    """The key of `rows_per_sample` rows: (row group, rows in it) parts, in the epoch's order."""

    __slots__ = ("parts", "where")

    def __init__(self, parts: list[tuple[RowGroup, np.ndarray]], where: list[tuple[str, int]]):
        self.parts = parts
        self.where = where  # (file, row group) of each part

    def __repr__(self) -> str:
        n = sum(len(rows) for _, rows in self.parts)
        (label, rg), more = self.where[0], len(self.where) - 1
        tail = f" and {more} more row groups" if more else ""
        return f"<{n} rows from row group {rg} of {label}{tail}>"

    def __reduce__(self) -> tuple[Any, ...]:
        rows = [rows.tolist() for _, rows in self.parts]
        return (tuple, ((tuple(self.where), tuple(rows)),))


class _AllRows(Sequence[tuple[str, int, int]]):
    """Every row as (file, row group, row): the keys as the loader's state fingerprints them."""

    def __init__(self, source: Parquet) -> None:
        self._source = source

    def __len__(self) -> int:
        return self._source.num_rows

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        g, row = self._source.locate(int(i))
        file, rg = self._source.row_groups[g]
        return (self._source.metas[file].label, rg, row)


class Parquet:
    """Rows of Parquet files, as a source. See `parquet()` for the arguments."""

    def __init__(
        self,
        urls: str | Sequence[str],
        columns: Sequence[str] | None = None,
        *,
        rows_per_sample: int | None = None,
        row_groups_in_flight: int = 16,
        options: ShardOptions | None = None,
        **shared: Any,
    ) -> None:
        """`shared`: the arguments `parquet()` shares with `tar_shards()` (`ShardOptions`: order,
        share, stores' options), one by one or together as `options`."""
        self.options = ShardOptions.of(options, shared, "Parquet.__init__")
        need_pyarrow()
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls or not all(isinstance(u, str) for u in self.urls):
            raise ValueError(f"urls: expected paths or URLs of Parquet files, got {urls!r}")
        self.options.check("rows")
        check_int("row_groups_in_flight", row_groups_in_flight, minimum=1)
        if rows_per_sample is not None:
            check_int("rows_per_sample", rows_per_sample, minimum=1)
        # what a Loader's refused shuffle=True says
        self.shuffles_how = "its row-group order every epoch, its rows with shuffle_buffer=N"
        self.columns = _columns_arg(columns)
        self.rows_per_sample = rows_per_sample
        self.shuffle = self.options.shuffle
        self.shuffle_buffer, self.seed = self.options.shuffle_buffer, self.options.seed
        self.slot, self.slots = self.options.place()
        self.row_groups_in_flight = row_groups_in_flight
        self.max_bytes_ahead: int | None = None  # set by a loader: half its max_bytes_in_flight
        self._store_options = self.options.stores()
        self._remotes: dict[str, Any] = {}
        self._stores = [store_for(u, self._remotes, self._options_of) for u in self.urls]
        self.metas: list[FileMeta] = (
            [read_local_footer(s) for s in self._stores]
            if len(self._stores) <= _LOCAL_FOOTERS_HERE and all(s.path for s in self._stores)
            else run_to_end(self._footers(), "aioloader-parquet-footers")
        )
        self._index_row_groups()
        self._epoch = 0
        self._live: dict[int, RowGroup] = {}
        self._reads: set[asyncio.Task[Any]] = set()  # row groups being read
        self._orders: dict[int, np.ndarray] = {}  # the epochs' orders: this one's and the next's
        self._all_rows = np.arange(self.num_rows)  # a fresh epoch's indices (shares are views)
        self._all_rows.setflags(write=False)
        # the last walk's placement of a fresh share: (order, span, groups, local, runs)
        self._placed_last: tuple[np.ndarray, tuple[int, int], np.ndarray, np.ndarray, Runs] | None
        self._placed_last = None
        self._drop_last = False  # as the loader last asked for this reader's share
        self._walks = 0  # walks begun over this source (early reads begin with the second)
        self._early_for = -1  # the epoch `_early` was read for
        self._early: dict[int, RowGroup] = {}  # its first row groups, read while the last ended
        self._early_plan: list[int] = []  # the row groups `_early` is filled from, in order
        self._counts = {"row_groups_read": 0, "bytes_read": 0}

    # -- footers and row groups ---------------------------------------------------------------------

    def _options_of(self, kind: str) -> dict[str, Any]:
        stores = self._store_options
        return stores[kind] if kind in stores else stores["http"]

    async def _footers(self) -> list[FileMeta]:
        try:
            return list(await asyncio.gather(*(read_footer(s) for s in self._stores)))
        finally:
            for remote in self._remotes.values():  # made on this loop; a later read opens anew
                await remote.aclose()

    def _index_row_groups(self) -> None:
        self.row_groups: list[tuple[int, int]] = []  # (file, row group) of each global row group
        counts: list[int] = []
        self._leaves: list[list[int]] = []
        for i, meta in enumerate(self.metas):
            names = meta.metadata.schema.to_arrow_schema().names
            missing = [c for c in self.columns or () if c not in names]
            if missing:
                raise ValueError(
                    f"columns: {missing[0]!r} is not a column of {meta.label} (its columns: "
                    f"{', '.join(names)})"
                )
            self._leaves.append(meta.leaves(self.columns))
            for rg, n in enumerate(meta.row_counts):
                self.row_groups.append((i, rg))
                counts.append(n)
        self.row_counts = counts
        self._starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        self.num_rows = int(self._starts[-1])

    def locate(self, row: int) -> tuple[int, int]:
        """(global row group, row within it) of global row `row`."""
        g = int(np.searchsorted(self._starts, row, side="right")) - 1
        return g, row - int(self._starts[g])

    def begin(self, group: RowGroup) -> asyncio.Task[Any]:
        """Start reading row group `group` (fetch and decode) on the running loop; the task, which
        `close()` cancels while it runs, gives its value (`readahead.Reader`)."""
        task = asyncio.get_running_loop().create_task(self._load(group))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)
        return task

    async def _load(self, group: RowGroup) -> Any:
        try:
            return await self._read(group)
        finally:
            group.ended()  # its waiters go on (to its value, or to why there is none)

    async def _read(self, group: RowGroup) -> Any:
        file, rg = self.row_groups[group.index]
        meta, store = self.metas[file], self._stores[file]
        pieces = None
        lead, group.after = group.after, None
        if store.path is None:  # remote: the chunks first; a local file is read by pyarrow
            if lead is not None and not group.waited():  # read ahead: after the walk's first
                await lead.read_ended()
            pieces = await fetch_row_group(store, meta, rg, self._leaves[file])
        loop = asyncio.get_running_loop()

        def arrived(part: Any) -> None:  # in the decode's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits for it
                loop.call_soon_threadsafe(group.arrived, part)

        async with self._decode_turns().turn(group.order):
            # in parts when its rows are wanted now (one read ahead is decoded whole: one chunk
            # a column, which a sample across the parts' ends would have to copy together)
            value, group.nbytes = await asyncio.to_thread(
                self._decode, meta, rg, pieces, store.path, arrived if group.waited() else None
            )
        self._counts["row_groups_read"] += 1
        self._counts["bytes_read"] += sum(n for _, n in meta.ranges(rg, self._leaves[file]))
        return value

    def _decode_turns(self) -> Turns:
        """This loop's decode turns, shared by every Parquet source it reads (a mix of them):
        one decode per core at a time, the row group needed first going first (row groups read
        ahead arrive together; decoded all at once, each would take as long as all of them, and
        the first batch would wait for the last of them)."""
        loop = asyncio.get_running_loop()
        turns = _TURNS.get(loop)
        if turns is None:
            turns = _TURNS[loop] = Turns(_turns_per_loop)
        return turns

    def _decode(
        self, meta: FileMeta, rg: int, pieces: list[tuple[int, Bytes]] | None, path: Path | None,
        arrived: Callable[[Any], None] | None,
    ) -> tuple[Any, int]:  # fmt: skip
        """In a thread: the row group's value and its size. With `arrived`, samples of rows
        (RecordBatches) are decoded in parts, each handed to it as it is in: the first samples of
        a row group go on before its last rows are decoded; lists of token ids that
        `parquet_lists` reads, in a row group fetched (`pieces`), are decoded at once, and handed
        to it whole (a local file is pyarrow's to read: see `parquet_lists`' measurements)."""
        whole = (
            parquet_lists.decode(meta, rg, self.columns, pieces, path, decode_pool())
            if pieces is not None
            else None
        )
        if self.rows_per_sample is None or arrived is None:
            table = whole if whole is not None else decode_row_group(meta, rg, self.columns,
                                                                     pieces, path)  # fmt: skip
            if self.rows_per_sample is not None:
                return table, table.nbytes
            return _python_columns(table), table.nbytes
        if whole is not None:  # decoded at once: handed over whole (one chunk a column: a sample
            # across what would have been parts is not copied together)
            if whole.num_rows:
                arrived(whole.to_batches()[0])
            return whole, whole.nbytes
        import pyarrow as pa

        parts = []
        rows = max(self.rows_per_sample, _PART_ROWS)
        for part in decode_row_group_in_parts(meta, rg, self.columns, pieces, path, rows):
            parts.append(part)
            arrived(part)
        if not parts:  # no rows: the row group's empty table, with its schema
            table = decode_row_group(meta, rg, self.columns, pieces, path)
        else:
            table = pa.Table.from_batches(parts)
        return table, table.nbytes

    # -- the order -----------------------------------------------------------------------------------

    def __repr__(self) -> str:
        cols = "all columns" if self.columns is None else f"columns={list(self.columns)}"
        mixing = f", shuffle_buffer={self.shuffle_buffer}" if self.shuffle_buffer else ""
        return (
            f"parquet([{len(self.urls)} files, {len(self.row_groups)} row groups, "
            f"{self.num_rows} rows], {cols}, shuffle={self.shuffle}{mixing}, "
            f"slot {self.slot} of {self.slots})"
        )

    def bind(self, *, rank: int, world_size: int) -> None:
        """Take the loader's rank and world size, unless this source was given its own share."""
        if self.slots == self.options.num_workers:  # built for rank 0 of 1: use the loader's
            self.slot, self.slots = self.options.place(rank, world_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next direct iteration (`async for`) read `epoch`."""
        self._epoch = check_int("epoch", epoch, minimum=0)

    def keys(self) -> Sequence[tuple[str, int, int]]:
        """Every row as (file, row group, row), in stored order (a loader orders them itself)."""
        return _AllRows(self)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global row numbers of the epoch, in its order (kept for the last two epochs asked)."""
        epoch = epoch if self.shuffle else 0  # the stored order: every epoch's
        order = self._orders.get(epoch)
        if order is None:
            order = epoch_rows(self.row_counts, self.shuffle, self.shuffle_buffer, self.seed, epoch)
            order.setflags(write=False)
            if len(self._orders) >= 2:
                del self._orders[min(self._orders)]
            self._orders[epoch] = order
        return order

    def share(
        self, consumed: Ranges, drop_last: bool = False, slot: int | None = None,
        slots: int | None = None,
    ) -> np.ndarray:  # fmt: skip
        """Indices into the epoch's order that reader `slot` of `slots` (default: this one)
        delivers, once the indices in `consumed` are taken out."""
        left = remaining(consumed, self.num_rows) if len(consumed) else self._all_rows
        if slot is None:
            self._drop_last = drop_last
        slot = self.slot if slot is None else slot
        return share(left, slot, self.slots if slots is None else slots, drop_last)

    def samples_of(self, rows: int) -> int:
        """How many samples `rows` rows make."""
        k = self.rows_per_sample or 1
        return -(-rows // k)

    def refs(
        self, epoch: int, mine: np.ndarray, skipped: np.ndarray | None = None
    ) -> Generator[tuple[int, RowRef | RowsRef], None, None]:
        """(position, key) of each sample of `mine` (indices into the epoch's order), reading
        row groups ahead as they come near. Where `skipped` (a mask over `mine`) is set, the
        samples were delivered before a resume: their keys come, but nothing is read for them."""
        groups, local, runs = self._placed(self.epoch_order(epoch), mine)
        if skipped is not None:
            runs = runs_of(np.where(skipped, -1, groups))
        return self._walk(epoch, mine, groups, local, runs, skipped)

    def _placed(self, order: np.ndarray, mine: np.ndarray) -> tuple[np.ndarray, np.ndarray, Runs]:
        """The row group and the row within it of each position of `mine`, and their runs. Kept
        for the next epoch when it is the same (stored order: epochs differ in nothing), so that
        a walk over a large set does not make arrays of millions anew each epoch (fresh memory
        costs a page fault per 4 KiB)."""
        whole = mine.base is self._all_rows and len(mine) > 0
        span = (int(mine[0]), len(mine)) if whole else None  # a run of a fresh epoch's indices
        held = self._placed_last
        if span is not None and held is not None and held[0] is order and held[1] == span:
            return held[2], held[3], held[4]
        rows = order[span[0] : span[0] + span[1]] if span is not None else order[mine]
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        local = rows - self._starts[groups]
        runs = runs_of(groups)
        if span is not None:
            groups.setflags(write=False)
            local.setflags(write=False)  # samples hold slices of it, over epochs
            self._placed_last = (order, span, groups, local, runs)
        return groups, local, runs

    def _walk(
        self, epoch: int, mine: np.ndarray, groups: np.ndarray, local: np.ndarray,
        runs: Runs, skipped: np.ndarray | None,
    ) -> Generator[tuple[int, RowRef | RowsRef], None, None]:  # fmt: skip
        self._claim_early(epoch)
        ahead = Ahead(self, runs, epoch, self._walks > 0)
        self._walks += 1
        k = self.rows_per_sample or 1
        try:
            for a in range(0, len(groups), k):
                b = min(len(groups), a + k)
                skip = skipped is not None and bool(skipped[a])
                get = RowGroup if skip else ahead.group  # a skipped one is never read
                if not skip:
                    ahead.reach(a, b)
                if self.rows_per_sample is None:
                    g = int(groups[a])
                    file, rg = self.row_groups[g]
                    label = self.metas[file].label
                    ref: RowRef | RowsRef = RowRef(get(g), label, rg, int(local[a]))
                else:
                    ref = self._rows_ref(get, groups[a:b], local[a:b])
                yield int(mine[a]), ref
        finally:
            ahead.close()

    def _rows_ref(
        self, get: Callable[[int], RowGroup], groups: np.ndarray, local: np.ndarray
    ) -> RowsRef:
        cuts = np.flatnonzero(np.diff(groups)) + 1
        parts, where = [], []
        for start, stop in zip([0, *cuts.tolist()], [*cuts.tolist(), len(groups)], strict=True):
            g = int(groups[start])
            parts.append((get(g), local[start:stop]))
            file, rg = self.row_groups[g]
            where.append((self.metas[file].label, rg))
        return RowsRef(parts, where)

    def group(self, index: int) -> RowGroup:
        """The row group `index` while anything holds it (or read early for this epoch), else a
        new one (not read yet)."""
        group = self._live.get(index)
        if group is None:
            group = self._early.pop(index, None) or RowGroup(index)
            self._live[index] = group
        return group

    def forget(self, index: int, group: RowGroup) -> None:
        """Row group `index` is held no more by a walk, if it is `group` (`readahead.Reader`)."""
        if self._live.get(index) is group:
            del self._live[index]

    # -- the next epoch's first row groups -----------------------------------------------------

    def early_reads(self, epoch: int) -> int:
        """How many of `epoch`'s first row groups are read early now (`readahead.Reader`)."""
        return len(self._early) if self._early_for == epoch else 0

    def _claim_early(self, epoch: int) -> None:
        """A walk over `epoch` begins: keep the early reads only if they are for it, on this loop."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        tasks = [g.task for g in self._early.values() if g.task is not None]
        if self._early_for != epoch or any(t.get_loop() is not loop for t in tasks):
            self._early.clear()  # dropped: a read still going is cancelled (`RowGroup.__del__`)

    def read_early(self, epoch: int, room: int, order: int) -> None:
        """Read the first row groups of `epoch`, this reader's fresh share of it, up to `room`
        of them (`order`: where their decodes queue, after this epoch's)."""
        if self._early_for != epoch:
            self._early.clear()
            self._early_for = epoch
            plan = self._early_plan = self._first_groups(epoch)
        else:
            plan = self._early_plan
        for g in plan:
            if len(self._early) >= room:
                return
            if g in self._early:
                continue
            group = self._early[g] = self._live.get(g) or RowGroup(g)
            group.order = order + len(self._early)
            with contextlib.suppress(RuntimeError):  # no running loop: read when fetched
                group.start(self)

    def _first_groups(self, epoch: int) -> list[int]:
        """The first `row_groups_in_flight` row groups a fresh walk of `epoch` will need."""
        mine = share(self._all_rows, self.slot, self.slots, self._drop_last)
        most = max(self.row_counts, default=0) * (self.row_groups_in_flight + 1)
        rows = self.epoch_order(epoch)[mine[:most]]
        groups = np.searchsorted(self._starts, rows, side="right") - 1
        return runs_of(groups)[2][: self.row_groups_in_flight]  # in the order first needed

    # -- samples -------------------------------------------------------------------------------------

    async def fetch(self, ref: RowRef | RowsRef) -> Any:
        """The sample of `ref`: a dict of column values (list columns as numpy arrays, binary ones
        as bytes), or with `rows_per_sample` a pyarrow RecordBatch of those rows."""
        import pyarrow as pa

        if isinstance(ref, RowRef):
            columns = await ref.group.value(self)
            return {name: values[ref.row] for name, values in columns.items()}
        tables = []
        for group, rows in ref.parts:
            table = await group.rows(self, int(rows.max()) + 1)
            tables.append(take_rows(table, rows))
        table = tables[0] if len(tables) == 1 else pa.concat_tables(tables)
        batches = table.to_batches()
        if len(batches) == 1:
            return batches[0]
        # rows across two row groups, or two parts of one: copied together, into the pool the
        # row groups decode into (the default pool is left alone; see `decode_pool`)
        return table.combine_chunks(memory_pool=decode_pool()).to_batches()[0]

    async def samples(self, epoch: int) -> AsyncIterator[Any]:
        """The samples of `epoch` for this reader, one after the other (row groups read ahead)."""
        walk = self.refs(epoch, self.share(Ranges()))
        try:
            for _, ref in walk:
                yield await self.fetch(ref)
        finally:
            walk.close()

    def __aiter__(self) -> AsyncIterator[Any]:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return self.samples(epoch)

    def stats(self) -> dict[str, float]:
        """Row groups and bytes read, and the requests and retries of the remote files' sources."""
        counts: dict[str, float] = dict(self._counts)
        for name in ("requests", "retries", "throttles"):
            counts[name] = sum(r.transport.counts.get(name, 0) for r in self._remotes.values())
        return counts

    async def aclose(self) -> None:
        """Stop the reads still going and close the remote files' connection pools. Idempotent."""
        tasks = list(self._reads)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._live.clear()
        self._early.clear()
        for remote in self._remotes.values():
            await remote.aclose()


def _python_columns(table: pa.Table) -> dict[str, list[Any]]:
    """Each column as a list of Python values; list columns' values as numpy arrays."""
    import pyarrow as pa

    out: dict[str, list[Any]] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if (
            pa.types.is_list(kind)
            or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind)
        ):
            out[name] = list(column.to_numpy(zero_copy_only=False))
        else:
            out[name] = column.to_pylist()
    return out


def _columns_arg(columns: Sequence[str] | None) -> tuple[str, ...] | None:
    if columns is None:
        return None
    if isinstance(columns, str) or not all(isinstance(c, str) for c in columns):
        raise TypeError(f"columns: expected a list of column names, got {columns!r}")
    if not columns:
        raise ValueError("columns: an empty list selects nothing; pass None for all columns")
    return tuple(columns)


def parquet(
    urls: str | Sequence[str],
    columns: Sequence[str] | None = None,
    *,
    rows_per_sample: int | None = None,
    shuffle: bool = True,
    shuffle_buffer: int = 0,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    row_groups_in_flight: int = 16,
    http_options: dict[str, Any] | None = None,
    s3_options: dict[str, Any] | None = None,
    gcs_options: dict[str, Any] | None = None,
    azure_options: dict[str, Any] | None = None,
) -> Parquet:
    """A source of the rows of Parquet files, read by row group with only `columns` fetched.

    Shuffled by default: every epoch reads the row groups in a new order (from `seed` and the
    epoch), and `shuffle_buffer` also mixes rows across neighbouring row groups; `shuffle=False`
    keeps the stored order (validation). The source orders itself, so a `Loader` over it takes no
    `shuffle=True`; it shares the rows among the loader's ranks (contiguous shares of equal length,
    padded by wrapping around), and resumes from `state_dict()` exactly, on another world size too.

    Args:
        urls: paths, file://, http(s):// or s3:// URLs of .parquet files (one schema for all).
        columns: the top-level columns to read (None: all); only their bytes are fetched.
        rows_per_sample: None: one sample per row, a dict of column values (list columns as numpy
            arrays, binary columns as bytes, nulls as None). N: one pyarrow RecordBatch of N rows
            per sample (the last of an epoch may be shorter); use the loader's `batch_size=None`.
        shuffle: a new row group order every epoch (True) or the stored order (False).
        shuffle_buffer: rows move up to this many places from their row-group order (0: none);
            a reader then holds the row groups those places span.
        seed: what every epoch's order derives from (with the epoch).
        rank, world_size, worker, num_workers: read only this reader's share when iterating the
            source directly (a Loader gives its own rank and world size).
        row_groups_in_flight: row groups read ahead of the rows handed out, at most.
        http_options: passed to `http()` for http(s) files (timeouts, retries, headers, ssl).
        s3_options: passed to `s3()` for s3:// files (endpoint_url, credentials, region, ...).
        gcs_options: passed to `gcs()` for gs:// files (endpoint_url, credentials_file, ...).
        azure_options: passed to `azure()` for az:// files (endpoint_url, connection_string, ...).

    Raises:
        ParquetError: (a FetchError) a file whose footer cannot be read, naming it; later, a row
            group whose pages do not decode, naming the file and the row group.
        ValueError: a column that one of the files does not have, naming it and the file.

    Example:
        >>> rows = parquet("s3://bucket/train/part-0000.parquet", ["text", "label"],
        ...                shuffle_buffer=10_000)  # doctest: +SKIP
    """
    shared = ShardOptions(
        shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed, rank=rank,
        world_size=world_size, worker=worker, num_workers=num_workers, http_options=http_options,
        s3_options=s3_options, gcs_options=gcs_options, azure_options=azure_options,
    )  # fmt: skip
    return Parquet(
        urls, columns, rows_per_sample=rows_per_sample,
        row_groups_in_flight=row_groups_in_flight, options=shared,
    )  # fmt: skip
