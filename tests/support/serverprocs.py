"""What the tests' server processes share (SeaweedFS, fake-gcs-server, Azurite): free ports, stopping."""

from __future__ import annotations

import socket
import subprocess

__all__ = ["STOP_WAIT_S", "free_port", "free_ports", "stop"]

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
