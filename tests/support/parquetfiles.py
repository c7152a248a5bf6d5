"""Parquet files for the Parquet tests: `write_files` writes FILES (nulls, nested lists, binary and
dictionary-encoded columns, four codecs, uneven row groups); `expected` is what pyarrow reads of them,
`rows_of` what a Loader over a source gives, as plain values; `write_tokens` a file of documents'
token ids (a `tokens` list<int32> column and an `id`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from aioloader import Loader
from aioloader.sources import Parquet

COLUMNS = ["id", "score", "label", "tokens", "image", "name", "extra"]
# (file name, rows, row group size, codec)
FILES = [("a.parquet", 500, 64, "snappy"), ("b.parquet", 230, 100, "zstd"),
         ("c.parquet", 97, 97, "gzip"), ("d.parquet", 40, 7, "none")]  # fmt: skip


def make_table(rows: int, first_id: int) -> pa.Table:
    """Nulls, nested lists, a binary image column, a dictionary-encoded string column."""
    rng = np.random.default_rng(first_id)
    ids = np.arange(first_id, first_id + rows)
    return pa.table({
        "id": ids,
        "score": pa.array([None if i % 11 == 0 else float(v)
                           for i, v in zip(ids, rng.random(rows), strict=True)]),
        "label": pa.array([int(i % 5) for i in ids], pa.int32()),
        "tokens": pa.array([None if i % 13 == 0 else rng.integers(0, 1000, i % 9).tolist() for i in ids],
                           pa.list_(pa.int64())),
        "image": pa.array([None if i % 17 == 0 else rng.bytes(int(i % 50) * 20) for i in ids], pa.binary()),
        "name": pa.array([f"class-{i % 4}" for i in ids]).dictionary_encode(),
        "extra": pa.array([rng.bytes(2000) for _ in ids], pa.binary()),
    })  # fmt: skip


def expected(paths: list[str], columns: list[str] | None) -> list[dict[str, Any]]:
    return [row for p in paths for row in pq.read_table(p, columns=columns).to_pylist()]


def plain(sample: dict[str, Any]) -> dict[str, Any]:
    """Numpy arrays (list columns) as lists, to compare with pyarrow's `to_pylist`."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in sample.items()}


def rows_of(source: Parquet, **loader: Any) -> list[dict[str, Any]]:
    with Loader(source, batch_size=None, collate=None, **loader) as ld:
        return [plain(s) for s in ld]


def write_files(folder: Path) -> list[str]:
    """FILES written in `folder`, their ids running on from file to file; their paths."""
    paths, first = [], 0
    for name, rows, group, codec in FILES:
        path = folder / name
        pq.write_table(make_table(rows, first), path, row_group_size=group, compression=codec)
        paths.append(str(path))
        first += rows
    return paths


def write_tokens(path: Path, rows: int, row_group: int, *, seed: int, longest: int) -> pa.Table:
    """`rows` documents of 1 to `longest - 1` random token ids in `tokens`, their row numbers in
    `id`, written to `path` in row groups of `row_group` rows; the table written."""
    rng = np.random.default_rng(seed)
    offsets = np.concatenate([[0], np.cumsum(rng.integers(1, longest, rows))]).astype(np.int32)
    values = rng.integers(1, 50_000, int(offsets[-1]), dtype=np.int32)
    table = pa.table({
        "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
        "id": pa.array(np.arange(rows)),
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=row_group)
    return table
