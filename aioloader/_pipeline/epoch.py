"""One epoch of the pipeline on one event loop: launch, fetch, decode, reorder, collate, hand over.

Bounds (all counted in samples or bytes, never in time):
- at most `concurrency` fetches in flight (the tuner may move that limit while the epoch runs);
- at most `prefetch * group_size + concurrency` samples held between launch and hand-over, so memory is
  bounded by `prefetch` batches plus `concurrency` samples whatever the consumer does;
- at most `max_bytes_in_flight` bytes held from fetch to hand-over (see `ByteBudget`);
- while process workers write batch rows in place (`RowPlan`), at most `ROWS_AHEAD_PER_WORKER` decodes
  per worker sent ahead, so that only the batches being decoded hold a buffer in shared memory.

Groups (see `order.py`) are delivered whole, in group order (`in_order=True`) or as they complete
(`reorder.py`).
With `on_error="raise"`, an error in a user callable ends the epoch: batches before it (in delivery
order) are delivered, then the error is raised to the consumer with a note naming the stage and the
key. With `on_error="skip"` the sample is dropped from its batch and counted, until `max_skipped`.
With `batch_errors` (torch's DataLoader), an error ends its batch only: `get()` hands the batch's
place over as a `BatchFailed`, whose error the consumer's `next()` raises, and the epoch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import warnings
from collections.abc import AsyncIterable, Awaitable, Iterable
from typing import Any, cast

from .._exceptions import DecodeError, LoaderClosedError
from .._executors.base import InlineExecutor, RowWriter
from .._observe.stats import Recorder, nbytes
from .._tuning.bounds import ByteBudget, Gate, HeldBound
from .._util.aiters import closing
from .._util.loops import is_async_callable
from .._util.rng import call_seeded, derive_seed
from .collate import RowPlan
from .inline import note_error
from .order import Group
from .reorder import Item, reorder
from .stages import END, SKIPPED, BatchFailed, Gap, Stages

__all__ = ["ROWS_AHEAD_PER_WORKER", "Epoch", "Unraised"]

ROWS_AHEAD_PER_WORKER = 4  # decodes sent ahead per worker while workers write batch rows


async def _each(groups: Iterable[Group] | AsyncIterable[Group]) -> AsyncIterable[Group]:
    if isinstance(groups, AsyncIterable):
        async with closing(groups) as each:
            async for group in each:
                yield group
    else:
        for group in groups:
            yield group


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


class Unraised:
    """An epoch's error among batches handed over together (`Epoch.ready_many`): the consumer
    raises it where it comes, after the batches before it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Failed(Exception):
    """Internal: an error was handed to the consumer; stop the epoch."""


class _GroupState:
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


