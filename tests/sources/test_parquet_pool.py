"""Row groups decode into the decode pool (jemalloc's where pyarrow has it), whether read from a
local file or from fetched bytes, whole or in parts; the process's default pool is left alone."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.parquetfiles import write_tokens

from aioloader._util.ranges import Ranges
from aioloader.sources import Parquet
from aioloader.sources.formats.parquet_bytes import (
    FileMeta,
    decode_pool,
    decode_row_group,
    decode_row_group_in_parts,
)

ROWS, GROUP = 2_000, 1_000


@pytest.fixture
def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.parquet"
    write_tokens(path, ROWS, GROUP, seed=5, longest=400)
    return path


@pytest.fixture
def pool() -> pa.MemoryPool:
    found = decode_pool()
    if found is None:
        pytest.skip("this pyarrow is built without jemalloc: decodes use the default pool")
    assert found.backend_name == "jemalloc"
    return found


def meta_of(path: Path) -> FileMeta:
    return FileMeta(str(path), path.name, pq.read_metadata(path), path.stat().st_size, b"")


def fetched(path: Path, meta: FileMeta, row_group: int) -> list[tuple[int, bytes]]:
    """The row group's chunks of "tokens", as a fetch would hand them over: real bytes."""
    data = path.read_bytes()
    return [(a, data[a : a + n]) for a, n in meta.ranges(row_group, meta.leaves(["tokens"]))]


@contextlib.contextmanager
def counted(pool: pa.MemoryPool) -> Iterator[list[int]]:
    """The bytes the block leaves allocated in `pool` and in the default pool, in the list given
    (set as it ends). Earlier tests' leftovers are collected first and none while it runs: only
    the block's own buffers move the counts."""
    default = pa.default_memory_pool()
    gc.collect()
    gc.disable()
    ours, theirs = pool.bytes_allocated(), default.bytes_allocated()
    grew: list[int] = []
    try:
        yield grew
    finally:
        grew[:] = [pool.bytes_allocated() - ours, default.bytes_allocated() - theirs]
        gc.enable()


def grown(pool: pa.MemoryPool, make: Callable[[], Any]) -> tuple[Any, int, int]:
    """What `make()` returns, and the bytes it left allocated in `pool` and in the default pool."""
    with counted(pool) as grew:
        value = make()
    return value, grew[0], grew[1]


def values_bytes(table: Any) -> int:
    column = table.column("tokens")
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    # (a part may be a slice of its row group's array: its own ids, not all of the child's)
    return sum((c.offsets[-1].as_py() - c.offsets[0].as_py()) * 4 for c in chunks)


@pytest.mark.parametrize("where", ["local file", "fetched bytes"])
def test_a_row_group_decodes_into_the_decode_pool(
    tokens_file: Path, pool: pa.MemoryPool, where: str
) -> None:
    meta = meta_of(tokens_file)
    remote = where == "fetched bytes"
    path = None if remote else tokens_file

    def pieces(row_group: int) -> list[tuple[int, bytes]] | None:
        return fetched(tokens_file, meta, row_group) if remote else None

    table, ours, theirs = grown(
        pool, lambda: decode_row_group(meta, 1, ["tokens"], pieces(1), path)
    )
    assert table.equals(pq.read_table(tokens_file, columns=["tokens"]).slice(GROUP, GROUP))
    assert ours >= values_bytes(table)  # its token ids at least
    assert theirs < values_bytes(table) // 10
    del table
    parts, ours, theirs = grown(
        pool, lambda: list(decode_row_group_in_parts(meta, 0, ["tokens"], pieces(0), path, 256))
    )
    assert [len(p) for p in parts] == [256, 256, 256, 232]
    assert ours >= sum(values_bytes(p) for p in parts)
    assert theirs < sum(values_bytes(p) for p in parts) // 10


@pytest.mark.asyncio
async def test_the_sources_samples_hold_their_tokens_in_the_decode_pool(
    tokens_file: Path, pool: pa.MemoryPool
) -> None:
    src = Parquet(str(tokens_file), ["tokens"], rows_per_sample=500, shuffle=False)
    walk = src.refs(0, src.share(Ranges()))
    with counted(pool) as grew:
        try:
            samples = [await src.fetch(ref) for _, ref in walk]
        finally:
            walk.close()
            await src.aclose()
    assert sum(len(s) for s in samples) == ROWS
    held = sum(values_bytes(s) for s in samples)
    assert grew[0] >= held
    # (not a tenth, as for one decode above: beside two CPU hogs about one run in ten ends with
    # 405,504 bytes more in the default pool, not from the source's opens or decodes, which take
    # none of it when measured alone; the samples' own would be all of `held`)
    assert grew[1] < held // 2
