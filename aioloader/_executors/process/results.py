"""The process pool's results: reading the workers' answers and settling their tasks."""

from __future__ import annotations

import functools
import time
from typing import Any

from . import wire
from .arena import Slot
from .config import SLOT_WAIT_S
from .outcomes import cancelled
from .sending import Sending
from .tasks import Handle, Task
from .wire import Unpacker, load_placed, rebuild_error

__all__ = ["Results"]


class Results(Sending):
    """Reads what the workers answer and settles their tasks (on the pool's thread)."""

    def _read(self, h: Handle) -> None:
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
                self._grow(h, *msg[1:])
            elif kind == wire.WANT:
                self._want(h, *msg[1:])
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

    def _grow(self, h: Handle, task_id: int, needed: int) -> None:
        """A result did not fit its output slot (the first of a `size_first` pool): learn the size,
        and give the worker a slot that holds it (or none: it then pickles the result)."""
        self._state.out_bytes, self._state.out_known = max(self._state.out_bytes, needed), True
        task = h.inflight.get(task_id)
        if task is None or self._state.arena is None:
            return  # it timed out meanwhile: the worker is being replaced
        task.spare, task.out_slot = task.out_slot, self._out_slot(h, needed)
        ref = None
        if task.out_slot is not None:
            h.share(self._state.arena, task.out_slot.slab_id)
            ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        h.send((wire.GROWN, task_id, ref))

    def _want(self, h: Handle, task_id: int, patient: bool, nbytes: int = 0) -> None:
        """A running whole-batch task asks for its output slot (`wire.py`: WANT). A free one is
        granted at once, and so is a patient ask's None; the last ask may wait (`_answer_wants`).
        An ask with `nbytes` more than the task's slot holds (a first batch, larger than the guess)
        gives that slot back and tells the pool the size of its results."""
        task = h.inflight.get(task_id)
        if task is None or self._state.arena is None:
            h.send((wire.SLOT, task_id, None))
            return
        if nbytes:
            if task.out_slot is not None and nbytes > task.out_slot.capacity:
                self._state.free(task.out_slot)
                task.out_slot = None
            state = self._state
            state.out_bytes = max(state.out_bytes, nbytes) if state.out_known else nbytes
            state.out_known = True
        if task.out_slot is None:
            if patient:
                task.out_slot = self._free_slot(h, others=False)
            else:
                self._wants.append((h, task_id, time.monotonic()))
                self._answer_wants()
                return
        self._grant(h, task_id, task.out_slot)

    def _grant(self, h: Handle, task_id: int, slot: Slot | None) -> None:
        ref = None
        if slot is not None and self._state.arena is not None:
            h.share(self._state.arena, slot.slab_id)
            ref = (slot.slab_id, slot.offset, slot.capacity)
        h.send((wire.SLOT, task_id, ref))

    def _answer_wants(self) -> None:
        """Answer the last asks for a slot (`_want`) that can be answered now.

        A free slot of `h`'s slabs is granted at once (of any slab, to the oldest task in flight).
        Else the ask waits up to `SLOT_WAIT_S` for one to be freed, counted from when no older task
        is in flight (until then the consumer waits for that one); once such a wait has run out (the
        consumer keeps its batches a while), asks wait no more for that, and `h` may get a slab more
        (`_more_slot`). Past that, an ask waits while another worker is busy and not waiting itself
        (its result, or the consumer, will free a slot), or while the consumer frees slots (one
        freed lately: `_keeps_from`); else it gets None (the batch is pickled: a consumer
        that keeps every batch never deadlocks the pool). An ask whose task or worker is gone is
        dropped: its worker is being replaced.
        """
        self._state.slot_waits = True  # before: a slot freed meanwhile wakes us
        wants, self._wants = sorted(self._wants, key=lambda want: want[1]), []  # oldest first
        now = time.monotonic()
        oldest = min((t for x in self._workers.handles for t in x.inflight), default=None)
        roomy = self._roomy()
        for i, (h, task_id, since) in enumerate(wants):
            task = h.inflight.get(task_id)
            if task is None or not h.open:
                continue
            if oldest is not None and oldest < task_id:
                since = now  # the consumer waits for an older batch: not a sign that it keeps ours
                if not roomy and self._older_unslotted(task_id):
                    self._wants.append((h, task_id, since))
                    continue
            # another worker's free slot only for the oldest batch: one taken by a later batch stays
            # held (the consumer takes batches in order) while the one it needs waits for room
            slot = self._free_slot(h, others=oldest is None or oldest >= task_id)
            if slot is None and (self._consumer_keeps or now >= since + SLOT_WAIT_S):
                self._consumer_keeps = True
                waiting = {w[0] for w in wants[i + 1 :]} | {w[0] for w in self._wants}
                alone = not self._busy(but=h, waiting=waiting)
                slot = self._more_slot(h, alone=alone)
                if slot is None and alone and now >= self._state.keeps_from():
                    task.out_slot = None  # the consumer keeps what it has, so none would come
                    self._grant(h, task_id, None)
                    continue
            if slot is None:
                self._wants.append((h, task_id, since))
                continue
            task.out_slot = slot
            self._grant(h, task_id, slot)
        self._state.slot_waits = bool(self._wants)

    def _older_unslotted(self, task_id: int) -> bool:
        """Whether a whole batch sent before `task_id` has no output slot of the size results take
        yet. Under a budget that does not hold two batches per worker, slots go to batches in the
        order the consumer takes them: a later batch that took the last room would be held in the
        consumer's reorder while the batch it needs first waits for room that never comes (and is
        then made in its worker's memory and pickled, past the budget)."""
        size = self._state.out_bytes
        return any(
            t < task_id and not task.is_async and task.row is None
            and (task.out_slot is None or task.out_slot.capacity < size)
            for x in self._workers.handles for t, task in x.inflight.items()
        )  # fmt: skip

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
                result = load_placed(self._state.arena, slot, data, self._copies)
                self._state.counts["results_in_shm"] += 1
            elif how == wire.SHM and slot is not None and self._state.arena is not None:
                result = Unpacker(data, self._state.arena, slot, self._copies).load()
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
