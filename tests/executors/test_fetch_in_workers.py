"""Fetch in the workers (`fetch_in_workers=True`): each process worker fetches on its own event loop.

Real worker processes, real HTTP on 127.0.0.1: the `origin` fixture, and a `SlowOrigin` here that
answers after a delay and records how many requests it held at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from aiohttp import web
from scripts.leakcheck import gone, shm_names
from support.faultproxy import Origin, ServerThread

import aioloader
from aioloader import FetchError, Loader, ProcessExecutor, WorkerDied
from aioloader._util import threads as _threads
from aioloader.sources import http

BODY = bytes(range(256)) * 128  # 32 KiB: in shared memory, not in the pipe


class SlowOrigin(ServerThread):
    """Serves BODY at every path after `delay` seconds; `peak` is the most requests held at once.
    After `hold(first, count)`, a request for "<i>.bin" with i >= `first` also waits until
    `release()`; `holding` is set once `count` of them wait."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.in_flight = self.peak = self.hits = 0
        self.holding = threading.Event()
        self._first: int | None = None
        self._count = self._held = 0
        self._gate: asyncio.Event | None = None
        app = web.Application()
        app.router.add_get("/{name:.*}", self._get)
        super().__init__(app, "test-slow-origin")

    def hold(self, first: int, count: int) -> None:
        async def gate() -> asyncio.Event:
            return asyncio.Event()

        self._gate, self._first, self._count = self.call(gate()), first, count

    def release(self) -> None:
        if self._gate is not None:
            self.loop.call_soon_threadsafe(self._gate.set)

    async def _get(self, request: web.Request) -> web.Response:
        self.in_flight += 1
        self.hits += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            name = request.match_info["name"].removesuffix(".bin")
            if self._gate is not None and self._first is not None and int(name) >= self._first:
                self._held += 1
                if self._held >= self._count:
                    self.holding.set()
                await self._gate.wait()
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        return web.Response(body=BODY)


@pytest.fixture
def slow() -> Iterator[SlowOrigin]:
    server = SlowOrigin(0.1)
    yield server
    server.stop()


def decode(raw: bytearray) -> tuple[int, int, torch.Tensor]:
    """Runs in a worker: its pid, the size, and a draw from the sample's generator."""
    return os.getpid(), len(raw), torch.rand(2, generator=aioloader.sample_generator())


def test_every_key_once_and_in_order(origin: Origin, objects: dict[str, bytes]) -> None:
    src = http(origin.url + "/", list(objects), concurrency=8)
    options: dict[str, Any] = {"executor": "process", "workers": 2, "fetch_in_workers": True}
    with Loader(src, batch_size=5, collate=None, concurrency=16, **options) as loader:
        got = [sample for batch in loader for sample in batch]
        pids = set(loader._stages.decoder.pids)  # type: ignore[attr-defined]
    assert got == list(objects.values())
    assert all(type(sample) is bytearray for sample in got)
    assert set(origin.hits.values()) == {1}
    assert len(origin.hits) == len(objects)
    assert src.stats()["requests"] == 0  # the parent's copy of the source fetched nothing
    assert all(gone(pid) for pid in pids)


def test_worker_loops_fetch_many_at_once(slow: SlowOrigin) -> None:
    keys = [f"{i}.bin" for i in range(128)]
    src = http(slow.url + "/", keys, concurrency=64)
    options: dict[str, Any] = {"executor": "process", "workers": 2, "fetch_in_workers": True}
    with Loader(src, concurrency=64, collate=None, **options) as loader:
        pool = loader._stages.decoder
        assert pool.async_depth == 32  # type: ignore[attr-defined]
        assert sum(len(sample) for sample in loader) == len(keys) * len(BODY)
        stats = pool.stats()  # type: ignore[attr-defined]
    # 128 requests of 100 ms each: one at a time per worker would hold 2; the loops hold dozens
    assert slow.peak >= 32, slow.peak
    assert slow.peak <= 64  # the loader's concurrency bounds them in all
    assert stats["async_tasks"] == len(keys)
    # one task per worker went first, until a result told the size: then every result came back
    # in shared memory (none pickled through a pipe), with a few hundred bytes per sample in the pipes
    assert stats["results_in_shm"] == len(keys)
    assert stats.get("results_pickled", 0) == 0
    assert stats["pipe_bytes_received"] < 400 * len(keys)


