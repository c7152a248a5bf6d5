"""torch's contract with a user's dataset, kept by `aioloader.DataLoader` with default arguments.

torch's workers call `__getitem__` one at a time, each on its own copy of the dataset; datasets
written for torch rely on it (a handle opened lazily once per worker). Here, the datasets a torch
user writes that way, at num_workers 0 and 2, give torch's samples; and every batch sampler torch
accepts gives torch's batches, whatever their sizes.
"""

from __future__ import annotations

import http.client
import http.server
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import Dataset

from aioloader import DataLoader

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

N = 256
WAIT_S = 0.003  # a network filesystem's latency


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file of N records of 4 KiB, record i holding i."""
    path = tmp_path_factory.mktemp("contract") / "records.bin"
    path.write_bytes(b"".join(i.to_bytes(4, "little") * 1024 for i in range(N)))
    return path


class SeekWaitRead(Dataset[int]):
    """One file handle per worker, opened on first use: seek, wait (or read, then wait), read."""

    def __init__(self, path: Path, wait_after: bool = False) -> None:
        self.path, self.wait_after = path, wait_after
        self.f: Any = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        if self.f is None:
            self.f = open(self.path, "rb")  # noqa: SIM115 - kept open, as users do
        self.f.seek(i * 4096)
        if not self.wait_after:
            time.sleep(WAIT_S)
        record = self.f.read(4096)
        if self.wait_after:
            time.sleep(WAIT_S)  # a second lookup
        return int.from_bytes(record[:4], "little")

    def __del__(self) -> None:  # (the tests run with ResourceWarning as an error)
        if self.f is not None:
            self.f.close()


class OneConnection(Dataset[int]):
    """One `http.client.HTTPConnection` per worker, a GET per sample."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn: http.client.HTTPConnection | None = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        self.conn.request("GET", f"/{i}")
        return int(self.conn.getresponse().read())

    def __del__(self) -> None:
        if self.conn is not None:
            self.conn.close()


