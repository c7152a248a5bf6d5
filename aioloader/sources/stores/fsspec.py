"""Any filesystem fsspec knows (hf://, abfs://, sftp://, memory://, ...), as a source.

The fallback for stores without a source of their own. An async filesystem (fsspec's
`AsyncFileSystem`: HTTP, s3fs, gcsfs, adlfs, ...) is driven on the loader's event loop: an instance
made for that loop (`asynchronous=True, loop=...`) whose coroutines (`_cat_file`) the fetches await.
Any other (local, memory, sftp, ...) is called in threads. Needs `fsspec` (`aioloader[fsspec]`) and
the package of the filesystem itself (s3fs, huggingface_hub, ...).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections.abc import Sequence
from typing import Any

from ..._exceptions import FetchError, InvalidKeyError
from ..._util.deps import fsspec_cat_file
from ..cache.disk import Cache, Expect, check_cache_args
from ..transport.redact import redact_text, redact_url

__all__ = ["Fsspec", "fsspec"]


class Fsspec:
    """The files under `url` in an fsspec filesystem, as a source. See `fsspec()` for the arguments.

    `fetch(key)` returns the file's bytes, `fetch_range(key, offset, length)` part of them; both are
    coroutines, safe to cancel, and raise `FetchError` naming the key when the filesystem fails.

    Example:
        >>> src = fsspec("memory://train/")
        >>> src.keys()  # doctest: +SKIP
        ['a/0001.jpg', 'b/0002.jpg']
    """

    def __init__(
        self,
        url: str,
        keys: Sequence[str] | None = None,
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        **storage_options: Any,
    ) -> None:
        if not isinstance(url, str) or not url:
            raise TypeError(f"url must be a non-empty str, got {url!r}")
        check_cache_args(cache_dir, cache_limit)
        self.fs, root = _url_to_fs(url, storage_options)
        self.url = url
        self.root = root.rstrip("/")
        self.is_async = bool(getattr(self.fs, "async_impl", False))
        self._given = None if keys is None else [self._checked(k) for k in keys]
        self._sizes: dict[str, int] = {}
        self._cache = None if cache_dir is None else Cache(cache_dir, cache_limit)
        self._afs: Any = None  # the async instance bound to the loop of the fetches
        self._afs_loop: asyncio.AbstractEventLoop | None = None
        self.counts = {"requests": 0, "failures": 0, "bytes": 0}

    def __repr__(self) -> str:
        how = "async" if self.is_async else "threads"
        return f"fsspec({redact_url(self.url)!r}) [{type(self.fs).__name__}, {how}]"

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the instance bound to a loop (a copy makes its own)."""
        return {**self.__dict__, "_afs": None, "_afs_loop": None}

    def keys(self) -> list[str]:
        """The keys given, else every file under the root, relative to it, sorted (blocks while
        it lists; the sizes found serve `size`)."""
        if self._given is not None:
            return list(self._given)
        try:
            found = self.fs.find(self.root, detail=True, withdirs=False)
        except Exception as exc:
            where = redact_url(self.url)
            raise FetchError(f"cannot list {where}: {_what(exc, self.url)}", key=where) from None
        prefix = self.root + "/"
        for name, info in found.items():
            if name.startswith(prefix) and info.get("type", "file") == "file":
                self._sizes[name[len(prefix) :]] = int(info.get("size") or 0)
        return sorted(self._sizes)

    def size(self, key: str) -> int | None:
        """The size of file `key` as listed (None for keys given)."""
        return self._sizes.get(key)

    def path(self, key: str) -> str:
        """Where `key` is in the filesystem; `InvalidKeyError` for a key outside the root."""
        return f"{self.root}/{self._checked(key)}"

    def _checked(self, key: Any) -> str:
        rel = key.lstrip("/") if isinstance(key, str) else ""
        if not rel or "\x00" in rel or ".." in rel.split("/") or posixpath.isabs(rel):
            raise InvalidKeyError(f"key {key!r} is not a path under {redact_url(self.url)!r}")
        return rel

    async def fetch(self, key: str) -> bytes | bytearray:
        """The whole file `key` (from the cache, with `cache_dir`, when it has a valid copy)."""
        path = self.path(key)
        if self._cache is None:
            return await self._cat(key, path)

        async def download(version: dict[str, str]) -> bytearray:
            return bytearray(await self._cat(key, path))

        expect = Expect(self.size(key))
        return await self._cache.fetch(path, redact_url(path), expect, download)

    async def fetch_range(self, key: str, offset: int, length: int | None = None) -> bytes:
        """`length` bytes of file `key` from byte `offset` (to its end when `length` is None)."""
        if offset < 0 or (length is not None and length < 0):
            raise ValueError(f"bad range: offset={offset}, length={length}")
        if length == 0:
            return b""
        end = None if length is None else offset + length
        return await self._cat(key, self.path(key), offset, end)

    async def _cat(
        self, key: str, path: str, start: int | None = None, end: int | None = None
    ) -> bytes:
        self.counts["requests"] += 1
        try:
            if self.is_async:
                data = await fsspec_cat_file(self._async_fs(), path, start, end)
            else:
                data = await asyncio.to_thread(self.fs.cat_file, path, start=start, end=end)
        except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:
            self.counts["failures"] += 1
            message = f"{redact_url(path)}: {_what(exc, path)}"
            raise FetchError(message, key=key, stage="fetch") from None
        self.counts["bytes"] += len(data)
        return bytes(data) if not isinstance(data, bytes) else data

    def _async_fs(self) -> Any:
        """The filesystem's async instance for the running loop (made on first use there)."""
        loop = asyncio.get_running_loop()
        if self._afs is None or self._afs_loop is not loop:
            options = {**self.fs.storage_options, "asynchronous": True, "loop": loop}
            self._afs = type(self.fs)(skip_instance_cache=True, **options)
            self._afs_loop = loop
        return self._afs

    def stats(self) -> dict[str, float]:
        """Reads, failures and bytes read; with a cache, its counters too."""
        return {**self.counts, **(self._cache.counts if self._cache is not None else {})}

    async def aclose(self) -> None:
        """Close the async instance's session, if it has one. Idempotent."""
        afs, self._afs, self._afs_loop = self._afs, None, None
        session = getattr(afs, "_session", None)
        if session is not None and hasattr(session, "close"):
            closing = session.close()
            if asyncio.iscoroutine(closing):
                await closing
        if self._cache is not None:
            await self._cache.aclose()


