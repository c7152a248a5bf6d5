"""How many samples tar shards hold: what sharing an epoch equally among readers needs (`tar_share.py`).

A shard's count is the number of samples its members group into (`TarShards`' rule: consecutive
members of one key make one sample). A local file is counted from its headers alone (the members'
data is skipped by seeking); a remote one is streamed once, through the cache when there is one, so
that the first epoch then reads it from there.
"""

from __future__ import annotations

import tarfile
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from ..._exceptions import FetchError
from ..transport.redact import redact_url

__all__ = ["count_local", "count_members"]

KeyOf = Callable[[str], "str | None"]  # a member's name -> its sample's key (None: not a sample's)


def count_local(path: str, key_of: KeyOf) -> int:
    """The samples of the tar file at `path`, from its headers (blocks; run it in a thread)."""
    try:
        with tarfile.open(Path(path.removeprefix("file://")), "r:") as archive:
            return _count((m.name for m in archive if m.isreg()), key_of)
    except (OSError, tarfile.TarError) as exc:
        raise FetchError(f"tar shard {path}: {exc}", key=redact_url(path)) from exc


async def count_members(members: AsyncIterator[tuple[str, bytes]], key_of: KeyOf) -> int:
    """The samples of a shard's (name, data) members, read to the end."""
    names = []
    async for name, _ in members:
        names.append(name)
    return _count(names, key_of)


def _count(names: Iterable[str], key_of: KeyOf) -> int:
    n, last = 0, None
    for name in names:
        key = key_of(name)
        if key is not None and key != last:
            n, last = n + 1, key
    return n
