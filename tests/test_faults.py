"""Faults from outside the loader, and what each one ends in.

A decode worker killed or stopped mid-epoch, an error kept by the consumer, a descriptor limit of
64 while the consumer holds 1,000 batches, the error policy under faults (local files' own faults:
sources/test_files_faults.py). Each ends in a typed error naming what failed (or in the documented
recovery) within a bounded time, and leaves nothing behind: no aioloader thread, no process, no
socket or descriptor more than before, no /dev/shm entry (`scripts/leakcheck.py`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from scripts.images import decode_jpeg, jpeg
from scripts.leakcheck import census, gone, left_behind_after, shm_names, warm_up
from support.fakes import POLL_INTERVAL_S

from aioloader import Loader, LoaderTimeout, ProcessExecutor, WorkerDied, WorkerTimeout
from aioloader.sources import files

SCRIPTS = Path(__file__).parent / "scripts"
WAIT_S = 30.0  # every wait in these tests ends by then, so a broken loader fails instead of hanging
# How soon a killed or stopped worker must surface through the loader. Generous: two shared cores;
# test_procpool holds the executor itself to 1 s.
NOTICE_S = 5.0
EXECUTOR_TIMEOUT_S = 1.5
BLOCK_AT = 5  # the key whose decode the test kills or stops
N_KEYS = 16


# -- decode callables (module level: workers import this module to find them) ----------------------


def decode_or_wait(raw: tuple[int, str]) -> torch.Tensor:
    """Key BLOCK_AT announces its pid in `folder`/blocked, then waits for `folder`/go."""
    key, folder = raw
    if key == BLOCK_AT:
        Path(folder, "blocked").write_text(str(os.getpid()))
        deadline = time.monotonic() + WAIT_S
        while not Path(folder, "go").exists() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL_S)  # a file from another process: nothing can signal it
    return torch.full((2,), float(key))


# -- helpers ------------------------------------------------------------------------------------------


def wait_for_file(path: Path) -> str:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(POLL_INTERVAL_S)
    if not path.exists():
        return ""
    text = path.read_text()
    while not text and time.monotonic() < deadline:  # written but not yet flushed
        time.sleep(POLL_INTERVAL_S)
        text = path.read_text()
    return text


class Saboteur:
    """On a thread: wait until the blocked decode announces its worker, signal it, then let go."""

    def __init__(self, folder: Path, sig: signal.Signals) -> None:
        self.folder = folder
        self.sig = sig
        self.pid = 0
        self.at = 0.0
        self.shm_seen: list[str] = []
        self._thread = threading.Thread(target=self._run, name="test-saboteur")
        self._thread.start()

    def _run(self) -> None:
        announced = wait_for_file(self.folder / "blocked")
        if not announced:  # no worker blocked in time: nothing to signal (the test fails on pid 0)
            return
        self.pid = int(announced)
        self.shm_seen = shm_names(os.getpid())  # mid-epoch: slabs exist, but no name is left
        os.kill(self.pid, self.sig)
        self.at = time.monotonic()
        (self.folder / "go").touch()

    def join(self) -> None:
        self._thread.join(WAIT_S)


def keys_and_folder(folder: Path) -> tuple[list[int], Any]:
    async def fetch(key: int) -> tuple[int, str]:
        return key, str(folder)

    return list(range(N_KEYS)), fetch


def consume(loader: Loader[Any], mode: str) -> list[int]:
    """Keys of the samples of one epoch; an error propagates, carrying those delivered before it
    as `.delivered`. No sample is kept (a sample viewing shared memory would pin its slab)."""
    got: list[int] = []

    async def main() -> None:
        async for sample in loader:
            got.append(int(sample[0]))
            del sample

    try:
        if mode == "sync":
            for sample in loader:
                got.append(int(sample[0]))
                del sample
        else:
            asyncio.run(main())
    except BaseException as exc:
        exc.delivered = got  # type: ignore[attr-defined]
        raise
    return got


def kill_stopped(pid: int) -> None:
    """Let a worker this test stopped die, should the loader have failed to (cleanup only). A pid
    of 0 (the worker never announced itself) is no worker: `os.kill(0, ...)` would signal this
    test's whole process group, pytest and whatever started it included."""
    if pid <= 0:
        return
    for sig in (signal.SIGKILL, signal.SIGCONT):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


