"""Tar shards read ahead and a shuffle buffer that starts early: requests out before the current
shards end, bounded in number and bytes, the order unchanged, failures at their place, nothing left
behind; the first samples out after a small fill, resume exact past the buffer's growth."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from support.faultproxy import ServerThread
from support.shardfiles import write_bin_shards

from aioloader import FetchError, Loader
from aioloader._util.aiters import flattened as flat
from aioloader.sources.formats.shards import interleave, shuffled
from aioloader.sources.tar import TarShards, tar_shards


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """16 shards of 50 small samples: 800 in all."""
    return write_bin_shards(tmp_path_factory.mktemp("many"), 16, 50)


def keys_of(src: TarShards, epoch: int = 0) -> list[str]:
    async def run() -> list[str]:
        try:
            return [s["__key__"] async for s in src.samples(epoch)]
        finally:
            await src.aclose()

    return asyncio.run(run())


# -- the merge: the same order, whatever is read ahead -----------------------------------------------


@pytest.mark.parametrize("parallel", [1, 3])
def test_the_order_is_the_same_whatever_is_read_ahead(many: list[str], parallel: int) -> None:
    def order(read_ahead: int) -> list[str]:
        return keys_of(tar_shards(many, seed=4, shuffle_buffer=300, parallel=parallel,
                                  read_ahead=read_ahead), epoch=1)  # fmt: skip

    plain = order(0)
    assert sorted(plain) == sorted(f"s{s:03d}-{i:04d}" for s in range(16) for i in range(50))
    assert order(1) == plain
    assert order(4) == plain


def counted(
    name: str, items: list[bytes], log: dict[str, Any], gate: asyncio.Event | None = None
) -> AsyncGenerator[list[bytes], None]:
    """A stream of `items`, a chunk of one each, that records how many streams are open at once
    and what it yielded; after its first item it waits for `gate` (when given)."""

    async def gen() -> AsyncGenerator[list[bytes], None]:
        log["open"] += 1
        log["most_open"] = max(log["most_open"], log["open"])
        try:
            for n, item in enumerate(items):
                if n == 1 and gate is not None:
                    await gate.wait()
                log["yielded"][name] = log["yielded"].get(name, 0) + 1
                yield [item]
        finally:
            log["open"] -= 1

    return gen()


async def settle() -> None:
    """Let every task on the loop run until it waits (loop turns, no clock)."""
    for _ in range(200):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_streams_read_ahead_are_bounded_in_number() -> None:
    log: dict[str, Any] = {"open": 0, "most_open": 0, "yielded": {}}
    gate = asyncio.Event()
    streams = [counted(f"s{i}", [b"x%d" % i] * 5, log, gate) for i in range(12)]
    merged = flat(interleave(streams, 2, ahead=2))
    got = [await anext(merged)]
    await settle()
    assert log["open"] == 4  # the 2 taken from and the next 2, each past its first item
    assert sorted(log["yielded"]) == ["s0", "s1", "s2", "s3"]
    gate.set()
    got += [item async for item in merged]
    pairs = [(2 * p, 2 * p + 1) for p in range(6)]
    assert got == [b"x%d" % i for pair in pairs for _ in range(5) for i in pair]
    assert log["most_open"] == 4  # never more
    assert log["open"] == 0


@pytest.mark.asyncio
async def test_streams_read_ahead_hold_no_more_bytes_than_allowed() -> None:
    log: dict[str, Any] = {"open": 0, "most_open": 0, "yielded": {}}
    sample = bytes(1000)
    streams = [counted(f"s{i}", [sample] * 40, log) for i in range(4)]
    merged = flat(interleave(streams, 1, ahead=3, max_bytes_ahead=2500))
    first = await anext(merged)
    await settle()
    # the one taken from fills its queue (32 samples, over the bound: it never waits); each one
    # read ahead holds its first sample and has read one more, which waits for room
    assert first == sample
    assert [log["yielded"][f"s{i}"] for i in (1, 2, 3)] == [2, 2, 2]
    rest = [item async for item in merged]
    assert len(rest) == 4 * 40 - 1
    assert log["open"] == 0

    log = {"open": 0, "most_open": 0, "yielded": {}}
    unbounded = flat(
        interleave([counted(f"s{i}", [sample] * 40, log) for i in range(4)], 1, ahead=3)
    )
    await anext(unbounded)
    await settle()
    # without a byte bound: a few samples each (4 queued, 1 in hand), not a reader's 32
    assert [log["yielded"][f"s{i}"] for i in (1, 2, 3)] == [5, 5, 5]
    await unbounded.aclose()
    assert log["open"] == 0


@pytest.mark.in_process
def test_a_loader_gives_the_shards_its_read_ahead_share(many: list[str]) -> None:
    src = tar_shards(many)
    assert src.max_bytes_ahead is None  # alone: bounded in number only
    with Loader(src, max_bytes_in_flight=64 << 20, collate=None):
        assert src.max_bytes_ahead == 32 << 20  # MemoryBudget.read_ahead_bytes


# -- over HTTP: requests ahead, failures at their place, nothing left behind -------------------------


class ShardServer:
    """The shards over HTTP, 64 KiB per write; `arrived[name]` is set (on the server's loop) when
    a request for `name` comes in; shard i may hold its last bytes until shard `i + 1` is asked."""

    def __init__(self, paths: list[str], hold_for_next: bool = False) -> None:
        self.data = {Path(p).name: Path(p).read_bytes() for p in paths}
        self.names = sorted(self.data)
        self.hold_for_next = hold_for_next
        self.next_seen: dict[str, bool] = {}
        app = web.Application()
        app.router.add_get("/{name}", self.handler)
        self.server = ServerThread(app, "test-shard-server")
        self.arrived = {name: asyncio.Event() for name in self.names}  # the server loop's only

    @property
    def urls(self) -> list[str]:
        return [f"{self.server.url}/{name}" for name in self.names]

    async def handler(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in self.data:
            raise web.HTTPNotFound()
        self.arrived[name].set()
        data = self.data[name]
        resp = web.StreamResponse()
        resp.content_length = len(data)
        await resp.prepare(request)
        for at in range(0, len(data) - 1, 1 << 16):
            await resp.write(data[at : min(at + (1 << 16), len(data) - 1)])
        i = self.names.index(name)
        if self.hold_for_next and i + 1 < len(self.names):
            nxt = self.arrived[self.names[i + 1]]
            with contextlib.suppress(TimeoutError):  # then next_seen says it did not come
                await asyncio.wait_for(nxt.wait(), 10)
            self.next_seen[name] = nxt.is_set()
        await resp.write(data[-1:])
        return resp

    def stop(self) -> None:
        self.server.stop()


def test_each_next_shard_is_requested_before_the_current_one_ends(tmp_path: Path) -> None:
    paths = write_bin_shards(tmp_path, 5, 8, size=20_000)
    server = ShardServer(paths, hold_for_next=True)
    try:
        got = keys_of(tar_shards(server.urls, shuffle=False, parallel=1, read_ahead=1))
        assert got == [f"s{s:03d}-{i:04d}" for s in range(5) for i in range(8)]
        # each shard's last byte went out only once the next shard's request had come in
        assert server.next_seen == {name: True for name in server.names[:-1]}
    finally:
        server.stop()


def test_a_shard_that_fails_while_read_ahead_fails_at_its_place(tmp_path: Path) -> None:
    paths = write_bin_shards(tmp_path, 4, 6, size=2000)
    server = ShardServer(paths)
    urls = server.urls
    urls.insert(2, f"{server.server.url}/missing.tar")
    truncated = tmp_path / "cut.tar"
    truncated.write_bytes(Path(paths[0]).read_bytes()[:5000])
    try:
        src = tar_shards([*urls, str(truncated)], shuffle=False, parallel=1, read_ahead=3)

        async def run() -> tuple[list[str], BaseException | None]:
            got: list[str] = []
            try:
                async for sample in src.samples(0):
                    got.append(sample["__key__"])
            except FetchError as exc:
                return got, exc
            finally:
                await src.aclose()
            return got, None

        got, error = asyncio.run(run())
        # all of the shards before it (read while it had failed already), then its error
        assert got == [f"s{s:03d}-{i:04d}" for s in range(2) for i in range(6)]
        assert isinstance(error, FetchError)
        assert "missing.tar" in str(error.key)
        # under skip: its error and the cut shard's each where their samples would have come
        with Loader(tar_shards([*urls, str(truncated)], shuffle=False, parallel=1, read_ahead=3),
                    collate=None, on_error="skip", max_skipped=None) as loader:  # fmt: skip
            keys = [s["__key__"] for s in loader]
            skipped = [reason for _, reason in loader.stats().skipped]
        whole = [f"s{s:03d}-{i:04d}" for s in range(4) for i in range(6)]
        assert keys[: len(whole)] == whole  # the shards in order, the cut one's head after them
        assert set(keys[len(whole) :]) <= {f"s000-{i:04d}" for i in range(6)}
        assert len(skipped) == 2
        assert "missing.tar" in skipped[0]
        assert "cut.tar" in skipped[1]
    finally:
        server.stop()


def test_an_early_break_leaves_no_task_and_no_connection(
    tmp_path: Path, wait_until: Callable[..., bool]
) -> None:
    paths = write_bin_shards(tmp_path, 8, 40, size=50_000)  # 2 MB each: more than a socket holds
    server = ShardServer(paths)
    try:
        src = tar_shards(server.urls, parallel=2, read_ahead=2)

        async def run() -> set[asyncio.Task[Any]]:
            stream = src.samples(0)
            await anext(stream)
            assert server.server.open_connections() >= 2
            await stream.aclose()
            left = asyncio.all_tasks() - {asyncio.current_task()}
            await src.aclose()
            return {t for t in left if not t.done()}

        assert asyncio.run(run()) == set()
        assert wait_until(lambda: server.server.open_connections() == 0)
        # through a Loader: break after the first batch, close
        with Loader(tar_shards(server.urls, read_ahead=2), batch_size=8, collate=None) as loader:
            for _batch in loader:
                break
        assert wait_until(lambda: server.server.open_connections() == 0)
    finally:
        server.stop()


# -- the shuffle buffer: starts early, grows, resumes exactly ----------------------------------------


@pytest.mark.asyncio
async def test_the_shuffle_buffer_starts_after_a_small_fill_and_grows() -> None:
    pulled = 0

    async def numbers() -> AsyncGenerator[list[int], None]:
        nonlocal pulled
        for i in range(5000):
            pulled += 1
            yield [i]

    out = flat(shuffled(numbers(), 1000, random.Random(1)))
    first = [await anext(out) for _ in range(64)]
    assert pulled == 100 + 2 * 63  # a fill of 100, then two read per one out
    rest = [i async for i in out]
    assert sorted(first + rest) == list(range(5000))
    whole = flat(shuffled(numbers(), 1000, random.Random(1), initial=1000))
    await anext(whole)
    assert pulled == 5000 + 1000  # the whole buffer first
    await whole.aclose()


def test_a_first_batch_needs_far_fewer_samples_read_than_the_buffer(many: list[str]) -> None:
    src = tar_shards(many, shuffle_buffer=600, seed=2)

    async def first_batch() -> tuple[int, list[str]]:
        stream = src.samples(0)
        try:
            keys = [(await anext(stream))["__key__"] for _ in range(64)]
            read = int(src.stats()["shard_samples"] or 0)
            return read, keys
        finally:
            await stream.aclose()
            await src.aclose()

    read, keys = asyncio.run(first_batch())
    assert len(set(keys)) == 64
    # 226 to mix, and what the 4 readers (2 + 2 ahead) hold in their queues: far from 600 + 63
    assert read < 450, read


def run_from(
    paths: list[str], state: dict[str, Any] | None, batches: int | None
) -> tuple[list[list[str]], dict[str, Any]]:
    src = tar_shards(paths, shuffle_buffer=400, seed=9, read_ahead=2)
    with Loader(src, batch_size=16, collate=None) as loader:
        if state is not None:
            loader.load_state_dict(state)
        got = []
        for batch in loader:
            got.append([s["__key__"] for s in batch])
            if len(got) == batches:
                break
        return got, loader.state_dict()


def test_resume_after_the_buffer_has_grown_is_exact(many: list[str]) -> None:
    whole, _ = run_from(many, None, None)
    assert sum(map(len, whole)) == 800
    # the buffer grows from 100 to 400 over its first 300 samples out: resume at sample 480
    first, state = run_from(many, None, 30)
    rest, _ = run_from(many, state, None)
    assert first + rest == whole


@pytest.mark.asyncio
@pytest.mark.parametrize("cut", [1, 3, 17, 1000])
async def test_the_merged_and_shuffled_order_does_not_depend_on_the_chunks(cut: int) -> None:
    def chunked(items: list[int], rng: random.Random) -> AsyncGenerator[list[int], None]:
        async def gen() -> AsyncGenerator[list[int], None]:
            at = 0
            while at < len(items):
                n = rng.randint(1, cut)
                yield items[at : at + n]
                at += n

        return gen()

    async def order(rng: random.Random | None) -> list[int]:
        streams = [list(range(s * 100, s * 100 + 40 + s)) for s in range(9)]
        if rng is None:
            inputs = [counted(f"s{i}", items, {"open": 0, "most_open": 0, "yielded": {}})
                      for i, items in enumerate(streams)]  # fmt: skip
        else:
            inputs = [chunked(items, rng) for items in streams]
        merged = interleave(inputs, 3, ahead=2)
        return [i async for chunk in shuffled(merged, 50, random.Random(7)) for i in chunk]

    one_by_one = await order(None)  # a chunk of one item each: the order item by item
    assert sorted(one_by_one) == sorted(
        i for s in range(9) for i in range(s * 100, s * 100 + 40 + s)
    )
    assert await order(random.Random(cut)) == one_by_one


@pytest.mark.asyncio
async def test_what_is_merged_before_a_stream_fails_comes_out_before_its_error() -> None:
    async def good() -> AsyncGenerator[list[str], None]:
        yield [f"a{i}" for i in range(10)]

    async def broken() -> AsyncGenerator[list[str], None]:
        yield ["b0", "b1", "b2"]
        raise OSError("cut")

    got: list[str] = []

    async def run() -> None:
        async for chunk in interleave([good(), broken()], 2):
            got.extend(chunk)

    with pytest.raises(OSError, match="cut"):
        await run()
    assert got == ["a0", "b0", "a1", "b1", "a2", "b2", "a3"]  # up to the broken stream's turn
