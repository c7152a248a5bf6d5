"""Peak memory of a benchmark's child process tree: PSS (each shared page divided among its users);
and the tree's CPU time (`tree_cpu`).

`with PeakPss(pid) as pss: ...` samples the PSS of the process `pid` and all its descendants every
`period` seconds until the block ends; `pss.peak` is the largest sum seen, in bytes. `run_measured`
runs a contender's command in a child that way and returns its last JSON line with `peak_pss_mb`. psutil reads
/proc/PID/smaps_rollup per process, so a few samples a second cost the measured run little.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from types import TracebackType
from typing import Any

import psutil

PSS_PERIOD_S = 0.25


def tree_cpu(root: psutil.Process) -> float:
    """CPU seconds (user and system) of `root` and its live descendants now (processes that end
    meanwhile count 0)."""
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def tree_pss(root: psutil.Process) -> int:
    """The PSS of `root` and its descendants now, in bytes (processes that end meanwhile count 0)."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            total += proc.memory_full_info().pss
    return total


class PeakPss:
    """The peak PSS of a process tree while the `with` block runs (`peak`, bytes)."""

    def __init__(self, pid: int, period: float = PSS_PERIOD_S) -> None:
        self.root = psutil.Process(pid)
        self.period = period
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="pss-sampler")

    def _sample(self) -> None:
        while not self._done.wait(self.period):
            try:
                self.peak = max(self.peak, tree_pss(self.root))
            except psutil.Error:  # the root has ended
                return

    def __enter__(self) -> PeakPss:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._done.set()
        self._thread.join()


def run_measured(
    cmd: list[str], what: str, env: dict[str, str] | None = None, period: float = PSS_PERIOD_S
) -> dict[str, Any]:
    """Run a contender's `cmd` in a child process and return the JSON object of its last line of
    output, with the peak PSS of its process tree (`peak_pss_mb`); RuntimeError naming `what` when
    it fails."""
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    with PeakPss(child.pid, period) as pss:
        out, _ = child.communicate()
    if child.returncode != 0:
        raise RuntimeError(f"{what} failed with exit code {child.returncode}")
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    result["peak_pss_mb"] = pss.peak / 2**20
    return result
