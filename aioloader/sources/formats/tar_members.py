"""Tar members from a stream of byte chunks, without holding the archive: (name, bytes) as they arrive.

Reads ustar, GNU (long names, base-256 sizes) and pax (path, size) headers, checks every header's
checksum and yields regular files only. A stream that ends inside a member or before the end-of-archive
blocks, or a header that fails its checksum, raises `FetchError` naming the shard and the byte offset.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator

from ..._exceptions import FetchError
from ..transport.redact import redact_url

__all__ = ["BLOCK", "tar_members"]

BLOCK = 512
_REGULAR = (b"0", b"\x00", b"7")
_PADDING_MAX = 1 << 20  # bytes read past the end-of-archive blocks at most


class _Buffer:
    """Bytes pulled from `chunks` on demand; `offset` is the archive offset of the first unread byte."""

    def __init__(self, chunks: AsyncIterator[bytes | bytearray | memoryview]) -> None:
        self._chunks = chunks
        self._buf = bytearray()
        self._pos = 0
        self.offset = 0
        self.eof = False

    async def fill(self, n: int) -> bool:
        """Make `n` bytes available; False if the stream ends first."""
        while len(self._buf) - self._pos < n:
            if self.eof:
                return False
            chunk = await anext(self._chunks, None)
            if chunk is None:
                self.eof = True
                continue
            if self._pos:
                del self._buf[: self._pos]
                self._pos = 0
            self._buf += chunk
        return True

    def take(self, n: int) -> bytes:
        with memoryview(self._buf) as view:  # one copy, out of the buffer (a slice would be two)
            out = bytes(view[self._pos : self._pos + n])
        self.skip(n)
        return out

    def skip(self, n: int) -> None:
        self._pos += n
        self.offset += n

    def available(self) -> int:
        return len(self._buf) - self._pos


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
    unsigned = sum(header[:148]) + 8 * 0x20 + sum(header[156:])
    return stored == unsigned


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


async def tar_members(
    chunks: AsyncGenerator[bytes | bytearray | memoryview, None], shard: str
) -> AsyncGenerator[tuple[str, bytes], None]:
    """(name, contents) of each regular file in the tar archive that `chunks` carries, in order.

    Closes `chunks` when it ends, fails or is closed. After the end-of-archive blocks, the padding
    that follows (up to `_PADDING_MAX` bytes) is read too, so that a stream kept as it is read (a
    cached shard) ends whole.
    """
    try:
        async for member in _members(_Buffer(chunks), shard):
            yield member
        padding = 0
        async for chunk in chunks:
            padding += len(chunk)
            if padding > _PADDING_MAX:
                break
    finally:
        await chunks.aclose()


async def _members(buf: _Buffer, shard: str) -> AsyncGenerator[tuple[str, bytes], None]:
    long_name: str | None = None
    pax: dict[str, str] = {}

    def broken(what: str, at: int) -> FetchError:
        return FetchError(
            f"tar shard {redact_url(shard)}: {what} at byte offset {at}", key=redact_url(shard)
        )

    while True:
        at = buf.offset
        if not await buf.fill(BLOCK):
            raise broken(
                f"stream ended without the end-of-archive blocks ({buf.available()} left)", at
            )
        header = buf.take(BLOCK)
        if header == bytes(BLOCK):
            return  # end of archive (the second zero block and any padding are not needed)
        if not _checksum_ok(header):
            raise broken("bad header checksum (corrupt or not a tar file)", at)
        try:
            size = _number(header[124:136])
        except ValueError:
            raise broken("bad size field", at) from None
        kind = header[156:157]
        if kind not in (b"L", b"x", b"g") and "size" in pax:
            size = int(pax["size"]) if pax["size"].isdecimal() else -1
            if size < 0:
                raise broken(f"bad pax size {pax['size']!r}", at)
        padded = -(-size // BLOCK) * BLOCK
        if not await buf.fill(padded):
            raise broken(f"stream ended inside a member of {size} bytes (truncated shard)", at)
        data = buf.take(size)
        buf.skip(padded - size)
        if kind == b"L":
            long_name = data.rstrip(b"\x00").decode("utf-8", "surrogateescape")
        elif kind == b"x":
            try:
                pax = _pax(data)
            except ValueError:
                raise broken("bad pax header", at) from None
        elif kind != b"g":
            name = long_name or pax.get("path") or _ustar_name(header)
            long_name, pax = None, {}
            if kind in _REGULAR:
                yield name, data


def _ustar_name(header: bytes) -> str:
    name = header[0:100].split(b"\x00", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\x00", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape")
