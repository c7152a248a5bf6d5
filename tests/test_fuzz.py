"""Property tests of the two parsers of untrusted structure: the tar stream reader and default collate.

The tar reader (`aioloader.sources.formats.tar_members`, behind `tar_shards`) must, for any bytes in any
chunking, either yield members or raise `FetchError`: never hang, never another exception type. On an
intact archive it yields what `tarfile` lists; on a cut one, a prefix of that, then `FetchError`. The
reader of a tar file by position (`tar_file.TarFile`: local and cached shards) must yield the same
members and raise the same error as the stream reader, for any bytes and any sizes of its reads.

`aioloader.default_collate` (and the pooled collate the loader uses) must return what
`torch.utils.data.default_collate` returns for the same samples, or raise where torch raises.

Hypothesis runs derandomized (the same examples every run) and without an example database.
"""

from __future__ import annotations

import collections
import io
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import webdataset as wds
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from scripts.tarcraft import (
    END,
    header,
    member,
    octal,
    pax,
    pax_record,
    read_file_members,
    read_members,
)
from support.compare import assert_same
from torch.utils.data import default_collate as torch_collate

import aioloader
from aioloader import BufferPool, FetchError
from aioloader._pipeline.collate import make_collate
from aioloader.sources import tar_shards

FUZZ = settings(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# -- archives --------------------------------------------------------------------------------------

FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
_PART = st.text(
    st.characters(codec="utf-8", exclude_characters="/\x00", exclude_categories=("Cs",)),
    min_size=1,
    max_size=60,
).filter(lambda s: s not in (".", ".."))
NAMES = st.lists(_PART, min_size=1, max_size=3).map("/".join)
ENTRIES = st.lists(
    st.tuples(
        st.sampled_from(["file", "file", "file", "dir", "symlink"]), NAMES, st.integers(0, 1500)
    ),
    max_size=6,
)
CHUNKS = st.lists(st.integers(1, 1500), max_size=4)

Spec = tuple[str, list[tuple[str, str, int]]]


def build(spec: Spec) -> tuple[bytes, list[tuple[str, bytes]], int]:
    """(archive bytes, its regular files as (name, data), offset of its end-of-archive block)."""
    fmt, entries = spec
    buf = io.BytesIO()
    files: list[tuple[str, bytes]] = []
    try:
        with tarfile.open(fileobj=buf, mode="w", format=FORMATS[fmt]) as tar:
            for i, (kind, name, size) in enumerate(entries):
                info = tarfile.TarInfo(name)
                data = b""
                if kind == "dir":
                    info.type = tarfile.DIRTYPE
                elif kind == "symlink":
                    info.type, info.linkname = tarfile.SYMTYPE, name + "-target"
                else:
                    data = bytes((i * 31 + j) % 256 for j in range(size))
                    info.size = size
                    files.append((name, data))
                tar.addfile(info, io.BytesIO(data))
    except ValueError:  # a name ustar cannot store
        assume(False)
    archive = buf.getvalue()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        listed = [(m.name, m.isreg()) for m in tar.getmembers()]
        end = tar.offset
    assume([n for n, reg in listed if reg] == [n for n, _ in files])  # tarfile's own reading
    return archive, files, end


@settings(FUZZ, max_examples=60)
@given(fmt=st.sampled_from(sorted(FORMATS)), entries=ENTRIES, chunks=CHUNKS)
def test_intact_archives_read_as_tarfile_lists_them(
    fmt: str, entries: list[tuple[str, str, int]], chunks: list[int]
) -> None:
    archive, files, _ = build((fmt, entries))
    got, error = read_members(archive, chunks)
    assert error is None
    assert got == files


@settings(FUZZ, max_examples=60)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    entries=ENTRIES,
    cut=st.floats(0, 1),
    chunks=CHUNKS,
)
def test_cut_archives_yield_a_prefix_then_a_fetch_error_naming_the_offset(
    fmt: str, entries: list[tuple[str, str, int]], cut: float, chunks: list[int]
) -> None:
    archive, files, end = build((fmt, entries))
    at = int(cut * end)
    got, error = read_members(archive[:at], chunks)
    assert got == files[: len(got)]
    assert isinstance(error, FetchError), error
    assert "fuzz.tar" in str(error)
    assert "byte offset" in str(error)


@settings(FUZZ, max_examples=150)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    entries=ENTRIES,
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
    chunks=CHUNKS,
)
@example(fmt="ustar", entries=[("file", "a.txt", 3)], edits=[(148, ord("z"))], chunks=[])
def test_damaged_archives_yield_members_or_a_fetch_error(
    fmt: str,
    entries: list[tuple[str, str, int]],
    edits: list[tuple[int, int]],
    chunks: list[int],
) -> None:
    archive, _, end = build((fmt, entries))
    damaged = bytearray(archive)
    for position, value in edits:
        # mostly into the headers and pax records (the first block of each 512), anywhere else too
        damaged[position % max(1, end)] = value
    _, error = read_members(bytes(damaged), chunks)  # Hung (a loop or a wait) fails the test
    assert error is None or isinstance(error, FetchError), f"{type(error).__name__}: {error}"