def test_decode_runs_in_the_workers_with_the_sample_seed(
    origin: Origin, objects: dict[str, bytes]
) -> None:
    keys = list(objects)[:12]
    src = http(origin.url + "/", keys)
    with Loader(src, decode=decode, batch_size=4, collate=None, seed=3) as here:
        expected = [sample for batch in here for sample in batch]
    src = http(origin.url + "/", keys)
    options: dict[str, Any] = {"executor": "process", "workers": 2, "fetch_in_workers": True}
    with Loader(src, decode=decode, batch_size=4, collate=None, seed=3, **options) as there:
        got = [sample for batch in there for sample in batch]
    assert {pid for pid, _, _ in got}.isdisjoint({os.getpid()})
    assert [size for _, size, _ in got] == [len(objects[k]) for k in keys]
    for (_, _, drawn), (_, _, want) in zip(got, expected, strict=True):
        assert torch.equal(drawn, want)  # the same numbers as the same sample decoded here


def test_a_fetch_error_in_a_worker_names_the_key(origin: Origin) -> None:
    src = http(origin.url + "/", ["obj/00000.bin", "missing.bin"], attempts=1)
    options: dict[str, Any] = {"executor": "process", "workers": 1, "fetch_in_workers": True}
    with Loader(src, collate=None, **options) as loader, pytest.raises(FetchError) as info:
        list(loader)
    assert info.value.key == "missing.bin"
    assert "404" in str(info.value)
    assert "missing.bin" in "\n".join(info.value.__notes__)


def fixed_shape(raw: bytearray) -> torch.Tensor:
    """Runs in a worker: one tensor of one shape per sample (so batch rows are written in place)."""
    return torch.frombuffer(raw, dtype=torch.uint8)[:64].float()


def test_batch_rows_do_not_hold_back_the_worker_loops(slow: SlowOrigin) -> None:
    keys = [f"{i}.bin" for i in range(128)]
    src = http(slow.url + "/", keys, concurrency=64)
    options: dict[str, Any] = {"executor": "process", "workers": 2, "fetch_in_workers": True}
    with Loader(src, decode=fixed_shape, batch_size=8, concurrency=64, **options) as loader:
        batches = list(loader)
        assert loader._stages.rows is not None  # rows in place: the default collate stacks
    assert [tuple(b.shape) for b in batches] == [(8, 64)] * 16
    assert all(torch.equal(b[0], torch.arange(64, dtype=torch.float32)) for b in batches)
    # the few-per-worker window of plain decodes does not apply to fetch-then-decode coroutines
    assert slow.peak >= 32, slow.peak


@pytest.mark.parametrize("restarts", [0, 1])
def test_a_worker_killed_mid_epoch(slow: SlowOrigin, restarts: int) -> None:
    keys = [f"{i}.bin" for i in range(96)]
    src = http(slow.url + "/", keys, concurrency=32)
    # the first batch's requests go through; the next 16 (on both workers: each task goes to the
    # one with fewer in flight) wait at the origin until the victim is dead, so the kill always
    # finds requests in flight on it, however slow the machine
    slow.hold(8, 16)
    with ProcessExecutor(2, max_worker_restarts=restarts) as pool:
        # both workers up before one is killed: a worker that dies while it starts fails the pool
        # (it cannot be told from a broken start), and where workers import a large torch (the
        # free-threaded venv's CUDA build) the first batch can come before the second is ready
        assert pool.wait_ready(timeout=60)
        loader = Loader(
            src, executor=pool, fetch_in_workers=True, concurrency=32, batch_size=8, collate=None
        )
        with loader:
            batches = iter(loader)
            delivered = len(next(batches))
            assert slow.holding.wait(60)
            victim = pool.pids[0]
            os.kill(victim, signal.SIGKILL)  # with requests in flight on it
            slow.release()
            if restarts:
                delivered += sum(len(batch) for batch in batches)
                assert delivered == len(keys)
                # replaced; its requests in flight (if the kill found any) retried on the new one
                assert pool.stats()["replaced"] == 1
                assert pool.stats()["restarts"] <= 1
            else:
                with pytest.raises(WorkerDied) as info:
                    for _ in batches:
                        pass
                assert info.value.pid == victim
                assert info.value.tasks
        assert victim not in pool.pids


