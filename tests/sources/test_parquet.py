"""Parquet: rows equal to pyarrow's own reading (disk, HTTP, S3), only the chosen columns fetched,
sharding and resume (exact and elastic), errors naming file and row group, early break."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web
from support.azurite import AzuriteServer
from support.faultproxy import Fault, FaultProxy, Origin
from support.gcsserver import GcsServer
from support.parquetfiles import COLUMNS, FILES, expected, plain, rows_of, write_files
from support.s3server import SeaweedServer

from aioloader import FetchError, Loader
from aioloader._util.ranges import Ranges
from aioloader.sources import Parquet, ParquetError, parquet, tar_shards
from aioloader.sources.formats.options import ShardOptions
from aioloader.sources.formats.parquet_bytes import FOOTER_GUESS


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return write_files(tmp_path_factory.mktemp("parquet"))


@pytest.mark.parametrize("columns", [None, ["id", "tokens", "image", "name"], ["score"]])
def test_rows_equal_pyarrow_read_table(files: list[str], columns: list[str] | None) -> None:
    got = rows_of(parquet(files, columns, shuffle=False))
    assert got == expected(files, columns)
    sample = got[1]
    assert set(sample) == set(columns or COLUMNS)


def test_list_columns_are_numpy_arrays_and_binary_bytes(files: list[str]) -> None:
    with Loader(parquet(files[:1], ["tokens", "image"], shuffle=False), collate=None) as ld:
        samples = list(ld)
    assert isinstance(samples[1]["tokens"], np.ndarray)
    assert samples[0]["tokens"] is None
    assert isinstance(samples[1]["image"], bytes)
    assert samples[0]["image"] is None


def test_shuffled_epochs_hold_every_row_once_in_new_orders(files: list[str]) -> None:
    source = parquet(files, ["id", "label"], shuffle_buffer=50, seed=5)
    with Loader(source, batch_size=None, collate=None) as ld:
        first, second = [[s["id"] for s in ld] for _ in range(2)]
    n = sum(f[1] for f in FILES)
    assert sorted(first) == sorted(second) == list(range(n))
    assert first != second
    assert first != sorted(first)


def test_record_batches(files: list[str]) -> None:
    source = parquet(files, ["id", "tokens", "name"], rows_per_sample=64, shuffle=False)
    with Loader(source, batch_size=None, collate=None) as ld:
        batches = list(ld)
    assert all(isinstance(b, pa.RecordBatch) for b in batches)
    assert [b.num_rows for b in batches[:-1]] == [64] * (len(batches) - 1)
    assert pa.Table.from_batches(batches).to_pylist() == expected(files, ["id", "tokens", "name"])


def test_shuffled_record_batches_hold_every_row(files: list[str]) -> None:
    source = parquet(files, ["id"], rows_per_sample=50, shuffle_buffer=80, seed=1)
    with Loader(source, batch_size=None, collate=None) as ld:
        ids = [i for b in ld for i in b.column("id").to_pylist()]
    assert sorted(ids) == list(range(sum(f[1] for f in FILES)))


class RangeOrigin(Origin):
    """An `Origin` that records the byte ranges it served: (name, first byte, bytes)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__(objects)
        self.served: list[tuple[str, int, int]] = []

    async def _get(self, request: web.Request) -> web.StreamResponse:
        resp = await super()._get(request)
        if isinstance(resp, web.Response) and resp.status == 206 and resp.body is not None:
            first = int(resp.headers["Content-Range"].split()[1].split("-")[0])
            self.served.append((request.match_info["name"], first, len(resp.body)))  # type: ignore[arg-type]
        return resp


@pytest.fixture
def served(files: list[str]) -> Iterator[tuple[RangeOrigin, FaultProxy]]:
    origin = RangeOrigin({Path(p).name: Path(p).read_bytes() for p in files})
    proxy = FaultProxy(origin.url)
    yield origin, proxy
    proxy.stop()
    origin.stop()


