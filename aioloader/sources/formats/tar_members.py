"""Tar members from a stream of byte chunks, without holding the archive: (name, bytes) as they arrive.

Reads ustar, GNU (long names, base-256 sizes) and pax (path, size) headers, checks every header's
checksum and yields regular files only. A stream that ends inside a member or before the end-of-archive
blocks, or a header that fails its checksum, raises `FetchError` naming the shard and the byte offset.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ..._exceptions import FetchError
from ..._util.aiters import flattened
from ..transport.redact import redact_url

__all__ = ["BLOCK", "Members", "Names", "member_batches", "tar_members"]

BLOCK = 512
_REGULAR = (b"0", b"\x00", b"7")
_PADDING_MAX = 1 << 20  # bytes read past the end-of-archive blocks at most
_ZEROS = bytes(BLOCK)


class _Buffer:
    """Bytes pulled from `chunks` on demand, kept as the chunks they came in (views, not copied);
    `offset` is the archive offset of the first unread byte."""

    def __init__(self, chunks: AsyncIterator[Any]) -> None:
        self._chunks = chunks
        self._parts: collections.deque[memoryview] = collections.deque()  # the first: partly read
        self._held = 0  # unread bytes in `_parts`
        self.offset = 0
        self.eof = False

    async def fill(self, n: int) -> bool:
        """Make `n` bytes available; False if the stream ends first."""
        while self._held < n:
            if self.eof:
                return False
            chunk = await anext(self._chunks, None)
            if chunk is None:
                self.eof = True
            else:
                self.push(chunk)
        return True

    def push(self, chunk: bytes | bytearray | memoryview) -> None:
        """Add `chunk` after the bytes held (a recycled buffer is not reused while a view of it
        lives)."""
        if len(chunk):
            self._parts.append(chunk if isinstance(chunk, memoryview) else memoryview(chunk))
            self._held += len(chunk)

    def take(self, n: int) -> bytes:
        """The next `n` bytes (available), copied once out of the chunks they span."""
        parts = self._parts
        if not n:
            return b""
        if len(parts[0]) >= n:
            out = bytes(parts[0][:n])
        else:
            pieces, want = [], n
            while want > len(parts[0]):
                want -= len(parts[0])
                pieces.append(parts.popleft())
            pieces.append(parts[0][:want])
            out = b"".join(pieces)
            self._held -= n - want
            self.offset += n - want
            n = want
        self.skip(n)
        return out

    def skip(self, n: int) -> None:
        """Pass over the next `n` bytes (available)."""
        self._held -= n
        self.offset += n
        parts = self._parts
        while n:
            first = parts[0]
            if n < len(first):
                parts[0] = first[n:]
                return
            n -= len(first)
            parts.popleft()

    def available(self) -> int:
        return self._held


def _number(field: bytes) -> int:
    if field and field[0] & 0x80:  # GNU base-256
        value = int.from_bytes(field, "big") & ~(0x80 << (8 * (len(field) - 1)))
        return value
    text = field.split(b"\x00", 1)[0].strip()
    return int(text, 8) if text else 0


def _checksum_ok(header: bytes) -> bool:
    try:
        stored = _number(header[148:156])
    except ValueError:
        return False
    return stored == _byte_sum(header) - sum(header[148:156]) + 8 * 0x20


def _byte_sum(block: bytes) -> int:
    """The sum of a header block's 512 bytes, in C: Adler-32's first sum is 1 + the bytes' sum modulo
    65521, exact over 256 bytes (at most 65,280)."""
    with memoryview(block) as view:
        return (zlib.adler32(view[:256]) & 0xFFFF) + (zlib.adler32(view[256:]) & 0xFFFF) - 2


def _pax(data: bytes) -> dict[str, str]:
    fields, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        if length <= space - pos:  # a record is at least its own length field and a space
            raise ValueError(f"pax record length {length} at {pos}")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        fields[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return fields


def tar_members(
    chunks: AsyncGenerator[bytes | bytearray | memoryview | Members, None], shard: str
) -> AsyncGenerator[tuple[str, bytes], None]:
    """(name, contents) of each regular file in the tar archive that `chunks` carries, in order:
    `member_batches`, one member at a time."""
    return flattened(member_batches(chunks, shard))


async def member_batches(
    chunks: AsyncGenerator[bytes | bytearray | memoryview | Members, None], shard: str
) -> AsyncGenerator[list[tuple[str, bytes]], None]:
    """The regular files of the tar archive that `chunks` carries, in order, in lists of
    (name, contents): each list holds the members parsed from the bytes at hand, handed on before
    the stream is waited on for more (so a member never waits for a later one), and before an
    error is raised (so the members before a broken point all come out).

    `chunks` may carry, instead of the archive's bytes, its members already read, in `Members`
    batches (a file read by position: `tar_file.py`); they are handed on as they are.

    Closes `chunks` when it ends, fails or is closed. After the end-of-archive blocks, the padding
    that follows (up to `_PADDING_MAX` bytes) is read too, so that a stream kept as it is read (a
    cached shard) ends whole.
    """
    try:
        first = await anext(chunks, None)
        if isinstance(first, Members):
            batch: Any = first
            while batch is not None:
                if batch:
                    yield batch
                batch = await anext(chunks, None)
            return
        buf = _Buffer(chunks)
        if first is None:
            buf.eof = True
        else:
            buf.push(first)
        async for members in _member_batches(buf, shard):
            yield members
        padding = 0
        async for chunk in chunks:
            padding += len(chunk)
            if padding > _PADDING_MAX:
                break
    finally:
        await chunks.aclose()


class Members(list[tuple[str, bytes]]):
    """A batch of (name, data) members already read from a shard, which its stream hands over in
    place of its bytes (`open_shard(read_file=...)`, `tar_file.py`)."""


async def _member_batches(
    buf: _Buffer, shard: str
) -> AsyncGenerator[list[tuple[str, bytes]], None]:
    names = Names(shard)
    batch: list[tuple[str, bytes]] = []
    try:
        while True:
            at = buf.offset
            if buf.available() < BLOCK and batch:  # about to wait: hand over what is parsed
                yield batch
                batch = []
            if not await buf.fill(BLOCK):
                raise names.broken(
                    f"stream ended without the end-of-archive blocks ({buf.available()} left)", at
                )
            header = buf.take(BLOCK)
            head = names.header(header, at)
            if head is None:
                break  # end of archive (the second zero block and any padding are not needed)
            kind, size = head
            padded = -(-size // BLOCK) * BLOCK
            if buf.available() < padded and batch:
                yield batch
                batch = []
            if not await buf.fill(padded):
                raise names.broken(
                    f"stream ended inside a member of {size} bytes (truncated shard)", at
                )
            data = buf.take(size)
            buf.skip(padded - size)
            name = names.member(kind, header, data, at)
            if name is not None:
                batch.append((name, data))
    except FetchError:
        if batch:  # the members before the broken point come out first
            yield batch
        raise
    if batch:
        yield batch


class Names:
    """What a shard's headers say, one after the other: each header's kind and size, and the name
    of each regular file (from a GNU long name or pax header before it, else its own)."""

    def __init__(self, shard: str) -> None:
        self.shard = shard
        self._long_name: str | None = None
        self._pax: dict[str, str] = {}

    def broken(self, what: str, at: int) -> FetchError:
        """The error of a shard that is not a whole tar archive: `what` is wrong at byte `at`."""
        label = redact_url(self.shard)
        return FetchError(f"tar shard {label}: {what} at byte offset {at}", key=label)

    def header(self, header: bytes, at: int) -> tuple[bytes, int] | None:
        """(kind, size of the data that follows) of the header block at byte `at`; None: the
        end of the archive."""
        if header == _ZEROS:
            return None
        if not _checksum_ok(header):
            raise self.broken("bad header checksum (corrupt or not a tar file)", at)
        try:
            size = _number(header[124:136])
        except ValueError:
            raise self.broken("bad size field", at) from None
        kind = header[156:157]
        pax = self._pax
        if kind not in (b"L", b"x", b"g") and "size" in pax:
            size = int(pax["size"]) if pax["size"].isdecimal() else -1
            if size < 0:
                raise self.broken(f"bad pax size {pax['size']!r}", at)
        return kind, size

    def member(self, kind: bytes, header: bytes, data: bytes, at: int) -> str | None:
        """The name of the member whose header (at byte `at`) and data these are, if it is a
        regular file (None: a long name, a pax header, or not a regular file)."""
        if kind == b"L":
            self._long_name = data.rstrip(b"\x00").decode("utf-8", "surrogateescape")
        elif kind == b"x":
            try:
                self._pax = _pax(data)
            except ValueError:
                raise self.broken("bad pax header", at) from None
        elif kind != b"g":
            name = self._long_name or self._pax.get("path") or _ustar_name(header)
            self._long_name, self._pax = None, {}
            if kind in _REGULAR:
                return name
        return None


def _ustar_name(header: bytes) -> str:
    name = header[0:100].split(b"\x00", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\x00", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")
