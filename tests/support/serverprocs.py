"""What the tests' server processes share (SeaweedFS, fake-gcs-server, Azurite): free ports, starting
with a log, waiting until ready (or failing with the log's tail), stopping."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

__all__ = [
    "STOP_WAIT_S", "free_port", "free_ports", "start_logged", "stop", "wait_ready",
]  # fmt: skip

STOP_WAIT_S = 3.0  # a server's grace after SIGTERM, then SIGKILL


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now (all held at once while chosen)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """One port free on 127.0.0.1 now."""
    return free_ports(1)[0]


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a server process: SIGTERM, then SIGKILL after `STOP_WAIT_S`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_logged(cmd: list[str], log: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """Start `cmd`, its output (stdout and stderr) written to `log`."""
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, **popen)


def wait_ready(
    proc: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, log: Path,
    deadline_s: float, probe_s: float,
) -> None:  # fmt: skip
    """Probe `ready()` every `probe_s` (an OSError counts as "not yet") while `proc` runs, until it
    holds; after `deadline_s`, or if `proc` ends, stop it and fail the test with the log's tail.
    A process boundary: nothing else signals that a server in another process is ready."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            if ready():
                return
        except OSError:
            pass
        time.sleep(probe_s)
    stop(proc)
    tail = log.read_text(errors="replace")[-2000:]
    pytest.fail(f"{what} did not start within {deadline_s} s: {tail}")
