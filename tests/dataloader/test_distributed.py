"""Distributed training for real (torchrun, gloo, 2 processes) and resume across a SIGKILL."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.shardfiles import write_shards
from support.torchrun import SCRIPTS, torchrun

# A subprocess is polled for its "saved" line at this period (a process boundary).
POLL_S = 0.05


def test_torchrun_two_ranks_disjoint_complete_equal_steps(tmp_path: Path) -> None:
    written = [tmp_path / f"rank{r}.json" for r in range(2)]
    torchrun("ddp_train.py", 2, tmp_path, written=written, timeout=180)
    ranks = [json.loads(p.read_text()) for p in written]
    assert ranks[0]["steps"] == ranks[1]["steps"]  # same number of steps: nobody waits at the end
    for epoch in range(2):
        a, b = (set(r["keys"][epoch]) for r in ranks)
        assert not a & b  # disjoint
        assert a | b == set(range(50))  # complete
        assert len(ranks[0]["keys"][epoch]) == len(a)  # no sample twice on one rank
    assert ranks[0]["keys"][0] != ranks[0]["keys"][1]  # set_epoch reshuffled


def test_torchrun_four_ranks_step_together_over_uneven_tar_shards(tmp_path: Path) -> None:
    """DDP over tar shards of uneven sizes, and over a mix of them with a key list: every rank
    takes the same number of all-reduced steps (none hangs), and every sample comes; the ranks
    count the shards' samples together, each shard once."""
    sizes = [7, 13, 5, 11, 9, 3, 17, 8, 1, 14]
    shards = write_shards(tmp_path, sizes)
    written = [tmp_path / f"rank{r}.json" for r in range(4)]
    torchrun("ddp_shards.py", 4, tmp_path, *shards, written=written)
    ranks = [json.loads(p.read_text()) for p in written]
    every = {f"{s}-{i}" for s, n in enumerate(sizes) for i in range(n)}
    for run in ("tar", "mix"):
        assert len({r[run]["steps"] for r in ranks}) == 1, run  # equal steps: nobody hangs
    taken = [name for r in ranks for name in r["tar"]["samples"]]
    assert set(taken) == every  # 88 samples among 4 ranks: 22 each, none padded
    assert len(taken) == len(every)
    mixed = {name for r in ranks for name in r["mix"]["samples"]}
    assert every | {f"k{i}" for i in range(50)} <= mixed
    assert sum(r["counted"][0] for r in ranks) == len(shards)  # each shard counted once per job
    assert sum(r["counted"][1] for r in ranks) == 0  # the same shards again: the job's counts


def run_lines(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "resume_train.py"), *args],
        timeout=120, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def test_resume_after_sigkill_equals_uninterrupted_run(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    victim = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "resume_train.py"), "stop", "5", str(state)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert victim.stdout is not None
    before: list[str] = []
    deadline = time.monotonic() + 60
    for line in victim.stdout:
        if line.strip() == "saved":
            break
        before.append(line.strip())
        assert time.monotonic() < deadline
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(timeout=10) == -signal.SIGKILL
    victim.stdout.close()
    after = run_lines("resume", str(state))
    full = run_lines("full")
    assert before + after == full
    assert len({line.split()[0] for line in full}) == 3


def test_augmentations_do_not_depend_on_the_executor() -> None:
    import torch

    import aioloader

    def draw(key: int) -> torch.Tensor:
        return torch.rand(3, generator=aioloader.sample_generator()) + key

    def epoch(**kwargs: object) -> list[torch.Tensor]:
        with aioloader.Loader(
            list(range(20)), lambda k: k, decode=draw, batch_size=5, **kwargs
        ) as loader:
            return list(loader)

    inline = epoch(executor="inline")
    threads = epoch(executor="thread", workers=3, concurrency=7)
    assert all(torch.equal(a, b) for a, b in zip(inline, threads, strict=True))
    with pytest.raises(RuntimeError, match="inside a loader's decode"):
        aioloader.sample_seed()