SIZE_FIELDS = st.one_of(
    st.integers(0, 3000).map(lambda n: octal(n, 12)),
    st.binary(min_size=12, max_size=12),
    st.binary(min_size=11, max_size=11).map(lambda b: b"\x80" + b),  # GNU base-256
    st.binary(min_size=11, max_size=11).map(lambda b: b"\xff" + b),  # negative base-256
)
PAX_VALUES = st.one_of(
    st.integers(-2000, 3000).map(str), st.text(max_size=12), st.just("0x10"), st.just(" 12 ")
)
PAX_RECORDS = st.one_of(
    st.tuples(st.sampled_from(["size", "path", "linkpath", "mtime", "comment"]), PAX_VALUES).map(
        lambda kv: pax_record(*kv)
    ),
    st.tuples(st.integers(-20, 40), st.binary(max_size=20)).map(
        lambda lb: str(lb[0]).encode() + b" " + lb[1] + b"\n"
    ),
    st.binary(max_size=30),
)
BLOCKS = st.one_of(
    st.tuples(
        st.binary(min_size=1, max_size=30),
        SIZE_FIELDS,
        st.binary(min_size=1, max_size=1),
        st.binary(max_size=1200),
    ).map(lambda t: header(t[0], t[1], t[2]) + t[3].ljust(-(-len(t[3]) // 512) * 512, b"\x00")),
    st.lists(PAX_RECORDS, max_size=3).map(lambda rs: pax(b"".join(rs))),
    st.binary(max_size=300).map(lambda name: member(b"././@LongLink", name, kind=b"L")),
    st.tuples(st.binary(min_size=1, max_size=20), st.binary(max_size=700)).map(
        lambda t: member(t[0], t[1])
    ),
)


@settings(FUZZ, max_examples=200)
@given(blocks=st.lists(BLOCKS, min_size=1, max_size=5), end=st.booleans(), chunks=CHUNKS)
@example(blocks=[pax(b"0 a=b\n"), member(b"a.txt", b"hi")], end=True, chunks=[])
@example(blocks=[pax(pax_record("size", "-512")), member(b"a.txt", b"hi")], end=True, chunks=[])
@example(blocks=[pax(pax_record("size", "0x10")), member(b"a.txt", b"hi")], end=True, chunks=[])
def test_crafted_headers_yield_members_or_a_fetch_error(
    blocks: list[bytes], end: bool, chunks: list[int]
) -> None:
    data = b"".join(blocks) + (END if end else b"")
    _, error = read_members(data, chunks)  # Hung (a loop or a wait) fails the test
    assert error is None or isinstance(error, FetchError), f"{type(error).__name__}: {error}"


READS = st.tuples(
    st.sampled_from([512, 1024, 1536, 4096, 65536]),  # region
    st.sampled_from([1, 600, 1024, 32768]),  # direct
    st.sampled_from([1, 700, 5000, 1 << 21]),  # limit
)


def same_as_the_stream(data: bytes, reads: tuple[int, int, int]) -> None:
    """The file reader gives `data`'s members and error as the stream reader does."""
    streamed, stream_error = read_members(data)
    read, file_error = read_file_members(data, *reads)
    assert read == streamed
    assert repr(file_error) == repr(stream_error)


@settings(FUZZ, max_examples=80)
@given(
    fmt=st.sampled_from(sorted(FORMATS)),
    entries=ENTRIES,
    cut=st.floats(0, 1.2),
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), max_size=3),
    reads=READS,
)
def test_a_file_read_by_position_gives_what_its_stream_gives(
    fmt: str,
    entries: list[tuple[str, str, int]],
    cut: float,
    edits: list[tuple[int, int]],
    reads: tuple[int, int, int],
) -> None:
    archive, _, end = build((fmt, entries))
    data = bytearray(archive[: int(cut * len(archive))])
    for position, value in edits:
        if data:
            data[position % min(len(data), max(1, end))] = value
    same_as_the_stream(bytes(data), reads)


@settings(FUZZ, max_examples=120)
@given(blocks=st.lists(BLOCKS, min_size=1, max_size=5), end=st.booleans(), reads=READS)
def test_crafted_headers_read_by_position_as_streamed(
    blocks: list[bytes], end: bool, reads: tuple[int, int, int]
) -> None:
    same_as_the_stream(b"".join(blocks) + (END if end else b""), reads)


# -- the tar_shards source against webdataset ------------------------------------------------------

WDS_NAMES = st.tuples(
    st.sampled_from(["", "d/", "d/e/"]),
    st.sampled_from(["a", "b", "b2", "x.y"]),
    st.sampled_from(["jpg", "cls", "seg.png", "JSON", "__meta__", "txt"]),
).map(lambda t: f"{t[0]}{t[1]}.{t[2]}")


def webdataset_samples(path: str) -> list[dict[str, Any]]:
    with open(path, "rb") as stream:
        members = wds.tariterators.tar_file_expander([{"url": path, "stream": stream}])
        return list(wds.tariterators.group_by_keys(members))


def tar_shards_samples(path: str) -> list[dict[str, Any]]:
    import asyncio

    async def run() -> list[dict[str, Any]]:
        source = tar_shards([path], shuffle=False)
        try:
            return [sample async for sample in source.samples(0)]
        finally:
            await source.aclose()

    return asyncio.run(run())


@settings(FUZZ, max_examples=40)
@given(names=st.lists(WDS_NAMES, min_size=1, max_size=8))
def test_tar_shards_group_samples_as_webdataset_does(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "shard.tar")
        Path(path).write_bytes(
            b"".join(member(n.encode(), f"{i}:{n}".encode()) for i, n in enumerate(names)) + END
        )
        try:
            want: list[dict[str, Any]] | None = webdataset_samples(path)
        except ValueError:  # a file name twice in one sample
            want = None
        if want is None:
            with pytest.raises(FetchError, match="twice in one sample"):
                tar_shards_samples(path)
        else:
            assert tar_shards_samples(path) == want


# -- default collate against torch's ----------------------------------------------------------------

Point = collections.namedtuple("Point", ["x", "y"])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8,
          torch.bool, torch.complex64]  # fmt: skip
