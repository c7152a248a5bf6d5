"""Soak: one loader, many epochs; memory, descriptors, threads and processes stay flat.

The runner (`scripts/soak.py`) runs in a subprocess, so that what it measures is its own: thread and
process executors, each with sync and async iteration, one after the other. After the end of epoch 3
every metric stays within 5% of its value then (plus 2 descriptors and 1 OS thread of slack; none for
sockets, processes and /dev/shm entries), and after close() nothing is left. The default run does 10
epochs; the full 50-epoch soak is marked slow, which the default run deselects (`make soak`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from scripts.soak import WARMUP, verdict

SCRIPT = Path(__file__).parent / "scripts" / "soak.py"
PAIRS = [("thread", "sync"), ("thread", "async"), ("process", "sync"), ("process", "async")]
WORKERS = 2  # the runner's decode processes


def soak(epochs: int, out: Path, timeout: float) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--epochs", str(epochs), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.exists(), f"exit {done.returncode}: {done.stderr[-3000:]}"
    results: list[dict[str, Any]] = json.loads(out.read_text())
    assert [(r["executor"], r["mode"]) for r in results] == PAIRS
    problems = {f"{r['executor']}/{r['mode']}": r["problems"] for r in results if r["problems"]}
    assert problems == {}
    assert done.returncode == 0, done.stderr[-3000:]
    return results


def check_measured(results: list[dict[str, Any]], epochs: int) -> None:
    """The runner saw what it should: every epoch, and the decode workers it was meant to watch."""
    for r in results:
        assert len(r["epochs"]) == epochs
        children = {snap["children"] for snap in r["epochs"]}
        if r["executor"] == "process":
            assert min(children) >= WORKERS  # the workers (and their zygote) are counted
        else:  # beside the trainer (`make test-beside`): the loader's process and its zygote
            assert children == {2 if os.environ.get("AIOLOADER_BESIDE") == "1" else 0}
        assert r["after_close"]["children"] == []
        assert r["after_close"]["loader_threads"] == []
        assert r["after_close"]["shm"] == []


def test_ten_epochs_stay_flat_and_leave_nothing(tmp_path: Path) -> None:
    results = soak(10, tmp_path / "soak.json", timeout=110)
    check_measured(results, 10)


@pytest.mark.slow  # deselected by default: `make soak`
@pytest.mark.timeout(1800)
def test_fifty_epochs_stay_flat_and_leave_nothing(tmp_path: Path) -> None:
    results = soak(50, tmp_path / "soak.json", timeout=1700)
    check_measured(results, 50)


def epochs_of(**changes: list[int]) -> dict[str, Any]:
    base = {"rss": 300 << 20, "objects": 190_000, "fds": 12, "sockets": 2, "threads": 10,
            "children": 3, "shm": 0}  # fmt: skip
    n = max(len(v) for v in changes.values())
    epochs = [dict(base) for _ in range(n)]
    for metric, values in changes.items():
        for snap, value in zip(epochs, values, strict=True):
            snap[metric] = value
    return {"epochs": epochs, "left_behind": {}}


@pytest.mark.parametrize(
    ("changes", "flagged"),
    [
        ({"fds": [12, 12, 12, 13, 14, 14, 13]}, None),  # within the slack of 2
        ({"fds": [12, 12, 12, 12, 13, 14, 15]}, "fds after epoch 7"),
        ({"fds": [5, 9, 12, 12, 12, 12, 12]}, None),  # growth before the baseline is warm-up
        ({"children": [3, 3, 3, 3, 4, 3, 3]}, "children after epoch 5"),
        ({"rss": [300 << 20] * 3 + [314 << 20, 316 << 20]}, "rss after epoch 5"),
        ({"objects": [190_000] * 4 + [199_000, 200_000]}, "objects after epoch 6"),
        ({"threads": [10, 10, 10, 11, 11, 11]}, None),
        ({"threads": [10, 10, 10, 12, 12, 12]}, "threads after epoch 4"),
    ],
)
def test_the_verdict_flags_growth_after_warmup(
    changes: dict[str, list[int]], flagged: str | None
) -> None:
    problems = verdict(epochs_of(**changes))
    if flagged is None:
        assert problems == []
    else:
        assert len(problems) == 1
        assert problems[0].startswith(flagged), problems
        assert f"after epoch {WARMUP}" in problems[0]


def test_the_verdict_flags_what_close_left_behind() -> None:
    record = epochs_of(fds=[12] * 5)
    record["left_behind"] = {"children": [1234]}
    assert verdict(record) == ["left behind after close: {'children': [1234]}"]
