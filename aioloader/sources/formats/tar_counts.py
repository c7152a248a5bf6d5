"""How many samples tar shards hold: what sharing an epoch equally among readers needs (`tar_share.py`).

A shard's count is the number of samples its members group into (`TarShards`' rule: consecutive
members of one key make one sample). A local file is counted from its headers alone (the members'
data is skipped by seeking); a remote one is streamed once, through the cache when there is one, so
that the first epoch then reads it from there.

In a torch.distributed job the ranks count together (`count_together`): each shard is counted by the
first rank to claim it in the job's key-value store, which publishes the count there; a rank claims
shards starting from its own place in the list and then waits for the counts the others claimed. So
a job reads each shard once to count it, whatever its world size, and a rank that counts nothing
(one that built no such source) holds up no one.
"""

from __future__ import annotations

import asyncio
import hashlib
import tarfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path

from ..._exceptions import FetchError
from ..stores.manifest import KeyValueStore, job_store
from ..transport.redact import redact_url

__all__ = ["count_all", "count_local", "count_members", "count_together"]

_SHARED_PREFIX = "aioloader/tar-counts/"

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


async def count_all(
    shards: Sequence[str], count: Callable[[str], Awaitable[int]], first: int, parallel: int
) -> tuple[list[int], int]:
    """Every shard's count by `count`, `parallel` at once: with the job's other ranks when a
    torch.distributed process group is up (`count_together`, from shard `first` on), else all of
    them here. Returns the counts and how many this process counted."""
    store = job_store()
    if store is not None:
        return await count_together(shards, count, store, first, parallel)
    turns = asyncio.Semaphore(parallel)

    async def limited(shard: str) -> int:
        async with turns:
            return await count(shard)

    counts = list(await asyncio.gather(*(limited(s) for s in shards)))
    return counts, len(counts)


async def count_together(
    shards: Sequence[str], count: Callable[[str], Awaitable[int]], store: KeyValueStore,
    first: int, parallel: int,
) -> tuple[list[int], int]:  # fmt: skip
    """Every shard's count, shared through `store` with the job's other ranks (module docstring):
    this rank claims from shard `first` on, `parallel` counts at once. Returns the counts and how
    many of them this rank counted. A count that failed on any rank raises `FetchError`."""
    where = hashlib.blake2b("\n".join(shards).encode(), digest_size=12).hexdigest()
    keys = [f"{_SHARED_PREFIX}{where}/{i}" for i in range(len(shards))]
    turns = asyncio.Semaphore(parallel)
    counted = 0

    async def claim(i: int) -> None:
        nonlocal counted
        async with turns:
            if await asyncio.to_thread(store.add, f"{keys[i]}/claim", 1) != 1:
                return  # another rank counts it
            try:
                n = await count(shards[i])
            except BaseException as exc:
                text = f"E{type(exc).__name__}: {exc}".encode()
                await asyncio.to_thread(store.set, keys[i], text)
                raise
            await asyncio.to_thread(store.set, keys[i], str(n).encode())
            counted += 1

    order = [(first + j) % len(shards) for j in range(len(shards))]
    outcomes = await asyncio.gather(*(claim(i) for i in order), return_exceptions=True)
    for outcome in outcomes:  # every claimed count is published (or its error) before raising
        if isinstance(outcome, BaseException):
            raise outcome
    await asyncio.to_thread(store.wait, keys)
    values = [await asyncio.to_thread(store.get, key) for key in keys]
    out = []
    for shard, value in zip(shards, values, strict=True):
        if value[:1] == b"E":
            label = redact_url(shard)
            raise FetchError(
                f"tar shard {label}: counting its samples failed on the rank that counted it for "
                f"the job: {value[1:].decode(errors='replace')}",
                key=label,
            )
        out.append(int(value))
    return out, counted
