"""Parquet bytes for the parquet source: footers, column-chunk byte ranges, row groups decoded from them.

A file is read in two steps. Its footer: one request for the last `FOOTER_GUESS` bytes (a suffix Range
request, which also tells the file's size), and a second only when the footer is longer; the column
chunks in those last bytes are kept and not asked for again. Then each row
group the epoch needs: only the chosen columns' column chunks, adjacent chunks merged into one request,
all requests of a row group at once; pyarrow decodes the row group from those bytes in a thread (it
releases the GIL), reading them through `_Pieces`, a file whose only bytes are the ones fetched. A
local file's row groups are read and decoded by pyarrow itself, in one call in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..._exceptions import FetchError
from ..._util.bytearrays import Bytearrays, landing
from ..._util.deps import parquet_reader
from ..._util.per_thread import PerThread
from ..transport.redact import redact_url
from .shards import SCHEMES, StoreOptions

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = [
    "FOOTER_GUESS",
    "FileMeta",
    "ParquetError",
    "Store",
    "decode_row_group",
    "decode_row_group_in_parts",
    "need_pyarrow",
    "store_for",
]

Bytes = bytes | bytearray | memoryview  # a piece of a file: as read, received, or a view of it
FOOTER_GUESS = 64 << 10  # bytes asked for a footer; a longer one costs a second request
_MAGIC = b"PAR1"


class ParquetError(FetchError):
    """A Parquet file that cannot be read: a bad footer, or a row group whose pages do not decode.

    Attributes:
        url: the file (redacted).
        row_group: the row group that failed (None: the footer).
    """

    def __init__(self, message: str = "", *, url: str = "", row_group: int | None = None) -> None:
        super().__init__(message, key=url, stage="fetch")
        self.url = url
        self.row_group = row_group


def need_pyarrow() -> None:
    """Raise ImportError, saying what to install, when pyarrow is missing."""
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "sources.parquet needs pyarrow: pip install 'aioloader[parquet]'"
        ) from exc


class Store:
    """Byte ranges of one file, local or remote."""

    def __init__(self, url: str, remote: Any = None, remote_url: str = "") -> None:
        self.url = url
        self.label = redact_url(url)
        self._remote = remote
        self._remote_url = remote_url
        self.path = None if remote is not None else Path(url.removeprefix("file://"))

    async def tail(self, length: int) -> tuple[bytes, int]:
        """The last `length` bytes (all of a shorter file) and the file's size: one request."""
        if self._remote is not None:
            body, size = await self._remote.transport.tail(
                self._remote_url, key=self.label, length=length
            )
            return bytes(body), size
        return await asyncio.to_thread(self._local_tail, length)

    async def read(self, offset: int, length: int) -> Bytes:
        """Bytes [offset, offset + length) (a remote body as received: not copied). The fast
        engine receives it into the start of a recycled buffer (`_BODIES.fit`): chunk ranges
        are of every length, and a fresh buffer each time pays a page fault per 4 KiB."""
        if self._remote is not None:
            transport = self._remote.transport
            into = memoryview(_BODIES.fit(length)) if transport.engine == "fast" else None
            token = landing.set(into)
            try:
                body: Bytes = await transport.get(
                    self._remote_url, key=self.label, offset=offset, length=length
                )
                return body
            finally:
                landing.reset(token)
        return await asyncio.to_thread(self._local_read, offset, length)

    def _local_tail(self, length: int) -> tuple[bytes, int]:
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - length))
                return f.read(), size
        except OSError as exc:
            raise ParquetError(
                f"parquet {self.label}: {exc.strerror or exc}", url=self.label
            ) from exc

    def _local_read(self, offset: int, length: int) -> bytes:
        assert self.path is not None
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)


_BODIES = Bytearrays(64 << 20)  # the buffers remote chunk ranges are received into, kept


def store_for(url: str, remotes: dict[str, Any], options: StoreOptions) -> Store:
    """The `Store` of `url`: a source of its scheme (made once, kept in `remotes`), else a path."""
    scheme, sep, _ = url.partition("://")
    reach = SCHEMES.get(scheme) if sep else None
    if reach is None:
        return Store(url)
    remote, remote_url, _ = reach(url, remotes, options)
    return Store(url, remote, remote_url)


