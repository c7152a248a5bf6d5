"""`Loader(beside=True)`: the pipeline in a process of its own beside the trainer (`_pipeline/beside.py`).

Seen from the test's process, as a trainer sees it: the batches are those the in-process loader
gives, made in another process and mapped out of shared memory; a saved state is as of the last
batch handed over; errors, timeouts, a worker's death, early breaks and closing behave as they do
in-process, and nothing is left behind.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from scripts.leakcheck import census, left_behind_after, warm_up
from support.fakecuda import FakeBackend
from support.fakes import Gate

from aioloader import Loader, LoaderTimeout, ProcessExecutor, WorkerDied
from aioloader._loader import BesideLoader
from aioloader._pipeline.beside import Beside
from aioloader._pipeline.transfer import DeviceStage
from aioloader._util.threads import LOADER_NICE

N = 48
BATCH = 4


def read(key: int) -> torch.Tensor:
    """A sample that says which process made it: (key, pid)."""
    return torch.tensor([key, os.getpid()])


async def aread(key: int) -> torch.Tensor:
    await asyncio.sleep(0)
    return read(key)


def keys_of(batches: list[Any]) -> list[int]:
    return [int(k) for batch in batches for k in batch[:, 0]]


def reference(epochs: int = 2, **kwargs: Any) -> list[list[int]]:
    """Each epoch's keys as the in-process loader gives them."""
    with Loader(range(N), read, batch_size=BATCH, beside=False, **kwargs) as loader:
        return [keys_of(list(loader)) for _ in range(epochs)]


@pytest.mark.parametrize("fetch", [read, aread])
def test_batches_are_the_in_process_loaders_made_in_another_process(fetch: Any) -> None:
    want = reference(shuffle=True, seed=3)
    with Loader(range(N), fetch, batch_size=BATCH, shuffle=True, seed=3, beside=True) as loader:
        assert isinstance(loader, BesideLoader)
        assert isinstance(loader, Loader)
        first = list(loader)

        async def second() -> list[Any]:
            return [batch async for batch in loader]

        again = asyncio.run(second())
        stats = loader.stats()
        pid = stats.extra["beside"]["pid"]
    assert [keys_of(first), keys_of(again)] == want
    made_in = {int(p) for batch in first + again for p in batch[:, 1]}
    assert made_in == {pid}
    assert pid != os.getpid()
    pool = stats.extra["beside"]["pool"]
    assert pool["results_in_shm"] == 2 * N // BATCH  # every batch came back in shared memory
    assert stats.extra["beside"]["batches"] == 2 * N // BATCH == stats.batches


def niceness(key: int) -> torch.Tensor:
    """A sample that says how nice the thread that fetched it was: (key, nice)."""
    return torch.tensor([key, os.nice(0)])


async def aniceness(key: int) -> torch.Tensor:
    await asyncio.sleep(0)
    return niceness(key)


@pytest.mark.parametrize("fetch", [niceness, aniceness])
def test_the_pipeline_beside_yields_the_cpu_to_the_trainer(fetch: Any) -> None:
    # the threads that fetch (the loop's, and those a sync fetch runs in): Linux sets nice per thread
    with Loader(range(N), fetch, batch_size=BATCH, beside=True) as loader:
        seen = {int(n) for batch in loader for n in batch[:, 1]}
    assert seen == {min(19, os.nice(0) + LOADER_NICE)}


def test_callables_that_do_not_pickle_work_as_in_torchs_workers() -> None:
    lock = threading.Lock()  # does not pickle; nor does the closure

    def fetch(key: int) -> int:
        with lock:
            return key * 2

    with Loader(range(10), fetch, batch_size=5, collate=None, beside=True) as loader:
        assert list(loader) == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]
        assert "beside=True" in repr(loader)
        assert len(loader) == 2


