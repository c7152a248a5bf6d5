"""The rows of a sample (`rows_per_sample`) taken from a decoded row group: the same table as
pyarrow's own `take`, whatever the columns, with list columns of numbers gathered by numpy."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from aioloader.sources.formats.parquet_take import take_rows


def table(rng: np.random.Generator, n: int) -> pa.Table:
    lengths = rng.integers(0, 40, n)
    offsets = np.concatenate([[0], np.cumsum(lengths)])

    def lists(values: np.ndarray, kind: pa.DataType) -> pa.Array:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values), kind)

    total = int(offsets[-1])
    with_nulls = pa.array([None if i % 7 == 3 else list(range(i % 5)) for i in range(n)])
    return pa.table({
        "tokens": lists(rng.integers(0, 50_000, total, dtype=np.int32), pa.list_(pa.int32())),
        "floats": lists(rng.random(total).astype(np.float32), pa.list_(pa.float32())),
        "u8": lists(rng.integers(0, 255, total, dtype=np.uint8), pa.list_(pa.uint8())),
        "big": pa.LargeListArray.from_arrays(
            pa.array(offsets), pa.array(rng.integers(-9, 9, total)), pa.large_list(pa.int64())
        ),
        "nulls": with_nulls,
        "id": pa.array(np.arange(n)),
        "text": pa.array([f"doc {i}" for i in range(n)]),
    })  # fmt: skip


@pytest.mark.parametrize("how", ["whole", "sliced", "in parts"])
def test_a_gather_is_pyarrows_take(how: str) -> None:
    rng = np.random.default_rng(5)
    whole = table(rng, 300)
    # a row group's table may itself be a slice: its list offsets then do not start at 0; one
    # decoded in parts is a chunk per part
    if how == "sliced":
        source = whole.slice(37, 200)
    elif how == "in parts":
        source = pa.Table.from_batches(whole.slice(0, 300).to_batches(max_chunksize=64))
        assert source.column("tokens").num_chunks == 5
    else:
        source = whole
    for _ in range(20):
        rows = rng.permutation(len(source))[: int(rng.integers(3, 120))]
        got = take_rows(source, rows)
        assert got.schema == source.schema
        assert got.equals(source.take(pa.array(rows)))


def test_rows_in_order_are_a_slice_without_a_copy() -> None:
    source = table(np.random.default_rng(1), 50)
    got = take_rows(source, np.arange(10, 20))
    assert got.equals(source.slice(10, 10))
    ours = got.column("tokens").chunk(0).values.buffers()[1].address
    assert ours == source.column("tokens").chunk(0).values.buffers()[1].address


def test_a_list_with_a_null_row_or_value_goes_through_pyarrow() -> None:
    values = pa.array([1, None, 3, 4], pa.int32())
    kind = pa.list_(pa.int32())
    source = pa.table({"tokens": pa.ListArray.from_arrays(pa.array([0, 2, 3, 4]), values, kind)})
    rows = np.array([2, 0, 1])
    assert take_rows(source, rows).equals(source.take(pa.array(rows)))