# -- decode workers killed or stopped mid-epoch, through the Loader ----------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkilled_worker_mid_epoch_is_worker_died_naming_pid_and_key(
    mode: str, tmp_path: Path
) -> None:
    warm_up()
    before = census()
    keys, fetch = keys_and_folder(tmp_path)
    loader = Loader(keys, fetch, decode=decode_or_wait, executor="process", workers=2,
                    concurrency=4, prefetch=2)  # fmt: skip
    saboteur = Saboteur(tmp_path, signal.SIGKILL)
    with loader, pytest.raises(WorkerDied) as info:
        consume(loader, mode)
    raised_at = time.monotonic()
    saboteur.join()
    err = info.value
    assert raised_at - saboteur.at < NOTICE_S
    assert err.pid == saboteur.pid
    assert f"pid {saboteur.pid}" in str(err)
    assert "SIGKILL" in str(err)
    assert err.exitcode == -signal.SIGKILL
    assert any(f"stage 'decode' for key {BLOCK_AT}" in n for n in err.__notes__), err.__notes__
    assert err.delivered == keys[:BLOCK_AT]  # type: ignore[attr-defined]
    assert saboteur.shm_seen == []
    del err, info  # a kept error pins the epoch's samples (test_a_kept_error_pins_no_samples)
    assert left_behind_after(before) == {}
    assert gone(saboteur.pid)


def test_sigkill_mid_epoch_with_restarts_loses_and_repeats_nothing(tmp_path: Path) -> None:
    warm_up()
    before = census()
    keys, fetch = keys_and_folder(tmp_path)
    executor = ProcessExecutor(2, max_worker_restarts=1)
    try:
        with Loader(keys, fetch, decode=decode_or_wait, executor=executor, concurrency=4) as loader:
            saboteur = Saboteur(tmp_path, signal.SIGKILL)
            got = consume(loader, "sync")
            saboteur.join()
            assert got == keys  # the killed worker's tasks were retried on its replacement
            assert executor.stats()["restarts"] == 1
            assert saboteur.pid not in executor.pids
            assert consume(loader, "sync") == keys  # and the next epoch is whole too
    finally:
        executor.close()
    assert left_behind_after(before) == {}


def test_sigstopped_worker_mid_epoch_is_worker_timeout_naming_pid_and_key(tmp_path: Path) -> None:
    warm_up()
    before = census()
    keys, fetch = keys_and_folder(tmp_path)
    executor = ProcessExecutor(2, timeout=EXECUTOR_TIMEOUT_S)
    saboteur = None
    try:
        with Loader(keys, fetch, decode=decode_or_wait, executor=executor, concurrency=4) as loader:
            saboteur = Saboteur(tmp_path, signal.SIGSTOP)
            with pytest.raises(WorkerTimeout) as info:
                consume(loader, "sync")
            raised_at = time.monotonic()
            saboteur.join()
            err = info.value
            assert err.delivered == keys[:BLOCK_AT]  # type: ignore[attr-defined]
            assert raised_at - saboteur.at < EXECUTOR_TIMEOUT_S + NOTICE_S
            assert err.pid == saboteur.pid
            assert err.timeout == EXECUTOR_TIMEOUT_S
            assert f"pid {saboteur.pid}" in str(err)
            assert any(f"for key {BLOCK_AT}" in n for n in err.__notes__), err.__notes__
            assert saboteur.pid not in executor.pids  # killed and replaced
            del err, info  # see test_a_kept_error_pins_no_samples
            assert consume(loader, "sync") == keys  # the next epoch runs on the replacement
    finally:
        executor.close()
        if saboteur is not None:
            kill_stopped(saboteur.pid)
    assert saboteur.shm_seen == []
    assert left_behind_after(before) == {}


def _worker_start_s() -> float:
    """Seconds a process pool here takes from its start to its first result: the loader's timeout
    below counts them for the first batch (as torch's does), and an interpreter whose workers import
    a large torch (the free-threaded venv's CUDA build) takes seconds more than the GIL venv's."""
    executor = ProcessExecutor(1)
    began = time.monotonic()
    try:
        asyncio.run(executor.run(decode_or_wait, (0, "")))
        return time.monotonic() - began
    finally:
        executor.close()


