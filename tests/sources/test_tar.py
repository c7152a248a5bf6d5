"""Tar shards: webdataset compatibility, streaming, errors with offsets, sharding, HTTP, S3, Loader."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import webdataset as wds
from aiohttp import web
from support.faultproxy import Fault, FaultProxy, Origin, ServerThread
from support.s3server import SeaweedServer
from support.shardfiles import write_mixed_shards

from aioloader import FetchError, Loader, sample_seed
from aioloader.sources.formats.options import ShardOptions
from aioloader.sources.formats.tar import split_name
from aioloader.sources.formats.tar_counts import count_local
from aioloader.sources.tar import TarShards, tar_shards

N_SHARDS, PER_SHARD = 6, 7


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_mixed_shards(tmp_path_factory.mktemp("shards"), N_SHARDS, PER_SHARD)


def reference(paths: list[str]) -> list[dict[str, Any]]:
    """What webdataset's own tar iterator and grouping make of `paths`, in order."""
    out = []
    for path in paths:
        with open(path, "rb") as stream:
            members = wds.tariterators.tar_file_expander([{"url": path, "stream": stream}])
            out += list(wds.tariterators.group_by_keys(members))
    return out


def collect(src: TarShards, epoch: int = 0) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        try:
            return [sample async for sample in src.samples(epoch)]
        finally:
            await src.aclose()

    return asyncio.run(run())


def test_samples_match_webdataset(shards: list[str]) -> None:
    got = collect(tar_shards(shards, shuffle=False, parallel=1))
    want = reference(shards)
    assert len(want) == N_SHARDS * PER_SHARD
    assert got == want
    assert set(got[0]) == {"__key__", "__url__", "jpg", "cls", "seg.png"}


def test_split_name_like_webdataset() -> None:
    assert split_name("a/b.seg.jpg") == ("a/b", "seg.jpg")
    assert split_name("a.b/c.txt") == ("a.b/c", "txt")
    assert split_name("noext") == (None, "")
    assert split_name("dir/.hidden") == (None, "")


