"""The process pool's faults: workers that die or stall, tasks that time out or are cancelled."""

from __future__ import annotations

import contextlib
import time

from ..._exceptions import WorkerDied, WorkerTimeout
from . import wire
from .config import CANCEL_GRACE_S, START_TIMEOUT_S
from .core import PoolState, factory
from .outcomes import Outcomes, cancelled
from .results import Reader
from .sending import Sender
from .tasks import Handle, Task, died_text
from .workers import Workers

__all__ = ["Faults"]


class Faults:
    """Replaces dead and stalled workers, expires and cancels tasks (on the pool's thread): a dead
    worker's last answers are read (`Reader`), its process let go and replaced (`Workers`), and its
    tasks retried (queued again in `Sender`) or failed."""

    def __init__(
        self, state: PoolState, outcomes: Outcomes, workers: Workers, reader: Reader, sender: Sender
    ) -> None:
        self.cfg = state.cfg
        self._state = state
        self._outcomes = outcomes
        self._workers = workers
        self._reader = reader
        self._sender = sender

    def reap(self, h: Handle) -> None:
        """`h`'s process has exited: keep what it sent, then replace it and retry or fail its tasks."""
        self._reader.read(h)
        code, pid = self._workers.bury(h)
        tasks = h.take_all()
        for slot in h.quarantine + [s for t in tasks for s in t.take_slots()]:
            self._state.free(slot)
        tasks = self._live(tasks)
        if self._state.stopping or h.killed:
            return
        if not h.ready:
            text = f"{died_text(pid, code)} It died while starting."
            self._state.fail(factory(WorkerDied, text, pid=pid, exitcode=code, tasks=[]))
            return
        self._state.counts["replaced"] += 1
        self._workers.spawn(h.index)
        if not tasks:
            return
        if self._state.restarts < self.cfg.max_restarts:
            # Blame only the culprit: each task that was in flight runs again alone on a fresh
            # worker; one that kills its worker when alone fails, the others go on.
            self._state.restarts += 1
            culprits = [t for t in tasks if t.isolated]
            retried = [t for t in tasks if not t.isolated]
            for t in retried:
                t.isolated = True
            self._state.counts["retried"] += len(retried)
            self._sender.retry(retried)
            if not culprits:
                return
            tasks = culprits
        ids = [t.id for t in tasks]
        hint = (
            f"its max_worker_restarts={self.cfg.max_restarts} retries were used up"
            if self.cfg.max_restarts
            else "pass max_worker_restarts=N to retry such tasks on a new worker"
        )
        alone = len(tasks) == 1 and tasks[0].isolated
        text = (
            f"{died_text(pid, code)} It died with {len(ids)} task(s) in flight (task ids {ids})"
            f"{', running that task alone' if alone else ''} and was replaced; "
            f"{'the task killed it' if alone else hint}"
        )
        for t in tasks:
            self._outcomes.settle(t, error=WorkerDied(text, pid=pid, exitcode=code, tasks=ids))

    def expire(self) -> None:
        now = time.monotonic()
        for h in list(self._workers.handles):
            if not h.ready and not h.killed and now - h.spawned_at >= START_TIMEOUT_S:
                text = f"decode worker pid {h.pid} was not ready within {START_TIMEOUT_S} s"
                self._state.fail(factory(WorkerTimeout, text, pid=h.pid, timeout=START_TIMEOUT_S))
                return
            timeout = self.cfg.timeout
            if timeout is None or h.killed:
                continue
            if h.sync_n and now - h.head_since >= timeout:
                head = next(t for t in h.inflight.values() if not t.is_async)
                self._state.counts["timeouts"] += 1
                text = (
                    f"decode worker pid {h.pid} spent more than timeout={timeout} s on one task "
                    f"(task id {head.id}); it was killed and is being replaced"
                )
                self._kill(h, head, WorkerTimeout(text, pid=h.pid, timeout=timeout))
            elif h.async_n:
                self._expire_async(h, now, timeout)

    def _expire_async(self, h: Handle, now: float, timeout: float) -> None:
        """Answer `h`'s async tasks older than `timeout` with `WorkerTimeout` and cancel them there;
        kill `h` if one of them has not ended `CANCEL_GRACE_S` after that."""
        for t in h.inflight.values():  # oldest first: stop at the first one in time
            age = now - t.sent_at
            if t.is_async and age < timeout:
                return
            if not t.is_async:
                continue
            if not t.expired:
                t.expired = t.abandoned = True
                h.expired_n += 1
                self._state.counts["timeouts"] += 1
                with contextlib.suppress(OSError):
                    h.send((wire.CANCEL, t.id))
                text = (
                    f"an async task (task id {t.id}) ran more than timeout={timeout} s in decode "
                    f"worker pid {h.pid}; it was cancelled there"
                )
                self._outcomes.settle(t, error=WorkerTimeout(text, pid=h.pid, timeout=timeout))
            elif age >= timeout + CANCEL_GRACE_S:
                text = (
                    f"decode worker pid {h.pid} did not end a timed-out async task (task id {t.id}) "
                    f"within {CANCEL_GRACE_S} s of cancelling it (its event loop is blocked); it "
                    "was killed and is being replaced"
                )
                return self._kill(h, t, WorkerTimeout(text, pid=h.pid, timeout=timeout))

    def _async_deadlines(self, h: Handle) -> list[float]:
        """When `_expire_async` next has something to do for `h` (with `timeout` set)."""
        assert self.cfg.timeout is not None
        deadlines: list[float] = []
        for t in h.inflight.values():  # oldest first: the expired ones, then the others
            if not t.is_async or (t.expired and deadlines):
                continue
            deadlines.append(t.sent_at + self.cfg.timeout + (CANCEL_GRACE_S if t.expired else 0))
            if not t.expired:
                break  # those sent later expire later
        return deadlines

    def _kill(self, h: Handle, failed: Task, error: BaseException) -> None:
        """Kill a stalled worker and replace it: its other tasks are retried; `failed` gets `error`,
        unless `max_worker_restarts` allows one more try: it then runs again alone, and fails only
        if it stalls again alone (a worker that stalled for a cause of its own costs nothing)."""
        h.killed = True
        with contextlib.suppress(OSError, ValueError):
            h.process.kill()
        tasks = h.take_all()
        for t in tasks:  # it may still write to them until it is reaped
            h.quarantine += t.take_slots()
        retry = [t for t in tasks if t is not failed]
        state = self._state
        if not failed.isolated and not failed.is_async and state.restarts < self.cfg.max_restarts:
            state.restarts += 1
            failed.isolated = True
            state.counts["retried"] += 1
            retry.insert(0, failed)
        else:
            self._outcomes.settle(failed, error=error)
        self._sender.retry(self._live(retry))
        self._workers.spawn(h.index)

    def cancel(self, task: Task) -> None:
        if task.abandoned or (task.loop is None and task.future.done()):
            return  # (a `run` future is done here: its caller cancelled it)
        task.abandoned = True
        h = task.worker
        if task.is_async and h is not None and task.id in h.inflight and h.open:
            with contextlib.suppress(OSError):
                h.send((wire.CANCEL, task.id))

    def _live(self, tasks: list[Task]) -> list[Task]:
        """Of `tasks` taken from a worker, those still wanted; the others are answered."""
        for t in tasks:
            if t.abandoned:
                self._outcomes.settle(t, error=cancelled())
        return [t for t in tasks if not t.abandoned]

    def deadlines(self) -> list[float]:
        """When `expire` next has something to do: a worker not ready yet, a task's timeout."""
        handles = self._workers.handles
        deadlines = [h.spawned_at + START_TIMEOUT_S for h in handles if not h.ready]
        if self.cfg.timeout is not None:
            deadlines += [h.head_since + self.cfg.timeout for h in handles if h.sync_n]
            deadlines += [d for h in handles for d in self._async_deadlines(h)]
        return deadlines
