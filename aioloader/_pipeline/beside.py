"""A loader's pipeline in a process of its own, beside the training process (`Loader(beside=True)`).

Why. A training step is Python that launches kernels, each launch needing the GIL of its process. A
loader whose event loop, fetch callbacks, decode hand-offs and collate run as threads of the training
process takes the GIL from the step: each small op lets the GIL go and waits up to the switch interval
to get it back (measured, `benchmarks/trainer_tax.py`: the step ran 2.8-3.2x slower beside the
in-process loader). Beside it, the loader's Python runs under another GIL, and the training process
does one small thing per batch: it maps the batch out of shared memory.

How. The loader is built, iterated and asked questions in one worker process of a `ProcessExecutor`
(`_executors/process/`): forked as torch forks its workers (`fork_like_torch`: the zygote, so a
user callable that does not pickle works as it does in torch's workers), watched for death, with
batches coming back in its shared-memory arena (metadata over the pipe, the arrays mapped, never
pickled). Two channels:

- batches: each is one task on the worker (`Served`, sent to worker 0, run in order on its main
  thread), `ahead` of them in flight, so the worker stacks batch n+1 into its slot while the trainer
  steps on batch n. An answer carries the batch and the loader's `state_dict()` as of it: what the
  trainer was handed is what a saved state says, whatever the worker made ahead.
- questions (`state_dict`, `set_epoch`, `stats`, `diagnose`, `trace`, ...): a Unix socket to a
  thread of the worker (`_Answers`), answered while a batch task waits for the pipeline.

Each iteration is a new *run* (a number): the worker closes the previous run's iterator and starts
`iter(loader)` at the first task of a new run, so an epoch the trainer left early is left there too
(the tasks it had ahead answer at once). A worker that dies fails the batch with `WorkerDied`; the
next iteration builds the loader anew in its replacement, from the state of the last batch handed
over, so nothing is dropped or repeated.

What stays in the training process: the device stage (pinning and the side-stream copy need the
trainer's CUDA context; see `Beside.device`), and the hand-over.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import logging.handlers
import os
import pickle
import queue
import socket
import struct
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from .._exceptions import LoaderClosedError, LoaderTimeout, WorkerDied
from .._executors.process.executor import ProcessExecutor
from .._executors.process.wire import RemoteTraceback
from .._util.deps import forget_inherited_forkserver
from .._util.threads import yield_cpu_to_trainer

__all__ = ["BESIDE_ENV", "Beside", "Served", "TraceBeside", "beside_asked"]

BESIDE_ENV = "AIOLOADER_BESIDE"  # "1": every Loader whose `beside` is None runs beside
_GRACE_S = 5.0  # past a loader's own timeout, how long the trainer waits for the worker to answer
_CONNECT_S = 30.0  # the worker's build and its connection back, at most
_HEADER = struct.Struct("!I")
_names = itertools.count()


def beside_asked(beside: bool | None) -> bool:
    """`beside`, with None read from the environment (`AIOLOADER_BESIDE=1`)."""
    if beside is None:
        return os.environ.get(BESIDE_ENV, "") == "1"
    if not isinstance(beside, bool):
        raise TypeError(f"beside must be True, False or None, got {beside!r}")
    return beside


# -- the wire of the questions: length-prefixed pickles over a Unix socket --------------------------


def _send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=5)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    (size,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, size))


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise EOFError("the loader's process hung up")
        buf += chunk
    return bytes(buf)


# -- the worker's side ---------------------------------------------------------------------------------


class Served:
    """What the worker process runs (given to it as it starts: inherited by the fork, not pickled).

    `served(("build", address, level))` builds the loader from `recipe` and connects its answering
    thread to `address`; `served(("next", run, level))` is the next batch of iteration `run`:
    `[(True, batch, state), said]`, or `[(False, None, state), said]` once the iteration has ended
    or was left. `said`: the warnings raised (`_Warned`) and the records logged meanwhile, for the
    trainer to raise and log, where its own filters and handlers decide what becomes of them (as
    in-process, where they reach its threads); `level`: the trainer's for the "aioloader" logger.
    """

    def __init__(self, recipe: Callable[[], Any]) -> None:
        self.recipe = recipe
        self.loader: Any = None
        self._run = -1
        self._batches: Iterator[Any] | None = None
        self._left: set[int] = set()  # runs the trainer left: their tasks answer at once
        self._lock = threading.Lock()
        self._logged: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()

    def __call__(self, arg: tuple[Any, ...]) -> Any:
        """`arg`: (what, its argument, the trainer's level for the "aioloader" logger)."""
        _LOGGER.setLevel(arg[2])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every one recorded: the trainer's filters decide
            answer = self._next(arg[1]) if arg[0] == "next" else self._build(arg[1])
        logged = []
        with contextlib.suppress(queue.Empty):
            while True:
                logged.append(self._logged.get_nowait())
        # a list: the trainer empties it as it takes the batch, so that the task's future, which
        # a thread of its pool may still hold a moment, holds the batch no longer
        return [answer, ([_Warned(w) for w in caught], logged)]

    def _build(self, address: str) -> tuple[bool, None, None]:
        if self.loader is not None:
            raise RuntimeError("aioloader: the loader beside the trainer was built already")
        yield_cpu_to_trainer()  # the step's thread first, where the cores are all busy
        forget_inherited_forkserver()  # a decode pool of this loader starts its own
        # the loader's log records go to the trainer, whose handlers write them (`_said_again`)
        _LOGGER.handlers[:] = [logging.handlers.QueueHandler(self._logged)]
        _LOGGER.propagate = False
        self.loader = self.recipe()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        threading.Thread(
            target=_Answers(self, sock).serve, name="aioloader-beside-answers", daemon=True
        ).start()
        return True, None, None

    def _next(self, run: int) -> tuple[bool, Any, Any]:
        """`(True, batch, state)`; `(False, None, state)` at the end; `(False, _Carried, state)`
        for an error of the loader's, which `next()` raises in the trainer (the next `next()`
        goes on, as in-process)."""
        if self.loader is None:
            raise LoaderClosedError("aioloader: the loader's process was replaced; iterate anew")
        with self._lock:
            left = run in self._left
        if run != self._run:
            self._end_run()
            if left:
                return False, None, None
            self._run, self._batches = run, iter(self.loader)
        if left or self._batches is None:
            return False, None, None
        try:
            batch = next(self._batches)
        except StopIteration:
            self._end_run()
            return False, None, self.loader.state_dict()
        except BaseException as exc:  # the loader's error, in its place: the epoch may go on
            return False, _Carried(exc), self.loader.state_dict()
        return True, batch, self.loader.state_dict()

    def leave(self, run: int) -> None:
        """(The answering thread.) The trainer left iteration `run`: its tasks answer at once."""
        with self._lock:
            self._left.add(run)

    def leave_current(self) -> None:
        """(The answering thread.) Leave the iteration running, if any (the loader closes)."""
        self.leave(self._run)

    def _end_run(self) -> None:
        batches, self._batches = self._batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            close()


_LOGGER = logging.getLogger("aioloader")


class _Warned:
    """A warning raised in the worker, as it pickles: raised again in the trainer (`again`)."""

    __slots__ = ("category", "filename", "lineno", "message")

    def __init__(self, w: warnings.WarningMessage) -> None:
        category = w.category if isinstance(w.category, type) else UserWarning
        self.category = category if _pickles(category) else UserWarning
        self.message, self.filename, self.lineno = str(w.message), w.filename, w.lineno

    def again(self) -> None:
        warnings.warn_explicit(self.message, self.category, self.filename, self.lineno)


def _pickles(obj: Any) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:
        return False
    return True


class _Answers:
    """The worker's thread that answers the trainer's questions: `(name, args)` -> a call of the
    loader's method `name` (or one of the few below), answered `(True, result)` or `(False, error)`.
    """

    def __init__(self, served: Served, sock: socket.socket) -> None:
        self.served, self.sock = served, sock
        self.trace: Any = None

    def serve(self) -> None:
        with contextlib.suppress(EOFError, OSError):
            while True:
                name, args = _recv(self.sock)
                try:
                    answer: tuple[bool, Any] = (True, self._call(name, args))
                except Exception as exc:
                    answer = (False, _portable(exc))
                _send(self.sock, answer)
                if name == "close":
                    return

    def _call(self, name: str, args: tuple[Any, ...]) -> Any:
        loader = self.served.loader
        if name == "leave":
            return self.served.leave(*args)
        if name == "trace":
            self.trace = loader.trace(*args)
            return None
        if name in ("trace_write", "trace_close"):
            return None if self.trace is None else getattr(self.trace, name[6:])()
        if name in ("epoch", "closed"):
            return getattr(loader, name)
        if name == "close":  # closed first (an epoch left early stops there, as in-process),
            self.served.leave_current()  # then what a closed loader still answers (`_KEPT`)
            loader.close()
            kept = {}
            for kept_name in _KEPT:
                with contextlib.suppress(Exception):
                    kept[kept_name] = self._call(kept_name, ())
            return kept
        return getattr(loader, name)(*args)


class _Carried:
    """An error of the loader's, carried to the trainer as a value: the exception and its causes
    (`__cause__`, which pickling drops), each as it pickles, with the worker's traceback text."""

    def __init__(self, exc: BaseException) -> None:
        self.chain: list[BaseException] = []
        seen: BaseException | None = exc
        while seen is not None and len(self.chain) < _MOST_CAUSES:
            self.chain.append(_portable(seen))
            seen = seen.__cause__
        self.text = "".join(traceback.format_exception(exc))

    def rebuilt(self, pid: int | None) -> BaseException:
        """The exception, its causes chained again, the last caused by the worker's traceback."""
        for outer, inner in itertools.pairwise(self.chain):
            outer.__cause__ = inner
        self.chain[-1].__cause__ = RemoteTraceback(self.text)
        exc = self.chain[0]
        exc.add_note(f"aioloader: raised in the loader's process beside the trainer (pid {pid})")
        return exc


_MOST_CAUSES = 8


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it pickles both ways, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        text = "".join(traceback.format_exception_only(exc)).strip()
        return RuntimeError(f"aioloader: in the loader's process: {text}")
    return exc


# -- the training process's side -----------------------------------------------------------------------


class Beside:
    """The training process's handle on a loader built and run in a worker process (see the module
    docstring): its iterations (`iter`, `aiter`), its questions (`ask`), `close`.

    Args:
        recipe: makes the loader, in the worker (a `functools.partial` of `Loader`, with no device).
        ahead: batch tasks in flight at once (the worker's finished batches waiting in shared memory).
        timeout: the loader's own timeout; the trainer waits `_GRACE_S` longer for the worker's answer.
        device: the device stage (`make_device_stage`), run here: its copies need this process's
            CUDA context. Each batch is staged in a thread of this process as it comes.

    Raises (at construction) what building the loader raises in the worker, with its type where it
    pickles both ways.
    """

    def __init__(
        self,
        recipe: Callable[[], Any],
        *,
        ahead: int,
        timeout: float | None,
        device: Any = None,
    ) -> None:
        self.device = device
        self._ahead = ahead
        self._wait_s = None if timeout is None else timeout + _GRACE_S
        self._served = Served(recipe)
        self._pool = ProcessExecutor(
            1, fork_like_torch=True, size_first=True, given=(self._served,)
        )  # fmt: skip
        self._stager: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: collections.deque[Any] = collections.deque()  # the latest iteration's
        self._sock: socket.socket | None = None
        self._lock = threading.RLock()  # one question at a time; a rebuild inside one
        self._runs = itertools.count()
        self._state: Any = None  # the loader's state as of the last batch handed over
        self._since: list[tuple[str, tuple[Any, ...]]] = []  # calls that changed it since then
        self._lost = False  # the worker died: the next use builds the loader anew
        self.counts = {"batches": 0, "waited_s": 0.0, "rebuilds": 0}
        self._final: dict[str, Any] = {}  # what the loader said as it closed (`_KEPT`)
        self.closed = False
        try:
            self._build()
        except BaseException:
            self._pool.close()
            raise
        self._finalizer = weakref.finalize(self, self._pool.close)

    # -- the worker's loader ------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The worker process's id (None when none runs)."""
        pids = self._pool.pids
        return pids[0] if pids else None

    def stats(self) -> dict[str, Any]:
        """This process's side: batches handed over, the seconds waited for them, rebuilds, the
        worker's pid, and its pool's counters (`results_in_shm`, `results_pickled`, ...)."""
        return {**self.counts, "pid": self.pid, "pool": self._pool.stats()}

    def waiting(self) -> int:
        """Batches made ahead that wait here for the trainer (beyond the worker's `ready_batches`)."""
        return sum(1 for got in list(self._pending) if got.done() and not got.cancelled())

    def _build(self) -> None:
        address = f"\0aioloader-beside-{os.getpid()}-{next(_names)}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(address)
            listener.listen(1)
            asked = ("build", address, _LOGGER.getEffectiveLevel())
            _said_again(self._pool.submit(self._served, asked, worker=0).result()[1])
            listener.settimeout(_CONNECT_S)
            self._sock, _ = listener.accept()
        finally:
            listener.close()
        self._sock.settimeout(None)

    def _rebuild(self) -> None:
        """The worker died: build the loader in its replacement, as of the last batch handed over
        (then the calls made since), so that its next iteration goes on from there."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._build()
        self._lost = False
        self.counts["rebuilds"] += 1
        replay = ([("load_state_dict", (self._state,))] if self._state is not None else []) + [
            *self._since
        ]
        for name, args in replay:
            self._exchange(name, args)

    def ask(self, name: str, *args: Any) -> Any:
        """`loader.name(*args)` in the worker (or the attribute `name`), answered here; its error
        raised here. Calls that change where the next iteration starts are kept until a batch's
        state says where it stands, to be made again in a replacement worker. Once closed, what
        the loader said as it closed (`_KEPT`), else `LoaderClosedError`."""
        if self.closed and name in self._final:
            return self._final[name]
        self._check_open()
        with self._lock:
            if self._lost:
                self._rebuild()
            if name in _CHANGES_STATE:
                self._since.append((name, args))
            try:
                return self._exchange(name, args)
            except (EOFError, OSError):
                self._lost = True  # died since: ask its replacement, as of the last state
                self._rebuild()
                return self._exchange(name, args)

    def _exchange(self, name: str, args: tuple[Any, ...]) -> Any:
        assert self._sock is not None
        _send(self._sock, (name, args))
        ok, result = _recv(self._sock)
        if not ok:
            raise result
        return result

    def state_dict(self) -> Any:
        """The loader's state as of the last batch handed over (the worker may be ahead of it);
        asked of the worker when none was handed over, or after a call that changed it."""
        with self._lock:
            if self._state is not None and not self._since:
                return self._state
        return self.ask("state_dict")

    def _took(self, state: Any) -> None:
        with self._lock:
            self._state, self._since = state, []

    # -- iterations ---------------------------------------------------------------------------------

    def iter(self, owner: object) -> Iterator[Any]:
        """The next iteration's batches, for `for`. Its generator holds `owner` (the loader), as
        in-process: `for batch in Loader(...)` holds nothing else of it."""
        return _Batches(self._epoch(owner))

    def aiter(self, owner: object) -> AsyncIterator[Any]:
        """As `iter`, for `async for`."""
        return _AsyncBatches(self._aepoch(owner))

    def _begin(self) -> int:
        self._check_open()
        with self._lock:
            if self._lost:
                self._rebuild()
        return next(self._runs)

    def _submit(self, run: int) -> concurrent.futures.Future[Any]:
        got = self._pool.submit(self._served, ("next", run, _LOGGER.getEffectiveLevel()), worker=0)
        if self.device is None:
            return got
        if self._stager is None:
            self._stager = concurrent.futures.ThreadPoolExecutor(1, "aioloader-beside-transfer")
        return self._stager.submit(_staged, self.device, got)

    def _take(self, got: list[Any], t0: float) -> tuple[bool, list[Any]]:
        """(whether a batch came, [the batch or the loader's error to raise in its place]);
        `got` (the task's answer) emptied."""
        said = got.pop()
        ok, batch, state = got.pop()
        self.counts["waited_s"] += time.perf_counter() - t0
        if state is not None:
            self._took(state)
        _said_again(said)
        if not ok:
            return type(batch) is _Carried, [None if batch is None else _Raise(
                batch.rebuilt(self.pid)
            )]  # fmt: skip
        self.counts["batches"] += 1
        if self.device is not None:
            batch = self.device.hand_over(batch)
        return True, [batch]

    def _failed(self, exc: BaseException) -> _Raise:
        if isinstance(exc, WorkerDied):
            self._lost = True
        return _Raise(exc)

    def _timed_out(self) -> LoaderTimeout:
        return LoaderTimeout(
            f"aioloader: the loader's process (pid {self.pid}) gave no batch in {self._wait_s} s"
        )

    def _epoch(self, owner: object) -> Iterator[Any]:  # `owner`: see `iter`
        run = self._begin()
        pending = collections.deque(self._submit(run) for _ in range(self._ahead))
        self._pending = pending
        ended = False
        try:
            while not self._lost:
                got = pending.popleft()
                pending.append(self._submit(run))
                t0 = time.perf_counter()
                try:
                    answer = got.result(self._wait_s)
                except Exception as exc:
                    if isinstance(exc, TimeoutError) and not got.done():
                        raise self._timed_out() from None
                    yield self._failed(exc)
                    continue
                del got
                ok, box = self._take(answer, t0)
                del answer
                if not ok:
                    ended = True
                    return
                yield box.pop()  # held by nothing here once handed over
        finally:
            self._leave(run, pending, ended)

    async def _aepoch(self, owner: object) -> AsyncIterator[Any]:  # `owner`: see `iter`
        run = self._begin()
        pending = collections.deque(self._submit(run) for _ in range(self._ahead))
        self._pending = pending
        ended = False
        try:
            while not self._lost:
                got = pending.popleft()
                pending.append(self._submit(run))
                t0 = time.perf_counter()
                try:
                    async with asyncio.timeout(self._wait_s) as deadline:
                        await _done(got)
                    answer = got.result()
                except Exception as exc:
                    if isinstance(exc, TimeoutError) and deadline.expired():
                        raise self._timed_out() from None
                    yield self._failed(exc)
                    continue
                del got
                ok, box = self._take(answer, t0)
                del answer
                if not ok:
                    ended = True
                    return
                yield box.pop()  # held by nothing here once handed over
        finally:
            self._leave(run, pending, ended)

    def _leave(self, run: int, pending: collections.deque[Any], ended: bool) -> None:
        """The iteration ended or was left: the tasks ahead are dropped, and the worker told to
        answer them at once (not to read more of an epoch the trainer left)."""
        for got in pending:
            got.cancel()
        pending.clear()
        if not ended and not self._lost and not self.closed:
            with contextlib.suppress(Exception):
                self.ask("leave", run)

    # -- closing ------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise LoaderClosedError("this loader was closed; create a new one")

    def close(self) -> None:
        """Close the loader in the worker, then the worker; idempotent."""
        if self.closed:
            return
        with self._lock:
            if not self._lost and self._sock is not None:
                with contextlib.suppress(Exception):
                    self._final = self._exchange("close", ())
            self.closed = True
        if self._stager is not None:
            self._stager.shutdown(wait=True, cancel_futures=True)
        if self.device is not None:
            self.device.close()
        if self._sock is not None:
            self._sock.close()
        self._finalizer()


class TraceBeside:
    """`loader.trace(path)` of a loader beside the trainer: the trace is recorded in its process,
    and written there (`write()`, `close()`, the end of a `with` block), as `Trace` does."""

    def __init__(self, beside: Beside, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._beside = beside
        self.closed = False
        beside.ask("trace", self.path)

    def write(self) -> Path:
        self._beside.ask("trace_write")
        return self.path

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self._beside.closed:
                self._beside.ask("trace_close")

    def __enter__(self) -> TraceBeside:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# what a closed loader still answers, after its closing (its counters, as in-process)
_KEPT = ("stats", "diagnose", "state_dict", "epoch", "__len__")
# calls whose effect a replacement worker must see again (see `Beside.ask`)
_CHANGES_STATE = frozenset({"set_epoch", "load_state_dict", "start_epoch_afresh", "resume_at"})


def _staged(device: Any, got: concurrent.futures.Future[Any]) -> list[Any]:
    """(In the transfer thread.) The worker's answer, its batch staged on the device."""
    answer = got.result()
    said = answer.pop()
    ok, batch, state = answer.pop()
    return [(ok, (device.stage(batch) if ok else batch), state), said]


async def _done(got: concurrent.futures.Future[Any]) -> None:
    """Until `got` is done. (Not `asyncio.wrap_future`: the wrapper would keep the batch after the
    trainer dropped it, until the next answer.)"""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def wake(_: object) -> None:
        with contextlib.suppress(RuntimeError):  # the trainer's loop closed meanwhile
            loop.call_soon_threadsafe(done.set)

    got.add_done_callback(wake)
    await done.wait()


def _said_again(said: tuple[list[_Warned], list[logging.LogRecord]]) -> None:
    """Raise here the warnings the worker raised, and log here what it logged."""
    warned, logged = said
    for record in logged:
        logging.getLogger(record.name).handle(record)
    for w in warned:
        w.again()


class _Raise:
    """A batch that failed, raised by `next()` in its place; the iteration goes on after it."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unbox(item: Any) -> Any:
    if type(item) is _Raise:
        error = item.error
        del item
        raise error
    return item


class _Batches(Iterator[Any]):
    """An iteration of the loader beside the trainer (as `iter(loader)` in-process: an error is
    raised in a batch's place and the next `next()` goes on; dropping it leaves the epoch)."""

    __slots__ = ("_gen",)

    def __init__(self, gen: Iterator[Any]) -> None:
        self._gen = gen

    def __iter__(self) -> _Batches:
        return self

    def __next__(self) -> Any:
        return _unbox(next(self._gen))

    def close(self) -> None:
        self._gen.close()  # type: ignore[attr-defined]


class _AsyncBatches(AsyncIterator[Any]):
    """As `_Batches`, for `async for`."""

    __slots__ = ("_gen",)

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self._gen = gen

    def __aiter__(self) -> _AsyncBatches:
        return self

    async def __anext__(self) -> Any:
        return _unbox(await self._gen.__anext__())

    async def aclose(self) -> None:
        await self._gen.aclose()  # type: ignore[attr-defined]
