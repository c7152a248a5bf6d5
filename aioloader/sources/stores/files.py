"""Local files: keys are paths relative to a root, opened and read in threads."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from ..._exceptions import InvalidKeyError

__all__ = ["Files", "files"]


class Files:
    """The files under `root` that match `pattern`, as a source.

    Keys are POSIX paths relative to `root`, listed once and sorted, so the order (and every shuffle
    and shard derived from it) is the same on every run. `fetch` rejects a key that is absolute or
    climbs out of `root` with `InvalidKeyError`, whatever the listing says.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "a.txt").write_bytes(b"hi")
        2
        >>> files(d).keys()
        ['a.txt']
    """

    def __init__(self, root: str | os.PathLike[str], pattern: str = "**/*") -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"root: {str(root)!r} is not a directory")
        self.pattern = pattern
        found = {p.relative_to(self.root).as_posix(): p for p in self.root.glob(pattern)}
        self._sizes = _file_sizes(found)
        self._keys = sorted(self._sizes)

    def __repr__(self) -> str:
        return f"files({str(self.root)!r}, pattern={self.pattern!r}) [{len(self._keys)} files]"

    def keys(self) -> list[str]:
        """The relative paths of the listed files, sorted."""
        return list(self._keys)

    def size(self, key: str) -> int | None:
        """The size of `key`'s file when it was listed (None for a key that was not listed)."""
        return self._sizes.get(key)

    def path(self, key: str) -> Path:
        """The path of `key` under root; raises InvalidKeyError if it would leave root."""
        rel = PurePosixPath(key)
        if not key or rel.is_absolute() or ".." in rel.parts or "\x00" in key:
            raise InvalidKeyError(f"key {key!r} is not a path inside {str(self.root)!r}")
        return self.root / rel

    async def fetch(self, key: str) -> bytes:
        """Read the whole file named by `key`. Safe to cancel: a file opened after the cancel is
        closed by the thread that opened it, whatever the event loop does meanwhile."""
        opening = Opening()
        try:
            f = await asyncio.to_thread(opening.open, self.path(key))
        except asyncio.CancelledError:
            opening.cancel()
            raise
        try:
            return await asyncio.to_thread(f.read)
        finally:
            f.close()

    async def aclose(self) -> None:
        """Nothing to release; present for the Source protocol."""


def _file_sizes(paths: dict[str, Path]) -> dict[str, int]:
    """The size of each path that is a regular file (following links, as `is_file` does)."""
    out: dict[str, int] = {}
    for key, path in paths.items():
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out[key] = st.st_size
    return out


class Opening:
    """One open() in a thread that its fetch may give up on: the file never outlives the fetch."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._file: BinaryIO | None = None

    def open(self, path: Path) -> BinaryIO:
        f = open(path, "rb")  # noqa: SIM115 - closed by fetch, or here/by cancel() if abandoned
        with self._lock:
            if not self._cancelled:
                self._file = f
                return f
        f.close()  # the fetch was cancelled while this thread waited in open()
        raise asyncio.CancelledError

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            f, self._file = self._file, None
        if f is not None:  # opened, but the result never reached the fetch
            f.close()


def files(root: str | os.PathLike[str], pattern: str = "**/*") -> Files:
    """A source of the files under `root` matching the glob `pattern` (see `Files`)."""
    return Files(root, pattern)
