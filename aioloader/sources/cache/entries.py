"""The cache's files: where an object lives, its metadata and lock, and reading and writing them.

Each object named `name` (its URL) lives under `ROOT/data/<h[:2]>/<h>`, `h` the SHA-256 of the
name, with its metadata (its size, ETag, Last-Modified, generation, and where it came from,
redacted) beside it: in an extended attribute of the file (`user.aioloader`) where the file system
has them, set before the file gets its name, else in a sidecar file `<h>.json`. Its lock (which a
download holds) is one byte of the shared file `ROOT/locks`, at an offset from `h`: an open file
description lock (`F_OFD_SETLK`), which conflicts between processes and between two descriptors
of one process alike, and needs no file per object (creating a file costs ~1 ms here). A download
writes `<h>.<random>.part` and renames it over `<h>`, so a reader sees either no file or a
complete one; a file already open stays readable when another process replaces or evicts it
(POSIX unlink). A file whose size differs from its metadata's, or whose metadata differs from
what the source's listing says, is not used.

Every function here blocks: the cache calls them in threads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ATTR",
    "Expect",
    "Paths",
    "create_temp",
    "has_xattrs",
    "label",
    "leftovers",
    "metadata",
    "open_lock",
    "open_valid",
    "publish",
    "read_range",
    "remove_if_free",
    "try_lock",
    "write_all",
]

# Bytes of the metadata read at most (it holds a few short fields).
_META_MAX = 1 << 14
ATTR = "user.aioloader"


@dataclass(frozen=True)
class Paths:
    """The files of one cached object, and where its lock is."""

    id: str
    data: str
    meta: str
    locks: str
    offset: int  # of its byte in `locks`

    @classmethod
    def of(cls, root: Path, name: str) -> Paths:
        return cls.of_id(root, hashlib.sha256(name.encode()).hexdigest())

    @classmethod
    def of_id(cls, root: Path, id: str) -> Paths:
        base = str(root / "data" / id[:2] / id)
        return cls(id, base, base + ".json", str(root / "locks"), int(id[:15], 16))


@dataclass(frozen=True)
class Expect:
    """What the source knows of the object without reading it (from its listing); None: unknown."""

    size: int | None = None
    etag: str | None = None


def _bare_etag(etag: Any) -> str | None:
    return etag.removeprefix("W/").strip('"') if isinstance(etag, str) else None


def has_xattrs(root: Path) -> bool:
    """Whether files under `root` take user extended attributes (else: sidecar files)."""
    probe = root / f"probe.{secrets.token_hex(8)}.part"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.setxattr(fd, ATTR, b"{}")
            return os.getxattr(fd, ATTR) == b"{}"
        finally:
            os.close(fd)
            os.unlink(probe)
    except (OSError, AttributeError):  # ENOTSUP, EPERM; no os.setxattr off Linux
        return False


def _read_meta(paths: Paths, fd: int, xattr: bool) -> dict[str, Any] | None:
    try:
        if xattr:
            raw = os.getxattr(fd, ATTR)
        else:
            with open(paths.meta, "rb") as f:
                raw = f.read(_META_MAX)
        meta = json.loads(raw)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _fits(meta: dict[str, Any] | None, size: int, expect: Expect) -> bool:
    if meta is None or meta.get("size") != size:
        return False
    if expect.size is not None and expect.size != size:
        return False
    return expect.etag is None or _bare_etag(meta.get("etag")) == _bare_etag(expect.etag)


def metadata(label: str, size: int, version: dict[str, str], expect: Expect) -> dict[str, Any]:
    """What is kept beside an object: where it came from (`label`, no secrets), its size and the
    version headers of its response (`version`), else the ETag its listing gave."""
    meta: dict[str, Any] = {"source": label, "size": size}
    for name in ("etag", "last-modified", "x-goog-generation"):
        if name in version:
            meta[name] = version[name]
    if "etag" not in meta and expect.etag is not None:
        meta["etag"] = expect.etag
    return meta


def open_valid(paths: Paths, expect: Expect, xattr: bool) -> tuple[int, int] | None:
    """A descriptor of the complete cached object and its size; None when there is none, it is
    partial or corrupt (its size is not its metadata's), or stale (not what `expect` says).
    `xattr`: the metadata is in the file's extended attribute, else in its sidecar."""
    try:
        fd = os.open(paths.data, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if _fits(_read_meta(paths, fd, xattr), size, expect):
            return fd, size
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def read_range(
    paths: Paths, expect: Expect, xattr: bool, take: Callable[[int], bytearray], offset: int = 0,
    length: int | None = None,
) -> bytearray | None:  # fmt: skip
    """Bytes [offset, offset+length) of the cached object (to its end when `length` is None) in a
    buffer from `take`; None when it is not cached whole (see `open_valid`). Raises ValueError for
    an offset past its end."""
    opened = open_valid(paths, expect, xattr)
    if opened is None:
        return None
    fd, size = opened
    try:
        if offset > size or (offset == size and size > 0):
            raise ValueError(f"offset {offset} is past the end of the object ({size} bytes)")
        n = size - offset if length is None else min(length, size - offset)
        buf = take(n)
        return buf if _read_into(fd, buf, offset) else None
    finally:
        os.close(fd)


def _read_into(fd: int, buf: bytearray, offset: int) -> bool:
    """Fill `buf` from `offset`; False when the file ends first (cut short after it was opened)."""
    view, done = memoryview(buf), 0
    while done < len(buf):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            return False
        done += n
    return True


def open_lock(paths: Paths) -> int:
    """A new descriptor of the shared lock file (each holds its own locks)."""
    return os.open(paths.locks, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def try_lock(fd: int, paths: Paths) -> bool:
    """Take the object's lock through `fd` if no one holds it (never blocks). Closing `fd` lets
    it go."""
    lock = struct.pack("hh4xqqi4x", fcntl.F_WRLCK, os.SEEK_SET, paths.offset, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def create_temp(paths: Paths) -> tuple[int, str]:
    """A new temporary file beside the object (its folder made if need be): (descriptor, path)."""
    path = f"{paths.data}.{secrets.token_hex(8)}.part"
    # read and write: a reader behind its download reads what was written (cache/disk.py)
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o644), path
    except FileNotFoundError:  # the first object of its folder
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o644), path


def write_all(fd: int, chunks: Sequence[bytes | bytearray | memoryview]) -> int:
    """Write every chunk to `fd`; the bytes written."""
    total = 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            n = os.write(fd, view)
            view = view[n:]
            total += n
    return total


def label(fd: int, meta: dict[str, Any], xattr: bool) -> None:
    """Give the temporary file `fd` its metadata, when it goes in an extended attribute."""
    if xattr:
        os.setxattr(fd, ATTR, json.dumps(meta).encode())


def publish(paths: Paths, temp: str, meta: dict[str, Any], xattr: bool) -> None:
    """Rename the complete `temp` into place (its metadata with it: `label`), or, without
    extended attributes, then its sidecar (written to a temporary name too).

    In between, a reader may see the new file with the old sidecar: a mismatch it treats as a
    miss (it then waits for this writer's lock), never a torn file.
    """
    os.rename(temp, paths.data)
    if xattr:
        return
    side = f"{paths.meta}.{secrets.token_hex(8)}.part"
    try:
        with open(side, "x") as f:
            json.dump(meta, f)
        os.rename(side, paths.meta)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(side)
        raise


def remove_if_free(paths: Paths) -> bool:
    """Delete the object's files unless a download holds its lock; whether they are gone."""
    fd = open_lock(paths)
    try:
        if not try_lock(fd, paths):
            return False
        for path in (paths.meta, paths.data):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return True
    finally:
        os.close(fd)


def leftovers(root: Path) -> Iterator[tuple[str, int]]:
    """(id, size) of every complete cached object under `root`, deleting on the way the temporary
    files no download holds any more (left by a process that died mid-download)."""
    for folder in sorted((root / "data").glob("??")):
        for entry in os.scandir(folder):
            name = entry.name
            if name.endswith(".part"):
                _drop_orphan(root, name.partition(".")[0], entry.path)
            elif "." not in name:
                with contextlib.suppress(FileNotFoundError):
                    yield name, entry.stat().st_size


def _drop_orphan(root: Path, id: str, path: str) -> None:
    paths = Paths.of_id(root, id)
    fd = open_lock(paths)
    try:
        if try_lock(fd, paths):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(fd)
