"""The local files source: sorted relative keys, bytes through the loader, keys kept inside root."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import aioloader
from aioloader import InvalidKeyError, Loader
from aioloader.sources import Source, files

TREE = {
    "b.txt": b"bee",
    "a.txt": b"a",
    "sub/z.bin": bytes(range(256)),
    "sub/deeper/c.txt": b"sea",
    "sub/a b.txt": b"space",
}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for rel, data in TREE.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (tmp_path / "empty_dir").mkdir()
    return tmp_path


def test_keys_are_sorted_relative_posix_paths_of_files(root: Path) -> None:
    source = files(root)
    assert source.keys() == sorted(TREE)
    assert isinstance(source, Source)


def test_pattern_selects_files(root: Path) -> None:
    assert files(root, "*.txt").keys() == ["a.txt", "b.txt"]
    assert files(root, "**/*.txt").keys() == ["a.txt", "b.txt", "sub/a b.txt", "sub/deeper/c.txt"]
    assert files(str(root), "nothing*").keys() == []


def test_keys_are_a_copy(root: Path) -> None:
    source = files(root)
    source.keys().clear()
    assert source.keys() == sorted(TREE)


def test_loader_reads_every_file(root: Path) -> None:
    with Loader(files(root), concurrency=2) as loader:
        assert len(loader) == len(TREE)
        got = list(loader)
    assert got == [TREE[key] for key in sorted(TREE)]


def test_loader_batches_files_with_a_collate(root: Path) -> None:
    with Loader(files(root, "**/*.txt"), batch_size=3, collate=None) as loader:
        assert list(loader) == [[b"a", b"bee", b"space"], [b"sea"]]


@pytest.mark.asyncio
@pytest.mark.parametrize("use_caller_loop", [False, True])
async def test_async_loader_reads_every_file(root: Path, use_caller_loop: bool) -> None:
    async with Loader(files(root), use_caller_loop=use_caller_loop) as loader:
        got = [data async for data in loader]
    assert got == [TREE[key] for key in sorted(TREE)]


def test_root_that_is_not_a_directory(root: Path) -> None:
    with pytest.raises(ValueError, match="root"):
        files(root / "a.txt")
    with pytest.raises(ValueError, match="root"):
        files(root / "missing")


BAD_KEYS = ["../outside.txt", "sub/../../outside.txt", "/etc/passwd", "", "a\x00b", ".."]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_keys_outside_root_are_rejected(root: Path, key: str) -> None:
    (root.parent / "outside.txt").write_bytes(b"secret")
    source = files(root / "sub")
    with pytest.raises(InvalidKeyError, match="not a path inside"):
        asyncio.run(source.fetch(key))
    assert issubclass(InvalidKeyError, ValueError)


def test_a_rejected_key_reaches_the_consumer_with_a_note(root: Path) -> None:
    source = files(root)
    keys = ["a.txt", "b.txt", "../escape"]
    got: list[bytes] = []
    with Loader(keys, source.fetch) as loader, pytest.raises(InvalidKeyError) as info:
        got.extend(loader)
    assert got == [b"a", b"bee"]
    assert any("'../escape'" in note for note in info.value.__notes__)


def test_key_inside_root_with_dots_is_fine(root: Path) -> None:
    source = files(root)
    assert asyncio.run(source.fetch("sub/./deeper/c.txt")) == b"sea"


def test_missing_file_is_file_not_found(root: Path) -> None:
    with (
        Loader(["a.txt", "gone.txt"], files(root).fetch) as loader,
        pytest.raises(FileNotFoundError, match=r"gone\.txt"),
    ):
        list(loader)


def test_files_is_exported() -> None:
    assert aioloader.sources.files is files
