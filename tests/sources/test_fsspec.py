"""`sources.fsspec`: the local and memory filesystems (called in threads) and fsspec's async HTTP
filesystem (driven on the loader's loop) against the tests' object server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
from support.faultproxy import FaultProxy, Origin

from aioloader import FetchError, InvalidKeyError, Loader, sources

FILES = {"b/2.bin": b"two" * 400, "a/1.bin": b"one" * 300, "c.bin": b"three" * 100}


def load(src: sources.Fsspec, epochs: int = 1) -> list[list[bytes]]:
    with Loader(src, concurrency=4, collate=None) as loader:
        return [[bytes(x) for x in loader] for _ in range(epochs)]


def test_local_files_listed_sorted_with_sizes(tmp_path: Path) -> None:
    for name, body in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(body)
    src = sources.fsspec(str(tmp_path))
    assert not src.is_async
    assert src.keys() == sorted(FILES)
    assert [src.size(k) for k in sorted(FILES)] == [len(FILES[k]) for k in sorted(FILES)]
    assert load(src) == [[FILES[k] for k in sorted(FILES)]]
    assert "threads" in repr(src)


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"memory://test-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for name, body in FILES.items():
        fs.pipe(f"{root}/{name}", body)
    yield root
    fs.rm(root, recursive=True)


@pytest.mark.asyncio
async def test_memory_filesystem_fetch_range_and_errors(memory_root: str) -> None:
    src = sources.fsspec(memory_root + "/")
    assert src.keys() == sorted(FILES)
    key = "b/2.bin"
    assert await src.fetch(key) == FILES[key]
    assert await src.fetch_range(key, 10, 20) == FILES[key][10:30]
    assert await src.fetch_range(key, 1000) == FILES[key][1000:]
    assert await src.fetch_range(key, 3, 0) == b""
    with pytest.raises(FetchError, match=r"nope\.bin: FileNotFoundError") as info:
        await src.fetch("nope.bin")
    assert info.value.key == "nope.bin"
    with pytest.raises(InvalidKeyError, match=r"'\.\./x'"):
        await src.fetch("../x")
    with pytest.raises(ValueError, match="bad range"):
        await src.fetch_range(key, -1, 2)
    assert src.stats()["failures"] == 1
    await src.aclose()


def test_memory_filesystem_in_a_loader(memory_root: str) -> None:
    src = sources.fsspec(memory_root)
    assert load(src, epochs=2) == [[FILES[k] for k in sorted(FILES)]] * 2


@pytest.mark.asyncio
async def test_async_http_filesystem_runs_on_the_callers_loop(
    origin: Origin, objects: dict[str, bytes]
) -> None:
    keys = sorted(objects)[:6]
    src = sources.fsspec(origin.url + "/", keys)
    assert src.is_async
    threads = threading.active_count()
    try:
        got = await asyncio.gather(*(src.fetch(k) for k in keys))
        assert got == [objects[k] for k in keys]
        assert threading.active_count() == threads  # awaited here, no thread
        assert src._afs_loop is asyncio.get_running_loop()
        assert await src.fetch_range(keys[1], 5, 10) == objects[keys[1]][5:15]
        with pytest.raises(FetchError, match=r"missing\.bin: FileNotFoundError") as info:
            await src.fetch("missing.bin")
        assert info.value.key == "missing.bin"
    finally:
        await src.aclose()


@pytest.mark.in_process
def test_async_http_filesystem_in_a_loader_with_a_cache(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    keys = sorted(objects)[:10]
    src = sources.fsspec(proxy.url + "/", keys, cache_dir=tmp_path)
    assert load(src, epochs=2) == [[objects[k] for k in keys]] * 2
    assert sum(proxy.seen.values()) == len(keys)  # epoch 2 from the cache
    assert src.stats()["cache_hits"] == len(keys)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"url 'nosuchproto://x'"):
        sources.fsspec("nosuchproto://x")
    with pytest.raises(TypeError, match="url must be a non-empty str"):
        sources.fsspec(b"memory://x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_limit must be >= 0"):
        sources.fsspec("memory://x", cache_dir="/tmp", cache_limit=-5)
    with pytest.raises(InvalidKeyError):
        sources.fsspec("memory://x", ["/abs/../../etc"])
