"""The process pool's sending: which task goes to which worker, with which shared-memory slots."""

from __future__ import annotations

import collections
import contextlib
import time

from . import wire
from .config import QUEUE_DEPTH
from .core import PoolState
from .outcomes import Outcomes, cancelled
from .slots import Slots
from .tasks import Handle, Task
from .workers import Workers

__all__ = ["Sender"]


class Sender:
    """The queue of tasks not sent yet, and their sending to the workers that have room (on the
    pool's thread): a large input in a slot of the arena, the output slot from `Slots`."""

    def __init__(
        self, state: PoolState, outcomes: Outcomes, workers: Workers, slots: Slots
    ) -> None:
        self.cfg = state.cfg
        self._state = state
        self._outcomes = outcomes
        self._workers = workers
        self._slots = slots
        self._pending: collections.deque[Task] = collections.deque()  # in the order to send
        # each callable pickled once (or the id of one given to the workers), by its id: written
        # by `Pool._register` on the caller's thread, under the pool's lock, before its first task
        self.fn_blobs: dict[int, bytes | int] = {}
        self._send_waits = False  # a task waits to be sent until a slot is freed (`_releasing`)
        self._kept_waits = False  # ... and that wait is for a consumer that may be keeping

    def queue(self, task: Task) -> None:
        """Queue `task` behind the others."""
        self._pending.append(task)

    def retry(self, tasks: list[Task]) -> None:
        """Queue `tasks` again (taken back from a worker), in their order, ahead of the others."""
        self._pending.extendleft(reversed(tasks))

    def take_all(self) -> list[Task]:
        """Empty the queue; returns its tasks in order."""
        tasks = list(self._pending)
        self._pending.clear()
        return tasks

    def dispatch(self) -> None:
        """Send what the workers have room for, in order; a task pinned to a busy worker waits
        without holding back the tasks behind it that may go elsewhere (only those pinned to the
        same worker wait behind it: a worker runs its tasks in the order they were submitted)."""
        passed: collections.deque[Task] = collections.deque()  # not sent yet, in order
        held: set[int] = set()  # workers whose next task waits
        while self._pending:
            task = self._pending.popleft()
            if not task.started:
                future = task.future
                if task.loop is None and not future.set_running_or_notify_cancel():  # type: ignore[union-attr]
                    continue  # cancelled while queued
                task.started = True
            if task.abandoned:
                self._outcomes.settle(task, error=cancelled())
                continue
            h = None if task.pin in held else self._pick(task)
            try:
                if h is not None and self._send(h, task):
                    continue
            except OSError:  # it is dying; its sentinel will tell, and the task stays queued
                assert h is not None
                h.open = False
                for slot in task.take_slots():
                    self._state.free(slot)
                self._pending.appendleft(task)
                continue
            except BaseException:  # a bug: keep every task where `Pool._shutdown` fails it
                self._pending.extendleft([task, *reversed(passed)])
                raise
            passed.append(task)
            if task.pin is None:
                break  # no worker has room for it: nor for those behind it
            held.add(task.pin)
        self._pending.extendleft(reversed(passed))
        if self._state.arena is not None:
            for slab_id in self._state.arena.take_dropped():
                for h in self._workers.handles:
                    if slab_id in h.slabs and h.open:
                        h.slabs.discard(slab_id)
                        with contextlib.suppress(OSError):
                            h.send((wire.DROP, slab_id))

    def _pick(self, task: Task) -> Handle | None:
        """The ready worker with the fewest tasks in flight that has room for `task`, if any."""
        best: Handle | None = None
        for h in self._workers.handles:
            if not h.ready or not h.open or h.killed or task.pin not in (None, h.index):
                continue
            if (
                self._state.restarts
                and h.inflight
                and (task.isolated or any(t.isolated for t in h.inflight.values()))
            ):
                continue  # a suspect (there are some only after a restart) runs alone: `Faults.reap`
            if task.is_async:  # none to a loop that has not ended a timed-out task yet
                room = h.async_n < self._async_room() and not h.expired_n
            else:  # a whole batch keeps a worker busy far longer than a round trip: one at a time
                room = h.sync_n < (1 if self.cfg.size_first else QUEUE_DEPTH)
            if room and (best is None or len(h.inflight) < len(best.inflight)):
                best = h
        return best

    def _releasing(self) -> bool:
        """Whether the consumer is not yet taken to keep what it holds (`PoolState.keeps_from`)."""
        return time.monotonic() < self._state.keeps_from()

    def _async_room(self) -> int:
        """Async tasks one worker may hold now. Until the first result tells how large results are,
        one: a first wave of `async_depth` tasks per worker would either fill the arena with slots of
        a guessed size or, without slots, send every result of that wave through the pipe."""
        return self.cfg.async_depth if self._state.out_known else 1

    def _send(self, h: Handle, task: Task) -> bool:
        """Send `task` to `h`; False when it must wait (a large message, and `h` is busy)."""
        arena, inline_max = self._state.arena, self.cfg.inline_max
        assert arena is not None
        if task.fn_id not in h.fns:
            blob = self.fn_blobs[task.fn_id]
            if isinstance(blob, bytes) and len(blob) > inline_max and h.inflight:
                return False
            h.send((wire.FN, task.fn_id, blob, task.is_async))
            h.fns.add(task.fn_id)
        inline: bytes | None = task.arg
        in_ref = out_ref = None
        if len(task.arg) > inline_max:
            if task.in_slot is None:
                task.in_slot = arena.acquire(len(task.arg))
                if task.in_slot is not None:
                    task.in_slot.write(task.arg)
            if task.in_slot is not None:
                h.share(arena, task.in_slot.slab_id)
                inline, in_ref = None, (task.in_slot.slab_id, task.in_slot.offset, len(task.arg))
                self._state.counts["inputs_in_shm"] += 1
            elif h.inflight:
                return False  # no slot free: send it inline, but only to an idle worker
        row = None if task.row is None else task.row.batch.wire(task.row.row)
        grow = self.cfg.size_first and not task.is_async and row is None
        ask = False
        if self._state.out_bytes and task.out_slot is None and row is None:
            if grow and self._state.out_known and self._slots.roomy():
                # only a free slot now; else the worker asks as it needs one (`wire.py`)
                task.out_slot = arena.acquire(self._state.out_bytes, h.slabs, only=True, new=False)
                ask = task.out_slot is None
            else:
                self._state.slot_waits = grow  # before: a slot freed meanwhile wakes us
                task.out_slot = self._slots.out_slot(h)
                # no slot for it: wait for one, while a result or the consumer may free it (else
                # it would be made in its worker's memory, past the budget); a consumer that has
                # freed none for a while keeps what it has (`keeps_from`), and the batch goes without
                if task.out_slot is None and grow and (self._slots.busy() or self._releasing()):
                    self._send_waits = True  # `deadlines` looks again by `keeps_from`
                    self._kept_waits = self._kept_waits or not self._slots.busy()
                    return False
                if task.out_slot is None and grow and self._kept_waits:
                    # the wait ran out: the consumer keeps its batches, this one goes pickled
                    self._state.counts["consumer_waits"] += 1
                    self._kept_waits = False
                self._state.slot_waits = bool(self._slots.wants)
        if task.out_slot is not None:
            h.share(arena, task.out_slot.slab_id)
            out_ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        if task.row is not None:
            h.share(arena, task.row.batch.slot.slab_id)
        now = time.monotonic()
        if not task.is_async and not h.sync_n:
            h.head_since = now
        h.send((
            wire.TASK, task.id, task.fn_id, task.seed, task.kind, inline, in_ref, out_ref, row, grow,
            ask,
        ))  # fmt: skip
        h.inflight[task.id] = task
        task.worker, task.sent_at = h, now
        h.async_n += task.is_async
        self._state.counts["tasks"] += 1
        self._state.counts["async_tasks"] += task.is_async
        return True

    def deadlines(self, now: float, keeps_from: float) -> list[float]:
        """When a task that waits to be sent (`_send_waits`) is to be looked at again, if no slot
        is freed and no result comes before: when the consumer is taken to keep what it holds
        (`keeps_from`: `PoolState.keeps_from()` at `now`)."""
        deadlines: list[float] = []
        if self._send_waits and self._pending:
            self._send_waits = False
            if keeps_from > now:
                deadlines.append(keeps_from)
        return deadlines
