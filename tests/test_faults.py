"""Faults from outside the loader, and what each one ends in.

A file that may not be read, one that vanishes (or turns into a directory) between listing and
reading, a descriptor limit of 64 while the consumer holds 1,000 batches, a decode worker killed or
stopped mid-epoch. Each ends in a typed error naming what failed (or in the documented recovery)
within a bounded time, and leaves nothing behind: no aioloader thread, no process, no socket or
descriptor more than before, no /dev/shm entry (`scripts/leakcheck.py`).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from conftest import POLL_INTERVAL_S
from scripts.images import decode_jpeg, jpeg
from scripts.leakcheck import census, left_behind_after, shm_names, warm_up

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
        self.pid = int(wait_for_file(self.folder / "blocked"))
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


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_stopped(pid: int) -> None:
    """Let a worker this test stopped die, should the loader have failed to (cleanup only)."""
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
    assert not alive(saboteur.pid)


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


def test_sigstopped_worker_without_executor_timeout_ends_in_loader_timeout(tmp_path: Path) -> None:
    warm_up()
    before = census()
    keys, fetch = keys_and_folder(tmp_path)
    loader = Loader(keys, fetch, decode=decode_or_wait, executor="process", workers=2,
                    concurrency=4, timeout=EXECUTOR_TIMEOUT_S)  # fmt: skip
    saboteur = Saboteur(tmp_path, signal.SIGSTOP)
    try:
        with loader, pytest.raises(LoaderTimeout) as info:
            consume(loader, "sync")
        saboteur.join()
        assert info.value.delivered == keys[:BLOCK_AT]  # type: ignore[attr-defined]
        del info  # see test_a_kept_error_pins_no_samples
        # close() had to end a worker that cannot run: nothing of it is left
        assert left_behind_after(before) == {}
        assert not alive(saboteur.pid)
    finally:
        kill_stopped(saboteur.pid)


# -- local files: permission denied, vanished, replaced by a directory --------------------------------


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A folder of 5 small files that a process without DAC capabilities can traverse."""
    root = Path(tempfile.mkdtemp(prefix="aioloader-faults-"))
    root.chmod(0o755)
    for i in range(5):
        (root / f"{i}.txt").write_text(f"sample {i}")
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_permission_denied_names_the_key_and_can_be_skipped(shared_root: Path) -> None:
    (shared_root / "2.txt").chmod(0o000)
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "denied_read.py"), str(shared_root), "2.txt"],
        capture_output=True, text=True, timeout=WAIT_S * 2,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])  # only where this process cannot be denied a read
    assert result["raise"]["type"] == "PermissionError"
    assert result["raise"]["key_named"], result["raise"]["notes"]
    policy = result["skip_policy"]
    assert policy["delivered"] == [f"sample {i}" for i in (0, 1, 3, 4)]
    [(key, reason)] = policy["skipped"]
    assert key == "2.txt"
    assert reason.startswith("PermissionError")
    assert result["threads"] == []


@pytest.mark.parametrize("replacement", ["nothing", "directory"])
def test_a_file_gone_mid_epoch_names_the_key_after_the_samples_before_it(
    shared_root: Path, replacement: str
) -> None:
    for i in range(5, 40):
        (shared_root / f"{i}.txt").write_text(f"sample {i}")
    source = files(shared_root)
    keys = source.keys()  # listed now: "30.txt" exists
    victim = "30.txt"
    # held at most: prefetch * batch_size + concurrency = 5 samples, so when the first batch arrives,
    # the victim (the 24th key in sorted order) has not been read yet. One fetch at a time: none is
    # in flight when the victim's fails (see test_a_cancelled_file_read_leaves_no_open_file).
    position = keys.index(victim)
    assert position > 2 * 2 + 1 + 2
    warm_up()
    before = census()
    with Loader(source, collate=None, batch_size=2, prefetch=2, concurrency=1) as loader:
        batches = iter(loader)
        got = list(next(batches))
        (shared_root / victim).unlink()
        if replacement == "directory":
            (shared_root / victim).mkdir()
        expected = FileNotFoundError if replacement == "nothing" else IsADirectoryError
        start = time.monotonic()
        with pytest.raises(expected) as info:
            drain(batches, got)
        assert time.monotonic() - start < NOTICE_S
    assert [bytes(x).decode() for x in got] == [f"sample {k[:-4]}" for k in keys[: len(got)]]
    assert len(got) == position - position % 2  # every batch before the victim's, no more
    assert any(f"stage 'fetch' for key {victim!r}" in n for n in info.value.__notes__)
    assert victim in str(info.value)
    del info
    assert left_behind_after(before) == {}


def drain(batches: Iterator[list[Any]], into: list[Any]) -> None:
    """Add the samples of the remaining batches to `into`, until an error (which propagates)."""
    for batch in batches:
        into += batch


def fetch_thread_blocked_in_open(path: Path) -> bool:
    """A thread of this process is blocked opening `path` (a FIFO without a writer)."""
    for top in sys._current_frames().values():
        frame: Any = top
        while frame is not None:  # the thread's stack, from the innermost frame out
            if frame.f_code.co_name == "open" and str(frame.f_locals.get("path")) == str(path):
                return True
            frame = frame.f_back
    return False


def test_a_cancelled_file_read_leaves_no_open_file(
    tmp_path: Path, wait_until: Callable[..., bool]
) -> None:
    (tmp_path / "a.bin").write_bytes(b"a")
    fifo = tmp_path / "slow.bin"
    os.mkfifo(fifo)  # its open() blocks until a writer comes: a read that is in flight, for sure
    source = files(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = Loader(["a.bin", "slow.bin"], source.fetch, collate=None, concurrency=2)
        batches = iter(loader)
        assert next(batches) == b"a"
        assert wait_until(lambda: fetch_thread_blocked_in_open(fifo), WAIT_S)
        batches.close()  # the epoch ends: its fetch of slow.bin is cancelled
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # now open() returns, to nobody
        os.close(writer)
        loader.close()
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


# -- a kept error pins nothing -----------------------------------------------------------------------


class Sample:
    """A decoded sample that can be watched with a weak reference."""

    def __init__(self, key: int) -> None:
        self.key = key


@pytest.mark.parametrize("mode", ["sync", "async"])
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
        drain_batches(loader, got)
    gc.collect()  # an orphaned file is closed now, under this test's warning filter
    assert indices_of(got) == [i for i in range(12) if i not in (3, 7)]
    notes = "\n".join(info.value.__notes__)
    assert "max_skipped=2 is spent" in notes
    assert f"stage 'decode' for key {TRUNCATED!r}" in notes
    assert sorted(key for key, _ in loader.stats().skipped) == [GARBLED, VANISHED]


def drain_batches(loader: Loader[Any], into: list[Any]) -> None:
    for batch in loader:
        into.append(batch)
