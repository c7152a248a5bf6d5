"""Lists of token ids decoded without pyarrow's reader (`parquet_lists`): the same table as
pyarrow's `read_row_group`, whatever the writer's settings; row groups it does not read are left
to pyarrow (None), and a Parquet source gives the same samples either way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.faultproxy import Origin

from aioloader import Loader, sources
from aioloader.sources.formats import parquet_lists
from aioloader.sources.formats.parquet_bytes import FileMeta, decode_pool


def documents(rng: np.random.Generator, n: int, vocab: int, repeats: bool) -> list[np.ndarray]:
    """`n` documents of 1 to 300 ids below `vocab`; with `repeats`, runs of one id (RLE runs of
    dictionary indices) and one-id documents (RLE runs of repetition level 0)."""
    docs = []
    for i in range(n):
        length = 1 if repeats and i % 5 == 0 else int(rng.integers(1, 300))
        doc = rng.integers(0, vocab, length)
        if repeats and length > 40:
            doc[5:35] = doc[4]
        docs.append(doc)
    return docs


def write(path: Path, docs: list[np.ndarray], *, dtype: Any = np.int32, large: bool = False,
          **options: Any) -> pq.ParquetFile:  # fmt: skip
    lengths = np.array([len(d) for d in docs])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    values = pa.array(np.concatenate(docs).astype(dtype))
    if large:
        tokens: pa.Array = pa.LargeListArray.from_arrays(pa.array(offsets), values)
    else:
        tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values)
    table = pa.table({"id": np.arange(len(docs)), "tokens": tokens,
                      "labels": tokens, "text": [f"d{i}" for i in range(len(docs))]})  # fmt: skip
    pq.write_table(table, path, **options)
    return pq.ParquetFile(path)


def meta_of(path: Path) -> FileMeta:
    md = pq.read_metadata(path)
    return FileMeta(url=str(path), label=path.name, metadata=md, size=path.stat().st_size, tail=b"")


def same_as_pyarrow(path: Path, columns: list[str], *, pieces: bool = False) -> int:
    """Every row group decoded here equals pyarrow's; how many were decoded here (not left)."""
    meta, file = meta_of(path), pq.ParquetFile(path)
    data = path.read_bytes()
    ours = 0
    for rg in range(file.num_row_groups):
        given = [(0, data)] if pieces else None
        got = parquet_lists.decode(meta, rg, columns, given, None if pieces else path,
                                   decode_pool())  # fmt: skip
        if got is None:
            continue
        ours += 1
        want = file.read_row_group(rg, columns=columns)
        assert got.schema == want.schema
        assert got.schema.metadata == want.schema.metadata
        assert got.equals(want), f"row group {rg}"
    return ours


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.sampled_from([200, 250, 40_000, 65_536, 70_000, 2**31 - 1]),
    repeats=st.booleans(),
    compression=st.sampled_from(["NONE", "SNAPPY", "ZSTD", "GZIP", "LZ4", "BROTLI"]),
    version=st.sampled_from(["1.0", "2.0"]),
    page=st.sampled_from([512, 8192, 1 << 20]),
    dictionary=st.booleans(),
    int64=st.booleans(),
    large=st.booleans(),
)
def test_a_row_group_is_pyarrows(
    tmp_path: Path, seed: int, vocab: int, repeats: bool, compression: str, version: str,
    page: int, dictionary: bool, int64: bool, large: bool,
) -> None:  # fmt: skip
    rng = np.random.default_rng(seed)
    path = tmp_path / f"{seed}.parquet"
    docs = documents(rng, int(rng.integers(1, 400)), vocab, repeats)
    write(path, docs, dtype=np.int64 if int64 else np.int32, large=large,
          compression=compression, data_page_version=version, data_page_size=page,
          use_dictionary=dictionary, row_group_size=int(rng.integers(1, 300)))  # fmt: skip
    # every one decoded here (no document is empty, no id null: nothing is left to pyarrow), but
    # LZ4 (pyarrow names its codec so whether or not it has Hadoop's framing)
    groups = 0 if compression == "LZ4" else pq.ParquetFile(path).num_row_groups
    assert same_as_pyarrow(path, ["tokens"]) == groups
    assert same_as_pyarrow(path, ["labels", "tokens"]) == groups


@pytest.mark.parametrize("version", ["1.0", "2.0"])
@pytest.mark.parametrize("compression", ["NONE", "SNAPPY", "ZSTD"])
@pytest.mark.parametrize("vocab", [1, 250, 3_000, 50_000, 0])  # 0: no dictionary (PLAIN pages)
def test_the_usual_files_are_read_here(
    tmp_path: Path, version: str, compression: str, vocab: int
) -> None:
    """Lists of ids as writers make them (dictionary indices of 0 to 16 bits, or PLAIN values; one
    page or many): every row group is decoded here, and equals pyarrow's. A decoder that left them
    all to pyarrow would fail this."""
    rng = np.random.default_rng(vocab)
    path = tmp_path / "usual.parquet"
    docs = documents(rng, 600, vocab or 2**31 - 1, repeats=True)
    write(path, docs, compression=compression, data_page_version=version, data_page_size=4096,
          row_group_size=200, use_dictionary=vocab > 0)  # fmt: skip
    assert same_as_pyarrow(path, ["tokens"]) == 3
    assert same_as_pyarrow(path, ["tokens"], pieces=True) == 3  # from fetched bytes too


