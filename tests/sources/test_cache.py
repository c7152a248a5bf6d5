"""The local cache of remote sources (`cache_dir=`, `cache_limit=`), against real servers on 127.0.0.1.

Requests are counted where they arrive: at the fault proxy in front of the object server (HTTP) or
of SeaweedFS (S3). Several processes sharing one cache directory are real processes
(tests/scripts/cache_reader.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.faultproxy import Fault, FaultProxy, Origin
from support.s3server import SeaweedServer

from aioloader import FetchError, Loader, sources
from aioloader.sources.cache import disk as cache_module
from aioloader.sources.cache.entries import ATTR, has_xattrs

SCRIPTS = Path(__file__).parent.parent / "scripts"
KEYS = [f"obj/{i:05d}.bin" for i in range(12)]


def gets(proxy: FaultProxy) -> int:
    """GETs the proxy has seen so far."""
    return sum(proxy.seen.values())


def parts(cache_dir: Path) -> list[Path]:
    """Temporary files (downloads under way or given up) in the cache."""
    return sorted(cache_dir.rglob("*.part"))


def data_file(cache_dir: Path, url: str) -> Path:
    h = hashlib.sha256(url.encode()).hexdigest()
    return cache_dir / "data" / h[:2] / h


def epochs(src: object, n: int) -> list[list[object]]:
    """Every sample of `n` epochs (bytes, or a tar sample's dict of bytes), in delivery order."""

    def plain(x: object) -> object:
        return (
            {k: bytes(v) if k[0] != "_" else v for k, v in x.items()}
            if isinstance(x, dict)
            else bytes(x)
        )  # type: ignore[call-overload]

    with Loader(src, concurrency=8, collate=None) as loader:
        return [[plain(x) for x in loader] for _ in range(n)]


@pytest.mark.in_process
def test_epoch_two_makes_no_get(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path)
    with Loader(src, concurrency=8, collate=None) as loader:
        first = [bytes(x) for x in loader]
        after_first = gets(proxy)
        second = [bytes(x) for x in loader]
        stats = src.stats()
    assert first == second == [objects[k] for k in KEYS]
    assert after_first == len(KEYS)
    assert gets(proxy) == len(KEYS)  # epoch 2: not one request
    assert stats["cache_hits"] == len(KEYS)
    assert stats["cache_misses"] == len(KEYS)
    assert not parts(tmp_path)


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
@pytest.mark.asyncio
async def test_ranges_of_a_cached_object_come_from_its_file(
    engine: str, proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path, engine=engine)
    key = KEYS[5]
    try:
        assert await src.fetch_range(key, 10, 20) == objects[key][10:30]  # not cached: the store
        assert gets(proxy) == 1
        assert not data_file(tmp_path, src.url(key)).exists()
        assert await src.fetch(key) == objects[key]
        before = gets(proxy)
        assert await src.fetch_range(key, 100, 50) == objects[key][100:150]
        assert await src.fetch_range(key, 1000) == objects[key][1000:]
        assert await src.fetch_range(key, 7, 0) == b""
        with pytest.raises(FetchError, match="past the end"):
            await src.fetch_range(key, len(objects[key]) + 1)
        assert gets(proxy) == before
    finally:
        await src.aclose()


def set_meta(file: Path, raw: bytes | None, xattr: bool) -> None:
    """Overwrite (None: delete) the metadata kept beside a cached file."""
    if xattr and raw is None:
        os.removexattr(file, ATTR)
    elif xattr:
        os.setxattr(file, ATTR, raw)  # type: ignore[arg-type]
    elif raw is None:
        file.with_suffix(".json").unlink()
    else:
        file.with_suffix(".json").write_bytes(raw)


def get_meta(file: Path, xattr: bool) -> dict[str, Any]:
    raw = os.getxattr(file, ATTR) if xattr else file.with_suffix(".json").read_bytes()
    return dict(json.loads(raw))


@pytest.mark.parametrize("xattr", [True, False], ids=["xattr", "sidecar"])
@pytest.mark.asyncio
async def test_a_corrupt_or_partial_file_is_fetched_again(
    xattr: bool,
    proxy: FaultProxy,
    objects: dict[str, bytes],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not xattr:
        monkeypatch.setattr(cache_module, "has_xattrs", lambda root: False)
    elif not has_xattrs(tmp_path):
        pytest.skip("this file system takes no user extended attributes")
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path)
    try:
        for key in KEYS[:4]:
            await src.fetch(key)
        files = [data_file(tmp_path, src.url(k)) for k in KEYS[:4]]
        assert all(f.with_suffix(".json").exists() != xattr for f in files)
        with files[0].open("r+b") as f:
            f.truncate(100)  # cut short
        set_meta(files[1], b"{not json", xattr)  # metadata that does not parse
        meta = get_meta(files[2], xattr)
        set_meta(files[2], json.dumps({**meta, "size": meta["size"] + 1}).encode(), xattr)
        set_meta(files[3], None, xattr)  # no metadata at all
        proxy.reset_counts()
        for key in KEYS[:4]:
            assert await src.fetch(key) == objects[key]
        assert dict(proxy.seen) == {k: 1 for k in KEYS[:4]}
        for key in KEYS[:4]:  # mended: read from the cache again
            assert await src.fetch(key) == objects[key]
        assert gets(proxy) == 4
    finally:
        await src.aclose()


@pytest.mark.asyncio
async def test_least_recently_used_is_evicted_at_the_limit(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    a, b, c, d = KEYS[:4]  # 1, 2, 3 and 4 KiB
    limit = sum(len(objects[k]) for k in (a, b, c)) + 1024
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path, cache_limit=limit)
    try:
        for key in (a, b, c):
            await src.fetch(key)
        await src.fetch(a)  # a is now used more recently than b and c
        await src.fetch(d)  # over the limit: b (least recently used) goes, then c
        assert src.stats()["cache_evictions"] == 2
        proxy.reset_counts()
        for key in (a, d):
            assert await src.fetch(key) == objects[key]
        assert gets(proxy) == 0
        assert await src.fetch(b) == objects[b]
        assert dict(proxy.seen) == {b: 1}
        kept = sum(
            p.stat().st_size for p in (tmp_path / "data").rglob("*") if p.is_file() and not p.suffix
        )
        assert kept <= limit
    finally:
        await src.aclose()


@pytest.mark.asyncio
async def test_an_object_over_the_limit_is_served_but_not_kept(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path, cache_limit=1000)
    try:
        assert await src.fetch(KEYS[1]) == objects[KEYS[1]]
        assert await src.fetch(KEYS[1]) == objects[KEYS[1]]
        assert gets(proxy) == 2
        assert not parts(tmp_path)
    finally:
        await src.aclose()


@pytest.fixture
def s3proxy(seaweed: SeaweedServer) -> Iterator[FaultProxy]:
    proxy = FaultProxy(seaweed.endpoint)
    yield proxy
    proxy.stop()


def test_s3_changed_object_is_fetched_again(
    seaweed: SeaweedServer, s3proxy: FaultProxy, tmp_path: Path
) -> None:
    prefix = "cache-etag/"
    bodies = {f"{prefix}{i}.bin": bytes([i]) * (2000 + i) for i in range(6)}
    for key, body in bodies.items():
        seaweed.put(key, body)

    def source() -> sources.S3:
        return sources.s3(f"s3://{seaweed.bucket}/{prefix}", endpoint_url=s3proxy.url,
                          credentials=seaweed.credentials, addressing="path",
                          cache_dir=tmp_path)  # fmt: skip

    assert epochs(source(), 2) == [list(bodies.values())] * 2
    assert gets(s3proxy) == 1 + len(bodies)  # the listing, then each object once
    changed = f"{prefix}3.bin"
    bodies[changed] = b"new" * 700  # a new ETag (and size) in the next listing
    seaweed.put(changed, bodies[changed])
    s3proxy.reset_counts()
    assert epochs(source(), 1) == [list(bodies.values())]
    bucket = seaweed.bucket  # the new listing (its path is the bucket's), and the changed object
    assert dict(s3proxy.seen) == {f"{bucket}/": 1, f"{bucket}/{changed}": 1}


def test_two_endpoints_of_one_bucket_share_one_cached_copy(
    seaweed: SeaweedServer, s3proxy: FaultProxy, tmp_path: Path
) -> None:
    """Objects and tar shards are cached by store, bucket and key: a process that reaches the same
    bucket through another endpoint URL (here, a proxy in front of it) reads the copy the first
    one downloaded, and sends no request."""
    prefix = "cache-endpoints/"
    bodies = {f"{prefix}{i}.bin": bytes([i]) * (1000 + i) for i in range(4)}
    for key, body in bodies.items():
        seaweed.put(key, body)
    shard = f"{prefix}shard.tar"
    seaweed.put(shard, _tar({"a.txt": b"one", "b.txt": b"two"}))
    keys = sorted(bodies)
    credentials, bucket = seaweed.credentials, seaweed.bucket

    def both(endpoint: str) -> tuple[list[object], list[object]]:
        objects = sources.s3(f"s3://{bucket}/{prefix}", keys, endpoint_url=endpoint,
                             credentials=credentials, cache_dir=tmp_path)  # fmt: skip
        shards = sources.tar_shards([f"s3://{bucket}/{shard}"], cache_dir=tmp_path,
                                    s3_options={"endpoint_url": endpoint,
                                                "credentials": credentials})  # fmt: skip
        return epochs(objects, 1)[0], epochs(shards, 1)[0]

    direct = both(seaweed.endpoint)
    assert direct[0] == list(bodies.values())
    assert [s["txt"] for s in direct[1]] == [b"one", b"two"]  # type: ignore[index]
    assert both(s3proxy.url) == direct
    assert gets(s3proxy) == 0  # all from the copies the other endpoint's reads kept
    assert data_file(tmp_path, f"s3://{bucket}/{keys[0]}").exists()


def _tar(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return out.getvalue()


@pytest.fixture
def shard_server() -> Iterator[tuple[Origin, FaultProxy]]:
    shards = {
        f"shard-{s}.tar": _tar({f"s{s}-{i:03d}.txt": f"{s}/{i}".encode() * 500 for i in range(40)})
        for s in range(3)
    }
    origin = Origin(shards)
    proxy = FaultProxy(origin.url)
    yield origin, proxy
    proxy.stop()
    origin.stop()


@pytest.mark.in_process
def test_cached_tar_shards_epoch_two_makes_no_get(
    shard_server: tuple[Origin, FaultProxy], tmp_path: Path
) -> None:
    origin, proxy = shard_server
    urls = [f"{proxy.url}/{name}" for name in sorted(origin.objects)]
    shards = sources.tar_shards(urls, shuffle=False, cache_dir=tmp_path)
    got = epochs(shards, 2)
    assert got[0] == got[1]
    assert len(got[0]) == 3 * 40
    assert gets(proxy) == 3
    stats = shards.stats()
    assert stats["cache_misses"] == 3
    assert stats["cache_hits"] == 3


@pytest.mark.asyncio
async def test_a_cached_shard_that_does_not_parse_is_fetched_again(
    shard_server: tuple[Origin, FaultProxy], tmp_path: Path
) -> None:
    origin, proxy = shard_server
    url = f"{proxy.url}/shard-1.tar"
    with tarfile.open(fileobj=io.BytesIO(origin.objects["shard-1.tar"])) as tar:
        third = tar.getmembers()[2].offset  # where the third member's header starts
    shards = sources.tar_shards([url], shuffle=False, cache_dir=tmp_path)
    try:
        whole = [s async for s in shards]
        cached = data_file(tmp_path, url)
        with cached.open("r+b") as f:  # same size, a header's checksum broken
            f.seek(third + 100)
            f.write(b"\xff" * 8)
        with pytest.raises(FetchError, match="bad header checksum"):
            _ = [s async for s in shards]
        assert not cached.exists()  # dropped: the next epoch fetches it again
        assert [s async for s in shards] == whole
        assert proxy.seen["shard-1.tar"] == 2
    finally:
        await shards.aclose()


@pytest.mark.asyncio
async def test_early_break_mid_shard_leaves_no_file(
    shard_server: tuple[Origin, FaultProxy], tmp_path: Path
) -> None:
    _origin, proxy = shard_server
    url = f"{proxy.url}/shard-0.tar"
    # The first GET's body comes in eight pieces 0.2 s apart: the break comes before its end.
    proxy.plan = lambda path, n: Fault("trickle", 0.2) if n == 1 else None
    shards = sources.tar_shards([url], shuffle=False, cache_dir=tmp_path, parallel=1)
    try:
        async for sample in shards:
            assert sample["__key__"] == "s0-000"
            break  # the shard's download is given up part-way
        await asyncio.sleep(0.05)
        assert not parts(tmp_path)
        assert not data_file(tmp_path, url).exists()
        assert len([s async for s in shards]) == 40  # read whole: now kept
        assert data_file(tmp_path, url).exists()
        assert not parts(tmp_path)
    finally:
        await shards.aclose()


# Another process: takes the lock of the shard named argv[2] in the cache argv[1], says "held",
# and lets go once the file argv[3] is in the cache ("published"), or after 60 s ("timeout").
HOLD_LOCK = """
import os, sys, time
from pathlib import Path
from aioloader.sources.cache.entries import Paths, open_lock, try_lock
fd = open_lock(Paths.of(Path(sys.argv[1]), sys.argv[2]))
assert try_lock(fd, Paths.of(Path(sys.argv[1]), sys.argv[2]))
print("held", flush=True)
end = time.monotonic() + 60
while not os.path.exists(sys.argv[3]) and time.monotonic() < end:
    time.sleep(0.01)
print("published" if os.path.exists(sys.argv[3]) else "timeout", flush=True)
"""


def _two_shards() -> tuple[dict[str, bytes], Origin, list[str]]:
    """Shards 0 and 1 of 200 samples each ("s<shard>-<i>"), an origin serving them, their URLs."""
    shards = {
        f"shard-{s}.tar": _tar({f"s{s}-{i:03d}.bin": bytes([s]) * 4096 for i in range(200)})
        for s in range(2)
    }
    origin = Origin(shards)
    return shards, origin, [f"{origin.url}/shard-{s}.tar" for s in range(2)]


def test_a_download_goes_on_while_its_reader_waits_for_another_process(tmp_path: Path) -> None:
    # Two ranks read shards 0 and 1 round-robin through one cache. The other holds shard 1's lock
    # and wants shard 0's first sample before it lets go; this one downloads shard 0 and wants
    # shard 1's first sample next. Were shard 0's download paced by its reader (32 samples ahead
    # at most, of 200), neither would ever go on.
    _, origin, urls = _two_shards()
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(tmp_path), urls[1], str(data_file(tmp_path, urls[0]))],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "held"
        src = sources.tar_shards(urls, shuffle=False, cache_dir=tmp_path, parallel=2)
        keys = [s["__key__"] for s in epochs(src, 1)[0]]
        assert other.stdout.readline().strip() == "published"
    finally:
        other.kill()
        other.communicate()
        origin.stop()
    assert sorted(keys) == sorted(f"s{s}-{i:03d}" for s in range(2) for i in range(200))
    assert keys[:2] == ["s0-000", "s1-000"]  # round-robin, as ever
    assert origin.hits == {"shard-0.tar": 1, "shard-1.tar": 1}
    assert not parts(tmp_path)


# Another process, for the round-robin deadlock: holds the lock of the shard named argv[2] in the
# cache argv[1] ("held"); once the file argv[3] is in the cache, puts that shard's bytes (the file
# argv[4]) in place as its finished download would ("published"), and holds the lock until killed
# (its reader, say, waits for the first process's next shard).
PUBLISH_AND_HOLD = """
import os, sys, time
from pathlib import Path
from aioloader.sources.cache.entries import (
    Expect, Paths, create_temp, has_xattrs, label, metadata, open_lock, publish, try_lock,
    write_all,
)
root, held = Path(sys.argv[1]), Paths.of(Path(sys.argv[1]), sys.argv[2])
(root / "data").mkdir(parents=True, exist_ok=True)
fd = open_lock(held)
assert try_lock(fd, held)
print("held", flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.01)
body, xattr = Path(sys.argv[4]).read_bytes(), has_xattrs(root / "data")
out, temp = create_temp(held)
write_all(out, [body])
meta = metadata("other", len(body), {}, Expect())
label(out, meta, xattr)
os.close(out)
publish(held, temp, meta, xattr)
print("published", flush=True)
time.sleep(300)
"""


def test_a_shard_in_place_is_read_while_another_process_still_holds_its_lock(
    tmp_path: Path,
) -> None:
    # Two ranks read shards 0 and 1 round-robin through one cache. The other downloaded shard 1
    # and holds its lock while its reader is busy; this one, waiting for that lock since it
    # started, reads the file once it is in place. Were the file looked for only when the lock
    # was free, this one would wait for shard 1 for ever (LoaderTimeout here).
    shards, origin, urls = _two_shards()
    body = tmp_path / "shard-1.tar"
    body.write_bytes(shards["shard-1.tar"])
    cache = tmp_path / "cache"
    other = subprocess.Popen(
        [sys.executable, "-c", PUBLISH_AND_HOLD, str(cache), urls[1],
         str(data_file(cache, urls[0])), str(body)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert other.stdout is not None
        assert other.stdout.readline().strip() == "held"
        src = sources.tar_shards(urls, shuffle=False, cache_dir=cache, parallel=2)
        with Loader(src, concurrency=8, collate=None, timeout=60) as loader:
            samples = list(loader)
        assert other.stdout.readline().strip() == "published"
    finally:
        other.kill()
        other.communicate()
        origin.stop()
    assert sorted(s["__key__"] for s in samples) == sorted(
        f"s{s}-{i:03d}" for s in range(2) for i in range(200)
    )
    assert all(bytes(s["bin"]) == bytes([int(s["__key__"][1])]) * 4096 for s in samples)
    assert origin.hits == {"shard-0.tar": 1}  # shard 1 came from the other's file
    assert not parts(cache)


@pytest.mark.asyncio
async def test_a_download_lets_go_of_its_lock_when_it_ends_not_when_its_reader_does(
    tmp_path: Path,
) -> None:
    # A reader that took one sample of its shard and waits (for another process's shard, say):
    # once the shard is in the cache, its lock is free for that other process. Held until the
    # reader was done, two processes reading round-robin could each wait for the other's lock
    # where no file was kept (a failed download, one over the limit).
    from aioloader.sources.cache.entries import Paths, open_lock, try_lock

    origin = Origin({"shard.tar": _tar({f"s-{i:03d}.bin": bytes([i]) * 4096 for i in range(200)})})
    url = f"{origin.url}/shard.tar"
    src = sources.tar_shards([url], shuffle=False, cache_dir=tmp_path)
    probe = -1
    try:
        samples = src.samples(0)
        first = await samples.__anext__()
        while not data_file(tmp_path, url).exists():  # noqa: ASYNC110 - a file: polled
            await asyncio.sleep(0.01)
        paths = Paths.of(tmp_path, url)
        probe = open_lock(paths)

        async def freed() -> None:  # (it goes as the download's task ends, just after the file)
            while not try_lock(probe, paths):  # noqa: ASYNC110 - another descriptor's lock
                await asyncio.sleep(0.01)

        await asyncio.wait_for(freed(), 60)  # held until the reader is done: TimeoutError
        rest = [s async for s in samples]
    finally:
        if probe >= 0:
            os.close(probe)
        await src.aclose()
        origin.stop()
    assert [s["__key__"] for s in [first, *rest]] == [f"s-{i:03d}" for i in range(200)]
    assert origin.hits == {"shard.tar": 1}
    assert not parts(tmp_path)


@pytest.mark.asyncio
async def test_a_reader_far_behind_its_download_reads_the_rest_from_the_file(
    tmp_path: Path,
) -> None:
    # The download keeps FRESH_BYTES for its reader in memory; a reader that falls further behind
    # (here: it waits, after its first sample, until the whole shard is in the cache) takes the
    # rest from the file being written. That file was opened write-only once: EBADF at the first
    # read from it (a shard over 4 MiB read through a cache by a reader slower than the wire).
    from aioloader.sources.cache.handles import FRESH_BYTES

    body = {
        f"s-{i:03d}.bin": bytes([i]) * (200 << 10) for i in range(3 * FRESH_BYTES // (200 << 10))
    }
    origin = Origin({"shard.tar": _tar(body)})
    url = f"{origin.url}/shard.tar"
    src = sources.tar_shards([url], shuffle=False, cache_dir=tmp_path)
    try:
        samples = src.samples(0)
        got = [await samples.__anext__()]
        # the download goes on without its reader, until its file is in place (a file: polled)
        while not data_file(tmp_path, url).exists():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        got += [s async for s in samples]
    finally:
        await src.aclose()
        origin.stop()
    assert [s["__key__"] for s in got] == [name.removesuffix(".bin") for name in body]
    assert all(s["bin"] == body[s["__key__"] + ".bin"] for s in got)
    assert origin.hits == {"shard.tar": 1}
    assert not parts(tmp_path)


@pytest.mark.asyncio
async def test_cancelled_download_leaves_no_file(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    loop, arrived = asyncio.get_running_loop(), asyncio.Event()

    def plan(path: str, n: int) -> Fault | None:
        loop.call_soon_threadsafe(arrived.set)  # the request is at the server
        return Fault("latency", 0.5) if n == 1 else None

    proxy.plan = plan
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path)
    try:
        task = asyncio.ensure_future(src.fetch(KEYS[2]))
        await arrived.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not data_file(tmp_path, src.url(KEYS[2])).exists()
        assert not parts(tmp_path)
        assert await src.fetch(KEYS[2]) == objects[KEYS[2]]  # the lock was given back
    finally:
        await src.aclose()


@pytest.mark.asyncio
async def test_a_failed_download_keeps_nothing_and_lets_go_of_the_lock(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    proxy.plan = lambda path, n: Fault("503") if n == 1 else None
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path, attempts=1)
    try:
        with pytest.raises(FetchError, match="status 503") as info:
            await src.fetch(KEYS[4])
        assert info.value.key == KEYS[4]
        assert not data_file(tmp_path, src.url(KEYS[4])).exists()
        assert await asyncio.wait_for(src.fetch(KEYS[4]), 10) == objects[KEYS[4]]
        assert await src.fetch(KEYS[4]) == objects[KEYS[4]]
        assert proxy.seen[KEYS[4]] == 2
    finally:
        await src.aclose()


def test_breaking_out_mid_epoch_leaves_no_partial_file(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    proxy.plan = lambda path, n: Fault("latency", 0.05 if path == KEYS[0] else 0.4)
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path)
    with Loader(src, concurrency=8, collate=None) as loader:
        for sample in loader:
            assert bytes(sample) == objects[KEYS[0]]
            break  # seven downloads in flight are given up
    assert not parts(tmp_path)
    kept = [k for k in KEYS if data_file(tmp_path, src.url(k)).exists()]
    assert kept == [KEYS[0]]
    proxy.plan = lambda path, n: None
    assert epochs(sources.http(proxy.url, KEYS, cache_dir=tmp_path), 1) == [
        [objects[k] for k in KEYS]
    ]


@pytest.mark.asyncio
async def test_leftover_temporary_files_are_deleted(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    src = sources.http(proxy.url, KEYS, cache_dir=tmp_path)
    try:
        await src.fetch(KEYS[0])
    finally:
        await src.aclose()
    target = data_file(tmp_path, src.url(KEYS[1]))
    target.parent.mkdir(parents=True, exist_ok=True)
    dead = target.with_name(target.name + ".0123456789abcdef.part")  # a download that died
    dead.write_bytes(b"half")
    again = sources.http(proxy.url, KEYS, cache_dir=tmp_path)
    try:
        assert await again.fetch(KEYS[0]) == objects[KEYS[0]]
        assert not dead.exists()
        assert gets(proxy) == 1
    finally:
        await again.aclose()


def _readers(proxy: FaultProxy, ready: Path, phases: list[dict[str, Any]], n: int = 2) -> list[Any]:
    """Run `n` processes of scripts/cache_reader.py at once; each one's results, phase by phase."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(SCRIPTS / "cache_reader.py"),
                proxy.url,
                str(ready),
                str(n),
                json.dumps(phases),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.splitlines()[-1]))
    return results


def test_processes_sharing_a_cache(
    proxy: FaultProxy, objects: dict[str, bytes], tmp_path: Path
) -> None:
    """Phase 0: two processes read the same objects at once: each is downloaded once in all.
    Phase 1: with a limit a third of the objects, the two evict each other's files and download
    them again all the time: every read is still whole and right."""
    shared, evicting = KEYS[:8], [f"obj/{i:05d}.bin" for i in range(12, 36)]
    limit = sum(len(objects[k]) for k in evicting) // 3
    # the first GET of each shared object is held for a second: the other process, started at the
    # same moment, finds its lock taken and waits
    proxy.plan = lambda path, n: Fault("latency", 1.0) if path in shared and n == 1 else None
    phases = [
        {"cache_dir": str(tmp_path / "a"), "limit": None, "passes": 2, "keys": shared},
        {"cache_dir": str(tmp_path / "b"), "limit": limit, "passes": 4, "keys": evicting},
    ]
    results = _readers(proxy, tmp_path / "ready", phases)
    for phase, keys in ((0, shared), (1, evicting)):
        want = {k: [hashlib.sha256(objects[k]).hexdigest()] * phases[phase]["passes"] for k in keys}
        assert all(r[phase]["digests"] == want for r in results)
    assert {k: proxy.seen[k] for k in shared} == dict.fromkeys(shared, 1)  # once, in all
    assert sum(r[0]["stats"]["cache_waits"] for r in results) > 0  # one waited for the other
    assert sum(r[1]["stats"]["cache_evictions"] for r in results) > 0
    files = (tmp_path / "b" / "data").rglob("*")
    assert sum(p.stat().st_size for p in files if p.is_file() and not p.suffix) <= limit
    assert not parts(tmp_path)


def test_bad_cache_arguments_name_the_argument(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"cache_dir .* is not a directory"):
        sources.http("http://127.0.0.1:1/", ["a"], cache_dir=tmp_path / "file")
    with pytest.raises(ValueError, match="cache_limit must be >= 0, got -1"):
        sources.http("http://127.0.0.1:1/", ["a"], cache_dir=tmp_path, cache_limit=-1)
    with pytest.raises(TypeError, match="cache_limit must be an int"):
        sources.RemoteOptions(cache_dir=tmp_path, cache_limit=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_limit is given without cache_dir"):
        sources.s3("s3://b/", endpoint_url="http://127.0.0.1:1", cache_limit=10)
    with pytest.raises(TypeError, match="cache_dir must be a path"):
        sources.tar_shards(["a.tar"], cache_dir=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"cache_dir .* is not a directory"):
        sources.tar_shards(["a.tar"], cache_dir=tmp_path / "file")


def test_connections_opening_a_new_index_at_once_all_open_it(tmp_path: Path) -> None:
    # Each opener converts a new index to WAL first; where two do it at once, SQLite fails the
    # second at once ("database is locked", its busy timeout not asked), which stopped one of the
    # cache benchmark's two processes in CI. Connections of one process race alike (threads).
    from aioloader.sources.cache.index import Index

    for trial in range(100):
        root = tmp_path / str(trial)
        root.mkdir()
        start, errors = threading.Barrier(4), []

        def open_index(
            root: Path = root, start: threading.Barrier = start, errors: list[str] = errors
        ) -> None:
            start.wait()
            index = Index(root)
            try:
                index.reconcile([], lambda _id: True)
            except Exception as exc:  # every opener's failure is the finding
                errors.append(repr(exc))
            finally:
                index.close()  # (an unclosed connection is a ResourceWarning from Python 3.13)

        threads = [threading.Thread(target=open_index) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == [], (trial, errors)