def test_sigstopped_worker_without_executor_timeout_ends_in_loader_timeout(tmp_path: Path) -> None:
    warm_up()
    timeout = EXECUTOR_TIMEOUT_S + 2 * _worker_start_s()
    before = census()
    keys, fetch = keys_and_folder(tmp_path)
    loader = Loader(keys, fetch, decode=decode_or_wait, executor="process", workers=2,
                    concurrency=4, timeout=timeout)  # fmt: skip
    saboteur = Saboteur(tmp_path, signal.SIGSTOP)
    try:
        with loader, pytest.raises(LoaderTimeout) as info:
            consume(loader, "sync")
        saboteur.join()
        assert info.value.delivered == keys[:BLOCK_AT]  # type: ignore[attr-defined]
        del info  # see test_a_kept_error_pins_no_samples
        # close() had to end a worker that cannot run: nothing of it is left
        assert left_behind_after(before) == {}
        assert gone(saboteur.pid)
    finally:
        kill_stopped(saboteur.pid)


# -- a kept error pins nothing -----------------------------------------------------------------------


class Sample:
    """A decoded sample that can be watched with a weak reference."""

    def __init__(self, key: int) -> None:
        self.key = key


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.in_process
def test_a_kept_error_pins_no_samples(mode: str) -> None:
    made: weakref.WeakSet[Sample] = weakref.WeakSet()
    decoded: list[int] = []
    seven: list[asyncio.Event] = []  # made on the loader's loop, by the first fetch

    def decode(key: int) -> Sample:  # inline: runs on the loader's loop
        sample = Sample(key)
        made.add(sample)
        decoded.append(key)
        if len(decoded) == 7:
            seven[0].set()
        return sample

    async def fetch(key: int) -> int:
        if not seven:
            seven.append(asyncio.Event())
        if key == 3:  # fail once samples after it are decoded and wait in the reorder buffer
            await asyncio.wait_for(seven[0].wait(), WAIT_S)
            raise OSError("cannot read 3")
        return key

    loader = Loader(range(16), fetch, decode=decode, collate=None, concurrency=4, prefetch=2)
    with loader, pytest.raises(OSError, match="cannot read 3") as info:
        consume_samples(loader, mode)
    assert info.value.delivered == [0, 1, 2]  # type: ignore[attr-defined]
    assert len(decoded) >= 7
    gc.collect()
    # the consumer keeps only the error (as a retry wrapper or a logger would)
    assert sorted(s.key for s in made) == []


def consume_samples(loader: Loader[Any], mode: str) -> None:
    got: list[int] = []

    async def main() -> None:
        async for sample in loader:
            got.append(sample.key)
            del sample

    try:
        if mode == "sync":
            for sample in loader:
                got.append(sample.key)
                del sample
        else:
            asyncio.run(main())
    except BaseException as exc:
        exc.delivered = got  # type: ignore[attr-defined]
        raise


# -- a descriptor limit of 64 while the consumer holds 1,000 batches ---------------------------------

FD_PAIRS = {
    "thread, batches of 1": ("thread", "1"),
    "thread, unbatched": ("thread", "none"),
    "process, batches of 2": ("process", "2"),
    "process, unbatched": ("process", "none"),
}


@pytest.fixture(scope="module")
def fd_limit_runs() -> dict[str, dict[str, Any]]:
    """Every FD_PAIRS run, in two subprocesses run at once (the slowest pair in its own)."""
    groups = [["thread, batches of 1", "thread, unbatched", "process, batches of 2"],
              ["process, unbatched"]]  # fmt: skip
    procs = []
    for names in groups:
        args = [a for name in names for a in FD_PAIRS[name]]
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPTS / "fd_limit.py"), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results: dict[str, dict[str, Any]] = {}
    for names, proc in zip(groups, procs, strict=True):
        out, err = proc.communicate(timeout=WAIT_S * 3)
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert len(lines) == len(names), f"exit {proc.returncode}: {err[-2000:]}"
        results.update(zip(names, lines, strict=True))
    return results


