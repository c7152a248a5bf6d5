"""How results reach their callers: futures settled, and outcomes posted to event loops in batches."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tasks import Task

__all__ = ["Mailbox", "Outcome", "Outcomes", "cancelled", "settle_all", "settle_future"]


def settle_future(
    future: concurrent.futures.Future[Any], result: Any = None, error: BaseException | None = None
) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


Outcome = tuple["asyncio.Future[Any]", Any, "BaseException | None"]


class Mailbox:
    """Outcomes of `run` calls on its way to one event loop: at most one callback scheduled on that
    loop at a time, which settles every outcome posted until it runs (a loop that is busy is woken
    once for many results, not once per result)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[Outcome] = []
        self._scheduled = False

    def post(self, items: list[Outcome]) -> None:
        """From the pool's thread."""
        with self._lock:
            self._items += items
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # its loop is closed: nobody awaits these
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        settle_all(items)


class Outcomes:
    """The outcomes the pool's thread gives tasks in one step, and the mailboxes of the event loops
    that `run` calls wait on (on the pool's thread)."""

    def __init__(self) -> None:
        self._outcomes: dict[asyncio.AbstractEventLoop, list[Outcome]] = {}  # see `settle`
        self._mailboxes: dict[asyncio.AbstractEventLoop, Mailbox] = {}

    def settle(self, task: Task, result: Any = None, error: BaseException | None = None) -> None:
        """Give `task` its outcome: a concurrent future at once, an asyncio one at `hand_over`."""
        if task.loop is None:
            settle_future(task.future, result, error)  # type: ignore[arg-type]
        else:
            outcome = (task.future, result, error)
            self._outcomes.setdefault(task.loop, []).append(outcome)  # type: ignore[arg-type]

    def hand_over(self) -> None:
        """Post the queued outcomes of `run` calls to their loops' mailboxes."""
        outcomes, self._outcomes = self._outcomes, {}
        for loop, items in outcomes.items():
            box = self._mailboxes.get(loop)
            if box is None:
                for old in [x for x in self._mailboxes if x.is_closed()]:
                    del self._mailboxes[old]
                box = self._mailboxes[loop] = Mailbox(loop)
            box.post(items)


def settle_all(outcomes: list[Outcome]) -> None:
    """Settle the asyncio futures of `run` calls (on their loop, one call for many results)."""
    for future, result, error in outcomes:
        if future.done():
            continue  # cancelled meanwhile
        if isinstance(error, concurrent.futures.CancelledError):
            future.cancel()
        elif error is None:
            future.set_result(result)
        else:
            future.set_exception(error)


def cancelled() -> BaseException:
    return concurrent.futures.CancelledError()
