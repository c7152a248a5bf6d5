"""A row group's list-of-integer columns (token ids) decoded with numpy, without pyarrow's reader.

pyarrow's Parquet reader turns a `list<int32>` column chunk into an array through its generic
nested-column path: it expands every value's repetition and definition levels, builds a validity
bitmap and the list offsets from them, and looks each value up in the dictionary. For a column of
token ids that was half the CPU of an epoch of packed tokens (5-7 ns an id). Here the same chunk
is read in a few whole-array steps (2.5-5 ns an id, `tests/sources/test_parquet_lists.py` checks
the result is pyarrow's):

- the pages' headers (Thrift compact structs) are read in Python, a few per column chunk;
- each page body is decompressed by pyarrow's codec (into the decode pool);
- definition levels must all be the maximum (no null list, no empty list, no null id): one run,
  as writers write them, is checked in Python; other levels as the repetition levels are read;
- repetition levels are read run by run without expanding them (`_doc_starts`): a document starts
  at each level 0, and a run of level 1 (most of a page) is skipped whole;
- dictionary indices: the bit-packed runs' payloads side by side are one bit-packed stream, copied
  a block of equal runs at a time (`_indices`) and unpacked at once (`_unpack`; indices of 8, 16
  or 32 bits are their bytes as they lie); one `take` from the dictionary makes the values. PLAIN
  pages are their bytes.

Few steps matter as much as cheap ones: each numpy or pyarrow call on a large array lets the GIL
go, and a decode thread that comes back for it waits behind the consumer's Python each time; a
first version that read the levels in ~45 calls a page cost the consumer more than it saved.

Where it pays, measured in the whole pipeline (`benchmarks/tokens.py --contenders aioloader
--batches 1900`, 2026-12-07, 2 cores, the A/B in docs/benchmarks.md): row groups fetched from a
store (`--store`, 20 ms a request) cost 11.3-11.9 CPU µs a document with it against 12.8-13.1
without (12-14 % less CPU per token, tokens/s alike); from local files, pyarrow reading the file in
parts went 10 % faster in tokens/s (103.0 and 102.5 M tokens/s against 93.9 and 92.7) for 3-5 %
more CPU, with an earlier first batch. So `Parquet` decodes with it only the row groups it fetched
(`pieces`), and lets pyarrow read local files.

What does not fit (another encoding, a null, an empty document, a legacy list layout, a column
that is not a list of int32 or int64 ids) is left to pyarrow: `decode` returns None and the caller
reads the row group as before. Any error here also hands the row group to pyarrow, which says
what is wrong with the file, so a damaged file fails as it did.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._util.deps import arrow_take
from ..._util.per_thread import PerThread

if TYPE_CHECKING:
    import pyarrow as pa

    from .parquet_bytes import Bytes, FileMeta

__all__ = ["decode", "plan_of"]

# pyarrow's codec names for the Parquet compression names read here (LZ4 with Hadoop's framing is not)
_CODECS = {
    "SNAPPY": "snappy",
    "ZSTD": "zstd",
    "GZIP": "gzip",
    "BROTLI": "brotli",
    "LZ4_RAW": "lz4_raw",
}
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 2, 3
# the PageHeader fields read (Thrift field ids; the rest, statistics included, are skipped)
_WANT = {
    1: True, 2: True, 3: True,
    5: {1: True, 2: True, 3: True, 4: True},  # DataPageHeader
    7: {1: True, 2: True},  # DictionaryPageHeader
    8: {1: True, 2: True, 3: True, 4: True, 5: True, 6: True, 7: True},  # DataPageHeaderV2
}  # fmt: skip


class _Unfit(Exception):
    """The chunk is not one this decoder reads: pyarrow reads the row group."""


class _Column:
    """What decoding one list column needs from the schema: its leaf, its Arrow type, its levels."""

    __slots__ = ("leaf", "list_type", "max_def", "name", "schema", "value_dtype")

    def __init__(self, name: str, leaf: int, list_type: Any, max_def: int, value_dtype: Any):
        self.name, self.leaf, self.list_type = name, leaf, list_type
        self.max_def, self.value_dtype = max_def, value_dtype
        self.schema: Any = None  # the table's, as pyarrow's reader gives it (the first column's)


def plan_of(meta: FileMeta, columns: Sequence[str] | None) -> list[_Column] | None:
    """The columns to decode here, in the order asked, or None when any of them is not a list of
    int32 or int64 ids in the standard three-level layout (worked out once per footer)."""
    if not columns:
        return None
    key = tuple(columns)
    if key not in meta.plans:  # (two threads may both work it out: the same answer)
        meta.plans[key] = _plan(meta, columns)
    plan: list[_Column] | None = meta.plans[key]
    return plan


def _plan(meta: FileMeta, columns: Sequence[str]) -> list[_Column] | None:
    import pyarrow as pa

    schema = meta.metadata.schema
    try:
        arrow = schema.to_arrow_schema()
    except (pa.ArrowException, ValueError):
        return None
    if len(set(arrow.names)) != len(arrow.names):  # a name twice: pyarrow says what it reads
        return None
    plan = []
    for name in columns:
        if name not in arrow.names:
            return None
        kind = arrow.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
            return None
        value = kind.value_type
        dtype = {pa.int32(): np.dtype("<i4"), pa.int64(): np.dtype("<i8")}.get(value)
        leaves = [j for j in range(len(schema)) if schema.column(j).path.split(".")[0] == name]
        if dtype is None or len(leaves) != 1:
            return None
        leaf = schema.column(leaves[0])
        physical = {"INT32": np.dtype("<i4"), "INT64": np.dtype("<i8")}.get(leaf.physical_type)
        # three levels: <name> (optional or required) / list (repeated) / element; one repetition
        if (
            physical != dtype
            or leaf.max_repetition_level != 1
            or len(leaf.path.split(".")) != 3
            or leaf.max_definition_level not in (1, 2, 3)
        ):
            return None
        plan.append(_Column(name, leaves[0], kind, leaf.max_definition_level, dtype))
    plan[0].schema = pa.schema([arrow.field(c.name) for c in plan], metadata=arrow.metadata)
    return plan


def decode(
    meta: FileMeta, row_group: int, columns: Sequence[str] | None,
    pieces: list[tuple[int, Bytes]] | None, path: Path | None, pool: pa.MemoryPool | None,
) -> pa.Table | None:  # fmt: skip
    """Row group `row_group` of `columns` as pyarrow would read it, or None where this decoder does
    not read it (see the module docstring). `pieces` (fetched byte ranges) or the local `path`."""
    plan = plan_of(meta, columns)
    if plan is None:
        return None
    import pyarrow as pa

    rg = meta.metadata.row_group(row_group)
    rows = rg.num_rows
    arrays = []
    try:
        for column in plan:
            chunk = rg.column(column.leaf)
            codec_name = chunk.compression
            codec = None
            if codec_name != "UNCOMPRESSED":
                if codec_name not in _CODECS:
                    return None
                codec = _codec(_CODECS[codec_name])
            start = chunk.data_page_offset
            if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
                start = chunk.dictionary_page_offset
            data = _bytes_of(meta, pieces, path, start, chunk.total_compressed_size)
            values, offsets = _chunk(data, codec, column, rows, pool)
            arrays.append(_lists(column.list_type, offsets, values))
    except (_Unfit, ValueError, IndexError, KeyError, OverflowError, TypeError, pa.ArrowException):
        return None  # pyarrow reads it (and names what is wrong, if anything is)
    return pa.Table.from_arrays(arrays, schema=plan[0].schema)


def _lists(kind: pa.DataType, offsets: np.ndarray, values: pa.Array) -> pa.Array:
    """The list array of `offsets` (int64) over `values`, made from buffers (`pa.array` of a
    numpy array imports `numpy.ma`, ~10 ms, in a first batch's way)."""
    import pyarrow as pa

    large = pa.types.is_large_list(kind)
    held = offsets if large else offsets.astype(np.int32)
    starts = pa.Array.from_buffers(pa.int64() if large else pa.int32(), len(held),
                                   [None, pa.py_buffer(held)])  # fmt: skip
    made = pa.LargeListArray if large else pa.ListArray
    return made.from_arrays(starts, values, type=kind)


@functools.cache
def _codec(name: str) -> pa.Codec:
    import pyarrow as pa

    return pa.Codec(name)


# -- the bytes of a column chunk ----------------------------------------------------------------------

# each thread's mapped files, the last few
_maps: PerThread[str, tuple[FileMeta, np.ndarray]] = PerThread(limit=8)


def _bytes_of(
    meta: FileMeta, pieces: list[tuple[int, Bytes]] | None, path: Path | None, start: int,
    size: int,
) -> np.ndarray:  # fmt: skip
    """The chunk's bytes as a uint8 array: a view of the fetched piece, or of the local file
    mapped (once per thread and footer, as pyarrow's readers are kept: `parquet_bytes._reader`)."""
    if pieces is not None:
        for offset, body in pieces:
            if offset <= start and start + size <= offset + len(body):
                view = np.frombuffer(body, dtype=np.uint8)
                return view[start - offset : start - offset + size]
        raise _Unfit("chunk not in one piece")
    if path is None:
        raise _Unfit("no bytes")
    key = str(path)
    kept = _maps.get(key)
    if kept is None or kept[0] is not meta:
        kept = _maps.make(key, functools.partial(_map, key, meta))
    whole = kept[1]
    if start + size > len(whole):
        raise _Unfit("chunk past the file's end")
    return whole[start : start + size]


def _map(path: str, meta: FileMeta) -> tuple[FileMeta, np.ndarray]:
    """The local file `path` mapped whole, read-only."""
    fd = os.open(path, os.O_RDONLY)
    try:
        length = os.fstat(fd).st_size
        if length == 0:
            raise _Unfit("empty file")
        mapped = mmap.mmap(fd, length, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return meta, np.frombuffer(mapped, dtype=np.uint8)


# -- pages ---------------------------------------------------------------------------------------------


def _chunk(
    data: np.ndarray, codec: Any, column: _Column, rows: int, pool: Any
) -> tuple[pa.Array, np.ndarray]:
    """(values, offsets) of one column chunk of `rows` rows."""
    view = memoryview(data.data)  # header bytes read as ints
    i, n = 0, len(data)
    dictionary: np.ndarray | None = None
    streams: list[tuple[np.ndarray, int, int]] = []  # (repetition levels, values, values before)
    pages: list[tuple[int, np.ndarray, np.ndarray | None]] = []  # (values, indices, plain values)
    total = 0
    width_of_def = column.max_def.bit_length()
    while i < n:
        header, i = _struct(view, i, _WANT)
        kind, size, stored = header[1], header[2], header[3]
        body = data[i : i + stored]
        if len(body) != stored:
            raise _Unfit("page past the chunk")
        i += stored
        if kind == _DICTIONARY_PAGE:
            head = header.get(7, {})
            if head.get(2, _PLAIN) not in (_PLAIN, _PLAIN_DICTIONARY) or dictionary is not None:
                raise _Unfit("dictionary encoding")
            raw = _inflate(body, codec, size, pool)
            dictionary = raw[: head[1] * column.value_dtype.itemsize].view(column.value_dtype)
            if len(dictionary) != head[1]:
                raise _Unfit("short dictionary")
            continue
        if kind == _DATA_PAGE:
            head = header[5]
            count, encoding = head[1], head[2]
            if head.get(3, _RLE) != _RLE or head.get(4, _RLE) != _RLE:
                raise _Unfit("level encoding")
            raw = _inflate(body, codec, size, pool)
            at = 0
            reps, at = _prefixed(raw, at)
            defs, at = _prefixed(raw, at)
            rest = raw[at:]
        elif kind == _DATA_PAGE_V2:
            head = header[8]
            count, nulls, encoding = head[1], head[2], head[4]
            def_length, rep_length = head[5], head[6]
            if nulls:
                raise _Unfit("nulls")
            reps = body[:rep_length]
            defs = body[rep_length : rep_length + def_length]
            rest = body[rep_length + def_length :]
            if head.get(7, True) and codec is not None:
                rest = _inflate(rest, codec, size - rep_length - def_length, pool)
        else:
            continue  # an index page: nothing of the values
        if count == 0:  # a page of no values (a writer's last, at times)
            continue
        if not _all_equal(defs, width_of_def, count, column.max_def):
            raise _Unfit("nulls or empty lists")
        streams.append((reps, count, total))
        if encoding in (_RLE_DICTIONARY, _PLAIN_DICTIONARY):
            if dictionary is None or not len(rest):
                raise _Unfit("no dictionary")
            pages.append((count, rest, None))
        elif encoding == _PLAIN:
            plain = rest[: count * column.value_dtype.itemsize].view(column.value_dtype)
            if len(plain) != count:
                raise _Unfit("short page")
            pages.append((count, rest, plain))
        else:
            raise _Unfit("value encoding")
        total += count
    first = _doc_starts(streams)
    if len(first) != rows or (rows and first[0] != 0):
        raise _Unfit("rows")
    offsets = np.empty(rows + 1, dtype=np.int64)
    offsets[:-1] = first
    offsets[-1] = total
    return _values(pages, dictionary, column.value_dtype, total, pool), offsets


def _values(
    pages: list[tuple[int, np.ndarray, np.ndarray | None]], dictionary: np.ndarray | None,
    dtype: np.dtype[Any], total: int, pool: Any,
) -> pa.Array:  # fmt: skip
    """The chunk's values as one Arrow array. When every page is dictionary-encoded: their indices
    side by side in one buffer (of 1, 2 or 4 bytes an index, as the widest page needs), checked
    against the dictionary's length, and one `take` from it; else each page's values put in place.
    `pages`: (values, the page's value bytes, its PLAIN values or None)."""
    import pyarrow as pa

    arrow_type = pa.int32() if dtype.itemsize == 4 else pa.int64()
    if dictionary is not None and all(plain is None for _, _, plain in pages):
        unit = _unit(max(int(rest[0]) for _, rest, _ in pages))
        into = _scratch("indices", total * unit).view(f"<u{unit}")
        at = 0
        for count, rest, _ in pages:
            _indices(rest[1:], int(rest[0]), count, into[at : at + count])
            at += count
        if total and int(into.max()) >= len(dictionary):
            raise _Unfit("index past the dictionary")  # (checked here: cheaper than take's check)
        kind = {1: pa.uint8(), 2: pa.uint16(), 4: pa.uint32()}[unit]
        keys = pa.Array.from_buffers(kind, total, [None, pa.py_buffer(into)])
        words = pa.Array.from_buffers(arrow_type, len(dictionary), [None, pa.py_buffer(dictionary)])
        return _take(words, keys, pool)
    out = pa.allocate_buffer(total * dtype.itemsize, memory_pool=pool)
    into = np.frombuffer(out, dtype=dtype)
    at = 0
    for count, rest, plain in pages:
        if plain is not None:
            into[at : at + count] = plain
        else:
            if dictionary is None:
                raise _Unfit("no dictionary")
            indices = np.empty(count, dtype=f"<u{_unit(int(rest[0]))}")
            _indices(rest[1:], int(rest[0]), count, indices)
            if count and int(indices.max()) >= len(dictionary):
                raise _Unfit("index past the dictionary")
            np.take(dictionary, indices, out=into[at : at + count])
        at += count
    return pa.Array.from_buffers(arrow_type, total, [None, out])


def _unit(width: int) -> int:
    """The bytes an index of `width` bits is held in."""
    if not 0 <= width <= 32:
        raise _Unfit(f"index width {width}")
    return 1 if width <= 8 else 2 if width <= 16 else 4


def _take(words: pa.Array, keys: pa.Array, pool: Any) -> pa.Array:
    """`words[keys]` (keys checked already), by Arrow's `take` called through `pyarrow._compute`:
    `pyarrow.compute`, which wraps it, takes ~90 ms to import, in the first batch's way."""
    function, options = arrow_take()
    return function.call([words, keys], options, memory_pool=pool)


_scratches: PerThread[str, np.ndarray] = PerThread()


def _scratch(name: str, size: int) -> np.ndarray:
    """`size` bytes of this thread's scratch buffer `name`: what a chunk's decode needs only until
    its `take` (its indices, packed and unpacked), reused rather than taken fresh each time (fresh
    memory costs a page fault per 4 KiB). Aligned to 8 bytes. A buffer is kept up to
    `_SCRATCH_KEPT` bytes; a larger need (a row group of tens of millions of ids) is met fresh and
    let go, so that each decode thread does not hold its largest chunk's buffers for good."""
    kept = _scratches.get(name)
    if kept is not None and len(kept) >= size:
        return kept[:size]
    fresh = np.empty(max(size, 1 << 20) // 8 + 1, dtype=np.uint64).view(np.uint8)
    if size <= _SCRATCH_KEPT:
        _scratches.put(name, fresh)
    return fresh[:size]


_SCRATCH_KEPT = 32 << 20


def _inflate(body: np.ndarray, codec: Any, size: int, pool: Any) -> np.ndarray:
    """A page body decompressed (into the decode pool), as uint8."""
    if codec is None:
        return body
    return np.frombuffer(codec.decompress(body, size, memory_pool=pool), dtype=np.uint8)


def _prefixed(raw: np.ndarray, at: int) -> tuple[np.ndarray, int]:
    """A data page v1's levels: a 4-byte little-endian length, then that many bytes."""
    if at + 4 > len(raw):
        raise _Unfit("short levels")
    length = int.from_bytes(raw[at : at + 4].tobytes(), "little")
    if at + 4 + length > len(raw):
        raise _Unfit("short levels")
    return raw[at + 4 : at + 4 + length], at + 4 + length


# -- Thrift's compact protocol (the page headers) -----------------------------------------------------


def _varint(b: memoryview, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        x = b[i]
        i += 1
        out |= (x & 0x7F) << shift
        if x < 0x80:
            return out, i
        shift += 7
        if shift > 63:
            raise _Unfit("varint")


def _skip(b: memoryview, i: int, kind: int) -> int:
    if kind in (1, 2):  # a bool, in its type
        return i
    if kind == 3:
        return i + 1
    if kind in (4, 5, 6):
        return _varint(b, i)[1]
    if kind == 7:
        return i + 8
    if kind == 8:
        n, i = _varint(b, i)
        return i + n
    if kind in (9, 10):  # list, set
        head = b[i]
        i += 1
        n, element = head >> 4, head & 15
        if n == 15:
            n, i = _varint(b, i)
        for _ in range(n):
            i = i + 1 if element in (1, 2) else _skip(b, i, element)
        return i
    if kind == 11:  # map
        n, i = _varint(b, i)
        if n:
            types = b[i]
            i += 1
            for _ in range(n):
                i = _skip(b, _skip(b, i, types >> 4), types & 15)
        return i
    if kind == 12:
        return _struct(b, i, None)[1]
    raise _Unfit(f"thrift type {kind}")


def _struct(b: memoryview, i: int, want: dict[int, Any] | None) -> tuple[dict[int, Any], int]:
    """A struct at `i`: the fields in `want` (id -> True, or a nested `want` for a struct) as
    ints, bools and dicts; and where it ends."""
    out: dict[int, Any] = {}
    last = 0
    while True:
        head = b[i]
        i += 1
        if head == 0:
            return out, i
        kind, delta = head & 15, head >> 4
        if delta:
            field = last + delta
        else:
            n, i = _varint(b, i)
            field = (n >> 1) ^ -(n & 1)
        last = field
        wanted = None if want is None else want.get(field)
        if wanted is None:
            i = _skip(b, i, kind)
        elif kind == 12:
            out[field], i = _struct(b, i, wanted if isinstance(wanted, dict) else None)
        elif kind in (1, 2):
            out[field] = kind == 1
        elif kind in (4, 5, 6):
            n, i = _varint(b, i)
            out[field] = (n >> 1) ^ -(n & 1)
        else:
            i = _skip(b, i, kind)


# -- the RLE / bit-packed hybrid encoding ----------------------------------------------------------


def _chain(buf: np.ndarray, width: int, count: int) -> tuple[np.ndarray, ...]:
    """The runs of `count` values of `width` bits in `buf`: (kind, values in the run, where its
    payload starts, the RLE value) per run, kind 1 bit-packed, 0 RLE. Every byte's next run header,
    were a header there, is worked out at once; the headers from byte 0 on are then taken by
    doubling (run k's header gives runs k + 2^j's), so the runs are found without a Python step per
    run."""
    n = len(buf)
    if n == 0:
        raise _Unfit("no levels")
    value_bytes = (width + 7) // 8
    pad = np.zeros(n + 6, dtype=np.int64)
    pad[:n] = buf
    # a varint of up to 5 bytes at every position
    value = np.zeros(n, dtype=np.int64)
    length = np.zeros(n, dtype=np.int64)
    going = np.ones(n, dtype=bool)
    for k in range(5):
        byte = pad[k : k + n]
        value |= np.where(going, (byte & 0x7F) << (7 * k), 0)
        length += going
        going &= byte >= 0x80
    packed = (value & 1).astype(bool)
    after = np.arange(n, dtype=np.int64) + length
    step = np.where(packed, (value >> 1) * width, value_bytes)
    jump = np.minimum(after + step, n)  # n: past the end
    jump = np.append(jump, n)  # the end leads to itself
    heads = np.zeros(1, dtype=np.int64)
    while heads[-1] < n:
        heads = np.concatenate([heads, jump[heads]])
        jump = jump[jump]
    heads = heads[heads < n]
    kind = packed[heads]
    values = np.where(kind, (value[heads] >> 1) * 8, value[heads] >> 1)
    ends = np.cumsum(values)
    cut = int(np.searchsorted(ends, count)) + 1  # the runs that hold the `count` values
    heads, kind, values = heads[:cut], kind[:cut], values[:cut]
    if not len(values) or int(values.sum()) < count:
        raise _Unfit("short run")
    payload = after[heads]
    rle = np.zeros(len(heads), dtype=np.int64)
    for k in range(value_bytes):
        rle |= pad[payload + k] << (8 * k)
    return kind, values, payload, rle


def _doc_starts(streams: list[tuple[np.ndarray, int, int]]) -> np.ndarray:
    """Where the repetition levels (1 bit each) of the chunk's pages are 0: each document's first
    value, counted from the chunk's first value. `streams`: (the page's levels, its values, the
    values before it).

    The pages' levels are read together, in a few whole-array steps (each lets the GIL go: a
    decode thread that came back for it once per run would wait behind the consumer each time).
    Every byte's next run header, were a header there, is worked out at once; the headers are then
    taken from each page's first byte on, in one Python step each (a list lookup); the runs' zeros
    come from their payloads at once."""
    bufs = [buf for buf, _, _ in streams]
    buf = np.concatenate(bufs) if len(bufs) > 1 else bufs[0]
    n = len(buf)
    if n == 0:
        raise _Unfit("no levels")
    pad = np.zeros(n + 3, dtype=np.int32)
    pad[:n] = buf
    b0, b1, b2 = pad[:n], pad[1 : n + 1], pad[2 : n + 2]
    m0 = b0 >> 7
    m1 = m0 & (b1 >> 7)
    value = (b0 & 0x7F) | ((b1 & 0x7F) << 7) * m0 | ((b2 & 0x7F) << 14) * m1
    # a run's payload: `groups` bytes of 8 levels (bit-packed), or one byte (RLE)
    jump = (
        np.arange(1, n + 1, dtype=np.int32) + m0 + m1 + np.where(value & 1, value >> 1, 1)
    ).tolist()
    heads: list[int] = []
    sizes: list[int] = []
    at = 0
    for page in bufs:
        p, end, before = at, at + len(page), len(heads)
        while p < end:
            heads.append(p)
            p = jump[p]
        if p != end:
            raise _Unfit("a run past its page's levels")
        sizes.append(len(heads) - before)
        at = end
    h = np.array(heads, dtype=np.intp)
    if bool((m1[h] & (b2[h] >> 7)).any()):
        raise _Unfit("a run header of over three bytes")
    v = value[h]
    packed = (v & 1).astype(bool)
    runs = np.where(packed, (v >> 1) * 8, v >> 1).astype(np.int64)
    counts = np.array([count for _, count, _ in streams], dtype=np.int64)
    befores = np.array([before for _, _, before in streams], dtype=np.int64)
    page_of = np.repeat(np.arange(len(streams)), sizes)
    ends = np.cumsum(runs)
    first_of_page = np.concatenate([[0], ends])[np.cumsum([0, *sizes[:-1]])]
    first = ends - runs - first_of_page[page_of]  # each run's first value within its page
    totals = np.bincount(page_of, weights=runs, minlength=len(streams))
    if bool((totals < counts).any()):
        raise _Unfit("fewer levels than values")
    limit = counts[page_of]  # a page's values past its count are the last run's padding
    shift = befores[page_of]
    parts = []
    zero_runs = ~packed & (pad[h + 1 + m0[h] + m1[h]] == 0)
    if zero_runs.any():  # runs of documents of one value each
        where = _ranges(first[zero_runs], runs[zero_runs])
        keep = where < np.repeat(limit[zero_runs], runs[zero_runs])
        parts.append((where + np.repeat(shift[zero_runs], runs[zero_runs]))[keep])
    if packed.any():
        payload = (h + 1 + m0[h] + m1[h])[packed]
        bits = np.unpackbits(buf[_ranges(payload, runs[packed] // 8)], bitorder="little")
        zeros = np.flatnonzero(bits == 0)
        starts = np.cumsum(runs[packed]) - runs[packed]
        run = np.searchsorted(starts, zeros, side="right") - 1
        where = first[packed][run] + zeros - starts[run]
        keep = where < limit[packed][run]
        parts.append((where + shift[packed][run])[keep])
    if not parts:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.concatenate(parts)) if len(parts) > 1 else parts[0]


def _all_equal(buf: np.ndarray, width: int, count: int, level: int) -> bool:
    """Whether the `count` levels of `width` bits in `buf` are all `level`."""
    view = memoryview(buf.data)
    header, at = _varint(view, 0) if len(buf) else (0, 0)
    size = (width + 7) // 8
    if (
        not header & 1 and header >> 1 >= count and at + size <= len(buf)
    ):  # one run: the common case
        return int.from_bytes(view[at : at + size], "little") == level
    kind, values, payload, rle = _chain(buf, width, count)
    if not bool((rle[~kind] == level).all()):
        return False
    if not kind.any():
        return True
    taken = buf[_ranges(payload[kind], values[kind] // 8 * width)]
    bits = np.unpackbits(taken, bitorder="little").reshape(-1, width)
    got = (bits.astype(np.int64) << np.arange(width)).sum(axis=1)
    where = _ranges((np.cumsum(values) - values)[kind], values[kind])
    return bool((got[where < count] == level).all())  # the last run's padding is no level


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start .. start + length of each (start, length), one after the other."""
    total = int(lengths.sum())
    shift = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return shift + np.arange(total)


def _indices(buf: np.ndarray, width: int, count: int, out: np.ndarray) -> None:
    """`count` dictionary indices of `width` bits in `buf` (the RLE / bit-packed hybrid), written
    into `out`. The bit-packed runs' payloads, side by side, are one bit-packed stream: runs of one
    length one after the other (most of a page: a writer's longest run, again and again) are found
    and copied together, the others one by one; the stream is then unpacked at once (`_unpack`;
    indices of a whole byte or two are their bytes as they lie)."""
    from numpy.lib.stride_tricks import as_strided

    if width == 0:  # a dictionary of one value
        out[:count] = 0
        return
    value_bytes = (width + 7) // 8
    direct = width == out.itemsize * 8  # the payload is the indices
    packed = out.view(np.uint8) if direct else _scratch("packed", len(buf) + 8)
    unit = out.itemsize if direct else 1  # bytes of `packed` per value, when direct
    view = memoryview(buf.data)
    segments: list[
        tuple[int, int, int, int]
    ] = []  # (out at, values, packed values at or -1, RLE value)
    n, at, got, stream = len(buf), 0, 0, 0  # stream: bytes of `packed` filled (not direct)
    while got < count:
        header, p = _varint(view, at)
        if not header & 1:  # RLE: one index, repeated
            run = header >> 1
            if p + value_bytes > n or run == 0:
                raise _Unfit("short run")
            take = min(run, count - got)
            segments.append((got, take, -1, int.from_bytes(view[p : p + value_bytes], "little")))
            got, at = got + take, p + value_bytes
            continue
        groups = header >> 1
        payload = groups * width  # bytes: 8 indices of `width` bits each group
        period = p - at + payload
        if groups == 0 or p + payload > n:
            raise _Unfit("short run")
        k = 1
        whole = min((count - got) // (groups * 8), (n - at) // period)
        if whole > 1:  # the same header again at each period: runs of this length
            heads = as_strided(buf[at:], shape=(whole, p - at), strides=(period, 1))
            same = (heads == buf[at:p]).all(axis=1)
            k = whole if bool(same.all()) else int(np.argmin(same))
        values = min(k * groups * 8, count - got)  # the last run's padding past `count`: not kept
        block = as_strided(buf[p:], shape=(k, payload), strides=(period, 1))
        if direct:
            if values < k * groups * 8:  # the last run: its first `values` indices
                packed[got * unit : (got + values) * unit] = buf[p : p + values * unit]
            else:
                packed[got * unit : (got + values) * unit].reshape(k, payload)[...] = block
        else:
            packed[stream : stream + k * payload].reshape(k, payload)[...] = block
            segments.append((got, values, stream // width * 8, 0))
            stream += k * payload
        got, at = got + values, at + k * period
    if direct:
        for start, values, _, value in segments:
            out[start : start + values] = value
        return
    unpacked = _unpack(packed, width, stream // width) if stream else packed
    for start, values, where, value in segments:
        if where < 0:
            out[start : start + values] = value
        else:
            out[start : start + values] = unpacked[where : where + values]


def _unpack(packed: np.ndarray, width: int, groups: int) -> np.ndarray:
    """The `groups * 8` values of `width` bits (1 to 32, little-endian bit order) bit-packed in
    `packed` (8 bytes of room after them): each of a group's 8 places read at once for every group,
    as a 4- or 8-byte word at its byte, shifted and masked."""
    word = np.dtype("<u4") if width <= 25 else np.dtype("<u8")
    out = _scratch("unpacked", groups * 8 * 4).view("<u4")[: groups * 8]
    shifted = _scratch("shifted", groups * word.itemsize).view(word)[:groups]
    mask = word.type((1 << width) - 1)
    for k in range(8):
        bit = k * width
        words = np.ndarray((groups,), dtype=word, buffer=packed, offset=bit >> 3, strides=(width,))
        np.right_shift(words, word.type(bit & 7), out=shifted)
        np.bitwise_and(shifted, mask, out=out[k::8], casting="unsafe")
    return out
