"""The process pool's results: reading the workers' answers and settling their tasks."""

from __future__ import annotations

import functools
import time
from typing import Any

from ..._util.bytearrays import Bytearrays
from . import wire
from .config import COPIES_BYTES
from .core import PoolState
from .outcomes import Outcomes, cancelled
from .slots import Slots
from .tasks import Handle, Task
from .wire import Unpacker, load_placed, rebuild_error
from .workers import Workers

__all__ = ["Reader"]


class Reader:
    """Reads what the workers answer and settles their tasks (on the pool's thread): results (DONE,
    FAILED) and a worker's start (READY, INIT_FAILED); its asks for an output slot (NEED, WANT) go
    to `Slots`."""

    def __init__(
        self, state: PoolState, outcomes: Outcomes, workers: Workers, slots: Slots
    ) -> None:
        self._state = state
        self._outcomes = outcomes
        self._workers = workers
        self._slots = slots
        # bytearray results are copied out of their slot into these (see `_util/bytearrays.py`)
        self.copies = Bytearrays(COPIES_BYTES)

    def read(self, h: Handle) -> None:
        if not h.open:
            return
        try:
            msgs = h.receive()
        except OSError:
            h.open = False  # it is exiting; its sentinel says when it is gone
            return
        for msg in msgs:
            kind = msg[0]
            if kind == wire.DONE:
                self._done(h, *msg[1:])
            elif kind == wire.NEED:
                self._slots.grow(h, *msg[1:])
            elif kind == wire.WANT:
                self._slots.want(h, *msg[1:])
            elif kind == wire.FAILED:
                self._failed(h, *msg[1:])
            elif kind == wire.READY:
                h.ready = True
                if all(x.ready for x in self._workers.handles):
                    self._state.ready.set()
            elif kind == wire.INIT_FAILED:  # the user's own error, raised anew each time
                self._state.fail(functools.partial(rebuild_error, msg[1], h.pid, "worker_init_fn"))

    def _finish(self, h: Handle, task_id: int, needed: int | None = None) -> Task | None:
        task = h.inflight.pop(task_id, None)
        if task is None:
            return None  # it timed out meanwhile and was answered already
        if task.is_async:
            h.async_n -= 1
            h.expired_n -= task.expired
        else:
            h.head_since = time.monotonic()
        state = self._state
        if needed is not None and (needed or not state.out_known):  # a result tells its size
            state.out_bytes = needed if not state.out_known else max(state.out_bytes, needed)
            state.out_known = True
        self._state.free(task.in_slot)
        self._state.free(task.spare)
        task.in_slot = task.spare = None
        return task

    def _done(self, h: Handle, task_id: int, data: Any, how: str, needed: int) -> None:
        task = self._finish(h, task_id, needed)
        if task is None:
            return
        slot, task.out_slot = task.out_slot, None
        if slot is not None and how in (wire.SINGLE, wire.SHM):
            self._state.delivered_at = time.monotonic()  # a slot the consumer has not seen yet
        if task.abandoned:
            self._state.free(slot)
            self._outcomes.settle(task, error=cancelled())
            return
        try:
            if how == wire.ROW and task.row is not None:
                result = task.row.batch.tensor[task.row.row]
                self._state.counts["results_in_rows"] += 1
            elif how == wire.SINGLE and slot is not None and self._state.arena is not None:
                result = load_placed(self._state.arena, slot, data, self.copies)
                self._state.counts["results_in_shm"] += 1
            elif how == wire.SHM and slot is not None and self._state.arena is not None:
                result = Unpacker(data, self._state.arena, slot, self.copies).load()
                self._state.counts["results_in_shm"] += 1
            else:
                result = Unpacker(data, None, None).load()  # arrays in band (`_in_band`)
                self._state.counts["results_pickled"] += 1
        except Exception as exc:
            exc.add_note(f"aioloader: while reading the result of decode worker pid {h.pid}")
            self._outcomes.settle(task, error=exc)
        else:
            self._outcomes.settle(task, result)
        finally:
            self._state.free(slot)

    def _failed(self, h: Handle, task_id: int, error: Any) -> None:
        task = self._finish(h, task_id)
        if task is not None:
            self._state.free(task.out_slot)
            task.out_slot = None
            if task.abandoned:
                self._outcomes.settle(task, error=cancelled())
                return
            where = "an async task" if task.is_async else "decode"
            self._outcomes.settle(task, error=rebuild_error(error, h.pid, where))
