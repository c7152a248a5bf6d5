"""Functions the process-pool tests run in worker processes (tests/executors/test_procpool*.py).

They must pickle by reference, so they are module-level functions here; workers import this module
to find them. Some block, stall, die or fail on request; others make results of every kind."""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

import aioloader

# How soon a dead worker must be reported (the design's promise), and a bound for everything else.
NOTICE_S = 1.0
WAIT_S = 30.0


def echo(x: Any) -> Any:
    return x


def nested(n: int) -> dict[str, Any]:
    return {
        "image": torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3).transpose(1, 2),
        "extras": (torch.ones(n, dtype=torch.bfloat16), [torch.tensor(n), torch.zeros(2, dtype=torch.bool)]),
        "numpy": np.asfortranarray(np.arange(n * 4, dtype=np.float16).reshape(n, 4)),
        "complex": torch.full((2,), n, dtype=torch.complex64),
        "label": f"sample-{n}",
        "graded": torch.ones(2, requires_grad=True),  # not plain: pickled in-band
        "empty": np.zeros((0, 3)),
        "empty_expanded": torch.zeros(1, dtype=torch.int32).expand(0),  # a stride of 0
    }  # fmt: skip


def describe(raw: Any) -> tuple[int, str, int]:
    return len(raw), type(raw).__name__, zlib.crc32(bytes(raw))


def draw(_: Any) -> torch.Tensor:
    return torch.rand(4, generator=aioloader.sample_generator())


def block(marker: str) -> None:
    Path(marker).touch()
    time.sleep(WAIT_S)


def die(how: str) -> None:
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    elif how == "segfault":
        faulthandler.disable()  # inherited from pytest: its report would only add noise here
        ctypes.string_at(0)


def stall(how: str) -> None:
    if how == "sleep":
        time.sleep(WAIT_S)
    elif how == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # "spin": an endless loop that holds the CPU
        pass


def stall_once(folder: str) -> str:
    """Stalls at its first try only (a transient stall). Here, not in the test module: a fresh
    worker finds it without importing pytest and the test's other imports, which on a busy
    machine took longer than the test's 0.5 s timeout."""
    marker = Path(folder, "stalled")
    if not marker.exists():
        marker.touch()
        time.sleep(WAIT_S)
    return "done"


def die_once_at(arg: tuple[str, int, int]) -> int:
    folder, i, fatal = arg
    marker = Path(folder, f"died-{fatal}")
    if i == fatal and not marker.exists():
        marker.touch()
        os._exit(1)
    with open(Path(folder, "log"), "a") as log:
        log.write(f"{i}\n")
    return i


def image_or_not(i: int) -> Any:
    if i == 2:
        return torch.zeros(2)  # not the row's shape
    if i == 3:
        return np.full((3, 4, 4), i, dtype=np.float32)  # an array converts
    return torch.full((3, 4, 4), float(i))


def half_mebibyte(i: int) -> np.ndarray[Any, Any]:
    return np.full(200_000, i % 251, dtype=np.uint8)


class Unrebuildable(Exception):
    def __init__(self, a: int, *, b: int) -> None:
        super().__init__(a)


def fail(kind: str) -> None:
    if kind == "value":
        raise ValueError("bad sample")
    raise Unrebuildable(1, b=2)


def remember_id(worker_id: int) -> None:
    global WORKER_ID
    WORKER_ID = worker_id


def worker_id(_: Any) -> tuple[int | None, int]:
    return WORKER_ID, os.getpid()


def broken_init(worker_id: int) -> None:
    raise ValueError(f"cannot set up worker {worker_id}")


class CountsPickles:
    """A decode callable that counts how often it is pickled (here) and unpickled (in a worker)."""

    pickled = 0
    unpickled = 0

    def __reduce__(self) -> tuple[Any, ...]:
        CountsPickles.pickled += 1
        return (_rebuild_counter, ())

    def __call__(self, _: Any) -> tuple[int, int]:
        return os.getpid(), CountsPickles.unpickled


def _rebuild_counter() -> CountsPickles:
    CountsPickles.unpickled += 1
    return CountsPickles()


async def snooze(arg: tuple[float, Any]) -> tuple[int, Any, torch.Tensor]:
    """An async task: waits, then answers its pid, its argument and a draw of the sample's seed."""
    seconds, value = arg
    await asyncio.sleep(seconds)
    return os.getpid(), value, torch.rand(2, generator=aioloader.sample_generator())


async def block_loop(seconds: float) -> None:
    time.sleep(seconds)  # noqa: ASYNC251 - blocks the worker's loop: a cancel cannot reach it


async def note_cancel(folder: str) -> None:
    Path(folder, "started").touch()  # noqa: ASYNC240 - a marker the test waits for
    try:
        await asyncio.sleep(WAIT_S)
    except asyncio.CancelledError:
        Path(folder, "cancelled").touch()  # noqa: ASYNC240
        raise


def wait_for_file(path: Path) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # a file written by another process: nothing can signal it
    return path.exists()


def mebibyte_tensor(_: Any) -> torch.Tensor:
    return torch.ones(1 << 18, dtype=torch.float32)


def fresh_16_mib(key: int) -> np.ndarray[Any, Any]:
    out = np.empty(16 << 20, dtype=np.uint8)
    out.fill(key)  # every page touched, as a decoder writes them
    return out


def blob(kind: str) -> bytes | bytearray:
    data = bytes(range(256)) * 400  # 100 KiB
    return data if kind == "bytes" else bytearray(data)


def parent_only_marks(_: Any) -> list[int]:
    """The descriptors this worker's process has marked parent-only (`slab_memory.parent_only`)."""
    from aioloader._executors.process.slab_memory import parent_only_fds

    return sorted(parent_only_fds())
