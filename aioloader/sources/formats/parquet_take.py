"""The rows of a decoded row group that make one sample (`rows_per_sample`), as a new table.

Rows that run in order are a slice (no copy). Others are gathered column by column: pyarrow's
`take` for most columns; a list column of numbers without nulls (a document's token ids) by numpy,
one slice copy per row. pyarrow gathers such a column through an index per value and costs about
twice as much per token; for a column of tokens that is most of a sample's cost after the decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["take_rows"]


def take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """`rows` of `table` (distinct row numbers, in the sample's order)."""
    import pyarrow as pa

    n = len(rows)
    # a sample's rows are distinct: n of them spanning n places are a run, in order when each is
    # above the one before
    run = n and int(rows[-1]) - int(rows[0]) == n - 1
    if run and (n < 3 or bool((rows[1:] > rows[:-1]).all())):
        return table.slice(int(rows[0]), n)
    indices: pa.Array | None = None
    columns = []
    for column in table.columns:
        if column.num_chunks and all(_numeric_list(c) for c in column.chunks):
            columns.append(_gather_list(column.chunks, rows))
            continue
        if indices is None:
            indices = pa.array(rows)
        columns.append(column.take(indices))
    return pa.Table.from_arrays(columns, schema=table.schema)


def _numeric_list(array: Any) -> bool:
    """Whether `array` is a list (or large list) of integers or floats, with no null anywhere."""
    import pyarrow as pa

    kind = array.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return False
    value = kind.value_type
    return bool(
        (pa.types.is_integer(value) or pa.types.is_floating(value))
        and array.null_count == 0
        and array.values.null_count == 0
    )


def _gather_list(chunks: list[Any], rows: np.ndarray) -> Any:
    """Rows `rows` of the list array made of `chunks` (each as `_numeric_list` asks; a row group
    decoded in parts has one per part): new offsets, and each row's values copied into one new
    buffer."""
    import pyarrow as pa

    kind = chunks[0].type
    large = pa.types.is_large_list(kind)
    sources, starts, ends = [], [], []  # per chunk: its values; its rows' starts and ends
    for array in chunks:
        offsets = np.frombuffer(array.buffers()[1], dtype=np.int64 if large else np.int32)
        starts.append(offsets[array.offset : array.offset + len(array)])
        ends.append(offsets[array.offset + 1 : array.offset + len(array) + 1])
        child = array.values  # offsets count from its start, whatever the array's own slice
        values = np.frombuffer(child.buffers()[1], dtype=_dtype(child.type))
        sources.append(values[child.offset : child.offset + len(child)])
    if len(chunks) == 1:
        which = np.zeros(len(rows), dtype=np.intp)
        first, last = starts[0][rows], ends[0][rows]
    else:  # each row's chunk; its start and end among that chunk's values
        which = np.searchsorted(np.cumsum([len(c) for c in chunks]), rows, side="right")
        first, last = np.concatenate(starts)[rows], np.concatenate(ends)[rows]
    out_offsets = np.zeros(len(rows) + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(last - first, out=out_offsets[1:])
    out = np.empty(int(out_offsets[-1]), dtype=sources[0].dtype)
    for c, start, end, at in zip(
        which.tolist(), first.tolist(), last.tolist(), out_offsets.tolist(), strict=False
    ):
        out[at : at + end - start] = sources[c][start:end]
    build = pa.LargeListArray if large else pa.ListArray
    return build.from_arrays(pa.array(out_offsets), pa.array(out), type=kind)


def _dtype(kind: Any) -> np.dtype[Any]:
    """The numpy dtype of a pyarrow integer or floating type."""
    import pyarrow as pa

    size = kind.bit_width // 8
    if pa.types.is_floating(kind):
        return np.dtype(f"f{size}")
    return np.dtype(f"{'i' if pa.types.is_signed_integer(kind) else 'u'}{size}")
