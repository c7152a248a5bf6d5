"""Tar archives built byte by byte, and the tar stream reader run under a CPU and a wall-clock limit.

`header()` makes one 512-byte header with the fields given and (unless told otherwise) a valid
checksum, so a test can reach the reader's code past the checksum check with any size field, type
or pax record. `read_members()` runs `aioloader.sources.formats.tar_members.tar_members` over the bytes, fed
in chunks of the sizes given, and returns what it yielded and what it raised. A reader that loops
without awaiting is stopped by SIGPROF after `cpu_s` seconds of CPU (raising `Hung`); one that waits
forever, by a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import tempfile
from collections.abc import AsyncGenerator, Iterator, Sequence
from types import FrameType

from aioloader.sources.formats.tar_file import TarFile
from aioloader.sources.formats.tar_members import tar_members

BLOCK = 512
END = bytes(2 * BLOCK)  # the end-of-archive blocks


class Hung(Exception):
    """The reader ran past its CPU or wall-clock limit."""


def octal(value: int, width: int) -> bytes:
    """A NUL-terminated octal field of `width` bytes."""
    return b"%0*o\x00" % (width - 1, value)


def header(
    name: bytes = b"a.txt",
    size: int | bytes = 0,
    kind: bytes = b"0",
    checksum: bytes | None = None,
    prefix: bytes = b"",
) -> bytes:
    """A ustar header; `size` as a number or the raw 12-byte field; a valid checksum by default."""
    h = bytearray(BLOCK)
    h[0:100] = name[:100].ljust(100, b"\x00")
    h[100:108] = octal(0o644, 8)
    h[108:116] = octal(0, 8)
    h[116:124] = octal(0, 8)
    h[124:136] = size.ljust(12, b"\x00")[:12] if isinstance(size, bytes) else octal(size, 12)
    h[136:148] = octal(0, 12)
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[345:500] = prefix[:155].ljust(155, b"\x00")
    if checksum is None:
        h[148:156] = b" " * 8
        checksum = b"%06o\x00 " % sum(h)
    h[148:156] = checksum.ljust(8, b"\x00")[:8]
    return bytes(h)


def padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def member(name: bytes, data: bytes, kind: bytes = b"0") -> bytes:
    """A header and its data, padded to whole blocks."""
    return header(name, len(data), kind) + padded(data)


def pax_record(key: str, value: str) -> bytes:
    """One "<length> <key>=<value>\\n" record, its length counting itself."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    while len(str(length).encode()) + len(body) != length:
        length += 1
    return str(length).encode() + body


def pax(records: bytes) -> bytes:
    """A pax extended header member holding `records` (raw: they may be malformed on purpose)."""
    return member(b"././@PaxHeader", records, kind=b"x")


@contextlib.contextmanager
def cpu_limit(seconds: float) -> Iterator[None]:
    """Raise `Hung` in the main thread once this process has used `seconds` more CPU."""

    def on_timer(_signum: int, _frame: FrameType | None) -> None:
        raise Hung(f"the reader used more than {seconds} s of CPU")

    previous = signal.signal(signal.SIGPROF, on_timer)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def read_members(
    data: bytes,
    chunks: Sequence[int] = (),
    shard: str = "fuzz.tar",
    cpu_s: float = 1.0,
    wall_s: float = 10.0,
) -> tuple[list[tuple[str, bytes]], BaseException | None]:
    """(members yielded, the exception raised or None) for `data` fed in chunks of `chunks` sizes
    (cycled; the whole at once when empty)."""
    got: list[tuple[str, bytes]] = []

    async def stream() -> AsyncGenerator[bytes, None]:
        pos, i = 0, 0
        while pos < len(data):
            step = max(1, chunks[i % len(chunks)]) if chunks else len(data)
            yield data[pos : pos + step]
            pos, i = pos + step, i + 1
            await asyncio.sleep(0)

    async def collect() -> None:
        async with asyncio.timeout(wall_s):
            async for item in tar_members(stream(), shard):
                got.append(item)

    try:
        with cpu_limit(cpu_s):
            asyncio.run(collect())
    except TimeoutError as exc:
        raise Hung(f"the reader waited more than {wall_s} s") from exc
    except Exception as exc:
        if isinstance(exc, Hung):
            raise
        return got, exc
    return got, None


def read_file_members(
    data: bytes, region: int, direct: int, limit: int, shard: str = "fuzz.tar", cpu_s: float = 1.0
) -> tuple[list[tuple[str, bytes]], BaseException | None]:
    """`read_members`, but for `data` kept in a file and read by position (`tar_file.TarFile`,
    with these `region` and `direct` sizes and batches of `limit` bytes)."""
    got: list[tuple[str, bytes]] = []
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.flush()
        tar = TarFile(f.fileno(), len(data), shard, region, direct)
        try:
            with cpu_limit(cpu_s):
                while not tar.done:
                    got += tar.read(limit)
        except Exception as exc:
            if isinstance(exc, Hung):
                raise
            return got, exc
    return got, None