SHAPES = st.lists(st.integers(0, 3), max_size=3).map(tuple)


@st.composite
def leaves(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["int", "float", "bool", "str", "bytes", "tensor", "array",
                                 "np_scalar", "none", "str_array"]))  # fmt: skip
    if kind == "int":
        return draw(st.integers(-(2**40), 2**40))
    if kind == "float":
        return draw(st.floats(width=32))
    if kind == "bool":
        return draw(st.booleans())
    if kind == "str":
        return draw(st.text(max_size=4))
    if kind == "bytes":
        return draw(st.binary(max_size=4))
    if kind == "none":
        return None
    if kind == "str_array":
        return np.array(draw(st.lists(st.text(max_size=2), min_size=1, max_size=3)))
    shape = draw(SHAPES)
    dtype = draw(st.sampled_from(DTYPES))
    if kind == "np_scalar" and dtype in (torch.float16, torch.complex64):
        dtype = torch.float64
    seed = draw(st.integers(0, 2**16))
    t = (torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 100).to(dtype)
    if kind == "tensor":
        if draw(st.booleans()) and t.dim() >= 2:
            t = t.transpose(0, 1)  # not contiguous
        return t
    array = t.numpy()
    return array.reshape(-1)[0] if kind == "np_scalar" and array.size else array


def structures(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3),
            st.lists(inner, max_size=3).map(tuple),
            st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3),
            st.tuples(inner, inner).map(lambda xy: Point(*xy)),
        ),
        max_leaves=6,
    )


def like(template: Any, draw: st.DrawFn) -> Any:
    """A sample shaped like `template`: same structure, types, shapes and dtypes, new values."""
    if isinstance(template, torch.Tensor):
        return torch.full_like(template, draw(st.integers(0, 9)))
    if isinstance(template, np.ndarray) and template.dtype.kind not in "SU":
        return np.full_like(template, draw(st.integers(0, 9)))
    if isinstance(template, Point):
        return Point(like(template.x, draw), like(template.y, draw))
    if isinstance(template, Mapping):
        return {k: like(v, draw) for k, v in template.items()}
    if isinstance(template, list | tuple):
        return type(template)(like(v, draw) for v in template)
    if isinstance(template, bool):
        return draw(st.booleans())
    if isinstance(template, int):
        return draw(st.integers(-100, 100))
    if isinstance(template, float):
        return draw(st.floats(-1e3, 1e3))
    return template


@st.composite
def batches(draw: st.DrawFn) -> list[Any]:
    """Samples of one structure (most often), or any samples at all."""
    n = draw(st.integers(1, 4))
    if draw(st.integers(0, 3)) == 0:
        return draw(st.lists(structures(leaves()), min_size=n, max_size=n))
    template = draw(structures(leaves()))
    samples = [template] + [like(template, draw) for _ in range(n - 1)]
    if draw(st.integers(0, 2)) == 0:  # one odd sample out
        samples[draw(st.integers(0, n - 1))] = draw(structures(leaves()))
    return samples


def outcome(collate: Any, samples: list[Any]) -> tuple[Any, BaseException | None]:
    try:
        return collate(samples), None
    except Exception as exc:
        return None, exc


@settings(FUZZ, max_examples=250)
@given(samples=batches())
def test_default_collate_matches_torch_or_both_raise(samples: list[Any]) -> None:
    theirs, their_error = outcome(torch_collate, samples)
    pooled = make_collate(BufferPool(per_shape=1))
    for collate in (aioloader.default_collate, pooled, pooled):  # pooled twice: a recycled buffer
        ours, our_error = outcome(collate, samples)
        if their_error is not None:
            assert our_error is not None, f"torch raised {their_error!r}; we returned {ours!r}"
        else:
            assert our_error is None, f"torch returned {theirs!r}; we raised {our_error!r}"
            assert_same(ours, theirs)
        del ours
