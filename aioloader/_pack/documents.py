"""What a loader hands the packer, turned into runs of tokens: documents with EOS after each.

An item of the loader is one of:

- one document: a 1-D integer numpy array or CPU tensor;
- a dict sample (a Parquet row, a decoded record) whose `key` field is one document;
- a pyarrow RecordBatch or Table (`sources.parquet(..., rows_per_sample=N)`) whose `key` column
  holds one document per row (list<int>): taken whole from its values and offsets, with no
  Python step per document (the columnar fast path);
- a list or tuple of any of the above (a loader's batch with `collate=None`).

Each item becomes one `Run`: its documents' tokens in the output dtype with `eos` after each
document, and where each document starts. Bad input raises TypeError or ValueError naming the
item and the sample key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["RowRuns", "Run", "run_of"]

_FIRST = np.zeros(1, dtype=np.int64)  # the starts of a run of one document
_FIRST.setflags(write=False)


class Run:
    """Tokens of whole documents, in stream order: `tokens` (1-D, EOS included) and `starts`
    (the index in `tokens` of each document's first token, ascending). `own`: `tokens` is an
    array made here, nobody else's, so a batch may be a view of it."""

    __slots__ = ("own", "starts", "tokens")

    def __init__(self, tokens: np.ndarray, starts: np.ndarray, own: bool = False) -> None:
        self.tokens, self.starts, self.own = tokens, starts, own


class RowRuns:
    """The items a mix by rows hands over (`HandsOverRowRuns`: each its loaders' items' parts and
    the order its positions take their rows in), as one run of tokens each. Each loader's item is
    converted once, when its first part comes (one pass over its column, as for a RecordBatch);
    an item of the mix is then its documents' tokens gathered from those, one slice per run of
    rows, with no Python step per document. One converted item is kept per loader: its next item
    replaces it."""

    def __init__(self, key: str | None, eos: int | None, dtype: np.dtype[Any]) -> None:
        self.key, self.eos, self.dtype = key, eos, dtype
        self._tables: dict[int, tuple[int, Run, np.ndarray]] = {}  # input -> serial, run, ends

    def clear(self) -> None:
        self._tables.clear()

    def run(self, item: Any, where: str) -> Run:
        parts, order = item
        runs, firsts, lasts, own = [], [], [], True
        for source, serial, table, first, rows in parts:
            kept = self._tables.get(source)
            if kept is None or kept[0] != serial:
                run = _from_table(table, self.key, self.eos, self.dtype, where)
                ends = np.append(run.starts[1:], len(run.tokens))
                kept = self._tables[source] = serial, run, ends
            runs.append(kept[1].tokens)
            own = own and kept[1].own
            firsts.append(kept[1].starts[first : first + rows])
            lasts.append(kept[2][first : first + rows])
        n = len(order)
        if len(parts) == 1:
            lo, hi = firsts[0], lasts[0]
        else:  # each position's document: its part's next row, the parts' rows in their order
            rank = np.empty(n, dtype=np.intp)
            rank[np.argsort(order, kind="stable")] = np.arange(n)
            lo, hi = np.concatenate(firsts)[rank], np.concatenate(lasts)[rank]
        lengths = hi - lo
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        # consecutive positions of one part are consecutive rows: a slice of its tokens each
        cuts = np.flatnonzero(order[1:] != order[:-1]) + 1
        if not len(cuts):
            return Run(runs[int(order[0])][int(lo[0]) : int(hi[-1])], starts, own)
        heads, tails = np.concatenate([[0], cuts]), np.concatenate([cuts - 1, [n - 1]])
        pieces = [
            runs[j][a:b]
            for j, a, b in zip(
                order[heads].tolist(), lo[heads].tolist(), hi[tails].tolist(), strict=True
            )
        ]
        return Run(np.concatenate(pieces), starts, own=True)


def run_of(item: Any, *, key: str | None, eos: int | None, dtype: np.dtype[Any], where: str) -> Run:
    """The run of one loader item (see the module docstring); `where` names the item in errors."""
    table = _columnar(item)
    if table is not None:
        return _from_table(table, key, eos, dtype, where)
    if isinstance(item, list | tuple):
        docs = [_document(x, key, where, i) for i, x in enumerate(item)]
    else:
        docs = [_document(item, key, where)]
    return _from_documents(docs, eos, dtype)


def _from_documents(docs: list[np.ndarray], eos: int | None, dtype: np.dtype[Any]) -> Run:
    if len(docs) == 1:  # the common item, in plain ints: a few numpy calls cost more than the copy
        doc = docs[0]
        if eos is None:
            return Run(doc.astype(dtype, copy=False), _FIRST)
        tokens = np.empty(len(doc) + 1, dtype=dtype)
        tokens[:-1] = doc
        tokens[-1] = eos
        return Run(tokens, _FIRST, own=True)
    lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
    extra = 0 if eos is None else 1
    ends = np.cumsum(lengths + extra)
    starts = ends - lengths - extra
    tokens = np.empty(int(ends[-1]) if len(docs) else 0, dtype=dtype)
    for doc, start in zip(docs, starts.tolist(), strict=True):  # per document, never per token
        tokens[start : start + len(doc)] = doc
    if eos is not None:
        tokens[ends - 1] = eos
    return Run(tokens, starts, own=True)


def _from_table(
    table: Any, key: str | None, eos: int | None, dtype: np.dtype[Any], where: str
) -> Run:
    """A RecordBatch's (or Table's) list column, whole: its flat values and its offsets."""
    import pyarrow as pa

    if key is None:
        raise TypeError(
            f"key: {where} is a pyarrow {type(table).__name__}; name its token column with "
            "pack(..., key='tokens')"
        )
    if key not in table.column_names:
        raise KeyError(f"key: {where} has no column {key!r} (its columns: {table.column_names})")
    column = table.column(key)
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise TypeError(f"key: column {key!r} of {where} is {kind}, not a list of token ids")
    if not pa.types.is_integer(kind.value_type):
        raise TypeError(
            f"key: column {key!r} of {where} holds {kind.value_type}, not integer token ids"
        )
    if column.null_count:
        raise ValueError(f"key: column {key!r} of {where} has {column.null_count} null rows")
    if column.values.null_count:
        raise ValueError(f"key: column {key!r} of {where} has null token ids")
    offsets = _numpy(column.offsets).astype(np.int64)
    values = _numpy(column.values)[offsets[0] : offsets[-1]]
    offsets -= offsets[0]
    n = len(offsets) - 1
    if eos is None:
        return Run(values.astype(dtype, copy=False), offsets[:-1])
    shift = np.arange(n, dtype=np.int64)
    starts = offsets[:-1] + shift  # each document moves one place per EOS before it
    ends = offsets[1:] + shift  # where its EOS goes
    tokens = np.empty(len(values) + n, dtype=dtype)
    keep = np.ones(len(tokens), dtype=bool)
    keep[ends] = False
    tokens[keep] = values
    tokens[ends] = eos
    return Run(tokens, starts, own=True)


def _numpy(array: Any) -> np.ndarray:
    """A pyarrow integer array without nulls as a numpy view of its buffer (`to_numpy()` would
    import pandas where it is installed: seconds before a first batch)."""
    data = array.buffers()[1]
    whole = np.frombuffer(data, dtype=np.dtype(str(array.type)))
    return whole[array.offset : array.offset + len(array)]


def _document(item: Any, key: str | None, where: str, element: int | None = None) -> np.ndarray:
    """One document as a 1-D integer numpy array (a view where it can be). `where` and `element`
    (its place in a list item) name it in errors."""
    field = None
    if type(item) is dict or isinstance(item, Mapping):
        if key is None or key not in item:
            fields = sorted(map(str, item))
            name = _named(where, element, None)
            if key is None:
                raise TypeError(
                    f"key: {name} is a dict (fields {fields}); name its token field with "
                    "pack(..., key=...)"
                )
            raise KeyError(f"key: {name} has no field {key!r} (its fields: {fields})")
        item, field = item[key], key
    if type(item) is np.ndarray:
        array = item
    elif isinstance(item, torch.Tensor):
        if item.device.type != "cpu":
            raise ValueError(
                f"{_named(where, element, field)}: a document must be on the CPU, got one on "
                f"{item.device}"
            )
        array = item.detach().numpy()
    elif isinstance(item, np.ndarray):
        array = item
    else:
        raise TypeError(
            f"{_named(where, element, field)}: expected a document as a 1-D integer numpy array "
            f"or tensor, got {type(item).__name__}"
        )
    if array.ndim != 1 or array.dtype.kind not in "iu":
        _refuse(array, _named(where, element, field))
    return array


def _refuse(array: np.ndarray, name: str) -> None:
    if array.ndim != 1:
        hint = " (a loader over documents takes batch_size=None, or collate=None)"
        raise ValueError(
            f"{name}: expected a 1-D array of token ids, got shape {tuple(array.shape)}"
            + (hint if array.ndim == 2 else "")
        )
    raise TypeError(f"{name}: expected integer token ids, got dtype {array.dtype}")


def _named(where: str, element: int | None, field: str | None) -> str:
    """The document's name in errors (made only for one)."""
    if element is not None:
        where = f"{where}, its element {element}"
    return where if field is None else f"{where}, sample key {field!r}"


def _columnar(item: Any) -> Any:
    """`item` if it is a pyarrow RecordBatch or Table (without importing pyarrow otherwise)."""
    module = type(item).__module__
    if module.startswith("pyarrow") and type(item).__name__ in ("RecordBatch", "Table"):
        return item
    return None
