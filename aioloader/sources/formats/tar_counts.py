"""How many samples tar shards hold: what sharing an epoch equally among readers needs (`tar_share.py`).

A shard's count is the number of samples its members group into (`TarShards`' rule: consecutive
members of one key make one sample). A local file is counted from its headers alone (the members'
data is skipped by seeking); a remote one is streamed once, through the cache when there is one, so
that the first epoch then reads it from there.

In a torch.distributed job the ranks count together (`count_together`): they take the shards to count
from one ticket counter in the job's key-value store (its `add`), so each shard is counted by the rank
that drew its ticket, which publishes the count there; a rank then waits for all the counts and reads
them in one request (`multi_get`, where the store has it). So a job reads each shard once to count
it, whatever its world size; the store answers about shards + ranks x `parallel` requests for the
tickets, not shards x ranks claims (12,800 requests at 64 ranks and 100 shards, ~800 now); and a
rank that counts nothing (one that built no such source) holds up no one.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from ..._exceptions import FetchError
from ..stores.manifest import KeyValueStore, job_store
from ..transport.redact import redact_url
from .tar_members import BLOCK, Names

__all__ = ["count_all", "count_local", "count_members", "count_together"]

_SHARED_PREFIX = "aioloader/tar-counts/"

KeyOf = Callable[[str], "str | None"]  # a member's name -> its sample's key (None: not a sample's)
_NAMING = (b"L", b"x")  # members whose data names the next member (GNU long name, pax header)


def count_local(path: str, key_of: KeyOf) -> int:
    """The samples of the tar file at `path`, from its headers, read by the shards' own parser
    (`tar_members.Names`: the same names and the same errors as a read of the shard); members'
    data is skipped, but for long names and pax headers. Blocks: run it in a thread."""
    try:
        with open(Path(path.removeprefix("file://")), "rb") as f:
            return _count(_local_names(f, path), key_of)
    except OSError as exc:
        raise FetchError(f"tar shard {path}: {exc}", key=redact_url(path)) from exc


def _local_names(f: BinaryIO, shard: str) -> Iterator[str]:
    """The names of the regular members of the tar archive `f`, in order."""
    names, size, at = Names(shard), os.fstat(f.fileno()).st_size, 0
    while True:
        f.seek(at)
        header = f.read(BLOCK)
        if len(header) < BLOCK:
            raise names.broken(f"file ended without the end-of-archive blocks ({size} bytes)", at)
        head = names.header(header, at)
        if head is None:
            return
        kind, length = head
        end = at + BLOCK + -(-length // BLOCK) * BLOCK
        if end > size:
            raise names.broken(
                f"file ended inside a member of {length} bytes (truncated shard)", at
            )
        data = f.read(length) if kind in _NAMING else b""
        name = names.member(kind, header, data, at)
        if name is not None:
            yield name
        at = end


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
    shards: Sequence[str], count: Callable[[str], Awaitable[int]], parallel: int
) -> tuple[list[int], int]:
    """Every shard's count by `count`, `parallel` at once: with the job's other ranks when a
    torch.distributed process group is up (`count_together`), else all of them here. Returns the
    counts and how many this process counted."""
    store = job_store()
    if store is not None:
        return await count_together(shards, count, store, parallel)
    turns = asyncio.Semaphore(parallel)

    async def limited(shard: str) -> int:
        async with turns:
            return await count(shard)

    counts = list(await asyncio.gather(*(limited(s) for s in shards)))
    return counts, len(counts)


async def count_together(
    shards: Sequence[str], count: Callable[[str], Awaitable[int]], store: KeyValueStore,
    parallel: int,
) -> tuple[list[int], int]:  # fmt: skip
    """Every shard's count, shared through `store` with the job's other ranks (module docstring):
    `parallel` counts at once here, each of the shard whose ticket it drew. Returns the counts and
    how many of them this rank counted. A count that failed on any rank raises `FetchError`."""
    if not shards:
        return [], 0
    where = hashlib.blake2b("\n".join(shards).encode(), digest_size=12).hexdigest()
    keys = [f"{_SHARED_PREFIX}{where}/{i}" for i in range(len(shards))]
    tickets = f"{_SHARED_PREFIX}{where}/next"
    counted = 0

    async def drawing() -> None:
        nonlocal counted
        while (i := await asyncio.to_thread(store.add, tickets, 1) - 1) < len(shards):
            try:
                n = await count(shards[i])
            except BaseException as exc:
                text = f"E{type(exc).__name__}: {exc}".encode()
                await asyncio.to_thread(store.set, keys[i], text)
                raise
            await asyncio.to_thread(store.set, keys[i], str(n).encode())
            counted += 1

    outcomes = await asyncio.gather(
        *(drawing() for _ in range(min(parallel, len(shards)))), return_exceptions=True
    )
    for outcome in outcomes:  # every drawn count is published (or its error) before raising
        if isinstance(outcome, BaseException):
            raise outcome
    values = await asyncio.to_thread(_wait_and_get, store, keys)
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


def _wait_and_get(store: KeyValueStore, keys: list[str]) -> list[bytes]:
    """The values of `keys` once all are set: two requests where the store has `multi_get`."""
    store.wait(keys)
    many = getattr(store, "multi_get", None)
    return list(many(keys)) if many is not None else [store.get(key) for key in keys]
