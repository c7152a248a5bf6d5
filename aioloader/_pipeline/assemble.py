"""Assembly: each group's samples fetched and decoded, then collated into its batch.

One sample path. A sample is fetched, counted as held by its batch, decoded (if there is a decode)
and put in its slot; the last of a group's samples to end collates the batch. Where nothing in the
path waits, the source hands the sample over at once (`Fetcher.now`: tar shards' streamed samples)
and decode runs on the loop, the launcher runs the whole path in its own step, with no task
(`sample_now`); otherwise each sample is a task (`sample`) that awaits where the fetch or a pooled
decode waits, and shares every other step with the first. A decode on the loop is called in place
either way.

Collate has two shortcuts while process workers write batch rows in shared memory (`RowPlan`):
when every row was written there, the batch is that buffer, nothing copied; when the first batches
were decoded before the row shape was known, their samples are copied into a recycled buffer rather
than into fresh memory.

A failure in a user callable is put to the error policy (`on_error.py`) and carried out here: the
sample dropped from its batch, the batch failed (`batch_errors`), or the error delivered, which
ends the epoch. What is in flight where is kept for `stuck()`, the diagnosis of a stalled epoch.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, cast

from .._exceptions import DecodeError
from .._executors.base import InlineExecutor, RowWriter
from .._observe.stats import Recorder, nbytes
from .._util.loops import is_async_callable
from .._util.rng import call_seeded, derive_seed
from .admission import Admission
from .collate import RowPlan
from .inline import note_error
from .on_error import OnError
from .order import Group
from .outbox import Outbox
from .stages import SKIPPED, Gap, Stages

__all__ = ["Assembler", "GroupState"]


class GroupState:
    """One group on its way to being a batch: its samples as they end, those dropped, the bytes it
    holds, and its rows in shared memory while workers write them."""

    __slots__ = (
        "buffer", "bytes", "error", "faults", "group", "remaining", "rows", "samples", "skipped",
    )  # fmt: skip

    def __init__(self, group: Group, rows: RowPlan | None) -> None:
        self.group = group
        self.samples: list[Any] = [None] * len(group.items)
        self.remaining = len(group.items)
        self.skipped: set[int] = set()
        self.faults: list[tuple[int, str, Any, BaseException]] = []  # skipped, not counted yet
        self.error: BaseException | None = None  # the first of the batch's (`batch_errors`)
        self.bytes = 0
        self.buffer: Any = None  # the batch in shared memory whose rows workers write (RowPlan)
        self.rows = rows if group.batched else None

    def row(self, slot: int) -> Any:
        """Where the worker should write sample `slot`, or None (no rows for this batch yet)."""
        if self.buffer is None and self.rows is not None:
            self.buffer = self.rows.buffer(len(self.group.items))
        return None if self.buffer is None else self.buffer.row(slot)

    def kept(self) -> list[Any]:
        return [
            s
            for i, s in enumerate(self.samples)
            if i not in self.skipped and not isinstance(s, Gap)
        ]

    def faults_in_order(self) -> tuple[tuple[str, Any, BaseException], ...]:
        """The samples dropped under `on_error="skip"`, in slot order, as (stage, key, error)."""
        return tuple(f[1:] for f in sorted(self.faults, key=lambda f: f[0]))


async def _attempt(
    rec: Recorder, stage: str, t0: float, work: Awaitable[Any], key: Any = None
) -> tuple[Any, BaseException | None]:
    """`(await work, None)`, timed as `stage`'s from `t0`. A cancel is counted as one and raised; an
    error is counted and returned as `(None, error)`: SystemExit & co. too, since they belong to the
    consumer (escaping, they would stop the event loop)."""
    try:
        return await work, None
    except asyncio.CancelledError:
        rec.cancelled(stage, t0)
        raise
    except BaseException as exc:
        rec.stop(stage, t0, error=True, key=key)
        return None, exc


class Assembler:
    """Makes one epoch's batches from its launched samples; see the module docstring. Construct it
    on the epoch's loop; every method runs there.

    Args:
        stages: what the epoch runs with (fetch, decode, collate, the recorder, the tuner).
        epoch: the epoch's number, which each sample's seed derives from.
        admission: the bounds; a sample's bytes are held there until its batch is taken.
        policy: the error policy a failed sample is put to.
        outbox: where each made batch, or the error in its place, is delivered.

    Attributes:
        at_once: whether every sample is made in the launcher's own step (`sample_now`).
    """

    def __init__(
        self, stages: Stages, epoch: int, admission: Admission, policy: OnError, outbox: Outbox
    ) -> None:
        assert stages.tuner is not None
        self._stages = stages
        self._rec = stages.recorder
        self._tuner = stages.tuner
        self._seed, self._epoch = stages.seed, epoch
        self._fetch, self._fetch_now = stages.fetch, stages.fetch.now
        self._decode = stages.decode
        self._keyed = stages.keyed
        self._admission = admission
        self._bytes = admission.bytes
        self._fetch_ended = admission.fetch_ended
        self._hold = admission.hold
        self._policy = policy
        self._outbox = outbox
        # a decode that runs on the loop and never waits: called in place (`_decode_on_loop`)
        on_loop = isinstance(stages.decoder, InlineExecutor)
        self._decodes_on_loop = on_loop and not is_async_callable(stages.decode)
        self.at_once = (
            self._fetch_now is not None
            and admission.decoding is None
            and (stages.decode is None or self._decodes_on_loop)
        )
        # (group, slot) -> (stage, key, since): what is in flight where (see `stuck`)
        self._active: dict[tuple[int, int], tuple[str, Any, float]] = {}

    def stuck(self) -> tuple[str, list[tuple[Any, float]]]:
        """(the stage that holds the oldest work in flight, up to 5 of its keys with their ages in
        seconds, oldest first); ("", []) when nothing is in flight. Safe from any thread."""
        active = list(self._active.values())  # one C call: no other thread runs meanwhile
        if not active:
            return "", []
        stage = min(active, key=lambda a: a[2])[0]
        now = time.monotonic()
        there = sorted((a for a in active if a[0] == stage), key=lambda a: a[2])[:5]
        return stage, [(key, now - since) for _, key, since in there]

    # -- one sample --------------------------------------------------------------------------------

    def sample_now(
        self, state: GroupState, slot: int, key: Any, expected: int | None
    ) -> Coroutine[Any, Any, None] | None:
        """Make sample `slot` of `state` in this step (where `at_once`): fetched from what its
        source holds, decoded on the loop. None when that is all; else what is left of its group's
        work, to run as a task: its failure carried out, or, as the last of its group, the collate.
        `expected`: the bytes its launch reserved (`Admission.admit`)."""
        rec = self._rec
        t0 = rec.start("fetch")
        try:
            raw = self._fetch_now(key)  # type: ignore[misc]
        except BaseException as exc:  # as `_attempt`: the consumer's, SystemExit & co. too
            rec.stop("fetch", t0, error=True, key=key)
            self._bytes.measured(None, expected)
            return self._failed(state, slot, key, "fetch", exc)
        finally:
            self._fetch_ended()
        size = self._fetched(state, key, raw, expected, t0)
        if self._decode is not None:
            raw, error = self._decode_on_loop(state, slot, key, raw, size)
            if error is not None:
                return self._failed(state, slot, key, "decode", error)
        state.samples[slot] = raw
        state.remaining -= 1
        return self._collate(state) if state.remaining == 0 else None

    async def sample(self, state: GroupState, slot: int, key: Any, expected: int | None) -> None:
        """Make sample `slot` of `state`, as a task: `sample_now`'s path, with a wait where the
        fetch, or a decode in a pool, waits. Safe to cancel (the epoch's task group does)."""
        where = (state.group.index, slot)
        active, rec = self._active, self._rec
        active[where] = ("fetch", key, time.monotonic())
        try:
            t0 = rec.start("fetch")
            try:
                raw, exc = await _attempt(rec, "fetch", t0, self._fetch(key), key)
            finally:
                self._fetch_ended()  # its place goes to the next fetch, whatever the outcome
            if exc is not None:
                if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
                    self._tuner.throttled()
                self._bytes.measured(None, expected)
                return await self._failed(state, slot, key, "fetch", exc)
            size = self._fetched(state, key, raw, expected, t0)
            if self._decode is not None:
                active[where] = ("decode", key, time.monotonic())
                if self._decodes_on_loop:
                    raw, exc = self._decode_on_loop(state, slot, key, raw, size)
                else:
                    raw, exc = await self._decode_in_pool(state, slot, key, raw, size)
                if exc is not None:
                    return await self._failed(state, slot, key, "decode", exc)
            state.samples[slot] = raw
            await self._done(state)
        finally:
            active.pop(where, None)

    def _fetched(
        self, state: GroupState, key: Any, raw: Any, expected: int | None, t0: float
    ) -> int:
        """Count a sample fetched (from `t0`) as held by its batch; its bytes."""
        rec = self._rec
        size = nbytes(raw)
        self._bytes.measured(size, expected)
        state.bytes += size
        self._hold(size)
        rec.stop("fetch", t0, size, key=key)
        self._tuner.completed(rec.stages["fetch"].last)
        return size

    def _decode_on_loop(
        self, state: GroupState, slot: int, key: Any, raw: Any, size: int
    ) -> tuple[Any, BaseException | None]:
        """Decode a sample fetched as `size` bytes, here and now: (the sample, None), or (None,
        the error). The seed is derived only if decode asks for it."""
        rec, decode = self._rec, self._decode
        seed = (self._seed, self._epoch, state.group.items[slot][0])
        t0 = rec.start("decode")
        self._bytes.decode_started()
        try:
            raw = call_seeded(decode, (key, raw) if self._keyed else raw, seed)  # type: ignore[arg-type]
        except BaseException as exc:  # as `_attempt`: the consumer's, SystemExit & co. too
            rec.stop("decode", t0, error=True, key=key)
            return None, exc
        finally:
            self._bytes.decode_ended()
        return self._decoded(state, key, raw, size, t0)

    async def _decode_in_pool(
        self, state: GroupState, slot: int, key: Any, raw: Any, size: int
    ) -> tuple[Any, BaseException | None]:
        """`_decode_on_loop` in the decoder's pool (threads or processes), which may write the
        sample straight into its batch's row."""
        rec = self._rec
        seed = derive_seed(self._seed, self._epoch, state.group.items[slot][0])
        t0 = rec.start("decode")
        work = self._run_decode(state, slot, (key, raw) if self._keyed else raw, seed)
        self._bytes.decode_started()
        try:
            raw, exc = await _attempt(rec, "decode", t0, work, key)
        finally:
            self._bytes.decode_ended()
        if exc is not None:
            return None, exc
        return self._decoded(state, key, raw, size, t0)

    async def _run_decode(self, state: GroupState, slot: int, raw: Any, seed: int) -> Any:
        decoder, decode, decoding = self._stages.decoder, self._decode, self._admission.decoding
        assert decode is not None
        if decoding is None or state.rows is None or state.rows.off:
            return await decoder.run(decode, raw, seed)
        async with decoding:
            into = state.row(slot)
            if into is None:
                return await decoder.run(decode, raw, seed)
            return await cast(RowWriter, decoder).run(decode, raw, seed, into=into)

    def _decoded(
        self, state: GroupState, key: Any, raw: Any, size: int, t0: float
    ) -> tuple[Any, BaseException | None]:
        """Count a sample decoded (from `t0`; `size` bytes as fetched): (the sample, None), or
        (None, the error) where decode gave None under `on_error="skip"` (no sample)."""
        stages, rec = self._stages, self._rec
        if raw is None and stages.errors.on_error == "skip":  # "no sample": this one alone
            rec.stop("decode", t0, error=True, key=key)
            return None, DecodeError(
                f"decode returned None for key {key!r}", key=key, stage="decode"
            )
        decoded = nbytes(raw)
        rec.stop("decode", t0, decoded, key=key)
        if stages.rows is not None:
            stages.rows.observe(raw)
        grown = max(0, decoded - size)
        state.bytes += grown
        self._hold(grown)
        self._bytes.grew(grown, size)  # what a launch reserves covers what decode adds
        return raw, None

    async def _done(self, state: GroupState) -> None:
        state.remaining -= 1
        if state.remaining == 0:
            await self._collate(state)

    async def _failed(
        self, state: GroupState, slot: int, key: Any, stage: str, exc: BaseException
    ) -> None:
        """Drop the sample from its batch within the error policy; else end its batch
        (`batch_errors`) or the epoch with `exc`.

        Under `on_error="skip"` the sample is dropped now and counted when its batch goes out in
        order (`OnError.settle`): which fault spends `max_skipped` does not depend on which ended
        first."""
        policy = self._policy
        if policy.skips_later(exc):
            state.faults.append((slot, stage, key, exc))
        elif not policy.skip(exc, stage, [key]):
            if not policy.batch_errors:
                error = note_error(exc, stage, [key])
                return self._outbox.deliver(state.group, None, error, state.bytes)
            if state.error is None:  # the batch fails once its other samples have ended
                state.error = note_error(exc, stage, [key])
        state.skipped.add(slot)
        await self._done(state)

    # -- one batch ---------------------------------------------------------------------------------

    async def _collate(self, state: GroupState) -> None:
        group, samples = state.group, state.kept()
        if state.error is not None:
            state.buffer = None
            return self._deliver(state, None, state.error)
        if not samples:
            return self._deliver(state, SKIPPED)
        if not group.batched:
            return self._deliver(state, samples[0])
        stages, rec = self._stages, self._rec
        if stages.collate is None:
            return self._deliver(state, samples)
        t0 = rec.start("collate")
        rows, buffer = stages.rows, state.buffer
        state.buffer = None
        batch = None if rows is None or buffer is None else rows.batch(buffer, samples)
        if batch is not None:  # the workers wrote every row: nothing to copy
            rec.stop("collate", t0, state.bytes, key=group.index)
            return self._deliver(state, batch)
        if rows is not None and buffer is None and (buffer := rows.buffer(len(samples))):
            # decoded before the row shape was known (the first batches): copy the samples into a
            # batch buffer, which is recycled, rather than into fresh memory that is not
            batch = await stages.collator.run(functools.partial(rows.batch, buffer), samples)
            if batch is not None:
                rec.stop("collate", t0, state.bytes, key=group.index)
                return self._deliver(state, batch)
        where = (group.index, -1)
        self._active[where] = ("collate", group.index, time.monotonic())
        try:
            work = stages.collator.run(stages.collate, samples)
            batch, exc = await _attempt(rec, "collate", t0, work)
        finally:
            self._active.pop(where, None)
        if exc is not None:
            keys = [key for i, (_, key) in enumerate(group.items) if i not in state.skipped]
            if self._policy.skip(exc, "collate", keys):
                return self._deliver(state, SKIPPED)
            return self._deliver(state, None, note_error(exc, "collate", keys))
        rec.stop("collate", t0, state.bytes, key=group.index)
        self._deliver(state, batch)

    def _deliver(self, state: GroupState, batch: Any, error: BaseException | None = None) -> None:
        """Hand `state`'s batch (or `error` in its place) to the outbox, with its dropped samples."""
        faults = state.faults_in_order() if state.faults else ()
        self._outbox.deliver(state.group, batch, error, state.bytes, faults)