# The parent maps slabs with no descriptor kept for the mapping, and closes each slab's own at
# close(): the batches held past it pin memory, not descriptors.
PINNED_FDS_MAX = 2


@pytest.mark.parametrize("pair", list(FD_PAIRS))
def test_holding_1000_batches_under_ulimit_64_pins_no_descriptors(
    fd_limit_runs: dict[str, dict[str, Any]], pair: str
) -> None:
    run = fd_limit_runs[pair]
    assert run["error"] is None
    assert run["delivered"] == 1000
    assert run["intact"]  # no batch held was overwritten by a later one
    # closed, the loader keeps at most a couple of descriptors for the consumer's batches (a slab
    # still viewed keeps its mapping, not a descriptor), never one per batch or per few batches
    assert run["fds_after_close"] - run["fds_before"] <= PINNED_FDS_MAX, run
    assert 0 < run["fds_max"] < 64


# -- the error policy under faults ------------------------------------------------------------------

N_IMAGES = 20
VANISHED, GARBLED, TRUNCATED = "07.jpg", "03.jpg", "12.jpg"


@pytest.fixture
def jpegs(tmp_path: Path) -> Path:
    """Twenty JPEGs, of which one is not an image and one is cut short."""
    for i in range(N_IMAGES):
        (tmp_path / f"{i:02d}.jpg").write_bytes(jpeg(i))
    (tmp_path / GARBLED).write_bytes(b"not a JPEG at all" * 10)
    (tmp_path / TRUNCATED).write_bytes(jpeg(12)[:300])
    return tmp_path


def indices_of(batches: list[dict[str, Any]]) -> list[int]:
    return [int(i) for batch in batches for i in batch["index"]]


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_skip_lists_each_fault_and_delivers_every_other_sample_once(
    jpegs: Path, executor: str
) -> None:
    source = files(jpegs)  # listed now; one file then vanishes before it is read
    (jpegs / VANISHED).unlink()
    bad = {VANISHED: "FileNotFoundError", GARBLED: "UnidentifiedImageError", TRUNCATED: "OSError"}
    good = [i for i in range(N_IMAGES) if f"{i:02d}.jpg" not in bad]
    loader = Loader(source, decode=decode_jpeg, executor=executor, workers=2, batch_size=4,
                    on_error="skip", max_skipped=3, concurrency=4)  # fmt: skip
    with loader:
        for epoch in range(2):
            assert indices_of(list(loader)) == good  # each once, in order, every epoch
            skipped = loader.stats().skipped
            assert len(skipped) == 3 * (epoch + 1)
    reasons = dict(skipped)
    assert set(reasons) == set(bad)
    for key, kind in bad.items():
        assert reasons[key].startswith(kind), reasons[key]
    assert "truncated" in reasons[TRUNCATED].lower()
    assert loader.stats().skipped_count == 6


# The epoch ends with reads in flight: their cancellation may orphan an open file (the bug of
# test_a_cancelled_file_read_leaves_no_open_file); its warning is not what this test is about.
@pytest.mark.filterwarnings("ignore:unclosed file:ResourceWarning")
@pytest.mark.parametrize("executor", ["thread", "process"])
def test_skip_raises_the_fault_past_max_skipped_after_the_batches_before_it(
    jpegs: Path, executor: str
) -> None:
    source = files(jpegs)
    (jpegs / VANISHED).unlink()
    loader = Loader(source, decode=decode_jpeg, executor=executor, workers=2, batch_size=4,
                    on_error="skip", max_skipped=2, concurrency=4)  # fmt: skip
    got: list[dict[str, Any]] = []
    with loader, pytest.raises(OSError, match=r"[Tt]runcated") as info:  # the third fault
        batches_until_error(loader, got)
    gc.collect()  # an orphaned file is closed now, under this test's warning filter
    assert indices_of(got) == [i for i in range(12) if i not in (3, 7)]
    notes = "\n".join(info.value.__notes__)
    assert "max_skipped=2 is spent" in notes
    assert f"stage 'decode' for key {TRUNCATED!r}" in notes
    assert sorted(key for key, _ in loader.stats().skipped) == [GARBLED, VANISHED]


def batches_until_error(loader: Loader[Any], into: list[Any]) -> None:
    for batch in loader:
        into.append(batch)
