"""What the object stores share (S3, GCS, Azure): a prefix listed page by page, sorted, with sizes.

Each store owns a `Listing` of its prefix and gives it the `Pages` protocol: `list_page` (one page of
its listing answer: the (key, size) pairs, their ETags and the next page's token, for a page of a
listing that may start after a key and end at one: see `keyspace.PageAt`), `list_transport` (a
small transport for listing off the loader's loop) and `list_width`. The keys, the streamed
listing, `size(key)` and `etag(key)` are the listing's; the store's methods of those names ask it,
and are written once here, in the stores' base `Bucket`.
A whole listing (`keys()`, `manifest()`) runs in parts at once over the key space (`keyspace.py`),
`list_width` pages in flight; a streamed one page after page.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Protocol

from ..._exceptions import FetchError
from ..transport.client import Transport
from ..transport.remote import Remote
from .keyspace import Objects, Page, PageAt, list_parts
from .manifest import Manifest, share_listing

__all__ = ["Bucket", "Listing", "Page", "PageAt", "Pages"]


class Pages(Protocol):
    """What a store gives the listing it owns: its answers, page by page, and transports to ask on."""

    transport: Transport  # the store's own, on the loader's loop (`iter_objects`)
    list_width: int  # pages in flight for one listing (1: serially, for a store that cannot start
    # a listing at a key)

    async def list_page(self, transport: Transport, at: PageAt) -> Page:
        """The page of the listing that `at` names (`at.token` None: the listing's first page),
        asked over `transport`."""
        ...

    def list_transport(self) -> Transport:
        """A transport of its own for `keys()`, which lists on a thread with its own loop."""
        ...


class Listing:
    """The objects under one prefix of a bucket (or container): a part each store owns.

    It holds the keys given (or a manifest's), and the sizes and ETags the listings found.
    """

    def __init__(
        self,
        pages: Pages,
        where: str,
        prefix: str,
        kind: str,
        keys: Sequence[str] | None,
        stream_keys: bool,
        manifest: str | os.PathLike[str] | Manifest | None = None,
    ) -> None:
        """`where`: the prefix's URL ("s3://bucket/prefix"), for errors; `kind` names the listing
        thread ("aioloader-s3-list"). The keys given, if any, or those of `manifest` (a `Manifest`
        or its file), with their sizes and ETags, are read instead of listing."""
        if manifest is not None and keys is not None:
            raise ValueError("keys and manifest: give one of them, not both")
        self._pages = pages
        self.where = where
        self.prefix = prefix
        self._kind = kind
        self._given = None if keys is None else list(keys)
        self.stream_keys = stream_keys
        self._sizes: dict[str, int] = {}  # from the listings (`size`)
        self._etags: dict[str, str] = {}  # from the listings (`etag`): a cached copy is checked
        if manifest is not None:
            given = manifest if isinstance(manifest, Manifest) else Manifest.read(manifest)
            if given.where != self.where:
                raise ValueError(
                    f"manifest: it lists {given.where}, not this source's {self.where}"
                )
            self._adopt(given)

    def _adopt(self, manifest: Manifest, given: bool = True) -> None:
        """Take `manifest`'s sizes and ETags, and its keys as the given ones (`given`)."""
        if given:
            self._given = manifest.keys
        self._sizes.update(zip(manifest.keys, manifest.sizes.tolist(), strict=True))
        self._etags.update((k, e) for k, e in zip(manifest.keys, manifest.etags, strict=True) if e)

    def cache_name(self, key: str) -> str:
        """What names object `key` in the cache: the store, its bucket and the key
        ("s3://bucket/key"), not the endpoint's URL, so that processes that reach one store by
        different endpoints (a node's ranks through their own gateways) keep one copy."""
        return self.where.removesuffix(self.prefix) + key

    def iter_objects(self) -> AsyncIterator[tuple[str, int]]:
        """(key, size) of each object under the prefix, in key order, one page at a time."""
        return self._objects(self._pages.transport)

    async def _objects(self, transport: Transport) -> AsyncIterator[tuple[str, int]]:
        token: str | None = None
        last = ""
        while True:
            page = await self._pages.list_page(transport, PageAt(token, None, None))
            self._etags.update(page.etags)
            for key, size in sorted(page.objects, key=lambda o: o[0].encode()):
                if key.endswith("/") and size == 0:
                    continue  # a "folder" marker
                if key.encode() <= last.encode():
                    where = self.where
                    raise FetchError(f"listing of {where} out of key order at {key!r}", key=where)
                last = key
                self._sizes[key] = size
                yield key, size
            if page.next_token is None:
                return
            token = page.next_token

    async def iter_keys(self) -> AsyncIterator[str]:
        """The keys under the prefix, in key order, streamed page by page (on the running loop)."""
        if self._given is not None:
            for key in self._given:
                yield key
            return
        async for key, _ in self.iter_objects():
            yield key

    def keys(self) -> list[str] | AsyncIterable[str]:
        """Every key under the prefix, sorted (or the keys given). Blocks while it lists.

        With `stream_keys=True`: an async iterable that lists anew, page by page, each time it is
        iterated (the loader then starts fetching while the listing goes on; no shuffle, no length).
        """
        if self._given is not None:
            return list(self._given)
        if self.stream_keys:
            return _Streamed(self)
        return self._list_now()

    def _list_now(self) -> list[str]:
        """Every key under the prefix, listed once for the job (see `share_listing`), blocking."""
        manifest = share_listing(self.where, self.manifest)
        self._adopt(manifest, given=False)  # the next call lists again
        return list(manifest.keys)

    def manifest(self) -> Manifest:
        """List the prefix now, here, on a thread of its own (with its own loop and transport),
        in parts at once over the key space (see `keyspace.py`). The source's sizes and ETags are
        left as they were: `keys()` takes them from the manifest, once."""
        found = self._list_here()
        return Manifest.of(self.where, found.keys, found.sizes, found.etags)

    def _list_here(self) -> Objects:
        found: list[Objects] = []
        errors: list[BaseException] = []

        async def collect() -> None:
            transport = self._pages.list_transport()
            try:
                page = functools.partial(self._pages.list_page, transport)
                found.append(
                    await list_parts(page, self.prefix, self.where, self._pages.list_width)
                )
            finally:
                await transport.aclose()

        def run() -> None:
            try:
                asyncio.run(collect())
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, name=f"aioloader-{self._kind}-list")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return found[0]

    def size(self, key: str) -> int | None:
        """The size of object `key` as last listed (None for keys given, or not listed yet)."""
        return self._sizes.get(key)

    def etag(self, key: str) -> str | None:
        """The ETag of object `key` as last listed (None for keys given, or not listed yet)."""
        return self._etags.get(key)


class _Streamed:
    """Re-iterable streamed listing: each `async for` lists the prefix again."""

    def __init__(self, source: Listing) -> None:
        self._source = source

    def __aiter__(self) -> AsyncIterator[str]:
        return self._source.iter_keys()


class Bucket(Remote):
    """A remote source of the objects under a prefix that it lists: the base of `S3`, `GCS` and
    `Azure`. Each builds its `listing` (`Listing(self, ...)`) and gives it `Pages`; the methods
    below ask that listing and hold nothing of their own, so a store is read in its own class and
    `Remote` (see tests/test_structure.py, which names this chain)."""

    listing: Listing

    @property
    def stream_keys(self) -> bool:
        """Whether `keys()` streams the listing."""
        return self.listing.stream_keys

    def keys(self) -> list[str] | AsyncIterable[str]:
        """Every key under the prefix, sorted (or the keys given); see `Listing.keys`."""
        return self.listing.keys()

    def iter_keys(self) -> AsyncIterator[str]:
        """The keys under the prefix, in key order, streamed page by page (on the running loop)."""
        return self.listing.iter_keys()

    def iter_objects(self) -> AsyncIterator[tuple[str, int]]:
        """(key, size) of each object under the prefix, in key order, one page at a time."""
        return self.listing.iter_objects()

    def manifest(self) -> Manifest:
        """List the prefix now, here, on a thread of its own (with its own loop and transport)."""
        return self.listing.manifest()

    def size(self, key: str) -> int | None:
        """The size of object `key` as last listed (None for keys given, or not listed yet)."""
        return self.listing.size(key)

    def etag(self, key: str) -> str | None:
        """The ETag of object `key` as last listed (None for keys given, or not listed yet)."""
        return self.listing.etag(key)

    def cache_name(self, key: str) -> str:
        """The store, its bucket and the key; see `Listing.cache_name`."""
        return self.listing.cache_name(key)