def chunk_bytes(path: str, columns: list[str], before: int) -> int:
    """The bytes of `columns`' column chunks in `path` that start before byte `before`."""
    md = pq.read_metadata(path)
    total = 0
    for g in range(md.num_row_groups):
        for j in range(md.num_columns):
            col = md.row_group(g).column(j)
            start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
            if col.path_in_schema.split(".")[0] in columns and start < before:
                total += col.total_compressed_size
    return total


def test_http_fetches_only_the_chosen_columns(
    files: list[str], served: tuple[RangeOrigin, FaultProxy]
) -> None:
    origin, proxy = served
    proxy.plan = lambda path, n: Fault("503") if n == 2 else None  # one retry per file
    columns = ["id", "name"]  # "id" first, "name" after four columns not read
    urls = [f"{proxy.url}/{Path(p).name}" for p in files]
    got = rows_of(parquet(urls, columns, shuffle=False, http_options={"backoff": 0.01}))
    assert got == expected(files, columns)
    per_file = collections.defaultdict(int)
    for name, _first, n in origin.served:
        per_file[name] += n
    for path in files:
        size = Path(path).stat().st_size
        tail = min(size, FOOTER_GUESS)  # read with the footer: the chunks in it are not asked for
        chunks = chunk_bytes(path, columns, size - tail)
        assert per_file[Path(path).name] == tail + chunks < size / 2
        assert chunks > 0
    assert proxy.injected["503"] == len(files)


def test_adjacent_columns_are_one_request(
    files: list[str], served: tuple[RangeOrigin, FaultProxy]
) -> None:
    origin, _ = served
    rows_of(parquet([f"{origin.url}/a.parquet"], ["id", "score", "label"], shuffle=False))
    size = Path(files[0]).stat().st_size
    md = pq.read_metadata(files[0])
    far = [g for g in range(md.num_row_groups) if md.row_group(g).column(2).data_page_offset
           < size - FOOTER_GUESS]  # fmt: skip
    assert origin.hits["a.parquet"] == 1 + len(far)
    assert len(far) > 3


def test_long_footer_takes_a_second_request(tmp_path: Path) -> None:
    table = pa.table({f"column_{i:04d}_{'x' * 40}": [i] for i in range(1500)})
    path = tmp_path / "wide.parquet"
    pq.write_table(table, path)
    footer_len = int.from_bytes(path.read_bytes()[-8:-4], "little")
    assert footer_len > FOOTER_GUESS
    origin = RangeOrigin({"wide.parquet": path.read_bytes()})
    try:
        got = rows_of(parquet([f"{origin.url}/wide.parquet"], ["column_0007_" + "x" * 40]))
        assert got == [{"column_0007_" + "x" * 40: 7}]
        assert len(origin.served) == 3  # the tail, the rest of the footer, the one column chunk
    finally:
        origin.stop()