class SqliteRows(Dataset[int]):
    """One sqlite3 connection per worker (bound to the thread that opened it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db: sqlite3.Connection | None = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> int:
        if self.db is None:
            self.db = sqlite3.connect(self.path)
        time.sleep(WAIT_S)
        (value,) = self.db.execute("SELECT v FROM t WHERE k = ?", (i,)).fetchone()
        return int(value)

    def __del__(self) -> None:
        if self.db is not None:
            self.db.close()


class _Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: one connection serves a worker's GETs
    wbufsize = 1 << 16  # the head and body in one write (no delayed ACK between them)
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        time.sleep(WAIT_S)
        body = self.path.lstrip("/").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="echo", daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def sqlite_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("contract") / "rows.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v INTEGER)")
        db.executemany("INSERT INTO t VALUES (?, ?)", [(i, i) for i in range(N)])
    return path


def _dataset(kind: str, records: Path, port: int, sqlite_path: Path) -> Dataset[int]:
    if kind == "seek-wait-read":
        return SeekWaitRead(records)
    if kind == "read-then-wait":
        return SeekWaitRead(records, wait_after=True)
    if kind == "http-connection":
        return OneConnection(port)
    return SqliteRows(sqlite_path)


def _order() -> list[int]:
    return torch.randperm(N, generator=torch.Generator().manual_seed(0)).tolist()


def _samples(loader: Any) -> list[int]:
    with_close = getattr(loader, "close", None)
    try:
        return [int(x) for batch in loader for x in batch]
    finally:
        if with_close is not None:
            with_close()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["seek-wait-read", "read-then-wait", "http-connection", "sqlite3"])
def test_datasets_that_rely_on_one_call_at_a_time_get_torchs_samples(
    kind: str, workers: int, records: Path, echo_port: int, sqlite_path: Path
) -> None:
    order = _order()
    dataset = _dataset(kind, records, echo_port, sqlite_path)
    ours = _samples(DataLoader(dataset, batch_size=32, sampler=order, num_workers=workers))
    assert ours == order  # every sample, and each the dataset's own
    if workers == 2 and kind == "seek-wait-read":  # torch gives the same (the dataset is right)
        fresh = _dataset(kind, records, echo_port, sqlite_path)
        assert (
            _samples(TorchDataLoader(fresh, batch_size=32, sampler=order, num_workers=2)) == order
        )


class Tagged(SeekWaitRead):
    """Each sample says which object and thread read it."""

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        value = super().__getitem__(i)
        return torch.tensor([value, id(self) % 2**31, threading.get_ident() % 2**31])


def test_threads_in_a_worker_read_copies_of_their_own(records: Path) -> None:
    """With threads asked for, each read thread reads its own copy (no two threads in one object),
    so the samples stay right; the reads still overlap (more than one copy served a batch)."""
    order = _order()
    with DataLoader(
        Tagged(records), batch_size=32, sampler=order, num_workers=1, threads_per_worker=4,
        worker_mode="process",
    ) as loader:  # fmt: skip
        batches = list(loader)
    rows = torch.cat(batches)
    assert rows[:, 0].tolist() == order
    readers: dict[int, set[int]] = {}
    for _, obj, thread in rows.tolist():
        readers.setdefault(obj, set()).add(thread)
    assert len(readers) > 1  # the reads overlapped, each on a copy
    assert all(len(threads) == 1 for threads in readers.values())  # a copy, one thread


class Entered(Dataset[int]):
    """Counts the threads inside `__getitem__` at once; `thread_safe` as the class says."""

    def __init__(self) -> None:
        self.inside = self.most = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.002)
        with self.lock:
            self.inside -= 1
        return i

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, lock=threading.Lock())


class SaysThreadSafe(Entered):
    thread_safe = True


@pytest.mark.parametrize("mode", ["for", "async for", "thread workers"])
def test_in_the_main_process_one_call_at_a_time_unless_thread_safe(mode: str) -> None:
    for cls, most in ((Entered, 1), (SaysThreadSafe, None)):
        dataset = cls()
        kwargs: dict[str, Any] = {"batch_size": 16}
        if mode == "thread workers":
            kwargs.update(num_workers=2, worker_mode="thread")
        with DataLoader(dataset, **kwargs) as loader:
            if mode == "async for":

                async def read(loader: Any = loader) -> list[Any]:
                    return [b async for b in loader]

                import asyncio

                got = asyncio.run(read())
            else:
                got = list(loader)
        assert torch.cat(got).tolist() == list(range(64))
        if most is not None:  # (threads as workers read copies: the dataset itself, not at all)
            assert dataset.most <= most
        elif mode != "thread workers":
            assert dataset.most > 1  # declared thread-safe: calls overlap


# -- batch samplers of every shape ----------------------------------------------------------------


class Bucketing:
    """A length-bucketing batch sampler: batches of differing sizes."""

    sizes = (8, 16, 32, 24, 40, 30, 50)

    def __iter__(self) -> Iterator[list[int]]:
        start = 0
        for size in self.sizes:
            yield list(range(start, start + size))
            start += size

    def __len__(self) -> int:
        return len(self.sizes)


class FromGenerator:
    """An iterable whose batches come from a generator."""

    def __iter__(self) -> Iterator[list[int]]:
        yield from ([i, i + 1, i + 2][: 1 + i % 3] for i in range(0, 60, 3))


class Squares(Dataset[int]):
    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> int:
        if i == 77:
            raise KeyError(f"sample {i} is missing")
        return i * i


SAMPLERS = {
    "bucketing": Bucketing,
    "short last batch": lambda: [list(range(k, min(k + 32, 100))) for k in range(0, 100, 32)],
    "generator-backed": FromGenerator,
    "error in one batch": lambda: [[1, 2], [76, 77, 78], [3]],
}


def _outcomes(loader: Any) -> list[Any]:
    """Each batch as a list, or the error a `next()` raised in its place."""
    out: list[Any] = []
    it = iter(loader)
    while True:
        try:
            out.append(next(it).tolist())
        except StopIteration:
            return out
        except KeyError as exc:
            out.append(f"KeyError: {exc.args[0]}")


async def _aoutcomes(loader: Any) -> list[Any]:
    out: list[Any] = []
    it = aiter(loader)
    while True:
        try:
            out.append((await anext(it)).tolist())
        except StopAsyncIteration:
            return out
        except KeyError as exc:
            out.append(f"KeyError: {exc.args[0]}")


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
def test_batch_samplers_of_any_size_give_torchs_batches(sampler: str, workers: int) -> None:
    expected = _outcomes(TorchDataLoader(Squares(), batch_sampler=SAMPLERS[sampler]()))
    with DataLoader(Squares(), batch_sampler=SAMPLERS[sampler](), num_workers=workers) as ours:
        assert _outcomes(ours) == expected
    if workers == 0:  # `async for` goes through the pipeline, one read at a time
        import asyncio

        with DataLoader(Squares(), batch_sampler=SAMPLERS[sampler]()) as ours:
            assert asyncio.run(_aoutcomes(ours)) == expected
