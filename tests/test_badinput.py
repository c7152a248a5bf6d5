"""Bad input: corrupt images, truncated or malformed tar shards, empty objects, samples that cannot
be batched. Each ends in an error of a known type naming the key (and, for shards, the byte offset),
or is delivered as what it is (an empty object is b"", not an error)."""

from __future__ import annotations

import asyncio
import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import UnidentifiedImageError
from scripts.images import decode_jpeg, jpeg
from scripts.leakcheck import census, left_behind_after, warm_up
from scripts.tarcraft import END, header, member, pax, pax_record, read_members
from support.faultproxy import Origin

from aioloader import CollateError, FetchError, Loader
from aioloader.sources import files, http, tar_shards

EXECUTORS = ["inline", "thread", "process"]


@pytest.fixture
def images(tmp_path: Path) -> Path:
    """Ten JPEGs; 3.jpg is not an image at all, 6.jpg is cut in half."""
    for i in range(10):
        (tmp_path / f"{i}.jpg").write_bytes(jpeg(i))
    (tmp_path / "3.jpg").write_bytes(b"this is not a JPEG" * 8)
    (tmp_path / "6.jpg").write_bytes(jpeg(6)[:300])
    return tmp_path


@pytest.mark.parametrize("executor", EXECUTORS)
def test_corrupt_jpeg_keeps_pillows_error_and_names_the_key(images: Path, executor: str) -> None:
    keys = ["0.jpg", "1.jpg", "3.jpg"]
    with Loader(keys, files(images).fetch, decode=decode_jpeg, executor=executor, workers=2,
                batch_size=None) as loader:  # fmt: skip
        batches = iter(loader)
        assert [next(batches)["index"] for _ in range(2)] == [0, 1]
        with pytest.raises(UnidentifiedImageError) as info:
            next(batches)
    notes = "\n".join(info.value.__notes__)
    assert "stage 'decode' for key '3.jpg'" in notes
    if executor == "process":
        assert "worker process pid" in notes


@pytest.mark.parametrize("executor", EXECUTORS)
def test_truncated_jpeg_is_an_os_error_naming_the_key(images: Path, executor: str) -> None:
    loader = Loader(["5.jpg", "6.jpg"], files(images).fetch, decode=decode_jpeg,
                    executor=executor, workers=1)  # fmt: skip
    with loader, pytest.raises(OSError, match=r"[Tt]runcated") as info:
        list(loader)
    assert any("for key '6.jpg'" in n for n in info.value.__notes__)


# -- tar shards ----------------------------------------------------------------------------------


def write_shard(path: Path, samples: int) -> list[int]:
    """A WebDataset shard of `samples` samples ("s0003.cls", "s0003.bin"); the offset of each
    member's header."""
    offsets, data = [], b""
    for i in range(samples):
        for ext, body in (("cls", str(i).encode()), ("bin", bytes([i]) * (100 + 50 * i))):
            offsets.append(len(data))
            data += member(f"s{i:04d}.{ext}".encode(), body)
    path.write_bytes(data + END)
    return offsets


def collect_keys(loader: Loader[Any], into: list[str]) -> None:
    for sample in loader:
        into.append(sample["__key__"])


def test_truncated_shard_through_the_loader_names_shard_and_offset(tmp_path: Path) -> None:
    shard = tmp_path / "cut.tar"
    offsets = write_shard(shard, 12)
    cut_member = 15  # the .bin of sample 7
    data = shard.read_bytes()
    shard.write_bytes(data[: offsets[cut_member] + 512 + 40])  # inside its data
    warm_up()
    before = census()
    got: list[str] = []
    loader = Loader(tar_shards([str(shard)], shuffle=False), collate=None, concurrency=4)
    with loader, pytest.raises(FetchError) as info:
        collect_keys(loader, got)
    err = info.value
    assert str(shard) in str(err)
    assert f"at byte offset {offsets[cut_member]}" in str(err)
    assert "truncated" in str(err)
    assert err.key == str(shard)
    assert got == [f"s{i:04d}" for i in range(len(got))]  # whole samples before the cut, in order
    assert len(got) <= 7
    del err, info
    assert left_behind_after(before) == {}


def test_members_of_zero_bytes_are_empty_bytes(tmp_path: Path) -> None:
    shard = tmp_path / "empty-members.tar"
    shard.write_bytes(member(b"a.cls", b"") + member(b"a.txt", b"x") + member(b"b.cls", b"") + END)
    with Loader(tar_shards([str(shard)], shuffle=False), collate=None) as loader:
        samples = list(loader)
    assert [(s["__key__"], s["cls"], s.get("txt")) for s in samples] == [
        ("a", b"", b"x"),
        ("b", b"", None),
    ]


# Malformed headers that pass the checksum (or fail it oddly): the reader must raise FetchError
# naming the shard and the offset, never another exception, never loop. Each is a bug today.


def run_reader(data: bytes) -> tuple[list[tuple[str, bytes]], BaseException | None]:
    return read_members(data, chunks=[97, 512, 3], shard="bad.tar")


def assert_fetch_error_at(data: bytes, *offsets: int) -> None:
    """The reader raises FetchError naming the shard and one of `offsets` (the headers involved:
    a pax header, or the member it applies to)."""
    got, error = run_reader(data)
    assert isinstance(error, FetchError), f"{type(error).__name__}: {error} (yielded {got})"
    assert "bad.tar" in str(error)
    assert any(str(error).endswith(f"offset {offset}") for offset in offsets), str(error)