def test_local_footers_are_read_in_the_calling_thread(
    tmp_path: Path, files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a few local files: no loop and no thread of their own (they cost more than the reads);
    # a footer longer than the first read takes a second one there too
    table = pa.table({f"column_{i:04d}_{'x' * 40}": [i] for i in range(1500)})
    wide = tmp_path / "wide.parquet"
    pq.write_table(table, wide)
    assert int.from_bytes(wide.read_bytes()[-8:-4], "little") > FOOTER_GUESS

    def no_loop(coro: Any, name: str) -> Any:
        coro.close()
        raise AssertionError(f"a loop of its own ({name}) for local footers")

    monkeypatch.setattr("aioloader.sources.formats.parquet.run_to_end", no_loop)
    before = set(threading.enumerate())
    source = parquet(files, ["id"])
    column = "column_0007_" + "x" * 40
    long_footer = parquet(str(wide), [column])
    assert set(threading.enumerate()) == before
    assert source.num_rows == sum(pq.read_metadata(f).num_rows for f in files)
    assert long_footer.metas[0].metadata.num_columns == 1500
    assert rows_of(long_footer) == [{column: 7}]


@pytest.mark.in_process
def test_sources_on_one_loop_share_its_decode_turns(
    files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a mix of two Parquet sources decodes one row group per core at once, not one per core
    # each: on a core each, the first row group of each would wait for the other's read ahead
    from aioloader import mix
    from aioloader.sources.formats import parquet as module

    decode, lock = module.decode_row_group, threading.Lock()
    inside, most = [0], [0]

    def counted(*args: Any) -> Any:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            time.sleep(0.02)  # (widens the window in which a second decode could come in)
            return decode(*args)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(module, "decode_row_group", counted)
    monkeypatch.setattr(module, "cores", lambda: 1)
    both = mix({"a": parquet(files[:2], ["id"]), "b": parquet(files[2:], ["id"])}, [1, 1])
    with Loader(both, batch_size=None, collate=None) as loader:
        assert len(list(loader)) > 0
    assert most[0] == 1


@pytest.mark.parametrize("engine", ["aiohttp", "fast"])
@pytest.mark.in_process
def test_s3(seaweed: SeaweedServer, files: list[str], engine: str) -> None:
    # the fast engine receives the chunks into recycled buffers of a few sizes: two epochs, so
    # the second's land in buffers the first's used
    urls = []
    for path in files:
        seaweed.put(f"parquet/{Path(path).name}", Path(path).read_bytes())
        urls.append(f"s3://{seaweed.bucket}/parquet/{Path(path).name}")
    options = {"endpoint_url": seaweed.endpoint, "credentials": seaweed.credentials,
               "engine": engine}  # fmt: skip
    columns = ["id", "tokens", "image"]
    source = parquet(urls, columns, shuffle=False, s3_options=options)
    with Loader(source, batch_size=None, collate=None) as ld:
        for _ in range(2):
            assert [plain(s) for s in ld] == expected(files, columns)
    assert source.stats()["requests"] > len(files)  # footers, then column chunks


# -- errors and bounds -------------------------------------------------------------------------------


def test_corrupt_footer_names_the_file(tmp_path: Path, files: list[str]) -> None:
    data = bytearray(Path(files[1]).read_bytes())
    data[-40:-8] = b"\xff" * 32
    bad = tmp_path / "bad-footer.parquet"
    bad.write_bytes(bytes(data))
    with pytest.raises(ParquetError, match=r"bad-footer\.parquet: corrupt footer") as info:
        parquet([files[0], str(bad)])
    assert info.value.row_group is None
    assert info.value.url == str(bad)
    (tmp_path / "short.parquet").write_bytes(b"PAR1")
    with pytest.raises(ParquetError, match=r"short\.parquet: not a Parquet file"):
        parquet(str(tmp_path / "short.parquet"))


def test_corrupt_page_names_file_and_row_group(tmp_path: Path, files: list[str]) -> None:
    data = bytearray(Path(files[0]).read_bytes())
    col = pq.read_metadata(files[0]).row_group(3).column(0)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data[start : start + 24] = b"\xff" * 24  # the first page header of row group 3's "id"
    bad = tmp_path / "bad-page.parquet"
    bad.write_bytes(bytes(data))
    with Loader(parquet(str(bad), ["id", "label"], shuffle=False), collate=None) as ld:
        got: list[Any] = []
        with pytest.raises(
            ParquetError, match=r"bad-page.parquet: row group 3 does not decode"
        ) as e:
            got.extend(ld)
    assert e.value.row_group == 3
    assert isinstance(e.value, FetchError)
    assert [s["id"] for s in got] == list(range(3 * 64))
    with Loader(parquet(str(bad), ["label"], shuffle=False), collate=None) as ld:
        assert len(list(ld)) == 500  # the broken column is not read


def test_bad_arguments_are_named(files: list[str]) -> None:
    with pytest.raises(ValueError, match=r"columns: 'nope' is not a column of .*a\.parquet"):
        parquet(files, ["id", "nope"])
    with pytest.raises(TypeError, match="columns"):
        parquet(files, "id")
    with pytest.raises(ValueError, match="rows_per_sample"):
        parquet(files, rows_per_sample=0)
    with pytest.raises(ValueError, match="shuffle_buffer"):
        parquet(files, shuffle=False, shuffle_buffer=10)
    with pytest.raises(ValueError, match=r"shuffle=True: .*\(its row-group order every epoch"):
        Loader(parquet(files), shuffle=True)
    with pytest.raises(ParquetError, match=r"missing\.parquet"):
        parquet([*files, str(Path(files[0]).with_name("missing.parquet"))])


@pytest.mark.in_process
def test_row_groups_held_stay_bounded(files: list[str]) -> None:
    source = parquet(files[:1], ["id"], shuffle=False, row_groups_in_flight=2)
    peak = 0
    for _ in source.refs(0, source.share(Ranges())):  # the order alone (no loop: nothing read)
        peak = max(peak, len(source._live))
    assert peak == 1 + 2  # the row group being handed out and two read ahead
    assert source._live == {}

    async def watch(ref: Any) -> Any:
        nonlocal peak
        peak = max(peak, len(source._live))
        return await source.fetch(ref)

    peak = 0
    with Loader(source, watch, batch_size=4, collate=None, concurrency=8) as ld:
        assert sum(len(b) for b in ld) == 500
    # and the one or two row groups that the samples in flight (8 fetches, 2 batches) come from
    assert 3 <= peak <= 2 + 3
    assert source._live == {}


def test_row_groups_are_read_ahead_in_bursts(files: list[str]) -> None:
    # Once a quarter of those read ahead are reached, a quarter goes out at once: a server
    # spends less per request on requests that come together (see `Ahead.reach`).
    source = parquet(files, ["id"], shuffle=False, row_groups_in_flight=8)
    groups = len(source.row_groups)
    assert groups >= 16
    steps, seen = [], set()
    for _ in source.refs(0, source.share(Ranges())):  # the order alone (no loop: nothing read)
        new = set(source._live) - seen
        seen |= new
        if new:
            steps.append(len(new))
    assert sum(steps) == groups
    assert steps[0] == 1 + 8  # the first row group and eight read ahead
    assert set(steps[1:-1]) == {2}  # then two at a time, not one each time one is done
    assert steps[-1] <= 2
    assert source._live == {}


class OrderedOrigin(RangeOrigin):
    """A `RangeOrigin` that also logs, in order, each range asked for and each sent whole:
    ("ask" or "sent", first byte); with `hold_first`, the first range asked for is sent once
    another is asked for (or after half a second, if none is)."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        super().__init__(objects)
        self.log: list[tuple[str, int]] = []
        self.hold_first = False
        self.asked = asyncio.Event()
        self.logged = threading.Condition()  # told of each ("sent", first) logged

    def wait_logged(self, entry: tuple[str, int]) -> None:
        """Until `entry` is in the log (its server logs it on its own thread)."""
        with self.logged:
            assert self.logged.wait_for(lambda: entry in self.log, 10), (entry, self.log)

    async def _get(self, request: web.Request) -> web.StreamResponse:
        first = int(request.headers.get("Range", "bytes=0-").split("=")[1].split("-")[0] or 0)
        self.log.append(("ask", first))
        self.asked.set()
        if self.hold_first and len(self.log) == 1:  # the first: sent once another is asked for
            self.asked.clear()
            with contextlib.suppress(TimeoutError):  # (or, when none is, after a while)
                await asyncio.wait_for(self.asked.wait(), 0.5)
        resp = await super()._get(request)
        await resp.prepare(request)
        await resp.write_eof()  # sent: the client has all of it in its socket
        with self.logged:
            self.log.append(("sent", first))
            self.logged.notify_all()
        return resp


def test_a_remote_walks_first_row_group_is_read_before_those_read_ahead(
    files: list[str],
) -> None:
    # Fetched side by side, the first row group's bytes came in with every read ahead's (0.5 s
    # on the 20 ms store of benchmarks/tokens.py --store, where it alone takes 40 ms): the
    # first batch waits for it alone, and the reads ahead go out together once it is read.
    origin = OrderedOrigin({Path(p).name: Path(p).read_bytes() for p in files})
    try:
        source = parquet([f"{origin.url}/a.parquet"], ["id"], shuffle=False,
                         row_groups_in_flight=4)  # fmt: skip
        footer = [first for kind, first in origin.log if kind == "ask"]
        assert len(footer) == 1
        origin.wait_logged(("sent", footer[0]))  # its server may log it after the client has it
        origin.log.clear()
        origin.hold_first = True
        with Loader(source, batch_size=None, collate=None) as ld:
            got = [s["id"] for s in ld]
        assert got == [r["id"] for r in expected(files[:1], ["id"])]
        log = origin.log
        lead = log[0]
        assert lead[0] == "ask"
        assert log[1] == ("sent", lead[1])  # nothing else asked for while it was sent
        assert len(log) > 4  # (and the reads ahead after it)
    finally:
        origin.stop()


@pytest.mark.in_process
def test_a_remote_walks_first_row_group_that_fails_fails_the_loader_and_no_read_waits_on(
    tmp_path: Path, files: list[str]
) -> None:
    # The reads ahead wait for the first row group's read: its failure ends the wait too, the
    # error names the file and row group, and the loader closes with nothing left running.
    data = bytearray(Path(files[0]).read_bytes())
    col = pq.read_metadata(files[0]).row_group(0).column(0)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    data[start : start + 24] = b"\xff" * 24  # the first page header of row group 0's "id"
    origin = OrderedOrigin({"bad.parquet": bytes(data)})
    try:
        source = parquet([f"{origin.url}/bad.parquet"], ["id"], shuffle=False,
                         row_groups_in_flight=4)  # fmt: skip
        before = {t.name for t in threading.enumerate()}
        with (
            Loader(source, batch_size=None, collate=None) as ld,
            pytest.raises(ParquetError, match=r"bad.parquet: row group 0 does not decode"),
        ):
            list(ld)
        assert source._live == {}
        left = {t.name for t in threading.enumerate()} - before
        assert not [name for name in left if name.startswith("aioloader")]
    finally:
        origin.stop()


def test_early_break_and_cancel_leave_nothing_running(
    files: list[str], loop_tasks_left: Callable[..., set[Any]]
) -> None:
    source = parquet(files, ["id", "extra"], shuffle_buffer=20)
    with Loader(source, batch_size=8, collate=None) as ld:
        for i, _ in enumerate(ld):
            if i == 3:
                break
        assert len(list(ld)) == len(ld)  # the next epoch runs whole
    assert source._live == {}

    async def cancel_mid_read() -> None:
        src = parquet(files, ["id", "extra"])
        first = asyncio.Event()
        task = asyncio.create_task(_stuck_after_one(src, first))
        await first.wait()  # row groups are being read ahead now (unless all were read already)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await src.aclose()
        await asyncio.sleep(0)
        assert not [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert src._live == {}

    asyncio.run(cancel_mid_read())


async def _stuck_after_one(source: Parquet, first: asyncio.Event) -> None:
    """Take one row, then wait forever (a consumer stuck in its step), closing the rows if ended."""
    async with contextlib.aclosing(source.samples(0)) as rows:
        async for _ in rows:
            first.set()
            await asyncio.Event().wait()


def test_gs_and_az(gcs_server: GcsServer, azurite: AzuriteServer, files: list[str]) -> None:
    # the same files from fake-gcs-server and Azurite: each store's options reach its source
    columns = ["id", "score", "name"]
    names = [Path(path).name for path in files]
    for name, path in zip(names, files, strict=True):
        gcs_server.put(f"parquet/{name}", Path(path).read_bytes())
        azurite.put(f"parquet/{name}", Path(path).read_bytes())
    gs = parquet([f"gs://{gcs_server.bucket}/parquet/{n}" for n in names], columns, shuffle=False,
                 gcs_options={"endpoint_url": gcs_server.endpoint, "anonymous": True})  # fmt: skip
    assert rows_of(gs) == expected(files, columns)
    az = parquet([f"az://{azurite.container}/parquet/{n}" for n in names], columns, shuffle=False,
                 azure_options={"connection_string": azurite.connection_string()})  # fmt: skip
    assert rows_of(az) == expected(files, columns)
    assert az.stats()["requests"] > len(files)  # footers, then column chunks


@pytest.mark.in_process
def test_next_epochs_first_row_groups_are_read_while_an_epoch_ends(files: list[str]) -> None:
    """From the second epoch on, the next epoch's first row groups are read before it begins, and
    that epoch uses them (each of its row groups read once); the batches are those of a source
    that never reads early, epoch after epoch, also when another event loop iterates next."""

    def epochs(source: Parquet, n: int) -> list[list[list[int]]]:
        with Loader(source, batch_size=16, collate=None, seed=3) as ld:
            return [[[int(s["id"]) for s in b] for b in ld] for _ in range(n)]

    groups = 8  # files[0]: 500 rows in row groups of 64
    want = epochs(parquet(files[:1], ["id"], row_groups_in_flight=2), 4)
    source = parquet(files[:1], ["id"], row_groups_in_flight=2)
    now = [0]
    # (the epoch a row group is read for, the row group, the epoch running when it was asked for)
    loads: list[tuple[int, int, int]] = []
    load = source._load

    def logged(group: Any) -> Any:
        early = source._early.get(group.index) is group
        loads.append((source._early_for if early else now[0], group.index, now[0]))
        return load(group)

    source._load = logged  # type: ignore[method-assign]
    got: list[list[list[int]]] = []
    with Loader(source, batch_size=16, collate=None, seed=3) as ld:
        for epoch in range(3):
            now[0] = epoch
            got.append([[int(s["id"]) for s in b] for b in ld])
            if epoch == 0:  # the first epoch does not read ahead of the next
                assert all(e == 0 for e, _, _ in loads)
        for epoch in range(3):
            read = collections.Counter(g for e, g, _ in loads if e == epoch)
            assert set(read.values()) == {1}, epoch  # none read twice for one epoch
            # all read for it, but a row group the last epoch still held when it read early
            assert len(read) >= groups - 2, epoch
        assert [g for e, g, at in loads if e == 2 and at == 1]  # read early for epoch 2
        assert 1 <= len([g for e, g, _ in loads if e == 3]) <= 2  # row_groups_in_flight at most

        async def fourth() -> list[list[int]]:  # another loop: the early reads are not its
            now[0] = 3
            return [[int(s["id"]) for s in b] async for b in ld]

        got.append(asyncio.run(fourth()))
    assert got == want
    assert sorted(i for b in got[3] for i in b) == list(range(500))


def test_direct_iteration_leaves_no_thread_behind(files: list[str]) -> None:
    """`async for` over the source under asyncio.run: its decode threads end with the loop."""
    import threading

    before = set(threading.enumerate())

    async def main() -> int:
        return sum([1 async for _ in parquet(files[:2], ["id"])])

    assert asyncio.run(main()) == 500 + 230
    assert set(threading.enumerate()) - before == set()


def test_tar_shards_and_parquet_take_the_shared_arguments_with_the_same_defaults() -> None:
    shared = {f.name: f.default for f in dataclasses.fields(ShardOptions)}
    for function in (tar_shards, parquet):
        params = inspect.signature(function).parameters
        assert {name: params[name].default for name in shared} == shared, function.__name__


def test_parquet_takes_the_shared_arguments_one_by_one_or_as_one_object(files: list[str]) -> None:
    one_by_one = Parquet(files, ["id"], rank=1, world_size=2, seed=5)
    together = Parquet(files, ["id"], options=ShardOptions(rank=1, world_size=2, seed=5))
    assert one_by_one.options == together.options == parquet(files, ["id"], rank=1, world_size=2,
                                                        seed=5).options  # fmt: skip
    assert (one_by_one.slot, one_by_one.slots) == (together.slot, together.slots) == (1, 2)
    assert list(one_by_one.epoch_order(1)) == list(together.epoch_order(1))
    with pytest.raises(ValueError, match="shuffle_buffer=4 mixes rows"):
        parquet(files, shuffle=False, shuffle_buffer=4)