def test_a_saved_state_is_the_last_batch_handed_over_not_what_the_worker_made_ahead(
    wait_until: Callable[..., bool],
) -> None:
    (want, _) = reference(shuffle=True, seed=5)
    with Loader(range(N), read, batch_size=BATCH, shuffle=True, seed=5, beside=True) as loader:
        it = iter(loader)
        took = [next(it) for _ in range(3)]
        assert wait_until(lambda: loader.stats().batches > 3)  # the worker makes batches ahead
        state = loader.state_dict()
        del it
    assert keys_of(took) == want[: 3 * BATCH]
    for beside in (True, False):  # the state resumes beside or in-process alike
        with Loader(range(N), read, batch_size=BATCH, shuffle=True, seed=5, beside=beside) as again:
            again.load_state_dict(json.loads(json.dumps(state)))
            assert keys_of(list(again)) == want[3 * BATCH :]


def test_an_epoch_left_early_leaks_nothing_into_the_next() -> None:
    want = reference(shuffle=True, seed=7)
    with Loader(range(N), read, batch_size=BATCH, shuffle=True, seed=7, beside=True) as loader:
        for i, _ in enumerate(loader):
            if i == 1:
                break
        assert keys_of(list(loader)) == want[1]  # the next epoch, whole, from its start
        assert loader.epoch == 2


def test_errors_name_the_key_and_stage_and_the_epoch_goes_on_as_in_process() -> None:
    def fetch(key: int) -> int:
        if key == 5:
            raise KeyError(f"no object {key}")
        return key

    outcomes: dict[bool, list[Any]] = {}
    for beside in (False, True):
        got: list[Any] = []
        with Loader(range(12), fetch, batch_size=4, collate=None, beside=beside) as loader:
            it = iter(loader)
            while True:
                try:
                    got.append(next(it))
                except StopIteration:
                    break
                except KeyError as exc:
                    got.append(("error", [n for n in exc.__notes__ if "stage 'fetch'" in n]))
        outcomes[beside] = got
    assert outcomes[True] == outcomes[False]
    (notes,) = [o[1] for o in outcomes[True] if isinstance(o, tuple)]
    assert notes
    assert "5" in notes[0]


def test_a_stuck_pipeline_ends_in_loader_timeout_naming_the_stage() -> None:
    with Loader(range(3), Gate(), timeout=0.2, beside=True) as loader:
        it = iter(loader)
        with pytest.raises(LoaderTimeout, match="stage 'fetch'"):
            next(it)
        with pytest.raises(StopIteration):
            next(it)


def test_a_killed_worker_is_worker_died_and_the_next_epoch_goes_on_from_the_last_batch() -> None:
    warm_up()
    before = census()
    (want, _) = reference(shuffle=True, seed=9)
    loader = Loader(range(N), read, batch_size=BATCH, shuffle=True, seed=9, beside=True)
    got: list[Any] = []

    def until_it_dies() -> None:
        for batch in loader:
            got.append(batch)
            del batch  # (its frame outlives the error's traceback: no view of shared memory)
            if len(got) == 2:
                os.kill(loader.stats().extra["beside"]["pid"], signal.SIGKILL)

    with pytest.raises(WorkerDied):
        until_it_dies()
    got.extend(loader)  # the rest of the epoch, from a new worker
    assert keys_of(got) == want  # nothing dropped, nothing repeated
    assert loader.stats().extra["beside"]["rebuilds"] == 1
    loader.close()
    got.clear()  # (the batches view shared memory)
    assert left_behind_after(before) == {}


def test_closing_or_dropping_it_mid_epoch_leaves_nothing_behind() -> None:
    warm_up()
    before = census()
    for close in (True, False):
        loader = Loader(range(1000), read, batch_size=BATCH, beside=True)
        it = iter(loader)
        next(it)
        if close:
            loader.close()
            assert loader.stats().batches >= 1  # what it said as it closed
            with pytest.raises(Exception, match="closed"):
                list(loader)
        del loader, it
    assert left_behind_after(before) == {}


def test_trace_stats_and_diagnose_come_from_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "beside.json"
    with Loader(range(16), aread, batch_size=4, beside=True) as loader:
        with loader.trace(path):
            list(loader)
        assert loader.diagnose().bottleneck
    spans = json.loads(path.read_text())["traceEvents"]
    assert any(span.get("name", "").startswith("fetch") for span in spans)