def _url_to_fs(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    try:
        import fsspec.core
    except ImportError:
        raise ImportError("sources.fsspec needs fsspec: pip install 'aioloader[fsspec]'") from None
    try:
        return fsspec.core.url_to_fs(url, **options)  # type: ignore[no-any-return]
    except (ImportError, ValueError) as exc:  # an unknown protocol, or its package missing
        raise ValueError(f"url {redact_url(url)!r}: {exc}") from None


def _what(exc: BaseException, url: str) -> str:
    """What `exc` says, without the secrets of `url`."""
    return f"{type(exc).__name__}: {redact_text(str(exc), url)}" if str(exc) else type(exc).__name__


def fsspec(url: str, keys: Sequence[str] | None = None, **options: Any) -> Fsspec:
    """A source of the files under `url` in any filesystem fsspec knows.

    Args:
        url: "memory://data/", "/local/dir", "hf://datasets/...", "sftp://host/dir", ...
        keys: the files to read, relative to `url`, when known (a manifest; needed where the
            filesystem cannot list, e.g. plain HTTP); None lists every file under `url`.
        cache_dir, cache_limit: keep each file read in this directory, at most this many bytes
            (see `http()`), checked by the size the listing gave.
        **options: the filesystem's own storage options (credentials, endpoints, ...).
    """
    return Fsspec(url, keys, **options)
