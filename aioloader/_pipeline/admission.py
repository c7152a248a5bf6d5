"""Admission: when the next sample of an epoch may go, and what it holds until its batch is taken.

An epoch's memory is bounded by what it lets in, counted in samples and bytes, never in time:
- at most `concurrency` fetches in flight (the tuner may move that limit while the epoch runs);
- at most `prefetch * group_size + concurrency` samples held between launch and hand-over, so memory
  is bounded by `prefetch` batches plus `concurrency` samples whatever the consumer does;
- at most `max_bytes_in_flight` bytes held from fetch to hand-over (`ByteBudget`, `_tuning/`);
- while process workers write batch rows in place (`RowPlan`), at most `ROWS_AHEAD_PER_WORKER`
  decodes per worker sent ahead, so that only the batches being decoded hold a buffer in shared
  memory.

These bounds are one object because a launch waits on them together, in one order, and a batch
taken gives back to them together; the recorder's counts of what is held (`stats()`'s
`held_samples`, `held_bytes`, `reserved_bytes`) follow them from here. The sample path tells the
byte budget what it measures (`bytes`); the outbox gives the places back (`let_go`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .._tuning.bounds import ByteBudget, Gate, HeldBound
from .._util.loops import is_async_callable
from .stages import Stages

__all__ = ["ROWS_AHEAD_PER_WORKER", "Admission"]

ROWS_AHEAD_PER_WORKER = 4  # decodes sent ahead per worker while workers write batch rows


class Admission:
    """The bounds one epoch keeps (see the module docstring). Construct it on the epoch's loop.

    `admit` is awaited by the epoch's launcher alone (one waiter at a time); the rest is called on
    the loop and never blocks.

    Attributes:
        bytes: the byte budget, told by the sample path what each sample measures and adds.
        decoding: while workers write batch rows, the decodes sent ahead (None: not bounded here).
        fetch_ended: call as a fetch ends, whatever its outcome: its place goes to the next one.
    """

    def __init__(self, stages: Stages) -> None:
        assert stages.tuner is not None
        self._rec = stages.recorder
        self._size_of = stages.size_of
        self._held = Gate(HeldBound(stages.tuner, stages.prefetch * stages.group_size))
        self._in_flight = Gate(stages.tuner)
        # the in-flight gate's own `release`, bound: the sample path calls it with nothing between
        self.fetch_ended: Callable[[], None] = self._in_flight.release
        decoders = max(1, stages.limits()["decode"] or 1)
        # Rows in shared memory: a batch's buffer is taken when its first decode is sent. Sending
        # decodes only a few per worker ahead (in the order fetches complete) keeps the buffers taken
        # to the batches being decoded, instead of every batch whose samples are fetched.
        # (Not for an async decode, such as `fetch_in_workers`'s fetch-then-decode: each worker runs
        # many of those at once, and their number is `concurrency`'s to bound.)
        self.decoding = (
            None
            if stages.rows is None or is_async_callable(stages.decode)
            else asyncio.Semaphore(ROWS_AHEAD_PER_WORKER * decoders)
        )
        in_flight = stages.budget.in_flight_bytes(stages.pool_bytes)
        self.bytes = ByteBudget(
            in_flight,
            stages.sizes,
            first_decodes=decoders,
            give_back_every=stages.budget.give_back_every(in_flight),
        )

    async def admit(self, key: Any, at_least: int, oldest: Callable[[], bool]) -> int | None:
        """Wait until `key`'s sample may go, then count it as held; the bytes reserved for it
        (None: the mean, its size not known before it is fetched).

        It waits for a place among the samples held (a group larger than the bound, `at_least`
        samples, still goes: a batch sampler's batches vary), then for room in the byte budget
        (never for the oldest batch, `oldest()`: a batch larger than the budget still completes),
        then for a place among the fetches in flight. Safe to cancel: it holds nothing until it
        returns.
        """
        await self._held.acquire(at_least=at_least)
        budget = self.bytes
        expected = budget.expect(self._size(key))
        await budget.room(oldest, expected)
        await self._in_flight.acquire()
        budget.launched(expected)
        self._rec.launched(budget.reserved)
        return expected

    def _size(self, key: Any) -> int | None:
        """The bytes `key` will be fetched as, where its source knows without asking (else None)."""
        if self._size_of is None or self.bytes.max_bytes is None:
            return None
        try:
            return self._size_of(key)
        except Exception:  # a hint only: the fetch reports what is wrong with the key
            return None

    def hold(self, nbytes: int) -> None:
        """`nbytes` more are held by a batch being made, until it is taken (`let_go`)."""
        budget = self.bytes
        budget.add(nbytes)
        self._rec.held(nbytes, budget.reserved)

    def let_go(self, samples: int, held_bytes: int) -> None:
        """A batch was taken: the places of its `samples` and its `held_bytes` go to the next."""
        release = self._held.release
        for _ in range(samples):
            release()
        self.bytes.release(held_bytes)
        self._rec.let_go(samples, held_bytes)
