"""Local files: keys are paths relative to a root, read with aiofiles."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path, PurePosixPath
from typing import Any

import aiofiles

from .._exceptions import InvalidKeyError

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
        self._keys = sorted(
            p.relative_to(self.root).as_posix() for p in self.root.glob(pattern) if p.is_file()
        )

    def __repr__(self) -> str:
        return f"files({str(self.root)!r}, pattern={self.pattern!r}) [{len(self._keys)} files]"

    def keys(self) -> list[str]:
        """The relative paths of the listed files, sorted."""
        return list(self._keys)

    def path(self, key: str) -> Path:
        """The path of `key` under root; raises InvalidKeyError if it would leave root."""
        rel = PurePosixPath(key)
        if not key or rel.is_absolute() or ".." in rel.parts or "\x00" in key:
            raise InvalidKeyError(f"key {key!r} is not a path inside {str(self.root)!r}")
        return self.root / rel

    async def fetch(self, key: str) -> bytes:
        """Read the whole file named by `key`. Safe to cancel: a file opened after the cancel is
        closed, not leaked."""
        opening = asyncio.ensure_future(aiofiles.open(self.path(key), "rb"))
        try:
            f = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_late)
            raise
        try:
            data: bytes = await f.read()
        finally:
            await f.close()
        return data

    async def aclose(self) -> None:
        """Nothing to release; present for the Source protocol."""


_closing: set[asyncio.Future[Any]] = set()  # late closes in progress (the loop keeps weak refs)


def _close_late(opening: asyncio.Future[Any]) -> None:
    """Close a file whose open finished after its fetch was cancelled."""
    if not opening.cancelled() and opening.exception() is None:
        closing = asyncio.ensure_future(opening.result().close())
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)


def files(root: str | os.PathLike[str], pattern: str = "**/*") -> Files:
    """A source of the files under `root` matching the glob `pattern` (see `Files`)."""
    return Files(root, pattern)