def test_the_device_stage_runs_in_the_training_process() -> None:
    backend = FakeBackend()
    stage = DeviceStage(backend)
    beside = Beside(
        functools.partial(Loader, range(8), read, batch_size=4, beside=False),
        ahead=2, timeout=None, device=stage,
    )  # fmt: skip
    try:
        got = list(beside.iter(owner=None))
    finally:
        beside.close()
    assert keys_of(got) == list(range(8))
    copies = backend.kinds("copy")
    assert copies
    assert {op.thread for op in copies} == {"aioloader-beside-transfer_0"}
    assert {op.stream for op in copies} != {"default"}  # on the side stream


def test_an_executor_object_runs_in_process_with_a_warning() -> None:
    with ProcessExecutor(1) as executor:
        with pytest.warns(UserWarning, match="belong to this process"):
            loader = Loader(
                range(4), read, decode=torch.neg, executor=executor, batch_size=4, beside=True
            )
        with loader:
            assert not isinstance(loader, BesideLoader)
            assert keys_of(list(loader)) == [0, -1, -2, -3]  # decoded


def test_warnings_and_log_records_reach_the_trainers_filters_and_handlers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a batch over the byte budget warns in the consumer's thread in-process (ResourceWarning), and a
    # fetch that times out under concurrency="auto" logs that it throttled: beside, the worker
    # records both and the trainer raises and logs them again, where its filters and handlers are
    async def fetch(key: int) -> Any:
        if key == 5:
            raise TimeoutError("the store did not answer")
        return torch.full((1 << 18,), key, dtype=torch.int32)  # 1 MiB

    loader = Loader(range(24), fetch, batch_size=8, max_bytes_in_flight=3 << 20,
                    concurrency="auto", on_error="skip", max_skipped=None, beside=True)  # fmt: skip
    with caplog.at_level("INFO", logger="aioloader"), loader:
        with pytest.warns(ResourceWarning, match=r"one batch holds"):
            batches = list(loader)
        pid = loader.stats().extra["beside"]["pid"]
    assert len(batches) == 3
    assert {r.process for r in caplog.records if "throttled" in r.getMessage()} == {pid}


def test_an_environment_trace_is_numbered_among_the_trainers_loaders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIOLOADER_TRACE", str(tmp_path / "env.json"))
    for n in (6, 2):
        with Loader(range(n), read, batch_size=BATCH, beside=True) as loader:
            trace = loader.trace(tmp_path / "own.json")  # ends the environment's trace first
            list(loader)
        assert trace.closed  # written as the loader closed
    assert (tmp_path / "env.json").exists()
    assert (tmp_path / "env.1.json").exists()
    assert json.loads((tmp_path / "own.json").read_text())["traceEvents"]


def full(key: int) -> torch.Tensor:
    return torch.full((16, 8), float(key))


def test_batches_the_trainer_keeps_never_change_while_their_slots_go_round() -> None:
    kept: list[tuple[Any, torch.Tensor]] = []
    with Loader(range(120), full, batch_size=4, prefetch=3, beside=True) as loader:
        for epoch in range(2):
            for i, batch in enumerate(loader):
                assert torch.equal(batch[:, 0, 0], torch.arange(4 * i, 4 * i + 4).float())
                if epoch == 0 and i < 3:
                    kept.append((batch[i], batch[i].clone()))  # a view keeps its slot
                elif epoch == 0 and i == 3:
                    kept.append((batch.numpy(), batch.clone()))
                del batch
        pool = loader.stats().extra["beside"]["pool"]
    assert pool["results_in_shm"] == 60  # every batch mapped, none pickled
    for i, (item, clone) in enumerate(kept):
        assert torch.equal(torch.as_tensor(item), clone), f"kept batch {i} changed"


_UNGUARDED = """
import torch
from aioloader import Loader

async def fetch(key):
    return key

with Loader(range(8), fetch, decode=torch.tensor, executor="process", workers=2, batch_size=4,
            beside=True) as loader:
    print([b.tolist() for b in loader])
"""


def test_a_decode_pool_beside_forks_as_in_process_for_a_script_without_a_main_guard(
    tmp_path: Path,
) -> None:
    # in-process, such a pool forks its workers from a zygote; beside, the worker's one other
    # thread (its lifeline watcher) holds nothing a fork could need, so it does the same there,
    # rather than a fork server that would run the unguarded script again (and refuse to)
    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[[0, 1, 2, 3], [4, 5, 6, 7]]"
