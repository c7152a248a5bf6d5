"""Tar files on this machine read by position (`tar_file.py`): the blocking reads and header parsing in
a thread, whole members handed to the loop in batches; an early break, a cancel or a broken file
leaves no descriptor open."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.shardfiles import write_bin_shards

from aioloader import FetchError
from aioloader.sources.formats.tar_file import Indexes, TarFile, file_members
from aioloader.sources.formats.tar_members import Members, Names
from aioloader.sources.tar import tar_shards


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """4 shards of 30 samples of 40 KB (each "bin" member is read on its own)."""
    return write_bin_shards(tmp_path_factory.mktemp("big"), 4, 30, 40_000)


def test_every_read_runs_in_a_thread_and_members_come_in_batches(shards: list[str]) -> None:
    threads: set[int] = set()

    async def run(fn: Callable[..., Any], *args: Any) -> Any:
        def call() -> Any:
            threads.add(threading.get_ident())
            return fn(*args)

        return await asyncio.to_thread(call)

    async def read() -> tuple[list[Members], int]:
        fd = os.open(shards[0], os.O_RDONLY)
        try:
            items = file_members(run, fd, os.fstat(fd).st_size, shards[0], limit=200_000)
            return [batch async for batch in items], threading.get_ident()
        finally:
            os.close(fd)

    batches, loop_thread = asyncio.run(read())
    assert loop_thread not in threads
    assert threads
    assert all(isinstance(b, Members) for b in batches)
    assert len(batches) > 1  # 60 members of ~40 KB and 30 small ones, 200 KB a batch
    names = [name for batch in batches for name, _ in batch]
    assert names == [f"s000-{i // 2:04d}.{'bin' if i % 2 == 0 else 'cls'}" for i in range(60)]


def test_local_shards_give_what_tarfile_lists(shards: list[str]) -> None:
    async def read() -> list[dict[str, Any]]:
        src = tar_shards(shards, shuffle=False, parallel=1)
        try:
            return [s async for s in src]
        finally:
            await src.aclose()

    expected = []
    for shard in shards:
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".bin"):
                    f = tar.extractfile(m)
                    assert f is not None
                    expected.append((m.name.removesuffix(".bin"), f.read()))
    got = asyncio.run(read())
    assert [(s["__key__"], s["bin"]) for s in got] == expected
    assert all(type(s["bin"]) is bytes for s in got)


def test_an_early_break_and_a_cancel_leave_no_descriptor_open(shards: list[str]) -> None:
    async def early_break() -> None:
        src = tar_shards(shards, shuffle_buffer=20, parallel=2)
        try:
            async for _ in src:
                break
        finally:
            await src.aclose()

    async def cancelled() -> None:
        src = tar_shards(shards, shuffle_buffer=20, parallel=2)
        first = asyncio.Event()

        async def read() -> None:
            async for _ in src:
                first.set()

        task = asyncio.create_task(read())
        await first.wait()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await src.aclose()

    before = open_fds()
    asyncio.run(early_break())
    asyncio.run(cancelled())
    assert open_fds() == before


def test_a_cut_local_shard_gives_its_whole_samples_then_a_fetch_error(
    shards: list[str], tmp_path: Path
) -> None:
    data = Path(shards[0]).read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: len(data) // 2])

    async def read() -> tuple[list[str], BaseException | None]:
        src = tar_shards([str(cut)], shuffle=False)
        keys: list[str] = []
        try:
            async for s in src:
                keys.append(s["__key__"])
        except FetchError as exc:
            return keys, exc
        finally:
            await src.aclose()
        return keys, None

    before = open_fds()
    keys, error = asyncio.run(read())
    assert open_fds() == before
    assert isinstance(error, FetchError)
    assert "cut.tar" in str(error)
    assert "byte offset" in str(error)
    assert keys == [f"s000-{i:04d}" for i in range(len(keys))]
    assert 10 < len(keys) < 15


def read_all(path: str | Path, indexes: Indexes | None) -> tuple[Members, FetchError | None]:
    """Every member of the file at `path` by `TarFile` with `indexes`, and the error it ends with."""
    fd = os.open(path, os.O_RDONLY)
    got: Members = Members()
    try:
        tar = TarFile(fd, os.fstat(fd).st_size, str(path), indexes=indexes)
        while not tar.done:
            got += tar.read(100_000)
    except FetchError as exc:
        return got, exc
    finally:
        os.close(fd)
    return got, None


def test_a_file_read_again_is_read_by_its_index_to_the_same_members(
    shards: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    indexes = Indexes()
    first, _ = read_all(shards[1], indexes)
    assert indexes.members == len(first) == 60
    parsed = 0
    header = Names.header

    def counted(self: Names, *args: Any) -> Any:
        nonlocal parsed
        parsed += 1
        return header(self, *args)

    monkeypatch.setattr(Names, "header", counted)
    again, error = read_all(shards[1], indexes)
    assert error is None
    assert again == first
    assert parsed == 0  # no header parsed: each member read at its place
    # the same path with other contents is another file: parsed anew, its own members
    other = tmp_path / "other.tar"
    other.write_bytes(Path(shards[2]).read_bytes())
    read_all(other, indexes)
    other.write_bytes(Path(shards[3]).read_bytes())
    os.utime(other, ns=(1, 1))
    parsed = 0
    changed, _ = read_all(other, indexes)
    assert parsed > 0
    assert changed == read_all(shards[3], None)[0]


def test_a_broken_file_leaves_no_index_and_the_index_keeps_the_recently_used(
    shards: list[str], tmp_path: Path
) -> None:
    indexes = Indexes(max_members=130)
    cut = tmp_path / "cut.tar"
    cut.write_bytes(Path(shards[0]).read_bytes()[:50_000])
    _, error = read_all(cut, indexes)
    assert error is not None
    assert "truncated shard" in str(error)
    assert indexes.members == 0
    for shard in (shards[0], shards[1], shards[0], shards[2]):  # 60 members each
        read_all(shard, indexes)
    assert indexes.members == 120  # the two most recently read: shards[2] and shards[0]
    ident = [(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
             for st in map(os.stat, shards)]  # fmt: skip
    assert indexes.get(ident[0]) is not None
    assert indexes.get(ident[2]) is not None
    assert indexes.get(ident[1]) is None