@dataclass(frozen=True)
class FileMeta:
    """A file's footer, as needed: its metadata, row counts and each row group's chunk ranges."""

    url: str
    label: str
    metadata: pq.FileMetaData
    size: int
    tail: bytes  # the file's last bytes as read with the footer: chunks in it need no request
    _ranges: dict[tuple[int, tuple[int, ...]], list[tuple[int, int]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # `parquet_lists.plan_of`'s answer for each choice of columns, worked out once per footer
    plans: dict[tuple[str, ...], Any] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def row_counts(self) -> list[int]:
        md = self.metadata
        return [md.row_group(i).num_rows for i in range(md.num_row_groups)]

    def leaves(self, columns: Sequence[str] | None) -> list[int]:
        """The leaf columns (indices) that make up the top-level `columns` (None: all)."""
        schema = self.metadata.schema
        return [
            j
            for j in range(len(schema))
            if columns is None or schema.column(j).path.split(".")[0] in columns
        ]

    def ranges(self, row_group: int, leaves: Sequence[int]) -> list[tuple[int, int]]:
        """(offset, length) requests for `leaves` of `row_group`, adjacent chunks merged (worked
        out once: the footer's objects are slow to walk)."""
        key = (row_group, tuple(leaves))
        known = self._ranges.get(key)
        if known is None:
            rg = self.metadata.row_group(row_group)
            spans = []
            for j in leaves:
                col = rg.column(j)
                start = col.data_page_offset
                if col.has_dictionary_page and 0 < col.dictionary_page_offset < start:
                    start = col.dictionary_page_offset
                spans.append((start, start + col.total_compressed_size))
            known = self._ranges[key] = coalesce(spans)
        return known


def coalesce(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, stop) spans as (offset, length) requests, overlapping or adjacent ones merged."""
    merged: list[list[int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b - a) for a, b in merged]


async def read_footer(store: Store) -> FileMeta:
    """The footer of `store`'s file: one request, or two when it is longer than `FOOTER_GUESS`."""
    tail: Bytes
    tail, size = await store.tail(FOOTER_GUESS)
    length = _footer_length(store, tail, size)
    if length > len(tail):
        tail = await store.read(size - length, length)
    return _footer(store, tail, size, length)


def read_local_footer(store: Store) -> FileMeta:
    """`read_footer` of a local file, in this thread (no loop, no thread: a few reads of the
    page cache, where a loop and its threads would cost more than the reads)."""
    tail: Bytes
    tail, size = store._local_tail(FOOTER_GUESS)
    length = _footer_length(store, tail, size)
    if length > len(tail):
        tail = store._local_read(size - length, length)
    return _footer(store, tail, size, length)


def _footer_length(store: Store, tail: Bytes, size: int) -> int:
    """The bytes the footer takes at the file's end (its length field and magic included)."""
    if size < 12 or tail[-4:] != _MAGIC:
        raise ParquetError(
            f"parquet {store.label}: not a Parquet file (no PAR1 at its end; {size} bytes)",
            url=store.label,
        )
    length: int = struct.unpack("<I", tail[-8:-4])[0]
    if length + 8 > size - 4:
        raise ParquetError(
            f"parquet {store.label}: corrupt footer (says {length} bytes in a file of {size})",
            url=store.label,
        )
    return length + 8


def _footer(store: Store, tail: Bytes, size: int, length: int) -> FileMeta:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.read_metadata(pa.BufferReader(tail[-length:]))
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ParquetError(
            f"parquet {store.label}: corrupt footer: {exc}", url=store.label
        ) from exc
    return FileMeta(store.url, store.label, metadata, size, bytes(tail))


async def fetch_row_group(
    store: Store, meta: FileMeta, row_group: int, leaves: Sequence[int]
) -> list[tuple[int, Bytes]]:
    """The column-chunk bytes of `row_group` for `leaves`, as (offset, bytes) pieces; those in
    the tail read with the footer come from there."""
    ranges = meta.ranges(row_group, leaves)
    held = meta.size - len(meta.tail)

    async def read(offset: int, n: int) -> Bytes:
        if offset >= held:
            return meta.tail[offset - held : offset - held + n]
        return await store.read(offset, n)

    bodies = await asyncio.gather(*(read(offset, n) for offset, n in ranges))
    for (offset, n), body in zip(ranges, bodies, strict=True):
        if len(body) != n:
            raise ParquetError(
                f"parquet {meta.label}: row group {row_group}: {len(body)} of {n} bytes at "
                f"offset {offset} (the file is shorter than its footer says)",
                url=meta.label,
                row_group=row_group,
            )
    return [(offset, body) for (offset, _), body in zip(ranges, bodies, strict=True)]


class _Pieces:
    """A read-only file of `size` bytes of which only `pieces` exist; reading elsewhere fails.
    A read returns a view of a piece, not a copy; `pieces` may be replaced between reads (one
    reader serves a file's row groups one after the other)."""

    def __init__(self, pieces: list[tuple[int, Bytes]], size: int) -> None:
        self.pieces = pieces
        self._size = size
        self._pos = 0
        self.closed = False

    def read(self, n: int = -1) -> memoryview:
        start = self._pos
        stop = self._size if n < 0 else min(self._size, start + n)
        for offset, body in self.pieces:
            if offset <= start and stop <= offset + len(body):
                self._pos = stop
                return memoryview(body)[start - offset : stop - offset]
        raise OSError(f"bytes {start}-{stop} were not fetched (outside the column chunks)")

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._size + pos
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def decode_row_group(
    meta: FileMeta, row_group: int, columns: Sequence[str] | None,
    pieces: list[tuple[int, Bytes]] | None, path: Path | None = None,
) -> pa.Table:  # fmt: skip
    """Row group `row_group` of the chosen `columns`, decoded from its fetched `pieces`, or read by
    pyarrow from the local file `path` (run in a thread: pyarrow releases the GIL). A page that does
    not decode raises ParquetError naming the file and the row group. (Lists of token ids that
    `parquet_lists` reads are decoded there: `Parquet._decode` asks it first.)"""
    with _decoding(meta, row_group, pieces, path) as f:
        return f.read_row_group(row_group, columns=columns, use_threads=False)


def decode_row_group_in_parts(
    meta: FileMeta, row_group: int, columns: Sequence[str] | None,
    pieces: list[tuple[int, Bytes]] | None, path: Path | None, rows: int,
) -> Iterator[pa.RecordBatch]:  # fmt: skip
    """As `decode_row_group`, in record batches of `rows` rows, each one given as it is decoded
    (the rows of a row group needed first need not wait for its last ones; smaller buffers cost
    less to fill, too). Errors as there. (Lists of token ids that `parquet_lists` reads are
    decoded whole, at once: `Parquet._decode` asks it first.)"""
    with _decoding(meta, row_group, pieces, path) as f:
        yield from f.iter_batches(rows, row_groups=[row_group], columns=columns, use_threads=False)


@contextlib.contextmanager
def _decoding(
    meta: FileMeta, row_group: int, pieces: list[tuple[int, Bytes]] | None, path: Path | None
) -> Iterator[pq.ParquetFile]:
    """This thread's reader of the file, over `pieces` while the block runs; what pyarrow raises
    in it becomes a ParquetError naming the file and the row group."""
    import pyarrow as pa

    held: _Pieces | None = None
    try:
        f, held = _reader(meta, path)
        if held is not None:
            held.pieces = pieces or []
        yield f
    except (pa.ArrowException, OSError, ValueError, IndexError) as exc:
        raise ParquetError(
            f"parquet {meta.label}: row group {row_group} does not decode: "
            f"{type(exc).__name__}: {exc}",
            url=meta.label,
            row_group=row_group,
        ) from exc
    finally:
        if held is not None:
            held.pieces = []  # the fetched bytes are not kept past their decode


_OPEN_PER_THREAD = 8
# each thread's readers (a reader serves one thread at a time), the longest open let go first:
# descriptors stay few
_opened: PerThread[str, tuple[FileMeta, pq.ParquetFile, _Pieces | None]] = PerThread(
    limit=_OPEN_PER_THREAD
)


def _reader(meta: FileMeta, path: Path | None) -> tuple[pq.ParquetFile, _Pieces | None]:
    """This thread's reader of the file of `meta` (made once per thread: making one walks the
    schema in Python): over the local file `path`, or over fetched pieces (the `_Pieces` returned,
    whose pieces the caller sets)."""
    key = meta.url if path is None else str(path)
    held = _opened.get(key)
    if held is None or held[0] is not meta:
        held = _opened.make(key, functools.partial(_open_reader, meta, path))
    return held[1], held[2]


def _open_reader(
    meta: FileMeta, path: Path | None
) -> tuple[FileMeta, pq.ParquetFile, _Pieces | None]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if path is None:
        pieces = _Pieces([], meta.size)
        f = pa.PythonFile(pieces, mode="r")
        reader = _pooled(pq.ParquetFile(f, metadata=meta.metadata, pre_buffer=False), f,
                         meta, memory_map=False)  # fmt: skip
        return meta, reader, pieces
    # mapped: pages are decoded from the page cache, not first copied out of it
    source = str(path)
    reader = pq.ParquetFile(source, metadata=meta.metadata, pre_buffer=False,
                            memory_map=True)  # fmt: skip
    return meta, _pooled(reader, source, meta, memory_map=True), None


@functools.cache
def decode_pool() -> pa.MemoryPool | None:
    """The memory pool row groups are decoded into: jemalloc's where pyarrow has it (None: the
    default pool).

    Why not the default (mimalloc in pyarrow's Linux wheels): its arenas are marked for huge pages,
    and a purged part of one comes back as a fresh 2 MB page that the kernel zeroes whole. Decoding
    frees and takes megabytes per row group, so on a machine whose fresh memory is slow that zeroing
    was the largest single cost of an epoch of tokens (9-21% of the CPU; 1-2% with jemalloc, which
    keeps freed pages for reuse a while). Only the decode's buffers move: the process's default
    pool is left as it is."""
    import pyarrow as pa

    try:
        return pa.jemalloc_memory_pool()
    except (NotImplementedError, AttributeError):  # a build without jemalloc
        return None


def _pooled(
    file: pq.ParquetFile, source: Any, meta: FileMeta, *, memory_map: bool
) -> pq.ParquetFile:
    """`file`, its reads decoding into `decode_pool()`: its reader swapped for one opened on the
    same `source` with that pool (the reader `ParquetFile` makes takes the default pool; its other
    parts, the schema's column paths, are kept). Where pyarrow's reader takes no pool, `file`."""
    pool = decode_pool()
    if pool is None:
        return file
    reader = parquet_reader(pool)
    if reader is None:  # another pyarrow's reader: its own pool, then
        return file
    try:
        reader.open(source, use_memory_map=memory_map, pre_buffer=False, metadata=meta.metadata)
    except TypeError:  # another pyarrow's reader: its own pool, then
        return file
    file.reader = reader
    return file
