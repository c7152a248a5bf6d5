"""Faults of local files (`stores/files.py`), through the Loader: a file that may not be read, one that
vanishes or turns into a directory between listing and reading, a read cancelled while blocked in
open(). Each ends in a typed error naming the key (or is skipped, as asked) and leaves no thread,
process or open file behind (`scripts/leakcheck.py`)."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from scripts.leakcheck import census, left_behind_after, warm_up

from aioloader import Loader
from aioloader.sources import files

SCRIPTS = Path(__file__).parents[1] / "scripts"
WAIT_S = 30.0  # every wait in these tests ends by then, so a broken loader fails instead of hanging
NOTICE_S = 5.0  # how soon a fault must surface through the loader (generous: two shared cores)


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
            samples_until_error(batches, got)
        assert time.monotonic() - start < NOTICE_S
    assert [bytes(x).decode() for x in got] == [f"sample {k[:-4]}" for k in keys[: len(got)]]
    assert len(got) == position - position % 2  # every batch before the victim's, no more
    assert any(f"stage 'fetch' for key {victim!r}" in n for n in info.value.__notes__)
    assert victim in str(info.value)
    del info
    assert left_behind_after(before) == {}


def samples_until_error(batches: Iterator[list[Any]], into: list[Any]) -> None:
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


@pytest.mark.in_process
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