def test_what_it_does_not_read_is_left_to_pyarrow(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    plain = tmp_path / "plain.parquet"
    write(plain, documents(rng, 50, 50_000, False))
    meta = meta_of(plain)
    for columns in (None, [], ["id"], ["text"], ["tokens", "id"], ["missing"]):
        assert parquet_lists.decode(meta, 0, columns, None, plain, decode_pool()) is None
    # a null document, a null id, an empty document; floats
    for name, column in {
        "null-list": pa.array([[1, 2], None, [3]], pa.list_(pa.int32())),
        "null-id": pa.array([[1, None], [3]], pa.list_(pa.int32())),
        "empty": pa.array([[1, 2], [], [3]], pa.list_(pa.int32())),
        "floats": pa.array([[1.0], [2.0]], pa.list_(pa.float32())),
        "uint16": pa.array([[1], [2]], pa.list_(pa.uint16())),
    }.items():
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"tokens": column}), path)
        assert parquet_lists.decode(meta_of(path), 0, ["tokens"], None, path, decode_pool()) is None
        assert same_as_pyarrow(path, ["tokens"]) == 0


def test_a_damaged_chunk_is_left_to_pyarrow(tmp_path: Path) -> None:
    """A page header cut short, or a page longer than its chunk: not read here (pyarrow then reads
    it, and names what is wrong)."""
    path = tmp_path / "ok.parquet"
    write(path, documents(np.random.default_rng(9), 300, 50_000, False), row_group_size=300)
    meta = meta_of(path)
    chunk = meta.metadata.row_group(0).column(1)
    start = min(chunk.dictionary_page_offset or chunk.data_page_offset, chunk.data_page_offset)
    data = bytearray(path.read_bytes())
    for damage in (lambda d: d.__setitem__(slice(start, start + 12), b"\xff" * 12),
                   lambda d: d.__setitem__(slice(chunk.data_page_offset + 2,
                                                 chunk.data_page_offset + 6), b"\x7f" * 4)):  # fmt: skip
        broken = bytearray(data)
        damage(broken)
        assert parquet_lists.decode(meta, 0, ["tokens"], [(0, bytes(broken))], None,
                                    decode_pool()) is None  # fmt: skip


def test_a_rewritten_file_is_mapped_again(tmp_path: Path) -> None:
    """The mapped file is kept per footer: a file written anew under the same name and opened
    again (a new footer) is read anew, not from the old mapping."""
    path = tmp_path / "again.parquet"
    rng = np.random.default_rng(4)
    write(path, documents(rng, 100, 50_000, False))
    assert same_as_pyarrow(path, ["tokens"]) == 1
    write(path, documents(rng, 150, 50_000, False))
    assert same_as_pyarrow(path, ["tokens"]) == 1


@pytest.mark.in_process
def test_a_source_gives_the_same_samples_either_way_and_decodes_here_what_it_fetched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(11)
    paths = []
    for i in range(2):
        paths.append(tmp_path / f"part-{i}.parquet")
        write(paths[-1], documents(rng, 700, 50_000, True), row_group_size=250)
    calls = []
    decode = parquet_lists.decode

    def counted(*args: Any) -> Any:
        got = decode(*args)
        calls.append(got is not None)
        return got

    def epoch(rows: int | None, where: list[str]) -> list[Any]:
        source = sources.parquet(where, ["tokens"], rows_per_sample=rows, seed=2)
        with Loader(source, batch_size=None, collate=None) as loader:
            out = list(loader)
        if rows is None:
            return [np.asarray(s["tokens"]).tolist() for s in out]
        return [b.column("tokens").to_pylist() for b in out]

    origin = Origin({p.name: p.read_bytes() for p in paths})  # (fetched row groups: decoded here)
    try:
        urls = [f"{origin.url}/{p.name}" for p in paths]
        for rows in (None, 64):
            monkeypatch.setattr(parquet_lists, "decode", counted)
            ours = epoch(rows, urls)
            assert calls
            assert all(calls)  # every row group was decoded here
            monkeypatch.setattr(parquet_lists, "decode", lambda *args: None)
            assert epoch(rows, urls) == ours
            calls.clear()
            monkeypatch.setattr(parquet_lists, "decode", counted)
            assert epoch(rows, [str(p) for p in paths]) == ours
            assert not calls  # local files are pyarrow's to read (see the module's measurements)
    finally:
        origin.stop()


def test_the_ids_are_in_the_decode_pool(tmp_path: Path) -> None:
    pool = decode_pool()
    if pool is None:
        pytest.skip("this pyarrow is built without jemalloc: decodes use the default pool")
    path = tmp_path / "pool.parquet"
    write(path, documents(np.random.default_rng(2), 400, 50_000, False), row_group_size=400)
    meta = meta_of(path)
    before = pool.bytes_allocated()
    table = parquet_lists.decode(meta, 0, ["tokens"], None, path, pool)
    assert table is not None
    assert pool.bytes_allocated() - before >= len(table.column("tokens").chunk(0).values) * 4


def test_a_threads_scratch_is_kept_only_up_to_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet_lists, "_SCRATCH_KEPT", 4 << 20)
    small = parquet_lists._scratch("test", 3 << 20)
    assert parquet_lists._scratch("test", 1 << 20).base is small.base  # reused
    big = parquet_lists._scratch("test", 5 << 20)
    assert len(big) == 5 << 20
    assert parquet_lists._scratch("test", 1 << 20).base is small.base  # the big one was let go
