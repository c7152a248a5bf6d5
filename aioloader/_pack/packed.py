"""`aioloader.pack`: a loader of token documents packed into fixed-length rows, resumable exactly.

`pack(loader, seq_len, batch_size=..., eos=...)` wraps a loader (a `Loader`, or loaders mixed by
`aioloader.mix`) that yields documents, and yields batches of packed rows: greedy concatenation,
EOS after each document, rows of `seq_len` tokens (see `packer.py`; what a loader may yield:
`documents.py`). Each iteration is one epoch of the loader; the tokens left at the epoch's end that
do not fill a row are dropped, so epoch `e` depends on the loader's epoch `e` alone.

Exact resume: between any two batches, what the packer holds is the tokens of the documents the
loader has delivered that are not yet in a row. `state_dict()` is the loader's own state (which
counts exactly the items it delivered to the packer) and those tokens; `load_state_dict()` puts
both back, and the next iteration goes on with the batch after the saved one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Self

import numpy as np
import torch

from .._exceptions import StateError
from .._protocol import HandsOverRowRuns, HasAclose
from .._resume.state import STATE_VERSION, check_config
from .._util.validate import check_int
from .documents import RowRuns, run_of
from .packer import Packer
from .state import held_of, place_of, share_held

__all__ = ["Packed", "pack"]

_END: Any = object()


class Packed:
    """Batches of packed token rows from a loader of documents. Made by `aioloader.pack()`.

    Iterate with `for` or `async for` (one epoch of the loader per iteration); `set_epoch(e)`
    picks the next; `state_dict()` / `load_state_dict()` resume it exactly; `close()` (or the end
    of a `with` block) closes the loader.

    Example:
        >>> rows = sources.parquet(paths, ["tokens"], rows_per_sample=256)  # doctest: +SKIP
        >>> packed = pack(Loader(rows, batch_size=None), 2048, batch_size=8, eos=2,
        ...               key="tokens", targets=True)  # doctest: +SKIP
        >>> for batch in packed:  # doctest: +SKIP
        ...     inputs, targets = batch[:, :-1], batch[:, 1:]  # [8, 2048] each
    """

    def __init__(
        self, loader: Any, seq_len: int, batch_size: int, *, eos: int | None, key: str | None,
        targets: bool, boundaries: bool, drop_last: bool, dtype: torch.dtype,
        varlen: bool = False,
    ) -> None:  # fmt: skip
        self.loader = loader
        self.varlen = varlen
        self.seq_len, self.batch_size, self.eos, self.key = seq_len, batch_size, eos, key
        self.targets, self.boundaries, self.drop_last, self.dtype = (
            targets, boundaries, drop_last, dtype,
        )  # fmt: skip
        self._np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self._packer = Packer(seq_len, batch_size, targets=targets, boundaries=boundaries,
                              dtype=self._np_dtype, varlen=varlen)  # fmt: skip
        # a mix by rows hands over its items as runs of rows, read without joining them first
        self._row_runs = (
            RowRuns(key, eos, self._np_dtype) if isinstance(loader, HandsOverRowRuns) else None
        )
        self._epoch = 0  # the epoch the next iteration runs
        self._running: int | None = None  # the epoch being iterated
        self._resume: tuple[int, list[int], list[int]] | None = None  # (epoch, tokens, starts)

    def __repr__(self) -> str:
        extras = "".join(
            f", {name}=True"
            for name in ("targets", "boundaries", "varlen", "drop_last")
            if getattr(self, name)
        )
        key = "" if self.key is None else f", key={self.key!r}"
        return (
            f"pack({self.loader!r}, seq_len={self.seq_len}, batch_size={self.batch_size}, "
            f"eos={self.eos}{key}{extras}, dtype={self.dtype})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch` (the loader's too)."""
        self._epoch = check_int("epoch", epoch, minimum=0)
        self.loader.set_epoch(epoch)

    # -- iteration ----------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return self._batches(self._start())

    def __aiter__(self) -> AsyncIterator[Any]:
        """`async for batch in packed`: the same batches, from the loader's `async for`."""
        return self._abatches(self._start())

    def _start(self) -> int:
        """Take the next epoch; hold the tokens a load left for it, else nothing."""
        epoch, self._epoch = self._epoch, self._epoch + 1
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] == epoch:
            self._packer.hold(resume[1], resume[2])
        else:
            self._packer.clear()
        self._running = epoch
        return epoch

    def _items(self) -> Iterator[Any]:
        if self._row_runs is not None:
            self._row_runs.clear()
            return iter(self.loader.row_runs())
        return iter(self.loader)

    def _aitems(self) -> AsyncIterator[Any]:
        if self._row_runs is not None:
            self._row_runs.clear()
            return aiter(self.loader.arow_runs())
        return aiter(self.loader)

    def _run(self, item: Any, epoch: int, n: int) -> None:
        where = f"item {n} of this pass over epoch {epoch}"
        if self._row_runs is not None:
            self._packer.add(self._row_runs.run(item, where))
            return
        self._packer.add(
            run_of(item, key=self.key, eos=self.eos, dtype=self._np_dtype, where=where)
        )

    def _end(self, epoch: int) -> Any:
        """The epoch's last (shorter) batch, or None; nothing is held after it."""
        last = self._packer.last()
        if self._running == epoch:
            self._running = None
        return None if self.drop_last else last

    # `_batches` (for `for`) and `_abatches` (for `async for`) differ only in how they draw the
    # loader's items and close its iterator; what they do with each is `_run` and `_end`.

    def _batches(self, epoch: int) -> Iterator[Any]:
        packer, n = self._packer, 0
        items = self._items()
        try:
            while True:
                while packer.ready():  # (a resumed epoch may hold more than a batch at first)
                    yield packer.take()  # not bound here: not held while the consumer has it
                item = next(items, _END)
                if item is _END:
                    break
                self._run(item, epoch, n)
                n += 1
            last = self._end(epoch)
            if last is not None:
                yield last
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    async def _abatches(self, epoch: int) -> AsyncIterator[Any]:
        packer, n = self._packer, 0
        items = self._aitems()
        try:
            while True:
                while packer.ready():
                    yield packer.take()
                item = await anext(items, _END)
                if item is _END:
                    break
                self._run(item, epoch, n)
                n += 1
            last = self._end(epoch)
            if last is not None:
                yield last
        finally:
            if isinstance(items, HasAclose):
                await items.aclose()

    # -- state --------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "seq_len": self.seq_len, "batch_size": self.batch_size, "eos": self.eos,
            "key": self.key, "targets": self.targets, "boundaries": self.boundaries,
            "drop_last": self.drop_last, "dtype": str(self.dtype),
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The loader's state and the tokens held (and where their documents start): small
        except for those tokens, fewer than a batch's plus one document's; JSON-ready. Safe
        between any two batches, from the consumer's thread or task."""
        if self._running is not None:
            epoch, held = self._running, self._packer.held()
        elif self._resume is not None:
            epoch, held = self._resume[0], {"tokens": self._resume[1], "starts": self._resume[2]}
        else:
            epoch, held = self._epoch, {"tokens": [], "starts": []}
        return {
            "version": STATE_VERSION, "kind": type(self).__name__, "config": self._config(),
            "epoch": epoch, "loader": self.loader.state_dict(), **held,
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from `state`: the next iteration goes on with the batch after the saved one.

        Given every rank's state (a list), this rank's own is used; on another world size, the
        loader's elastic resume shares out the documents no rank was delivered and the tokens the
        old ranks held are shared out too (see `state.py`): each token is delivered once.

        Raises StateError naming the field when a state does not fit this packer.
        """
        states = [state] if isinstance(state, Mapping) else list(state)
        if not states:
            raise StateError("state: no state given", field="state")
        for s in states:
            check_config(s, type(self).__name__, self._config())
        here = place_of({"loader": self.loader.state_dict()})
        own = [s for s in states if place_of(s) == here]
        if len(own) == 1:
            held, loader_state = held_of(own[0]), own[0]["loader"]
        elif not own and len(states) > 1:
            held = share_held(states, *here)
            loader_state = [s["loader"] for s in states]
        else:
            raise StateError(
                f"states: {len(own)} of them are this rank's ({here[0]} of {here[1]}); pass this "
                "rank's own state, or every rank's to resume on another world size",
                field="states",
            )
        self.loader.load_state_dict(loader_state)
        self._resume, self._epoch, self._running = held, held[0], None

    # -- lifecycle ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the loader (idempotent)."""
        self.loader.close()

    async def aclose(self) -> None:
        """Close the loader from async code (idempotent)."""
        if isinstance(self.loader, HasAclose):
            await self.loader.aclose()
        else:
            self.loader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def pack(
    loader: Any,
    seq_len: int,
    *,
    batch_size: int,
    eos: int | None,
    key: str | None = None,
    targets: bool = False,
    boundaries: bool = False,
    drop_last: bool = False,
    dtype: torch.dtype = torch.int64,
    varlen: bool = False,
) -> Packed:
    """Pack a loader's token documents into batches of fixed-length rows, resumable exactly.

    Greedy concatenation: the epoch's documents in the loader's order, `eos` after each, cut into
    rows of `seq_len` tokens; a document that does not fit what is left of a row goes on at the
    start of the next. Vectorised: the work per document is a slice copy, none per token; a
    pyarrow RecordBatch of many documents (`sources.parquet(..., rows_per_sample=N)`) is taken
    whole, with no Python step per document (the fast path).

    Args:
        loader: an `aioloader.Loader` (or loaders mixed by `aioloader.mix`) that yields documents
            one by one (`batch_size=None`) or in lists (`collate=None`): each a 1-D integer
            array or tensor, a dict whose `key` field is one, or a RecordBatch / Table whose `key`
            column (list<int>) holds one per row. Over several ranks, each rank packs its own
            share (the loader's rank and world size); ranks' token counts differ, so their batch
            counts per epoch may too: train by steps (a mix with stop="cycle" never ends).
        seq_len: tokens per row.
        batch_size: rows per batch.
        eos: the token put after every document (an int), or None to concatenate documents as
            they are (documents that already end with their own separator).
        key: the field or column that holds the tokens, for dict or columnar items.
        targets: rows of `seq_len + 1` tokens, each row starting at the last token of the one
            before: `inputs, targets = batch[:, :-1], batch[:, 1:]`, every token a target once.
        boundaries: yield dicts of "tokens", "document_ids" and "positions" (each [batch, row
            length], int64): per token, the number of its document's segment within the row
            (0, 1, ...) and its position in that segment. A document cut by the start of a row
            begins a new segment there. For a document mask: attend where the ids are equal.
        varlen: yield dicts with "cu_seqlens" and "max_seqlen" too (with "tokens"; with
            `boundaries`, beside its two): the segments of the batch's rows flattened, as
            flash-attention's varlen functions and torch's jagged tensors take them, int32
            offsets of each segment's first token then the batch's token count, and the longest
            segment (an int). With `targets`, of the rows' inputs (`batch[:, :-1]`). Not part of
            the saved state's configuration: the batches are the same with or without it.
        drop_last: drop the epoch's last batch when it has fewer than `batch_size` rows (the
            tokens that do not fill a row at an epoch's end are always dropped).
        dtype: the integer dtype of the rows (int64 by default: what losses take as targets).

    Returns:
        A `Packed`: iterate it (`for` or `async for`), one epoch of the loader per iteration; its
        `state_dict()` holds the loader's state and the tokens not yet in a row.

    Raises:
        TypeError or ValueError naming the argument for bad arguments; at iteration, naming the
        item and the sample key for a document that is not 1-D, not integer, or missing.

    Example:
        >>> docs = [np.arange(5), np.arange(3)]
        >>> loader = Loader(range(2), docs.__getitem__, batch_size=None)  # doctest: +SKIP
        >>> with pack(loader, 4, batch_size=2, eos=99) as packed:  # doctest: +SKIP
        ...     [b.tolist() for b in packed]
        [[[0, 1, 2, 3], [4, 99, 0, 1]]]
    """
    for name in ("state_dict", "load_state_dict", "set_epoch", "__iter__", "close"):
        if not callable(getattr(loader, name, None)):
            raise TypeError(
                f"loader: expected an aioloader Loader (or a mix of loaders) that yields "
                f"documents, got {type(loader).__name__} (it has no {name}())"
            )
    check_int("seq_len", seq_len, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    if (
        not isinstance(dtype, torch.dtype)
        or dtype.is_floating_point
        or dtype.is_complex
        or (dtype == torch.bool)
    ):
        raise TypeError(f"dtype: expected an integer torch dtype, got {dtype!r}")
    if eos is not None:
        if isinstance(eos, bool) or not isinstance(eos, int | np.integer):
            raise TypeError(
                f"eos: expected an int token id or None, got {type(eos).__name__} {eos!r}"
            )
        eos = int(eos)
        info = torch.iinfo(dtype)
        if not info.min <= eos <= info.max:
            raise ValueError(f"eos: {eos} does not fit dtype {dtype}")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key: expected a field name (str) or None, got {key!r}")
    flags = (("targets", targets), ("boundaries", boundaries), ("drop_last", drop_last),
             ("varlen", varlen))  # fmt: skip
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected True or False, got {flag!r}")
    return Packed(
        loader, seq_len, batch_size, eos=eos, key=key, targets=targets, boundaries=boundaries,
        drop_last=drop_last, dtype=dtype, varlen=varlen,
    )  # fmt: skip
