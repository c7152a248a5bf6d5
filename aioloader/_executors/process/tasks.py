"""Tasks and the workers they are sent to, as the process executor's thread sees them.

- `Task`: one call, its encoded argument, its shared-memory slots and its future (a concurrent
  future for `submit`, an asyncio future for `run`).
- `Handle`: the parent's side of one worker process: its socket (messages framed as
  `Connection.send_bytes` frames them, queued and written in one call per step), its lifeline and
  its tasks in flight.

How their results reach the callers is `outcomes.py`; a batch whose rows workers write, `batch_buffer.py`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import pickle
import signal
import socket
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

from . import wire
from .arena import Arena, Slot
from .batch_buffer import RowTarget
from .slab_memory import parent_only

__all__ = ["INLINE_MAX", "Handle", "Task", "died_text", "encode_arg", "exit_text"]

INLINE_MAX = 64 << 10
"""Arguments up to this many bytes (raw or pickled) travel in the pipe; larger ones in shared memory."""
# Tasks sent ahead to one worker: one running, one waiting in its socket (hides the round trip).
FRAME_BYTES = 4  # the length prefix of each message (`Connection.send_bytes`'s framing)
READ_BYTES = 256 << 10  # what one read from a worker's socket takes at most


def encode_arg(arg: Any) -> tuple[str, bytes]:
    if type(arg) is bytes:
        return wire.RAW, arg
    if type(arg) is bytearray:
        return wire.RAW_BYTEARRAY, bytes(arg)
    if type(arg) is memoryview:
        return wire.RAW, arg.tobytes()
    try:
        return wire.PICKLED, pickle.dumps(arg, protocol=5)
    except Exception as exc:
        raise TypeError(
            f"executor='process' cannot send this decode argument to a worker: {exc}"
        ) from exc


def died_text(pid: int, code: int | None) -> str:
    """How a worker's death begins its error, in torch's DataLoader's words."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            name = signal.strsignal(-code)
            return f"DataLoader worker (pid {pid}) is killed by signal: {name}. ({exit_text(code)})"
    return f"DataLoader worker (pid {pid}) exited unexpectedly ({exit_text(code)})."


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


