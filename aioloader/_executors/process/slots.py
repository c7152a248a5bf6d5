"""The process pool's output slots: which slot a task's result gets, and the workers' asks for one."""

from __future__ import annotations

import time
from collections.abc import Container

from . import wire
from .arena import Slot, size_class
from .config import SLABS_PER_WORKER, SLOT_WAIT_S
from .core import PoolState
from .tasks import Handle
from .workers import Workers

__all__ = ["Slots"]


class Slots:
    """Output slots for results, whole batches above all (on the pool's thread): the slot a task is
    sent with (`out_slot`), and the answers to a worker that asks for one as its result needs it
    (NEED: `grow`; WANT: `want`, the asks that wait, `answer_wants`). Reads the arena and the size
    results take from `PoolState`, and the tasks in flight from `Workers`."""

    def __init__(self, state: PoolState, workers: Workers) -> None:
        self.cfg = state.cfg
        self._state = state
        self._workers = workers
        self.wants: list[tuple[Handle, int, float]] = []  # (worker, task id, since): slot asks
        self.consumer_keeps = False  # a slot ask waited `SLOT_WAIT_S` in vain
        self._kept_wait = False  # an ask waits for a consumer that may keep its batches

    def out_slot(self, h: Handle, nbytes: int | None = None) -> Slot | None:
        """An output slot for a task sent to `h` (for whole batches: `free_slot`, else
        `more_slot`)."""
        arena, nbytes = self._state.arena, nbytes or self._state.out_bytes
        assert arena is not None
        if not self.cfg.size_first:
            return arena.acquire(nbytes, h.slabs)
        return self.free_slot(h, nbytes) or self.more_slot(h, nbytes, not self.busy(but=h))

    def free_slot(self, h: Handle, nbytes: int | None = None, others: bool = True) -> Slot | None:
        """For a whole batch of `h`: a free slot of a slab `h` has mapped, or its first slab; else,
        with `others`, a free slot of any slab."""
        arena, nbytes = self._state.arena, nbytes or self._state.out_bytes
        assert arena is not None
        first = arena.whole_slabs(h.slabs, nbytes) == 0
        slot = arena.acquire(nbytes, h.slabs, only=True, new=first)
        if slot is None and others:
            slot = arena.acquire(nbytes, new=False)
        return slot

    def more_slot(self, h: Handle, nbytes: int | None = None, alone: bool = False) -> Slot | None:
        """For a whole batch of `h` when no slot is free: the second slab of `h` (below
        `SLABS_PER_WORKER`), else, `alone` (no other worker is busy: no result of theirs will free
        a slot), one within the budget; else None."""
        arena, nbytes = self._state.arena, nbytes or self._state.out_bytes
        assert arena is not None
        room = arena.whole_slabs(h.slabs, nbytes) < SLABS_PER_WORKER
        slot = arena.acquire(nbytes, h.slabs, only=True, new=room)
        if slot is None and alone:
            slot = arena.acquire(nbytes)
        return slot

    def busy(self, but: Handle | None = None, waiting: Container[Handle] = ()) -> bool:
        """Whether a worker (other than `but`, and not one `waiting` for a slot) has a task in
        flight: its result, or the consumer taking the results before it, will free a slot."""
        return any(h.inflight for h in self._workers.handles if h is not but and h not in waiting)

    def roomy(self) -> bool:
        """Whether the budget holds `SLABS_PER_WORKER` batch slabs for every worker. Only then
        is a whole batch sent without a slot, its worker asking for one as it needs it: a worker
        waits only for its own, which its earlier batches hold (the consumer takes them first). A
        tighter budget could be spent by later batches while the next one the consumer needs waits
        for room, so there a task is sent only with its slot, the oldest first."""
        assert self._state.arena is not None
        need = self.cfg.workers * SLABS_PER_WORKER * size_class(self._state.out_bytes)
        return need <= self._state.arena.budget

    def grow(self, h: Handle, task_id: int, needed: int) -> None:
        """A result did not fit its output slot (the first of a `size_first` pool): learn the size,
        and give the worker a slot that holds it (or none: it then pickles the result)."""
        state = self._state
        state.out_bytes, state.out_known = max(state.out_bytes, needed), True
        task = h.inflight.get(task_id)
        if task is None or state.arena is None:
            return  # it timed out meanwhile: the worker is being replaced
        task.spare, task.out_slot = task.out_slot, self.out_slot(h, needed)
        ref = None
        if task.out_slot is not None:
            h.share(state.arena, task.out_slot.slab_id)
            ref = (task.out_slot.slab_id, task.out_slot.offset, task.out_slot.capacity)
        h.send((wire.GROWN, task_id, ref))

    def want(self, h: Handle, task_id: int, patient: bool, nbytes: int = 0) -> None:
        """A running whole-batch task asks for its output slot (`wire.py`: WANT). A free one is
        granted at once, and so is a patient ask's None; the last ask may wait (`answer_wants`).
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
                task.out_slot = self.free_slot(h, others=False)
            else:
                self.wants.append((h, task_id, time.monotonic()))
                self.answer_wants()
                return
        self._grant(h, task_id, task.out_slot)

    def _grant(self, h: Handle, task_id: int, slot: Slot | None) -> None:
        ref = None
        if slot is not None and self._state.arena is not None:
            h.share(self._state.arena, slot.slab_id)
            ref = (slot.slab_id, slot.offset, slot.capacity)
        h.send((wire.SLOT, task_id, ref))

    def answer_wants(self) -> None:
        """Answer the last asks for a slot (`want`) that can be answered now.

        A free slot of `h`'s slabs is granted at once (of any slab, to the oldest task in flight).
        Else the ask waits up to `SLOT_WAIT_S` for one to be freed, counted from when no older task
        is in flight (until then the consumer waits for that one); once such a wait has run out (the
        consumer keeps its batches a while), asks wait no more for that, and `h` may get a slab more
        (`more_slot`). Past that, an ask waits while another worker is busy and not waiting itself
        (its result, or the consumer, will free a slot), or while the consumer frees slots (one
        freed lately: `PoolState.keeps_from`); else it gets None (the batch is pickled: a consumer
        that keeps every batch never deadlocks the pool). An ask whose task or worker is gone is
        dropped: its worker is being replaced.
        """
        self._state.slot_waits = True  # before: a slot freed meanwhile wakes us
        wants, self.wants = sorted(self.wants, key=lambda want: want[1]), []  # oldest first
        now = time.monotonic()
        oldest = min((t for x in self._workers.handles for t in x.inflight), default=None)
        roomy = self.roomy()
        for i, (h, task_id, since) in enumerate(wants):
            task = h.inflight.get(task_id)
            if task is None or not h.open:
                continue
            if oldest is not None and oldest < task_id:
                since = now  # the consumer waits for an older batch: not a sign that it keeps ours
                if not roomy and self._older_unslotted(task_id):
                    self.wants.append((h, task_id, since))
                    continue
            # another worker's free slot only for the oldest batch: one taken by a later batch stays
            # held (the consumer takes batches in order) while the one it needs waits for room
            slot = self.free_slot(h, others=oldest is None or oldest >= task_id)
            if slot is None and (self.consumer_keeps or now >= since + SLOT_WAIT_S):
                self.consumer_keeps = True
                waiting = {w[0] for w in wants[i + 1 :]} | {w[0] for w in self.wants}
                alone = not self.busy(but=h, waiting=waiting)
                slot = self.more_slot(h, alone=alone)
                if slot is None and alone and now >= self._state.keeps_from():
                    task.out_slot = None  # the consumer keeps what it has, so none would come
                    self._grant(h, task_id, None)
                    if self._kept_wait:  # an ask waited for that: count the wait, once
                        self._state.counts["consumer_waits"] += 1
                        self._kept_wait = False
                    continue
                self._kept_wait = self._kept_wait or (slot is None and alone)
            if slot is None:
                self.wants.append((h, task_id, since))
                continue
            task.out_slot = slot
            self._grant(h, task_id, slot)
        self._state.slot_waits = bool(self.wants)

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

    def deadlines(self, now: float, keeps_from: float) -> list[float]:
        """When `answer_wants` has something to do, if no slot is freed and no result comes
        (`keeps_from`: `PoolState.keeps_from()` at `now`)."""
        deadlines: list[float] = []
        if self.wants and not self.consumer_keeps:
            deadlines += [since + SLOT_WAIT_S for _, _, since in self.wants]
        elif self.wants and keeps_from > now:
            deadlines.append(keeps_from)  # else: a slot freed, or a result
        return deadlines
