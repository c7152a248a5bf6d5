"""A fork server forked from this process ("zygote"), so workers start in milliseconds and share memory.

A stdlib forkserver is a fresh interpreter: it imports torch a second time (~150 MB of private memory
and seconds of CPU before the first worker can start). A zygote is forked from this process once, when
the executor is created, and then forks every worker itself. The executor picks it by default only
while this process has one thread and no CUDA context (`zygote_allowed`): then no lock can be held by
a thread that does not exist in the child, and no CUDA state is inherited. Workers inherit every
imported module copy-on-write and are forked from a process that has only ever had one thread.
Linux only (SOCK_SEQPACKET, PR_SET_PDEATHSIG).

The zygote closes the pipe and socket ends this process keeps to itself (`parent_only`: workers'
lifelines and sockets, other zygotes' sockets), ignores SIGINT, dies with this process
(PR_SET_PDEATHSIG, and EOF on its socket), freezes the garbage collector's view of inherited objects
(`gc.freeze`: collections in workers do not write to, and so do not copy, inherited pages) and
reports each worker's exit status.

Wire: a SOCK_SEQPACKET socket pair. This process sends ("spawn", args) with the worker's three file
descriptors (its socket, its lifeline's read end, its sentinel's write end) as SCM_RIGHTS; the zygote
answers ("spawned", pid) and, whenever a worker exits, ("exited", pid, exitcode).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from .slab_memory import forget_parent_only, parent_only, parent_only_fds
from .worker import die_with_parent, threads_running

__all__ = ["Zygote", "ZygoteProcess", "zygote_allowed"]

_MESSAGE_MAX = 1 << 16
_EXIT_WAIT_S = 1.0  # close(): how long the zygote gets to exit on EOF before SIGKILL


def zygote_allowed() -> str | None:
    """None if forking a zygote now is safe, else why not (CUDA initialised, threads running)."""
    if not sys.platform.startswith("linux"):
        return "the zygote needs Linux"
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return "CUDA is initialised in this process"
    running = threads_running()
    if running > 1:
        return f"this process runs {running} threads"
    return None


class Zygote:
    """The zygote process and this side of its socket. `spawn`/`exitcode` are thread-safe."""

    def __init__(self, serve: Any) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: native threads (OpenMP)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the zygote
            code = 1
            try:
                _close_parent_only(ours.fileno())
                _zygote_main(theirs, parent, serve)
                code = 0
            finally:
                os._exit(code)
        theirs.close()
        parent_only(ours.fileno())
        self.pid = pid
        self._sock = ours
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        self._reaped = False

    def spawn(self, args: tuple[Any, ...], fds: list[int]) -> int:
        """Fork a worker running `serve(conn, lifeline, *args)` with `fds`; its pid."""
        with self._lock:
            socket.send_fds(self._sock, [pickle.dumps(("spawn", args))], fds)
            while True:
                msg = self._recv()
                if msg[0] == "spawned":
                    return int(msg[1])

    def _recv(self) -> tuple[Any, ...]:
        data = self._sock.recv(_MESSAGE_MAX)
        if not data:
            raise OSError("the zygote process exited")
        msg: tuple[Any, ...] = pickle.loads(data)
        if msg[0] == "exited":
            self._exits[msg[1]] = msg[2]
        return msg

    def exitcode(self, pid: int, timeout: float) -> int | None:
        """The exit code of worker `pid`, waiting up to `timeout` for the zygote to report it."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while pid not in self._exits:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._sock], [], [], left)[0]:
                    return None
                try:
                    self._recv()
                except OSError:
                    return None
            return self._exits.pop(pid)

    def close(self) -> None:
        """Stop the zygote (its workers are stopped by their own lifelines). Idempotent."""
        with self._lock:
            if self._reaped:
                return
            self._reaped = True
            parent_only(self._sock.fileno(), keep=False)
            self._sock.close()  # EOF: it exits at once
        try:
            pidfd = os.pidfd_open(self.pid)
            try:
                exited = bool(select.select([pidfd], [], [], _EXIT_WAIT_S)[0])
            finally:
                os.close(pidfd)
        except OSError:
            exited = False
        if not exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)


class ZygoteProcess:
    """What the pool needs of `multiprocessing.Process`, for a worker forked by a zygote."""

    def __init__(self, zygote: Zygote, pid: int, sentinel: int) -> None:
        self._zygote = zygote
        self.pid = pid
        self.sentinel = sentinel  # EOF once the worker has exited: it holds the only write end
        self._code: int | None = None
        self._closed = False

    @property
    def exitcode(self) -> int | None:
        if self._code is None and not self._closed and wait([self.sentinel], 0):
            self._code = self._zygote.exitcode(self.pid, 1.0)
        return self._code

    def join(self, timeout: float | None = None) -> None:
        if not self._closed and wait([self.sentinel], timeout):
            _ = self.exitcode

    def kill(self) -> None:
        if self._closed or wait([self.sentinel], 0):
            return  # gone already: its pid may belong to someone else by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self.sentinel)


def _zygote_main(sock: socket.socket, parent: int, serve: Any) -> None:  # pragma: no cover
    die_with_parent()
    if os.getppid() != parent:
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready = select.select([sock.fileno(), wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(sock)
        if sock.fileno() in ready:
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE_MAX, 3)
            if not data:
                return  # this process closed us, or died
            _, args = pickle.loads(data)
            pid = os.fork()
            if pid == 0:
                _worker_main(serve, args, fds, [sock.fileno(), wake_r, wake_w])
            for fd in fds:
                os.close(fd)
            sock.send(pickle.dumps(("spawned", pid)))


def _close_parent_only(ours: int) -> None:  # pragma: no cover
    # Only descriptors we know: other inherited ones stay open, as with any fork (closing them would
    # leave Python objects owning numbers that a later open() reuses).
    for fd in {ours, *parent_only_fds()}:
        with contextlib.suppress(OSError):
            os.close(fd)
    forget_parent_only()  # closed: their numbers are free for what this process opens next


def _reap(sock: socket.socket) -> None:  # pragma: no cover
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(pickle.dumps(("exited", pid, os.waitstatus_to_exitcode(status))))


def _worker_main(
    serve: Any, args: tuple[Any, ...], fds: list[int], close: list[int]
) -> None:  # pragma: no cover
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in close:
        os.close(fd)
    conn, lifeline, _sentinel = fds  # the sentinel stays open until this process exits
    code = 0
    try:
        serve(Connection(conn), Connection(lifeline, writable=False), *args)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)
