"""One epoch of the pipeline on one event loop: its parts wired, its launcher, its lifecycle.

An epoch is four parts, each with its own state, wired here and nowhere else:
- `Admission` (`admission.py`): when the next sample may go, bounded in samples and bytes;
- `Assembler` (`assemble.py`): each sample fetched and decoded (one path, in the launcher's own
  step where nothing waits), each group's batch collated;
- `OnError` (`on_error.py`): whether a failed sample may be dropped, and the count of those that
  were (`on_error`, `max_skipped`, `batch_errors`);
- `Outbox` (`outbox.py`): made batches in delivery order until the consumer has them.

The launcher walks the groups (see `order.py`) and admits their samples one by one; the consumer's
side (`get`, `ready`, `ready_many`, `handed`) is the outbox's, and `stuck` the assembler's, bound
here with nothing in between. The recorder's counts are kept by `Recorder` (`_observe/stats.py`):
the parts only say what happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterable, Iterable

from .._exceptions import LoaderClosedError
from .._util.aiters import closing
from .admission import ROWS_AHEAD_PER_WORKER, Admission
from .assemble import Assembler, GroupState
from .inline import note_error
from .on_error import OnError
from .order import Group
from .outbox import ErrorDelivered, Outbox, Unraised
from .stages import Stages

__all__ = ["ROWS_AHEAD_PER_WORKER", "Epoch", "Unraised"]


async def _each(groups: Iterable[Group] | AsyncIterable[Group]) -> AsyncIterable[Group]:
    if isinstance(groups, AsyncIterable):
        async with closing(groups) as each:
            async for group in each:
                yield group
    else:
        for group in groups:
            yield group


class Epoch:
    """Runs one pass over `groups`. Construct it inside the event loop that will run it.

    `get()` returns the next batch, or `END` after the last one; it raises the first error of the epoch
    (`Outbox.get`; `ready`, `ready_many` and `handed` serve a consumer in another thread). `stuck()`
    says where the oldest work in flight is (`Assembler.stuck`). `aclose()` cancels everything
    still running and is idempotent.
    """

    def __init__(
        self,
        stages: Stages,
        groups: Iterable[Group] | AsyncIterable[Group],
        epoch: int = 0,
        epoch_samples: int | None = None,
    ) -> None:
        self._rows = stages.rows
        self._groups = groups
        self._admission = Admission(stages)
        policy = OnError(stages, epoch_samples)
        self._outbox = outbox = Outbox(stages, self._admission, policy.settle)
        self._assembler = Assembler(stages, epoch, self._admission, policy, outbox)
        # the parts' own methods, bound: a batch's hand-over calls nothing in between
        self.get = outbox.get
        self.ready = outbox.ready
        self.ready_many = outbox.ready_many
        self.handed = outbox.handed
        self.stuck = self._assembler.stuck
        self._task = asyncio.get_running_loop().create_task(self._run(), name="aioloader-epoch")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this epoch runs on."""
        return self._task.get_loop()

    async def aclose(self) -> None:
        """Cancel the epoch, wait until every task of it has ended, and drop what it still holds
        (an error the consumer keeps may keep this object alive through its traceback)."""
        self.cancel()
        with contextlib.suppress(asyncio.CancelledError, ErrorDelivered):
            await self._task
        self._outbox.clear()

    def cancel(self) -> None:
        """Ask the epoch to stop (non-blocking; call on the epoch's loop).

        A `get()` waiting now, or called later, raises `LoaderClosedError` instead of waiting forever.
        """
        self._task.cancel()
        self._outbox.end(LoaderClosedError("the loader was closed"))

    async def _run(self) -> None:
        try:
            await self._launch()
        except BaseExceptionGroup as group:
            _, rest = group.split(ErrorDelivered)
            if rest is not None:
                if rest.subgroup(lambda e: not isinstance(e, Exception)) is not None:
                    raise
                # a bug, or an error raised while iterating the keys: hand it to the consumer
                self._outbox.end(note_error(rest.exceptions[0], "order", []))
            return
        except (KeyboardInterrupt, SystemExit) as exc:
            # TaskGroup raises these bare; escaping this task they would stop the event loop itself
            self._outbox.end(note_error(exc, "order", []))
            return
        self._outbox.end()

    async def _launch(self) -> None:
        """Launch every sample of every group, in order, as the admission lets each go: as a task
        of its own, or made in this step where the assembler can (`Assembler.at_once`)."""
        admission, outbox, assembler = self._admission, self._outbox, self._assembler
        admit, at_once = admission.admit, assembler.at_once
        async with asyncio.TaskGroup() as tasks, closing(_each(self._groups)) as groups:
            async for group in groups:
                if outbox.ended:
                    break
                outbox.launched(group.index)
                state = GroupState(group, self._rows)
                oldest = functools.partial(outbox.oldest, group.index)
                size = len(group.items)
                for slot, (_, key) in enumerate(group.items):
                    expected = await admit(key, size, oldest)
                    if not at_once:
                        tasks.create_task(assembler.sample(state, slot, key, expected))
                    elif (rest := assembler.sample_now(state, slot, key, expected)) is not None:
                        tasks.create_task(rest)