def test_an_early_break_leaves_no_process_thread_or_shared_memory(
    slow: SlowOrigin, wait_until: Callable[..., bool]
) -> None:
    keys = [f"{i}.bin" for i in range(200)]
    src = http(slow.url + "/", keys, concurrency=32)
    options: dict[str, Any] = {"executor": "process", "workers": 2, "fetch_in_workers": True}
    with Loader(src, concurrency=32, batch_size=8, **options) as loader:
        for _ in loader:
            break
        pool = loader._stages.decoder
        pids = pool.pids  # type: ignore[attr-defined]
        assert slow.open_connections() > 0
    assert pool.closed  # type: ignore[attr-defined]
    assert all(gone(pid) for pid in pids)
    assert shm_names(os.getpid()) == []
    assert wait_until(lambda: slow.open_connections() == 0)


class EpochSource:
    """A source with per-epoch state, like tar shards."""

    def keys(self) -> list[int]:
        return [0]

    async def fetch(self, key: int) -> int:
        return key

    async def aclose(self) -> None:
        pass

    def set_epoch(self, epoch: int) -> None:
        pass


def test_arguments_are_checked_up_front(origin: Origin) -> None:
    src = http(origin.url + "/", ["a"])
    with pytest.raises(ValueError, match="fetch_in_workers=True needs executor"):
        Loader(src, executor="thread", fetch_in_workers=True)
    with pytest.raises(ValueError, match="fetch_in_workers=True needs executor"):
        Loader(src, executor="inline", fetch_in_workers=True)
    with Loader(src, fetch_in_workers=True, workers=1) as loader:  # the default: processes
        assert isinstance(loader._stages.decoder, ProcessExecutor)
    with pytest.raises(ValueError, match="int concurrency"):
        Loader(src, executor="process", concurrency="auto", fetch_in_workers=True)
    with pytest.raises(ValueError, match="per-epoch state"):
        Loader(EpochSource(), executor="process", fetch_in_workers=True)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Loader(src, executor="process", workers=0, fetch_in_workers=True)


def sleepy_fetch(key: int) -> tuple[int, int, str]:
    """A plain fetch that blocks (a read), then returns where it ran."""
    time.sleep(0.05)
    return key, os.getpid(), threading.current_thread().name


def stamp(raw: tuple[int, int, str]) -> tuple[int, int, str, int]:
    """A decode: the raw sample and the pid the decode ran in."""
    return (*raw, os.getpid())


def test_a_plain_fetch_runs_in_worker_threads_with_its_decode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a worker's fetch threads grow only while the machine has a core idle: the workers (forked
    # from this process) see one core idle whatever else runs on the machine
    monkeypatch.setattr(
        _threads, "idle_ticks", lambda: int(time.monotonic() * _threads.TICKS_PER_S)
    )
    with Loader(
        range(32), sleepy_fetch, decode=stamp, executor="process", workers=2, concurrency=16,
        fetch_in_workers=True, collate=None, batch_size=8,
    ) as loader:  # fmt: skip
        samples = [s for batch in loader for s in batch]
    assert [s[0] for s in samples] == list(range(32))
    pids = {s[1] for s in samples}
    assert len(pids) == 2
    assert os.getpid() not in pids
    assert all(s[1] == s[3] for s in samples)  # decoded where it was fetched
    assert len({s[2] for s in samples}) > 2  # several fetch threads: the calls blocked
    assert all(s[2].startswith("aioloader-fetch") for s in samples)