def test_truncated_and_corrupt_shards_name_shard_and_offset(
    shards: list[str], tmp_path: Path
) -> None:
    data = Path(shards[0]).read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[:3000])
    with pytest.raises(FetchError, match=r"cut\.tar: stream ended inside a member .* offset \d+"):
        collect(tar_shards([str(cut)], shuffle=False))
    with tarfile.open(shards[0]) as tar:
        at = tar.getmembers()[2].offset
    bad = bytearray(data)
    bad[at + 10] ^= 0xFF  # a byte of the third member's header
    corrupt = tmp_path / "corrupt.tar"
    corrupt.write_bytes(bytes(bad))
    with pytest.raises(
        FetchError, match=rf"corrupt\.tar: bad header checksum .* offset {at}$"
    ) as info:
        collect(tar_shards([str(corrupt)], shuffle=False))
    assert info.value.key == str(corrupt)
    ended = tmp_path / "ended.tar"
    with tarfile.open(shards[0]) as tar:
        last = tar.getmembers()[-1]
    end = last.offset_data + -(-last.size // 512) * 512
    ended.write_bytes(data[:end])  # whole members, but no end-of-archive blocks
    with pytest.raises(FetchError, match="without the end-of-archive"):
        collect(tar_shards([str(ended)], shuffle=False))


def test_a_local_count_reads_the_headers_as_a_read_of_the_shard_does(
    shards: list[str], tmp_path: Path
) -> None:
    """`count_local` parses with the shards' own parser: the count of a read, and its errors."""
    for shard in shards[:2]:
        assert count_local(shard, sample_key) == len(reference([shard]))
    named = tmp_path / "named.tar"  # a GNU long name and a pax path name members
    with tarfile.open(named, "w", format=tarfile.GNU_FORMAT) as tar:
        for name in ("a" * 120 + "/x.txt", "a" * 120 + "/x.cls", "b.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    assert count_local(str(named), sample_key) == 2
    data = Path(shards[0]).read_bytes()
    (tmp_path / "cut.tar").write_bytes(data[:3000])
    with pytest.raises(FetchError, match=r"cut\.tar: file ended inside a member .* offset \d+"):
        count_local(str(tmp_path / "cut.tar"), sample_key)
    with tarfile.open(shards[0]) as tar:
        at = tar.getmembers()[2].offset
    bad = bytearray(data)
    bad[at + 10] ^= 0xFF
    (tmp_path / "corrupt.tar").write_bytes(bytes(bad))
    with pytest.raises(FetchError, match=rf"corrupt\.tar: bad header checksum .* offset {at}$"):
        count_local(str(tmp_path / "corrupt.tar"), sample_key)


def sample_key(name: str) -> str | None:
    return split_name(name)[0]


def test_shards_split_across_ranks_and_workers_without_overlap(shards: list[str]) -> None:
    seen: list[str] = []
    samples: list[list[str]] = []
    for rank in range(2):
        for worker in range(2):
            src = tar_shards(shards, rank=rank, world_size=2, worker=worker, num_workers=2)
            mine = src.shards_for(epoch=3)
            assert mine == TarShards(shards, rank=rank, world_size=2, worker=worker,
                                     num_workers=2).shards_for(3)  # fmt: skip
            seen += mine
            samples.append([s["__key__"] for s in collect(src, epoch=3)])
    assert set(seen) == set(shards)
    total = N_SHARDS * PER_SHARD  # 42 among 4 readers: 11 each, the last padded by 2
    assert [len(m) for m in samples] == [-(-total // 4)] * 4
    every = [k for m in samples for k in m]
    assert len(set(every)) == total
    assert all(len(set(m)) == len(m) for m in samples)  # no reader has a sample twice
    one = tar_shards(shards)
    assert one.shards_for(0) != one.shards_for(1)  # reshuffled per epoch
    assert sorted(one.shards_for(0)) == sorted(shards)


def test_shuffle_buffer_mixes_deterministically(shards: list[str]) -> None:
    plain = [s["__key__"] for s in collect(tar_shards(shards, shuffle=False, parallel=1))]
    mixed = [s["__key__"] for s in collect(tar_shards(shards, shuffle_buffer=10, seed=5))]
    again = [s["__key__"] for s in collect(tar_shards(shards, shuffle_buffer=10, seed=5))]
    assert mixed == again
    assert mixed != plain
    assert sorted(mixed) == sorted(plain)


def test_loader_streams_samples_per_epoch(shards: list[str]) -> None:
    src = tar_shards(shards, parallel=3, shuffle_buffer=8, suffixes=["cls", "jpg"])
    with Loader(src, concurrency=4, collate=None) as loader:
        epochs = [[(s["__key__"], s["cls"]) for s in loader] for _ in range(2)]
    assert len(epochs[0]) == len(epochs[1]) == N_SHARDS * PER_SHARD
    assert sorted(epochs[0]) == sorted(epochs[1])
    assert epochs[0] != epochs[1]


def test_shards_are_shuffled_by_default_and_a_validation_set_keeps_its_order(
    shards: list[str],
) -> None:
    train = tar_shards(shards)
    assert train.shuffle is True
    assert "shuffle=True" in repr(train)
    assert train.shards_for(0) != shards
    assert sorted(train.shards_for(0)) == sorted(shards)
    val = tar_shards(shards, shuffle=False, parallel=1)
    assert "shuffle=False" in repr(val)
    with Loader(val, concurrency=4, collate=None) as loader:
        epochs = [[s["__key__"] for s in loader] for _ in range(2)]
    assert epochs[0] == epochs[1] == [s["__key__"] for s in reference(shards)]


@pytest.mark.parametrize(
    ("options", "error", "name"),
    [
        ({"shuffle": False, "shuffle_buffer": 10}, ValueError, "shuffle_buffer"),
        ({"shuffle": "no"}, TypeError, "shuffle"),
        ({"shufle": False}, TypeError, "shufle"),
        ({"read_ahead": -1}, ValueError, "read_ahead"),
        ({"read_ahead": 1.5}, TypeError, "read_ahead"),
        ({"shuffle_initial": 0}, ValueError, "shuffle_initial"),
    ],
)
def test_bad_shuffle_options_name_the_argument(
    shards: list[str], options: dict[str, Any], error: type[Exception], name: str
) -> None:
    with pytest.raises(error, match=name):
        tar_shards(shards, **options)


def test_loader_shuffle_over_shards_says_that_they_shuffle_themselves(shards: list[str]) -> None:
    with pytest.raises(
        ValueError, match=r"^shuffle=True: tar_shards\(.*\) shuffles itself"
    ) as info:
        Loader(tar_shards(shards), shuffle=True)
    assert "_Epochs" not in str(info.value)
    assert "shuffle_buffer" in str(info.value)


@pytest.fixture
def shard_bytes(shards: list[str]) -> bytes:
    return Path(shards[0]).read_bytes()


@pytest.mark.asyncio
async def test_first_sample_arrives_before_the_shard_is_read(
    shards: list[str], shard_bytes: bytes
) -> None:
    data = shard_bytes
    release = asyncio.Event()  # used on the server's loop only: set through call_soon_threadsafe

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[:16384])
        await release.wait()
        await resp.write(data[16384:])
        return resp

    app = web.Application()
    app.router.add_get("/shard.tar", handler)
    server = ServerThread(app, "test-slow-shard")
    src = tar_shards([server.url + "/shard.tar"], shuffle=False)
    stream: AsyncIterator[dict[str, Any]] = src.samples(0)
    try:
        first = await asyncio.wait_for(anext(stream), 10)
        assert first == reference(shards[:1])[0] | {"__url__": server.url + "/shard.tar"}
        server.loop.call_soon_threadsafe(release.set)
        rest = [s async for s in stream]
        assert len(rest) == PER_SHARD - 1
    finally:
        server.loop.call_soon_threadsafe(release.set)
        await stream.aclose()  # type: ignore[attr-defined]
        await src.aclose()
        server.stop()


def test_http_shards_resume_after_resets(shards: list[str]) -> None:
    origin = Origin({Path(p).name: Path(p).read_bytes() for p in shards})
    proxy = FaultProxy(origin.url)
    proxy.plan = lambda path, n: Fault("reset-mid-body") if n <= 2 else None
    try:
        urls = [f"{proxy.url}/{Path(p).name}" for p in shards]
        got = collect(tar_shards(urls, shuffle=False, parallel=1, http_options={"backoff": 0.01}))
        want = [
            s | {"__url__": u}
            for s, u in zip(reference(shards), sorted(urls * PER_SHARD), strict=True)
        ]
        assert got == want
        assert proxy.injected["reset-mid-body"] == 2 * N_SHARDS
    finally:
        proxy.stop()
        origin.stop()


def test_s3_shards(seaweed: SeaweedServer, shards: list[str]) -> None:
    urls = []
    for path in shards[:2]:
        seaweed.put(f"tars/{Path(path).name}", Path(path).read_bytes())
        urls.append(f"s3://{seaweed.bucket}/tars/{Path(path).name}")
    options = {"endpoint_url": seaweed.endpoint, "credentials": seaweed.credentials}
    got = collect(tar_shards(urls, shuffle=False, parallel=1, s3_options=options))
    assert [s["jpg"] for s in got] == [s["jpg"] for s in reference(shards[:2])]


def test_members_without_data_kinds_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "dirs.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(tarfile.TarInfo("d"))  # a regular empty file without an extension
        info = tarfile.TarInfo("d/sub")
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
        body = b"\xe9t\xe9"
        info = tarfile.TarInfo("d/\u00e9t\u00e9.txt")  # a pax header carries the non-ASCII path
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    got = collect(tar_shards([str(path)], shuffle=False))
    assert got == [{"__key__": "d/\u00e9t\u00e9", "__url__": str(path), "txt": body}]


def test_under_skip_a_bad_shard_costs_its_rest_and_the_epoch_goes_on(
    shards: list[str], tmp_path: Path
) -> None:
    data = Path(shards[0]).read_bytes()
    with tarfile.open(shards[0]) as tar:
        third = tar.getmembers()[2].offset
    bad = {
        "cut.tar": data[:3000],  # truncated inside a member
        "corrupt.tar": data[:third + 10] + bytes([data[third + 10] ^ 0xFF]) + data[third + 11:],
        "empty.tar": b"",
    }  # fmt: skip
    for name, blob in bad.items():
        (tmp_path / name).write_bytes(blob)
    broken = [str(tmp_path / name) for name in bad] + [str(tmp_path / "missing.tar")]
    good = shards[1:3]
    source = tar_shards([*broken, *good], shuffle=False, parallel=2)
    with Loader(source, collate=None, on_error="skip", max_skipped=None) as loader:
        got = [sample["__key__"] for sample in loader]
        stats = loader.stats()
    whole = [s["__key__"] for s in reference(good)]
    assert sorted(k for k in got if not k.startswith("s0/")) == sorted(whole)  # every good one
    assert set(got) - set(whole) <= {s["__key__"] for s in reference(shards[:1])}  # ... + heads
    assert stats.skipped_count == len(broken)  # each broken shard: one skip for its rest
    reasons = " ".join(reason for _, reason in stats.skipped)
    for name in (*bad, "missing.tar"):
        assert name in reasons, reasons
    # without skip the first broken shard ends the epoch, naming it
    loader = Loader(tar_shards(broken, shuffle=False), collate=None)
    with loader, pytest.raises(FetchError, match=r"cut\.tar"):
        list(loader)


def test_the_class_takes_the_shared_arguments_one_by_one_or_as_one_object(
    shards: list[str],
) -> None:
    one_by_one = TarShards(shards, rank=1, world_size=2, seed=3, shuffle_buffer=8)
    together = TarShards(
        shards, options=ShardOptions(rank=1, world_size=2, seed=3, shuffle_buffer=8)
    )
    called = tar_shards(shards, rank=1, world_size=2, seed=3, shuffle_buffer=8)
    assert one_by_one.options == together.options == called.options
    assert one_by_one.shards_for(2) == together.shards_for(2) == called.shards_for(2)
    assert (one_by_one.slot, one_by_one.slots, one_by_one.shuffle_buffer, one_by_one.seed) == (
        1,
        2,
        8,
        3,
    )
    with pytest.raises(
        TypeError, match=r"TarShards\.__init__\(\) got an unexpected keyword .*'rnak'"
    ):
        TarShards(shards, rnak=1)
    with pytest.raises(ValueError, match="shuffle_buffer=8 mixes samples"):
        tar_shards(shards, shuffle=False, shuffle_buffer=8)


@pytest.mark.parametrize("shuffle", [False, True])
def test_an_early_break_closes_the_shard_streams_without_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, shuffle: bool
) -> None:
    # Left to the garbage collector, the streams of shards (and the shuffle buffer over them) were
    # closed each by a task of its own, one finding the next still running: "aclose(): asynchronous
    # generator is already running" in the log, at an early break.
    from support.shardfiles import write_shards

    paths = write_shards(tmp_path, [100] * 20)
    with caplog.at_level("ERROR"):
        for _ in range(3):
            with Loader(tar_shards(paths, shuffle=shuffle), batch_size=64, collate=None) as loader:
                for batch in loader:
                    assert len(batch) == 64
                    break
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == []


@pytest.mark.in_process
def test_a_loader_takes_streamed_samples_in_place_under_the_same_error_policy(
    shards: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aioloader._pipeline.assemble import Assembler

    tasks = 0
    sample_task = Assembler.sample

    async def counted(self: Assembler, *args: Any) -> None:
        nonlocal tasks
        tasks += 1
        await sample_task(self, *args)

    monkeypatch.setattr(Assembler, "sample", counted)
    keys = [s["__key__"] for s in reference(shards)]
    raising, empty = set(keys[3::7]), set(keys[5::11])

    def decode(sample: dict[str, Any]) -> str | None:
        if sample["__key__"] in raising:
            raise ValueError(f"bad {sample['__key__']}")
        if sample["__key__"] in empty:
            return None
        return f"{sample['__key__']}:{sample_seed()}"  # the same seed, whichever way it runs

    def run(executor: str) -> tuple[list[str], int]:
        source = tar_shards(shards, shuffle=False)
        with Loader(source, decode=decode, executor=executor, batch_size=4, collate=None,
                    on_error="skip", max_skipped=None) as loader:  # fmt: skip
            got = [key for batch in loader for key in batch]
            return got, loader.stats().skipped_count

    inline, skipped = run("inline")
    assert tasks == 0  # each sample fetched and decoded as it was launched
    assert sorted(k.partition(":")[0] for k in inline) == sorted(set(keys) - raising - empty)
    assert skipped == len(raising | empty)
    assert run("thread") == (inline, skipped)  # a task each, the same batches
    assert tasks == len(keys)
    loader = Loader(tar_shards(shards, shuffle=False), decode=decode, executor="inline")
    with loader, pytest.raises(ValueError, match="bad") as caught:
        list(loader)
    assert any("raised in stage 'decode' for key" in note for note in caught.value.__notes__)
