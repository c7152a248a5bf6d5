"""The process pool's worker processes: starting each, watching its socket and exit, stopping all."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import selectors
import time
from multiprocessing.connection import wait
from typing import Any

from ..._exceptions import LoaderClosedError
from .config import JOIN_TIMEOUT_S, STOP_GRACE_S
from .core import PoolCore, factory
from .tasks import Handle
from .worker import serve
from .zygote import ZygoteProcess

__all__ = ["WorkerProcesses"]


class WorkerProcesses(PoolCore):
    """Starts, watches and stops the worker processes (on the pool's thread)."""

    def _spawn(self, index: int) -> None:
        conn, child_conn = mp.Pipe(duplex=True)
        lifeline_r, lifeline_w = mp.Pipe(duplex=False)
        init = None if self.cfg.init is None else id(self.cfg.init)
        args = (index, self._seed + index, init, self._given_blob is not None)
        process: Any
        try:
            if self._zygote is not None:
                sentinel, sentinel_w = os.pipe()
                try:
                    fds = [child_conn.fileno(), lifeline_r.fileno(), sentinel_w]
                    process = ZygoteProcess(self._zygote, self._zygote.spawn(args, fds), sentinel)
                finally:
                    os.close(sentinel_w)
            else:
                assert self.cfg.context is not None
                process = self.cfg.context.Process(  # type: ignore[attr-defined]
                    target=serve, args=(child_conn, lifeline_r, *args), daemon=True,
                    name=f"aioloader-decode-{index}",
                )  # fmt: skip
                process.start()
        finally:
            child_conn.close()
            lifeline_r.close()
        handle = Handle(index, process, conn, lifeline_w, self.counts)
        self._handles.append(handle)
        if self._given_blob is not None:
            handle.send_bytes(self._given_blob)
            handle.flush()

    def _watch(self, h: Handle) -> None:
        """Wait on `h`'s socket (while it is open) and on its process's sentinel."""
        if h.open and not h.watched_conn:
            self._selector.register(h.conn.fileno(), selectors.EVENT_READ, ("conn", h))
            h.watched_conn = True
        if not h.open and h.watched_conn:  # at EOF it would read as ready forever
            self._selector.unregister(h.conn.fileno())
            h.watched_conn = False
        if not h.watched_exit:
            self._selector.register(h.process.sentinel, selectors.EVENT_READ, ("exit", h))
            h.watched_exit = True

    def _unwatch(self, h: Handle) -> None:
        """Stop waiting on `h` (before its descriptors close)."""
        if h.watched_conn:
            self._selector.unregister(h.conn.fileno())
        if h.watched_exit:
            self._selector.unregister(h.process.sentinel)
        h.watched_conn = h.watched_exit = False

    def _shutdown(self) -> None:
        with self._lock:
            self.closed = True
        handles, self._handles = self._handles, []
        self._selector.close()
        for h in handles:
            h.close_pipes()  # the lifeline's EOF makes each worker `os._exit` at once
        deadline = time.monotonic() + STOP_GRACE_S
        alive = [h for h in handles if h.process.exitcode is None]
        while alive and time.monotonic() < deadline:
            wait([h.process.sentinel for h in alive], deadline - time.monotonic())
            alive = [h for h in alive if h.process.exitcode is None]
        for h in handles:
            if h.process.exitcode is None:
                with contextlib.suppress(OSError):
                    h.process.kill()
            h.process.join(JOIN_TIMEOUT_S)
            with contextlib.suppress(ValueError):
                h.process.close()
        failure = self._failure or factory(LoaderClosedError, "the process executor was closed")
        tasks = [*self._pending, *self._inbox, *(t for h in handles for t in h.inflight.values())]
        self._pending.clear()
        self._inbox.clear()
        self._cancels.clear()
        for task in tasks:
            self._settle(task, error=failure())
        self._hand_over()
        if self._arena is not None:
            self._arena.close()
        if self._zygote is not None:
            self._zygote.close()
        with self._lock:
            wake_r, wake_w = self._wake_r, self._wake_w
            self._wake_r = self._wake_w = -1  # `_slot_freed` writes to it no more
            os.close(wake_r)
            os.close(wake_w)
        self._ready.set()
