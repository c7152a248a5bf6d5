"""The process pool's worker processes: starting each, watching its socket and exit, stopping all."""

from __future__ import annotations

import collections
import contextlib
import functools
import multiprocessing as mp
import os
import pickle
import selectors
import time
from collections.abc import Iterator
from multiprocessing.connection import wait
from typing import Any

import torch

from .config import FORKED, JOIN_TIMEOUT_S, STOP_GRACE_S, Config
from .tasks import Handle
from .worker import GIVEN, serve
from .zygote import Zygote, ZygoteProcess

__all__ = ["Workers", "pickle_given"]


class Workers:
    """The worker processes, a `Handle` each, and the selector the pool's thread waits on: starts,
    watches and stops them (on the pool's thread; `prepare` and `ungive` on the thread that starts
    or closes the pool, under its lock, and `close_zygote` there too if the pool's thread never
    started)."""

    def __init__(self, config: Config, counts: collections.Counter[str]) -> None:
        self.cfg = config
        self._counts = counts  # the pool's: each handle counts its pipe bytes there
        self.handles: list[Handle] = []
        # objects given to the workers as they start (see `worker.GIVEN`), by id
        self.given = {id(o): o for o in (*config.given, config.init) if o is not None}
        self._given_blob = (
            None if config.method in FORKED else pickle_given(self.given, config.method)
        )
        GIVEN.update(self.given)  # before any fork
        # what the pool's thread waits on: each worker's socket and sentinel, and the wake pipe
        self.selector = selectors.DefaultSelector()
        # from torch's seed, without drawing from its generator (a DataLoader must leave the global
        # RNG as torch's leaves it)
        self._seed = (torch.initial_seed() * 0x9E3779B97F4A7C15 + 1) % 2**62
        self._zygote: Zygote | None = None
        if config.method == "zygote" and not config.fork_at_start:
            self._zygote = Zygote(serve)

    def prepare(self) -> None:
        """(`Pool.start`.) What the workers are given, as it is now; the zygote, if it is forked
        only now."""
        if self._given_blob is not None:  # as they are now (checked at construction)
            self._given_blob = pickle_given(self.given, self.cfg.method)
        if self.cfg.method == "zygote" and self._zygote is None:
            self._zygote = Zygote(serve)

    def ungive(self) -> None:
        """(`Pool.close`.) Take back what the workers were given from `worker.GIVEN`."""
        for key, obj in self.given.items():
            if GIVEN.get(key) is obj:
                del GIVEN[key]

    def spawn(self, index: int) -> None:
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
        handle = Handle(index, process, conn, lifeline_w, self._counts)
        self.handles.append(handle)
        if self._given_blob is not None:
            handle.send_bytes(self._given_blob)
            handle.flush()

    def watch_all(self) -> None:
        for h in self.handles:
            self._watch(h)

    def _watch(self, h: Handle) -> None:
        """Wait on `h`'s socket (while it is open) and on its process's sentinel."""
        if h.open and not h.watched_conn:
            self.selector.register(h.conn.fileno(), selectors.EVENT_READ, ("conn", h))
            h.watched_conn = True
        if not h.open and h.watched_conn:  # at EOF it would read as ready forever
            self.selector.unregister(h.conn.fileno())
            h.watched_conn = False
        if not h.watched_exit:
            self.selector.register(h.process.sentinel, selectors.EVENT_READ, ("exit", h))
            h.watched_exit = True

    def _unwatch(self, h: Handle) -> None:
        """Stop waiting on `h` (before its descriptors close)."""
        if h.watched_conn:
            self.selector.unregister(h.conn.fileno())
        if h.watched_exit:
            self.selector.unregister(h.process.sentinel)
        h.watched_conn = h.watched_exit = False

    def flush(self) -> None:
        """Write what each worker has queued."""
        for h in self.handles:
            try:
                h.flush()
            except OSError:
                h.open = False  # it is dying: its sentinel will tell, and what it held is retried

    def bury(self, h: Handle) -> tuple[int | None, int]:
        """`h`'s process has exited (what it sent is read): let it go; (its exit code, its pid)."""
        h.process.join(0)
        code, pid = h.process.exitcode, h.pid
        self._unwatch(h)
        h.close_pipes()
        self.handles.remove(h)
        with contextlib.suppress(ValueError):
            h.process.close()
        return code, pid

    def stop(self) -> list[Handle]:
        """Stop every worker (SIGKILL past `STOP_GRACE_S`) and the selector; returns their
        handles, with the tasks they had in flight."""
        handles, self.handles = self.handles, []
        self.selector.close()
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
        return handles

    def close_zygote(self) -> None:
        if self._zygote is not None:
            self._zygote.close()


def pickle_given(given: dict[int, Any], method: str) -> bytes:
    """`given` pickled for workers that are not forked; a TypeError naming what does not pickle."""
    try:
        return pickle.dumps(given, protocol=5)
    except Exception as exc:
        where = next(
            (path for obj in given.values() for path in _unpicklable(obj, type(obj).__name__)),
            None,
        )
        raise TypeError(
            f"the worker processes do not fork (start method {method!r}), so what they run is "
            f"pickled, and "
            f"{where or 'it'} does not pickle ({type(exc).__name__}: {exc}). Define it at module "
            "level, keep the default (fork) start method, or read in threads "
            "(aioloader.DataLoader(..., worker_mode='thread'))"
        ) from exc


def _unpicklable(obj: Any, path: str, depth: int = 4) -> Iterator[str]:
    """Paths (`Dataset.transform.fn`) of the innermost attributes of `obj` that do not pickle."""
    try:
        pickle.dumps(obj, protocol=5)
        return
    except Exception:
        pass
    inner = vars(obj) if depth > 0 and hasattr(obj, "__dict__") else {}
    if isinstance(obj, functools.partial):
        inner = {"func": obj.func}
    elif depth > 0 and hasattr(obj, "__self__") and hasattr(obj, "__func__"):
        inner = {"__self__": obj.__self__}
    found = False
    for name, value in inner.items():
        for deeper in _unpicklable(value, f"{path}.{name}", depth - 1):
            found = True
            yield deeper
    if not found:
        yield path