class Task:
    __slots__ = (
        "abandoned",
        "arg",
        "expired",
        "fn_id",
        "future",
        "id",
        "in_slot",
        "is_async",
        "isolated",
        "kind",
        "loop",
        "out_slot",
        "pin",
        "row",
        "seed",
        "sent_at",
        "spare",
        "started",
        "worker",
    )

    def __init__(
        self,
        task_id: int,
        fn: tuple[int, bool],
        seed: int | None,
        kind: str,
        arg: bytes,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.id = task_id
        self.fn_id, self.is_async = fn
        self.seed = seed
        self.kind = kind
        self.arg = arg
        # `submit`: a concurrent future. `run`: an asyncio future of `loop`, which only that loop's
        # thread may touch: the pool's thread queues its outcome (`Outcomes.settle`) and hands the
        # loop all outcomes of a step in one call (one wake-up, no lock, no Condition per task)
        self.future: concurrent.futures.Future[Any] | asyncio.Future[Any] = (
            concurrent.futures.Future() if loop is None else loop.create_future()
        )
        self.loop = loop
        self.in_slot: Slot | None = None
        self.out_slot: Slot | None = None
        self.spare: Slot | None = None  # an output slot found too small, until the task ends
        self.row: RowTarget | None = None
        self.pin: int | None = None  # the index of the only worker it may run on
        self.started = False
        self.worker: Handle | None = None  # where it was sent last
        self.sent_at = 0.0
        self.expired = False  # an async task past its timeout: answered, cancel sent
        self.abandoned = False  # answered or cancelled here: drop what the worker sends
        self.isolated = False  # in flight on a worker that died: runs again alone (a suspect)

    def take_slots(self) -> list[Slot]:
        """The shared-memory slots this task holds, which it holds no more."""
        slots = [s for s in (self.in_slot, self.out_slot, self.spare) if s is not None]
        self.in_slot = self.out_slot = self.spare = None
        return slots


class Handle:
    """The parent's side of one worker process."""

    def __init__(
        self,
        index: int,
        process: Any,
        conn: Connection,
        lifeline: Connection,
        counts: collections.Counter[str],
    ) -> None:
        self.index = index
        self.process = process
        self.pid: int = process.pid
        self.conn = conn
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))
        self.lifeline = lifeline
        self._fds = [conn.fileno(), self.sock.fileno(), lifeline.fileno()]
        for fd in self._fds:
            parent_only(fd)
        self.open = True  # its socket has not reached EOF
        self.ready = False
        self.killed = False
        self.spawned_at = self.head_since = time.monotonic()
        self.inflight: dict[int, Task] = {}  # in the order sent (plain ones run in that order)
        self.async_n = 0  # of them, async tasks
        self.expired_n = (
            0  # of those, timed out and cancelled, not ended yet: its loop may be stuck
        )
        self.counts = counts  # the pool's: pipe bytes are counted here
        self._out = bytearray()  # messages queued for one write (`flush`)
        self._in = bytearray()  # bytes read, not yet whole messages
        self._chunk = memoryview(bytearray(READ_BYTES))
        self.fns: set[int] = set()
        self.slabs: set[int] = set()
        self.quarantine: list[Slot] = []  # slots it may still write to until it is reaped
        self.watched_conn = self.watched_exit = False  # registered with the pool's selector

    @property
    def sync_n(self) -> int:
        """Plain (not async) tasks in flight: they run one after the other."""
        return len(self.inflight) - self.async_n

    def send(self, msg: tuple[Any, ...]) -> None:
        self.send_bytes(pickle.dumps(msg, protocol=5))

    def send_bytes(self, data: bytes) -> None:
        """Queue one message, framed as `Connection.send_bytes` frames it; `flush` writes it."""
        self._out += wire.frame_header(len(data))
        self._out += data
        self.counts["pipe_bytes_sent"] += len(data) + FRAME_BYTES

    def flush(self) -> None:
        """Write every queued message in one call. Raises OSError when the worker is gone."""
        if self._out:
            data, self._out = self._out, bytearray()
            self.sock.sendall(data)

    def receive(self) -> list[Any]:
        """The messages that have arrived, without blocking; at EOF `open` turns False."""
        while True:
            try:
                n = self.sock.recv_into(self._chunk, READ_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            if n == 0:
                self.open = False  # it is exiting; its sentinel says when it is gone
                break
            self._in += self._chunk[:n]
            if n < READ_BYTES:
                break
        msgs, pos, end = [], 0, len(self._in)
        with memoryview(self._in) as buf:
            while end - pos >= 4:
                (size,), start = struct.unpack_from("!i", buf, pos), pos + 4
                if size == -1:
                    if end - start < 8:
                        break
                    (size,), start = struct.unpack_from("!Q", buf, start), start + 8
                if end - start < size:
                    break
                msgs.append(pickle.loads(buf[start : start + size]))
                self.counts["pipe_bytes_received"] += start - pos + size
                pos = start + size
        del self._in[:pos]
        return msgs

    def share(self, arena: Arena, slab_id: int) -> None:
        if slab_id not in self.slabs:
            fd, size, whole = arena.slab_fd(slab_id)
            self.send((wire.SLAB, slab_id, size, whole))
            self.flush()  # the descriptor follows its message
            socket.send_fds(self.sock, [b"F"], [fd])
            self.counts["pipe_bytes_sent"] += 1
            self.slabs.add(slab_id)

    def take_all(self) -> list[Task]:
        """Empty its tasks in flight; returns them in the order sent."""
        tasks = list(self.inflight.values())
        self.inflight.clear()
        self.async_n = self.expired_n = 0
        return tasks

    def close_pipes(self) -> None:
        """Close this side of its socket and its lifeline (idempotent)."""
        self.open = False
        for fd in self._fds:
            parent_only(fd, keep=False)
        self._fds = []
        for end in (self.lifeline, self.conn, self.sock):
            with contextlib.suppress(OSError):
                end.close()
