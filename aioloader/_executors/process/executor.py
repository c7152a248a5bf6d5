"""The process decode executor: persistent worker processes, shared-memory results, watched liveness.

`ProcessExecutor(workers)` starts `workers` processes once (in parallel, in the background) and keeps
them across epochs until `close()`. Each decode callable is pickled once and sent once to each worker;
a task then carries only its argument (in the pipe up to `inline_max` bytes, in a shared-memory slot
above) and its seed. Arrays in the result come back in place in slots of the parent's `Arena`
(`arena.py`): the parent views them without a copy, and a slot is reused only once nothing views it.

Start method. Workers are never forked from a process in which CUDA is initialised: the child
inherits a CUDA context it cannot use. Nor from a process running other threads: a lock one of them
holds at the fork (the event loop's, a fetch thread's, an allocator's) stays locked forever in the
child. So the default is:
- "zygote" (`zygote.py`) when this process has one thread and no CUDA when the executor is made
  (a Loader makes it in its constructor, before its own threads start): a fork server forked from
  this process then, which forks the workers. They share this process's imported modules
  copy-on-write: ready in ~0.05 s, and no second copy of torch (~150 MB) in memory.
- else "forkserver": the stdlib's clean, single-threaded server that imports aioloader, torch and
  numpy once (`set_forkserver_preload`); workers fork from it in milliseconds once it runs, but its
  first start imports torch again (seconds) and keeps that second copy in memory.
"spawn" and "fork" can be asked for; "fork" and "zygote" are refused once CUDA is initialised.
`aioloader.DataLoader` asks for torch's behaviour instead (`fork_like_torch`): the zygote whatever
threads run and even with CUDA initialised, forked when its first epoch starts; torch's DataLoader
forks its workers from such a process too, and a script that works with it works the same.

What the workers run is `given` to them as they start (`worker.GIVEN`): with a forked start it is
inherited, not pickled, so a dataset holding a lambda or a `multiprocessing.Value` works, and a
`worker_init_fn` that is a bound method of the dataset changes the very object the reads use.

One thread per executor, "aioloader-procpool", does all the waiting: it blocks in one selector
(epoll on Linux) on every worker's socket and process sentinel, so a worker that
dies (SIGKILL, `os._exit`, a segfault) is noticed at once, not by polling. A thread rather than the
event loop's `add_reader`, because one executor serves several loops (the loader's own loop thread,
the caller's loop under `use_caller_loop`, a new loop per `asyncio.run`) and must keep watching
between epochs and be closable from any thread.

Async tasks. A coroutine function (or an object whose `__call__` is one) runs on the worker's own
event loop (`worker_loop.py`), up to `async_depth` of them at once per worker: this is how
`fetch_in_workers` fetches in every worker. Each answers when it ends, in any order, and its result
comes back in its output slot like any other. Cancelling `run` cancels the coroutine in the worker.

Faults:
- a worker dies: it is replaced. Its tasks in flight are retried on the pool while fewer than
  `max_worker_restarts` deaths have been absorbed (each once: results it already sent are kept);
  past that they fail with `WorkerDied` (naming the pid, the exit, the tasks in flight).
- a worker runs one task longer than `timeout` seconds: it is killed and replaced; that task fails
  with `WorkerTimeout`, its other queued tasks are retried elsewhere.
- an async task is still running `timeout` seconds after the worker received it: it fails with
  `WorkerTimeout` at once and is cancelled in the worker, which goes on with its other tasks. Only
  if the cancelled task has not ended `CANCEL_GRACE_S` later (the worker's loop is blocked, by a
  decode that never returns, say) is the worker killed and replaced, as above: a loop that does not
  run cannot be told anything else. Until the cancelled task ends, that worker gets no new async
  task.
- decode raises: the parent re-raises the same exception type (when it pickles both ways), else
  `DecodeError`; always with a note naming the worker pid and the remote traceback as `__cause__`.

Where the code is: this module holds the public `ProcessExecutor`; `dispatcher.py` the pool and the
thread that runs it (the parts it owns in `workers.py`, `slots.py`, `sending.py`, `results.py`,
`faults.py`, what they share in `core.py`, its settings in `config.py`); `tasks.py` what that thread
works with (tasks, workers' handles);
`outcomes.py` the hand-over of results to their callers; `batch_buffer.py` batches written in place;
`wire.py` the wire format; `worker.py` the worker process; `arena.py` + `slab_memory.py` the arena;
`zygote.py` the fork server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

import torch

from ..._exceptions import LoaderClosedError
from ..._util.threads import default_workers
from ..._util.validate import check_callable, check_int, check_timeout
from .arena import arena_budget
from .batch_buffer import BatchBuffer, RowTarget
from .config import ASYNC_DEPTH, Config, pick_start_method
from .dispatcher import Pool
from .tasks import INLINE_MAX

__all__ = ["INLINE_MAX", "BatchBuffer", "ProcessExecutor", "RowTarget"]

T = TypeVar("T")


class ProcessExecutor:
    """Runs decode calls in `workers` persistent processes; results come back in shared memory.

    Args:
        workers: worker processes (default: the usable cores).
        start_method: "zygote", "forkserver", "spawn" or "fork"; None picks "zygote" where that is
            safe now (one thread, no CUDA), else "forkserver" (see the module docstring). "zygote"
            and "fork" are refused once CUDA is initialised in this process.
        timeout: seconds one task may run in a worker before it is killed (None: no limit).
        max_worker_restarts: worker deaths whose tasks in flight are retried instead of failing with
            `WorkerDied` (a dead worker is always replaced).
        worker_init_fn: called as `worker_init_fn(worker_id)` once in each worker before any task.
        arena_bytes: shared-memory budget for inputs and results (default: 256 MiB or half of the
            free /dev/shm, whichever is less). Checked here: too little room in /dev/shm raises
            OSError naming /dev/shm and the size needed.
        inline_max: arguments larger than this go through shared memory instead of the pipe.
        async_depth: async tasks (coroutine callables, see the module docstring) one worker may
            hold at once.
        size_first: for large results (whole batches): a worker whose result does not fit its
            output slot asks for one that does (no result is pickled through a pipe to learn how
            large they are), and while the arena has no room for an output slot, tasks wait as
            long as another is in flight (else one goes, its result pickled: slower, never a
            deadlock).
        given: objects the workers get as they start, not through their pipes (a callable among
            them that `run` is given is not pickled): with a forked start they are inherited, so
            a dataset holding a `multiprocessing.Value` or a lambda works, and `worker_init_fn`
            and the tasks share them; otherwise they are pickled together once per worker (and
            a TypeError here names the attribute that does not pickle). `worker_init_fn` is
            always given so.
        fork_like_torch: as torch's DataLoader forks its workers: with `start_method=None` the
            zygote is used whatever threads run and even once CUDA is initialised (a worker
            must then not use CUDA), and it is forked by `start` (the first task), so that it
            sees the objects as they are then rather than at construction.

    `batch_buffer` makes a batch in shared memory whose rows workers write in place (no collate).
    `run` is safe to cancel (the worker finishes the task; its result is dropped). `close` is
    idempotent, stops every worker within about a second, and also runs on garbage collection and at
    interpreter exit; workers also exit by themselves when this process dies, even by SIGKILL.

    Example:
        >>> import operator
        >>> with ProcessExecutor(2) as pool:
        ...     pool.submit(operator.neg, 3).result()
        -3
    """

    def __init__(
        self,
        workers: int | None = None,
        *,
        start_method: str | None = None,
        timeout: float | None = None,
        max_worker_restarts: int = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        arena_bytes: int | None = None,
        inline_max: int = INLINE_MAX,
        async_depth: int = ASYNC_DEPTH,
        size_first: bool = False,
        given: tuple[Any, ...] = (),
        fork_like_torch: bool = False,
    ) -> None:
        self.workers = (
            default_workers() if workers is None else check_int("workers", workers, minimum=1)
        )
        check_int("max_worker_restarts", max_worker_restarts, minimum=0)
        check_int("inline_max", inline_max, minimum=0)
        self.async_depth = check_int("async_depth", async_depth, minimum=1)
        check_callable("worker_init_fn", worker_init_fn, optional=True)
        method, context = pick_start_method(start_method, fork_like_torch)
        self.start_method = method
        config = Config(
            workers=self.workers, method=method, context=context,
            timeout=check_timeout("timeout", timeout), max_restarts=max_worker_restarts,
            init=worker_init_fn, arena_bytes=arena_budget(arena_bytes), inline_max=inline_max,
            async_depth=async_depth, size_first=size_first, given=given,
            fork_at_start=fork_like_torch,
        )  # fmt: skip
        self._pool = Pool(config)
        self._finalizer = weakref.finalize(self, self._pool.close)

    def start(self) -> None:
        """Begin starting the workers in the background (the first task does it too). Idempotent."""
        self._pool.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Start, then block until every worker is ready (True) or `timeout` passes (False).

        Raises:
            WorkerDied: a worker died while starting, or `worker_init_fn` raised (the cause).
        """
        self._pool.start()
        return self._pool.wait_ready(timeout)

    def submit(
        self,
        fn: Callable[[Any], T],
        arg: Any,
        seed: int | None = None,
        into: RowTarget | None = None,
        worker: int | None = None,
    ) -> concurrent.futures.Future[T]:
        """Queue `fn(arg)` with `seed` as the sample's seed (see `_util/rng.py`); never blocks.

        `worker=i` runs it on worker i alone (or its replacement), after the tasks sent there before
        it: per-worker state (an iterator) then sees its tasks in order.

        `fn` may be a coroutine function (or an object whose `__call__` is one): it then runs on
        the worker's event loop, with other such tasks, and the future holds what it returns.

        Raises:
            LoaderClosedError: the executor was closed.
            TypeError: `fn` or `arg` cannot be pickled.
        """
        return self._pool.submit(fn, arg, seed, into, worker).future  # type: ignore[return-value]

    async def run(
        self,
        fn: Callable[[Any], T],
        arg: Any,
        seed: int | None = None,
        into: RowTarget | None = None,
        worker: int | None = None,
    ) -> T:
        """Run `fn(arg)` in a worker (worker `worker` alone, when given: see `submit`) and await its
        result; safe to cancel. See `batch_buffer`.

        Cancelling it cancels an async task in the worker too; a plain one runs to its end there
        (its result is dropped).
        """
        loop = asyncio.get_running_loop()
        task = self._pool.submit(fn, arg, seed, into, worker, loop=loop)
        future: asyncio.Future[T] = task.future  # type: ignore[assignment]
        try:
            return await future
        except asyncio.CancelledError:
            self._pool.cancel(task)
            raise

    def batch_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> BatchBuffer | None:
        """A `BatchBuffer` of `shape` (rows first) in shared memory; None when the arena is full.

        Example (in a coroutine):
            batch = executor.batch_buffer((len(raws), 3, 224, 224), torch.float32)
            rows = [executor.run(decode, raw, into=batch.row(i)) for i, raw in enumerate(raws)]
            for i, sample in enumerate(await asyncio.gather(*rows)):
                if sample.data_ptr() != batch.tensor[i].data_ptr():
                    batch.tensor[i].copy_(sample)  # it did not fit the row
            # batch.tensor is the collated batch: no copy was made
        """
        return self._pool.batch_buffer(shape, dtype)

    def stats(self) -> dict[str, int]:
        """Counters: tasks (async_tasks of them async), results in shared memory or pickled,
        retries, restarts, timeouts, arena bytes, and the bytes of every message that crossed the
        workers' pipes (`pipe_bytes_sent` to them, `pipe_bytes_received` from them)."""
        return self._pool.stats()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers."""
        return self._pool.pids()

    def renew(self) -> None:
        """Stop the workers and start fresh ones (forked anew: they see the given objects as they
        are now), as torch's DataLoader does each epoch without `persistent_workers`. Call it
        between epochs: what is queued or running fails with `LoaderClosedError`. Arrays already
        handed out stay valid."""
        if self._pool.closed:
            raise LoaderClosedError("the process executor was closed")
        self._finalizer()
        self._pool = Pool(self._pool.cfg)
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def closed(self) -> bool:
        return self._pool.closed

    def close(self) -> None:
        """Stop every worker and free the arena; what is still queued fails with `LoaderClosedError`.

        Idempotent; blocks up to about 2 s. Arrays already handed out stay valid.
        """
        self._finalizer()

    def __enter__(self) -> ProcessExecutor:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