class Epoch:
    """Runs one pass over `groups`. Construct it inside the event loop that will run it.

    `get()` returns the next batch, or `END` after the last one; it raises the first error of the epoch.
    `aclose()` cancels everything still running and is idempotent.
    """

    def __init__(
        self,
        stages: Stages,
        groups: Iterable[Group] | AsyncIterable[Group],
        epoch: int = 0,
        epoch_samples: int | None = None,
    ) -> None:
        self._stages = stages
        self._epoch = epoch
        self._epoch_samples = epoch_samples
        self._groups = groups
        self._rec = stages.recorder
        self._out: asyncio.Queue[Item] = asyncio.Queue()
        assert stages.tuner is not None
        self._held = Gate(HeldBound(stages.tuner, stages.prefetch * stages.group_size))
        self._in_flight = Gate(stages.tuner)
        # Rows in shared memory: a batch's buffer is taken when its first decode is sent. Sending
        # decodes only a few per worker ahead (in the order fetches complete) keeps the buffers taken
        # to the batches being decoded, instead of every batch whose samples are fetched.
        # (Not for an async decode, such as `fetch_in_workers`'s fetch-then-decode: each worker runs
        # many of those at once, and their number is `concurrency`'s to bound.)
        self._decoding = (
            None
            if stages.rows is None or is_async_callable(stages.decode)
            else asyncio.Semaphore(ROWS_AHEAD_PER_WORKER * max(1, stages.limits()["decode"] or 1))
        )
        in_flight = stages.budget.in_flight_bytes(stages.pool_bytes)
        self._bytes = ByteBudget(
            in_flight,
            stages.sizes,
            first_decodes=max(1, stages.limits()["decode"] or 1),
            give_back_every=stages.budget.give_back_every(in_flight),
        )
        self._skipped = 0
        self._away = 0  # batches `ready_many` gave that are not handed over yet
        self._order = reorder(
            stages.in_order, self._out, self._bytes.poke, ends=not stages.batch_errors,
            settle=self._settle,
        )  # fmt: skip
        # (group, slot) -> (stage, key, since): what is in flight where (see `stuck`)
        self._active: dict[tuple[int, int], tuple[str, Any, float]] = {}
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aioloader-epoch")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this epoch runs on."""
        return self._task.get_loop()

    async def get(self) -> tuple[int, Any]:
        """(group index, batch) of the next batch, `(-1, END)` after the last; raises the epoch's
        error in its place."""
        return self._got(await self._out.get())

    def ready(self) -> tuple[int, Any] | None:
        """`get()` at once when a batch is waiting (None when none is): a consumer in another
        thread then needs no task on the loop for it."""
        return None if self._out.empty() else self._got(self._out.get_nowait())

    def ready_many(self, most: int) -> list[Any] | None:
        """For a consumer in another thread, in one call on the loop: up to `most` batches
        waiting, each as `(index, batch, samples, held_bytes)` (None when none is). Each keeps its
        places until the consumer hands it over and says so (`handed(samples, held_bytes, made)`, on
        the loop), so the prefetch and byte bounds count it while it waits in the consumer's
        thread. The end comes as `ready()` gives it, `(-1, END)`; an error ends the list, as an
        `Unraised` to raise there."""
        if self._out.empty():
            return None
        out: list[Any] = []
        while len(out) < most and not self._out.empty():
            item = self._out.get_nowait()
            if item.error is not None or item.batch is END:
                try:
                    out.append(self._got(item))
                except BaseException as exc:  # the epoch's error: raised where it comes
                    out.append(Unraised(exc))
                return out
            out.append((*self._out_of(item, counted=False), item.samples, item.held_bytes))
            self._away += 1
        return out

    def handed(self, size: int, held_bytes: int, made: bool) -> None:
        """A batch of `ready_many` was handed over (`made`: not one whose samples were all
        skipped): its places go, and it is counted as `ready()` counts it (on the loop)."""
        self._away -= 1
        self._let_go(size, held_bytes)
        self._rec.taken(made, size)

    def _got(self, item: Item) -> tuple[int, Any]:
        self._let_go(item.samples, item.held_bytes)
        return self._out_of(item)

    def _let_go(self, size: int, held_bytes: int) -> None:
        """The places a batch held: free for the next ones (on the loop)."""
        for _ in range(size):
            self._held.release()
        self._bytes.release(held_bytes)
        self._rec.let_go(size, held_bytes)

    def _out_of(self, item: Item, counted: bool = True) -> tuple[int, Any]:
        """What the consumer is handed for `item` (its error raised), counted (unless not
        `counted`: `handed` counts it then)."""
        index, batch, _, held_bytes, error, _ = item
        warning = self._bytes.over(held_bytes)
        if warning is not None:  # to the consumer (a warning that is an error reaches it as one)
            warnings.warn(warning, ResourceWarning, stacklevel=4)
        if error is not None:
            if index >= 0 and self._stages.batch_errors:
                return index, BatchFailed(error)
            raise error
        if counted and batch is not END:
            self._rec.taken(batch is not SKIPPED, item.samples)
        return index, batch

    async def aclose(self) -> None:
        """Cancel the epoch, wait until every task of it has ended, and drop what it still holds
        (an error the consumer keeps may keep this object alive through its traceback)."""
        self.cancel()
        with contextlib.suppress(asyncio.CancelledError, _Failed):
            await self._task
        self._order.clear()
        while not self._out.empty():
            self._out.get_nowait()

    def cancel(self) -> None:
        """Ask the epoch to stop (non-blocking; call on the epoch's loop).

        A `get()` waiting now, or called later, raises `LoaderClosedError` instead of waiting forever.
        """
        self._task.cancel()
        self._out.put_nowait(Item(-1, None, 0, 0, LoaderClosedError("the loader was closed")))

    async def _run(self) -> None:
        try:
            await self._launch()
        except BaseExceptionGroup as group:
            _, rest = group.split(_Failed)
            if rest is not None:
                if rest.subgroup(lambda e: not isinstance(e, Exception)) is not None:
                    raise
                # a bug, or an error raised while iterating the keys: hand it to the consumer
                self._out.put_nowait(
                    Item(-1, None, 0, 0, note_error(rest.exceptions[0], "order", []))
                )
            return
        except (KeyboardInterrupt, SystemExit) as exc:
            # TaskGroup raises these bare; escaping this task they would stop the event loop itself
            self._out.put_nowait(Item(-1, None, 0, 0, note_error(exc, "order", [])))
            return
        self._out.put_nowait(Item(-1, END, 0, 0, None))

    async def _launch(self) -> None:
        eager = self._eager()
        async with asyncio.TaskGroup() as tasks, closing(_each(self._groups)) as groups:
            async for group in groups:
                if self._order.failed is not None:
                    break
                self._order.launch(group.index)
                state = _GroupState(group, self._stages.rows)
                for slot, (_, key) in enumerate(group.items):
                    # a group larger than the bound (a batch sampler's batches vary) still goes
                    await self._held.acquire(at_least=len(group.items))
                    expected = self._bytes.expect(self._size_of(key))
                    await self._bytes.room(functools.partial(self._oldest, group.index), expected)
                    await self._in_flight.acquire()
                    self._bytes.launched(expected)
                    self._rec.launched(self._bytes.reserved)
                    if not eager:
                        tasks.create_task(self._sample(state, slot, key, expected))
                        continue
                    failed = self._sample_now(state, slot, key, expected)
                    if failed is not None:
                        tasks.create_task(self._failed(state, slot, key, *failed))
                    elif state.remaining == 0:
                        tasks.create_task(self._collate(state))

    def _eager(self) -> bool:
        """Whether each sample is fetched and decoded as it is launched, in the launcher's own
        step, with no task of its own: where its source hands over samples it holds already
        (`Fetcher.now`: tar shards' streamed samples) and decode, if any, runs on the loop."""
        stages = self._stages
        if stages.fetch.now is None or self._decoding is not None:
            return False
        return stages.decode is None or (
            isinstance(stages.decoder, InlineExecutor) and not is_async_callable(stages.decode)
        )

    def _size_of(self, key: Any) -> int | None:
        """The bytes `key` will be fetched as, where its source knows without asking (else None)."""
        size_of = self._stages.size_of
        if size_of is None or self._bytes.max_bytes is None:
            return None
        try:
            return size_of(key)
        except Exception:  # a hint only: the fetch reports what is wrong with the key
            return None

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

    def _oldest(self, group: int) -> bool:
        """Whether `group` is the oldest batch and no other holds bytes (made batches all taken by
        the consumer): it is never held back for bytes, so a batch larger than the budget goes."""
        return self._order.oldest() == group and self._out.empty() and not self._away

    async def _sample(
        self, state: _GroupState, slot: int, key: Any, expected: int | None = None
    ) -> None:
        where = (state.group.index, slot)
        self._active[where] = ("fetch", key, time.monotonic())
        try:
            await self._sample_at(state, slot, key, where, expected)
        finally:
            self._active.pop(where, None)

    async def _sample_at(
        self, state: _GroupState, slot: int, key: Any, where: tuple[int, int],
        expected: int | None,
    ) -> None:  # fmt: skip
        stages, rec = self._stages, self._rec
        t0 = rec.start("fetch")
        raw, exc = await _attempt(rec, "fetch", t0, self._fetch(key), key)
        if exc is not None:
            if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
                assert stages.tuner is not None
                stages.tuner.throttled()
            self._bytes.measured(None, expected)
            return await self._failed(state, slot, key, "fetch", exc)
        size = self._fetched(state, key, raw, expected, t0)
        if stages.decode is not None:
            seed = derive_seed(stages.seed, self._epoch, state.group.items[slot][0])
            self._active[where] = ("decode", key, time.monotonic())
            t0 = rec.start("decode")
            work = self._decode(state, slot, (key, raw) if stages.keyed else raw, seed)
            self._bytes.decode_started()
            try:
                raw, exc = await _attempt(rec, "decode", t0, work, key)
            finally:
                self._bytes.decode_ended()
            if exc is None:
                raw, exc = self._decoded(state, key, raw, size, t0)
            if exc is not None:
                return await self._failed(state, slot, key, "decode", exc)
        state.samples[slot] = raw
        await self._done(state)

    def _sample_now(
        self, state: _GroupState, slot: int, key: Any, expected: int | None
    ) -> tuple[str, BaseException] | None:
        """`_sample_at` in one step, for `_eager` stages: the sample is in `state` when it returns
        None, else (the stage, the error) to hand to `_failed`."""
        stages, rec = self._stages, self._rec
        t0 = rec.start("fetch")
        try:
            raw = stages.fetch.now(key)  # type: ignore[misc]
        except BaseException as exc:  # as `_attempt`: the consumer's, SystemExit & co. too
            rec.stop("fetch", t0, error=True, key=key)
            self._bytes.measured(None, expected)
            return "fetch", exc
        finally:
            self._in_flight.release()
        size = self._fetched(state, key, raw, expected, t0)
        if stages.decode is not None:
            seed = (stages.seed, self._epoch, state.group.items[slot][0])  # derived if asked for
            t0 = rec.start("decode")
            self._bytes.decode_started()
            try:
                raw = call_seeded(stages.decode, (key, raw) if stages.keyed else raw, seed)
            except BaseException as exc:
                rec.stop("decode", t0, error=True, key=key)
                return "decode", exc
            finally:
                self._bytes.decode_ended()
            raw, error = self._decoded(state, key, raw, size, t0)
            if error is not None:
                return "decode", error
        state.samples[slot] = raw
        state.remaining -= 1
        return None

    def _fetched(
        self, state: _GroupState, key: Any, raw: Any, expected: int | None, t0: float
    ) -> int:
        """Count a sample fetched (from `t0`) as held by its batch; its bytes."""
        stages, rec = self._stages, self._rec
        size = nbytes(raw)
        self._bytes.measured(size, expected)
        self._hold(state, size)
        rec.stop("fetch", t0, size, key=key)
        assert stages.tuner is not None
        stages.tuner.completed(rec.stages["fetch"].last)
        return size

    def _decoded(
        self, state: _GroupState, key: Any, raw: Any, size: int, t0: float
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
        self._hold(state, grown)
        self._bytes.grew(grown, size)  # what a launch reserves covers what decode adds
        return raw, None

    async def _fetch(self, key: Any) -> Any:
        try:
            return await self._stages.fetch(key)
        finally:
            self._in_flight.release()

    async def _decode(self, state: _GroupState, slot: int, raw: Any, seed: int) -> Any:
        decoder, decode = self._stages.decoder, self._stages.decode
        assert decode is not None
        if self._decoding is None or state.rows is None or state.rows.off:
            return await decoder.run(decode, raw, seed)
        async with self._decoding:
            into = state.row(slot)
            if into is None:
                return await decoder.run(decode, raw, seed)
            return await cast(RowWriter, decoder).run(decode, raw, seed, into=into)

    def _hold(self, state: _GroupState, size: int) -> None:
        """Count `size` more bytes as held by the group until it is handed over."""
        state.bytes += size
        self._bytes.add(size)
        self._rec.held(size, self._bytes.reserved)

    async def _done(self, state: _GroupState) -> None:
        state.remaining -= 1
        if state.remaining == 0:
            await self._collate(state)

    async def _failed(
        self, state: _GroupState, slot: int, key: Any, stage: str, exc: BaseException
    ) -> None:
        """Drop the sample from its batch within the error policy; else end the epoch with `exc`.

        Under `on_error="skip"` the sample is dropped now and counted when its batch goes out in
        order (`_settle`): which fault spends `max_skipped` does not depend on which ended first."""
        if self._stages.errors.on_error == "skip" and isinstance(exc, Exception):
            state.faults.append((slot, stage, key, exc))
        elif not self._skip(exc, stage, [key]):
            if not self._stages.batch_errors:
                return self._deliver(state.group, None, note_error(exc, stage, [key]), state.bytes)
            if state.error is None:  # the batch fails once its other samples have ended
                state.error = note_error(exc, stage, [key])
        state.skipped.add(slot)
        await self._done(state)

    def _settle(self, item: Item) -> Item:
        """`item` as it goes out in order: its skipped samples counted, and in its place the error
        of the first of them past `max_skipped`."""
        for stage, key, exc in item.faults:
            if not self._skip(exc, stage, [key]):
                if item.error is None:
                    self._rec.unmade()  # (counted as made; the consumer gets the error instead)
                return item._replace(batch=None, error=note_error(exc, stage, [key]), faults=())
        return item

    def _skip(self, exc: BaseException, stage: str, keys: list[Any]) -> bool:
        """Count `keys` as skipped if the policy allows it; False: `exc` must end the epoch."""
        policy = self._stages.errors
        self._skipped += len(keys)
        if isinstance(exc, Exception) and policy.allows(self._skipped, self._epoch_samples):
            for key in keys:
                self._rec.skip(stage, key, f"{type(exc).__name__}: {exc}")
            return True
        if policy.on_error == "skip":
            exc.add_note(
                f"aioloader: on_error='skip' but max_skipped={policy.max_skipped} is spent"
            )
        return False

    async def _collate(self, state: _GroupState) -> None:
        group, samples = state.group, state.kept()
        if state.error is not None:
            state.buffer = None
            return self._deliver(group, None, state.error, state.bytes, state.faults)
        if not samples:
            return self._deliver(group, SKIPPED, None, state.bytes, state.faults)
        if not group.batched:
            return self._deliver(group, samples[0], None, state.bytes, state.faults)
        if self._stages.collate is None:
            return self._deliver(group, samples, None, state.bytes, state.faults)
        rec = self._rec
        t0 = rec.start("collate")
        rows, buffer = self._stages.rows, state.buffer
        state.buffer = None
        batch = None if rows is None or buffer is None else rows.batch(buffer, samples)
        if batch is not None:  # the workers wrote every row: nothing to copy
            rec.stop("collate", t0, state.bytes, key=group.index)
            return self._deliver(group, batch, None, state.bytes, state.faults)
        if rows is not None and buffer is None and (buffer := rows.buffer(len(samples))):
            # decoded before the row shape was known (the first batches): copy the samples into a
            # batch buffer, which is recycled, rather than into fresh memory that is not
            batch = await self._stages.collator.run(functools.partial(rows.batch, buffer), samples)
            if batch is not None:
                rec.stop("collate", t0, state.bytes, key=group.index)
                return self._deliver(group, batch, None, state.bytes, state.faults)
        where = (group.index, -1)
        self._active[where] = ("collate", group.index, time.monotonic())
        try:
            work = self._stages.collator.run(self._stages.collate, samples)
            batch, exc = await _attempt(rec, "collate", t0, work)
        finally:
            self._active.pop(where, None)
        if exc is not None:
            keys = [key for i, (_, key) in enumerate(group.items) if i not in state.skipped]
            if self._skip(exc, "collate", keys):
                return self._deliver(group, SKIPPED, None, state.bytes, state.faults)
            error = note_error(exc, "collate", keys)
            return self._deliver(group, None, error, state.bytes, state.faults)
        rec.stop("collate", t0, state.bytes, key=group.index)
        self._deliver(group, batch, None, state.bytes, state.faults)

    def _deliver(
        self, group: Group, batch: Any, error: BaseException | None, size: int,
        faults: list[tuple[int, str, Any, BaseException]] | None = None,
    ) -> None:  # fmt: skip
        if error is None:
            self._rec.made()
        ordered = tuple(f[1:] for f in sorted(faults, key=lambda f: f[0])) if faults else ()
        item = Item(group.index, batch, len(group.items), size, error, ordered)
        if self._order.deliver(item):
            raise _Failed
