"""The process pool's settings: its `Config`, the start method it picks, the constants it keeps."""

from __future__ import annotations

import multiprocessing as mp
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

import torch

from ..._util.deps import forkserver_preloaded
from .main_guard import check_main_guard
from .zygote import zygote_allowed

__all__ = ["ASYNC_DEPTH", "Config", "pick_start_method"]


# Tasks sent ahead to one worker: one running, one waiting in its socket (hides the round trip).
# With `INLINE_MAX` this keeps what a worker has not read yet far below a socket's buffer, so the
# pool's thread never blocks on a send.
QUEUE_DEPTH = 2
ASYNC_DEPTH = 64  # async tasks one worker may hold at once, by default
COPIES_BYTES = 64 << 20  # recycled bytearrays kept for results copied out of slots, at most
# Whole batches: the slabs one worker may map for itself, the one it writes and the one it wrote last
# (the consumer has not taken it yet). Each costs the worker its pages' mapping once, and stays. A
# worker whose batch is read waits up to `SLOT_WAIT_S` for its first to be freed before a second is
# made; once such a wait has run out (a consumer that keeps batches a while), none waits again.
SLABS_PER_WORKER = 2
SLOT_WAIT_S = 0.1
# A batch that finds no slot and no room for one waits for the consumer to free one while it frees
# slots at all: none freed for this long (or three of its usual gaps between frees, if longer) since
# the later of its last free and the last result it was handed, and it is pickled instead (a consumer
# that keeps them all: `PoolState.keeps_from`).
RELEASES_STOP_S = 1.0
FIRST_OUTPUT_BYTES = 1 << 20  # output slot for tasks before the first result tells the real size
CANCEL_GRACE_S = 1.0  # a timed-out async task not ended this long after its cancel: kill the worker
START_TIMEOUT_S = 60.0  # a worker not ready by then (hung worker_init_fn) fails the pool
STOP_GRACE_S = 0.5  # close(): how long workers get to exit before SIGKILL
JOIN_TIMEOUT_S = 2.0
FORKED = ("zygote", "fork")  # start methods whose workers inherit what they are given
_PRELOAD = (
    "aioloader._executors.process.worker",
)  # imports torch, numpy and aioloader once, in the forkserver


def pick_start_method(
    method: str | None, like_torch: bool = False
) -> tuple[str, BaseContext | None]:
    """(method, its multiprocessing context; None for "zygote"). None picks as the docstring says;
    `like_torch`: forks where torch's DataLoader does (any Linux process, threads or CUDA).
    Raises RuntimeError where "forkserver" or "spawn" workers would run the caller's unguarded
    top-level script code again (`check_main_guard`)."""
    methods = [*mp.get_all_start_methods(), "zygote"]
    torch_fork = like_torch and method is None and sys.platform.startswith("linux")
    no_zygote = None
    if method is None:
        no_zygote = None if torch_fork else zygote_allowed()
        method = "zygote" if no_zygote is None else "forkserver"
        method = method if method in methods else "spawn"
    if method not in methods:
        raise ValueError(f"start_method must be one of {methods}, got {method!r}")
    cuda_live: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if method in ("fork", "zygote") and cuda_live and not torch_fork:
        raise RuntimeError(
            f"start_method={method!r} after CUDA was initialised in this process: a forked "
            "worker inherits a CUDA context it cannot use; use 'forkserver' or 'spawn'"
        )
    if method == "zygote":
        return method, None
    check_main_guard(method, no_zygote)  # before a forkserver or worker runs the script again
    ctx = mp.get_context(method)
    if method == "forkserver":
        preload = forkserver_preloaded()
        ctx.set_forkserver_preload(preload + [m for m in _PRELOAD if m not in preload])
    return method, ctx


@dataclass(frozen=True)
class Config:
    workers: int
    method: str
    context: BaseContext | None
    timeout: float | None
    max_restarts: int
    init: Callable[[int], Any] | None
    arena_bytes: int
    inline_max: int
    async_depth: int
    size_first: bool = False  # see ProcessExecutor
    given: tuple[Any, ...] = ()  # see ProcessExecutor
    fork_at_start: bool = False  # the zygote is forked by `start`, not by the constructor