def test_a_checksum_field_that_is_not_octal_is_a_fetch_error() -> None:
    assert_fetch_error_at(member(b"a.txt", b"hi") + header(checksum=b"zzzzzz\x00 ") + END, 1024)


def test_a_pax_size_that_is_not_a_number_is_a_fetch_error() -> None:
    data = pax(pax_record("size", "0x10")) + member(b"a.txt", b"hello") + END
    assert_fetch_error_at(data, 0, 1024)


@pytest.mark.parametrize("length", [b"0", b"-6"])
def test_a_pax_record_length_that_does_not_advance_is_a_fetch_error(length: bytes) -> None:
    data = pax(length + b" a=b\n") + member(b"a.txt", b"hello") + END
    assert_fetch_error_at(data, 0, 1024)


def test_a_negative_pax_size_is_a_fetch_error() -> None:
    data = pax(pax_record("size", "-512")) + member(b"a.txt", b"hello") + END
    assert_fetch_error_at(data, 0, 1024)


def test_a_gnu_base256_size_beyond_the_stream_is_a_fetch_error() -> None:
    # the reference point for the cases above: a huge (GNU base-256) size is handled
    assert_fetch_error_at(header(size=b"\x80" + b"\xff" * 11) + END, 0)


def test_tarfile_pax_and_gnu_archives_are_read_whole(tmp_path: Path) -> None:
    names = ["x" * 150 + ".bin", "dir/ü-ñ.txt", "plain.cls"]
    for fmt in (tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
            for i, name in enumerate(names):
                info = tarfile.TarInfo(name)
                info.size = i * 700
                tar.addfile(info, io.BytesIO(bytes([i]) * info.size))
        got, error = read_members(buf.getvalue(), chunks=[511])
        assert error is None
        assert got == [(name, bytes([i]) * (i * 700)) for i, name in enumerate(names)]


# -- empty objects ---------------------------------------------------------------------------------


def length(raw: bytes) -> int:
    return len(raw)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_an_empty_file_is_delivered_as_empty_bytes(tmp_path: Path, executor: str) -> None:
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "b.bin").write_bytes(b"b")
    with Loader(files(tmp_path), collate=None, batch_size=2) as loader:
        assert list(loader) == [[b"", b"b"]]
    with Loader(files(tmp_path), decode=length, executor=executor, workers=1) as loader:
        assert [int(n) for n in loader] == [0, 1]  # decode is called with b"" too
        assert loader.stats().skipped == []


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
def test_an_empty_http_object_is_delivered_as_empty_bytes(engine: str) -> None:
    origin = Origin({"empty.bin": b"", "x.bin": b"x"})
    try:
        src = http(origin.url + "/", ["empty.bin", "x.bin"], engine=engine, attempts=1)
        with Loader(src, collate=None) as loader:
            got = list(loader)
        assert got == [b"", b"x"]
        assert all(isinstance(x, bytearray) for x in got)
    finally:
        origin.stop()


# -- samples that cannot be batched ----------------------------------------------------------------


@pytest.mark.parametrize(
    "odd", [{1, 2}, object(), None], ids=["set", "object", "None"]
)  # fmt: skip
def test_a_sample_type_collate_cannot_handle_is_a_collate_error_naming_the_keys(odd: Any) -> None:
    async def fetch(key: str) -> Any:
        return odd

    loader = Loader(["a", "b", "c", "d"], fetch, batch_size=2)
    with loader, pytest.raises(CollateError) as info:
        list(loader)
    assert isinstance(info.value, TypeError)
    assert type(odd).__name__ in str(info.value)
    assert any("stage 'collate' for keys ['a', 'b']" in n for n in info.value.__notes__)


def maybe_none(key: int) -> torch.Tensor | None:
    return None if key == 2 else torch.zeros(3)


@pytest.mark.parametrize("odd", [None, 7, "text"], ids=["None", "int", "str"])
def test_a_tensor_batched_with_a_non_tensor_is_a_collate_error(odd: Any) -> None:
    async def fetch(key: int) -> Any:
        return odd if key == 2 else torch.zeros(3)

    with Loader(range(4), fetch, batch_size=4) as loader, pytest.raises(CollateError) as info:
        list(loader)
    assert any("keys [0, 1, 2, 3]" in n for n in info.value.__notes__)


def shaped(key: int) -> dict[str, Any]:
    """Decoded in a worker: arrays come back as views of shared memory."""
    side = 5 if key == 6 else 4
    return {"image": torch.zeros(3, side, side), "mask": np.ones((side, side), dtype=np.uint8)}


def test_mismatched_shapes_from_process_decode_name_the_keys_and_the_shapes() -> None:
    with Loader(range(8), lambda k: k, decode=shaped, executor="process", workers=2,
                batch_size=4) as loader:  # fmt: skip
        batches = iter(loader)
        first = next(batches)
        assert first["image"].shape == (4, 3, 4, 4)
        assert first["mask"].dtype == torch.uint8
        with pytest.raises(CollateError) as info:
            next(batches)
    assert "(3, 4, 4)" in str(info.value)
    assert "(3, 5, 5)" in str(info.value)
    assert any("keys [4, 5, 6, 7]" in n for n in info.value.__notes__)


def test_async_iteration_reports_bad_input_the_same_way(images: Path) -> None:
    async def run() -> None:
        async with Loader(["2.jpg", "3.jpg"], files(images).fetch, decode=decode_jpeg) as loader:
            async for _ in loader:
                pass

    with pytest.raises(UnidentifiedImageError) as info:
        asyncio.run(run())
    assert any("for key '3.jpg'" in n for n in info.value.__notes__)
