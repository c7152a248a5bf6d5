"""Named thread pools that start lazily, grow only while their threads are blocked, and stop within
a deadline.

Why not start `size` threads at the first burst, as `concurrent.futures.ThreadPoolExecutor` does:
each thread that allocates gets a glibc malloc arena of its own, and an arena keeps its high-water
mark (about 1 MB for a fetch thread that reads 60 KB files). Sixteen fetch threads reading local
files from the page cache hold sixteen arenas while doing the work of one.

So a pool starts one thread, and every `grow_after` seconds while calls wait for a thread it looks at
two things: the share of that time its threads spent inside calls (at least `BUSY_TO_GROW`), and the
median time of the last `RECENT_CALLS` calls and of those running (at least `SLOW_CALL_S`). When
both hold, the threads are blocked (network reads, `time.sleep`, a cold disk) and it starts a thread
for each waiting call, at most doubling: `size` threads within a few ticks. Quick calls that the GIL
or busy cores stretch now and then look busy too, but their median stays short, and more threads
would not help them.

`spare_cores=True`, for a pool in one of several processes that share the cores (a process worker's
read threads), looks at waiting rather than time: the median counts only the part of each call that
neither ran on its thread's CPU nor waited in a run queue for a core (`runnable_clock`: a call that
computes while other processes hold the cores is preempted, not blocked), and a third condition must
hold, that the machine had at least `IDLE_TO_GROW` of a core idle over the last `IDLE_WINDOW_S`
(Linux's /proc/stat). Calls that compute keep the cores busy and start no thread, however long they
take or wait for the GIL; calls that sleep or wait on a socket leave cores idle. (Measured, JPEG
decode in 2 workers on 2 cores: the first two rules alone grew each worker to 16 threads, 170 MB
more memory for no speed.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = [
    "BUSY_TO_GROW", "GROW_AFTER_S", "IDLE_TO_GROW", "SLOW_CALL_S", "LazyThreadPool", "cores_idle",
    "default_workers", "gil_enabled", "idle_ticks", "runnable_clock",
]  # fmt: skip

T = TypeVar("T")

GROW_AFTER_S = 0.005  # while calls wait, how often the pool considers starting threads
BUSY_TO_GROW = 0.8  # ... the share of that time its threads must have spent inside calls
SLOW_CALL_S = 0.001  # ... and the last calls must take this long (median): blocking, not quick
RECENT_CALLS = 32
IDLE_TO_GROW = 0.25  # `spare_cores`: ... and the machine must have had this much of a core idle,
IDLE_WINDOW_S = 0.1  # ... over this long at least (/proc/stat counts in 10 ms ticks)


TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def idle_ticks() -> int | None:
    """Clock ticks all cores have spent idle since boot (Linux), None where unknown."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return int(fields[4]) + int(fields[5])  # idle + iowait


_SCHEDSTAT = "/proc/thread-self/schedstat"


def runnable_clock() -> float:
    """Seconds this thread has spent running or runnable (waiting in a run queue for a core).

    Linux's schedstat counts both; what a call's wall time has beyond it, the call spent blocked (a
    sleep, a socket, a cold disk). `time.thread_time()` alone counts only the running part, so a
    call that computes while other processes hold the cores would look blocked for as long as it
    was preempted. Where schedstat is not there, `time.thread_time()`.
    """
    try:
        fd = os.open(_SCHEDSTAT, os.O_RDONLY)
    except OSError:
        return time.thread_time()
    try:
        ran, queued, _ = os.read(fd, 96).split()
    except (OSError, ValueError):
        return time.thread_time()
    finally:
        os.close(fd)
    return (int(ran) + int(queued)) / 1e9


def cores_idle(ticks: int | None, ticks_now: int | None, seconds: float) -> float:
    """Cores idle on average between two `idle_ticks()` readings `seconds` apart; 1.0 where the
    readings are unknown (not Linux: the caller's other rules decide)."""
    if ticks is None or ticks_now is None or seconds <= 0:
        return 1.0
    return (ticks_now - ticks) / TICKS_PER_S / seconds


# A loader's own processes (a DataLoader's workers, the pipeline beside the trainer) run this much
# nicer than the training process: where the cores are all busy, the training step's thread gets
# its core first, and the loader the time the step leaves; where a core is idle it changes nothing.
# Measured on `benchmarks/trainer_tax.py` (2 cores, 2026-12-07): the step beside the front door's
# eight workers ran 1.48-1.58x its resident time at nice 10, waiting 2.7-3.1 ms a step in a run
# queue, against 1.23-1.29x beside torch's workers (at the trainer's priority: theirs feed half the
# steps, so take half the CPU a second); at nice 19, in five full runs, 1.11-1.26x against torch's
# 1.17-1.34x, 0.5-1.1 ms queued, and more steps/s than at nice 10. The cost is where other
# CPU-bound work at nice 0 shares the job's scheduling group (its session, or its container's
# cgroup: across groups the kernel shares by group first): the loader then gets little of a busy
# core (`tests/dataloader` beside two spinning processes of the same session took 311 s at nice 19,
# 97 s at nice 10). `AIOLOADER_NICE=0` in the environment keeps them at the trainer's priority.
LOADER_NICE = 19
NICE_ENV = "AIOLOADER_NICE"


def yield_cpu_to_trainer() -> None:
    """In a loader's own process: lower its priority by `LOADER_NICE` (or `AIOLOADER_NICE`)."""
    try:
        step = int(os.environ.get(NICE_ENV, LOADER_NICE))
    except ValueError:
        step = LOADER_NICE
    if step > 0 and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(step)


def default_workers() -> int:
    """The default size of a decode pool (threads or processes): the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def gil_enabled() -> bool:
    """Whether the GIL is on in this interpreter now: False on a free-threaded build (3.13t and
    later) unless an extension module turned it back on; True on every other build."""
    probe = getattr(sys, "_is_gil_enabled", None)
    return True if probe is None else bool(probe())


class _Call:
    __slots__ = ("args", "fn", "future", "loop")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], future: asyncio.Future[Any]):
        self.fn = fn
        self.args = args
        self.future = future
        self.loop = future.get_loop()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class _Crew:
    """The threads of one pool between its start and its close."""

    def __init__(self, pool: LazyThreadPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.wake = threading.Condition(self.lock)
        self.calls: collections.deque[_Call] = collections.deque()
        self.threads: list[threading.Thread] = []
        self.since: list[float] = []  # per thread: when its current call began; 0.0 between calls
        self.spent: list[float] = []  # per thread: seconds inside calls that have ended
        self.mark = (0.0, 0.0)  # (when, busy seconds until then) at the last look
        # `spare_cores`: the window's start (/proc/stat is read only by pools that use it)
        self.idle_mark = (time.monotonic(), idle_ticks() if pool.spare_cores else None)
        self.idle_cores: float | None = None  # cores idle over the last whole window
        self.recent: collections.deque[float] = collections.deque(maxlen=RECENT_CALLS)
        self.busy = 0  # threads inside a call; the others are idle, or starting, or about to wake
        self.closed = False
        self.timer: asyncio.AbstractEventLoop | None = None  # the loop whose `_grow` is due

    def submit(self, call: _Call) -> bool:
        """Queue `call`; False when this crew was closed meanwhile (the caller takes a new one)."""
        pool = self.pool
        with self.lock:
            if self.closed:  # `close` ran between the pool handing out this crew and now
                return False
            self.calls.append(call)
            self.wake.notify()
            unserved = len(self.calls) - (len(self.threads) - self.busy)
            if unserved > 0 and (not self.threads or pool.grow_after <= 0):
                self._start(min(unserved, pool.size - len(self.threads)))
            elif unserved > 0 and len(self.threads) < pool.floor:  # the threads asked for
                self._start(min(unserved, pool.floor - len(self.threads)))
            if (
                pool.grow_after > 0
                and len(self.threads) < pool.size
                and self.timer is not call.loop
            ):
                self._arm(call.loop)
        return True

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            loop.call_later(self.pool.grow_after, self._grow, loop)
        except RuntimeError:  # the loop is closed
            return
        self.timer = loop
        now = time.monotonic()
        self.mark = (now, self._busy(now))

    def _busy(self, now: float) -> float:
        """Seconds the threads have spent inside calls until `now` (racy reads of floats that only
        their own thread writes: a look may be off by one call, which the next look corrects)."""
        return sum(self.spent) + sum(now - since for since in self.since if since)

    def _grow(self, loop: asyncio.AbstractEventLoop) -> None:
        """(On the loop) while calls wait and the threads were kept busy, start more threads."""
        with self.lock:
            self.timer = None
            if self.closed:
                return
            now = time.monotonic()
            (then, busy_then), threads = self.mark, len(self.threads)
            busy = (self._busy(now) - busy_then) / (threads * (now - then)) if now > then else 0.0
            unserved = len(self.calls) - (threads - self.busy)
            # How long the last calls took, and the running ones have run: blocking calls are long;
            # quick ones stay short even when the GIL or busy cores stretch some of them (the median).
            running = () if self.pool.spare_cores else (now - t for t in self.since if t)
            took = sorted([*self.recent, *running])
            slow = bool(took) and took[len(took) // 2] >= SLOW_CALL_S
            if self.pool.spare_cores:  # cores to spare: the calls wait, not compute
                idle = self._idle(now)
                slow = slow and idle is not None and idle >= IDLE_TO_GROW
            if busy >= BUSY_TO_GROW and unserved > 0 and slow:
                self._start(min(unserved, threads, self.pool.size - threads))
            if self.calls and len(self.threads) < self.pool.size:
                self._arm(loop)

    def _idle(self, now: float) -> float | None:
        """Cores idle over the last whole `IDLE_WINDOW_S` (None before the first)."""
        since, ticks = self.idle_mark
        if now - since >= IDLE_WINDOW_S:
            ticks_now = idle_ticks()
            self.idle_cores = cores_idle(ticks, ticks_now, now - since)
            self.idle_mark = (now, ticks_now)
        return self.idle_cores

    def _start(self, n: int) -> None:
        for _ in range(max(0, n)):
            index = len(self.threads)
            name = f"{self.pool.name}_{index}"
            thread = threading.Thread(target=self._serve, args=(index,), name=name, daemon=True)
            self.threads.append(thread)
            self.since.append(0.0)
            self.spent.append(0.0)
            thread.start()

    def _serve(self, index: int) -> None:
        # `since[index]` and `spent[index]` are written by this thread alone (`_busy` reads them
        # racily); `calls`, `busy` and `recent` only under the lock (`_grow` iterates `recent`)
        since, spent = self.since, self.spent
        if self.pool.initializer is not None:
            try:
                self.pool.initializer()
            except BaseException as exc:  # every call of this pool fails with it
                self._fail_all(exc)
                return
        while True:
            with self.lock:
                while not self.calls and not self.closed:
                    self.wake.wait()
                if self.closed:
                    return
                call = self.calls.popleft()
                self.busy += 1
            took: float | None = None  # how long the call took (None: it never ran)
            if not call.future.cancelled():
                result, error = None, None
                began = since[index] = time.monotonic()
                cpu = runnable_clock() if self.pool.spare_cores else 0.0
                try:
                    result = call.fn(*call.args)
                except BaseException as exc:  # handed to the caller
                    error = exc
                took = time.monotonic() - began
                spent[index] += took
                if self.pool.spare_cores:  # the time it was blocked, not the time it computed
                    took -= runnable_clock() - cpu
                since[index] = 0.0
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                    call.loop.call_soon_threadsafe(_settle, call.future, result, error)
                del result, error  # hold nothing while idle
            del call
            with self.lock:
                if took is not None:
                    self.recent.append(took)
                self.busy -= 1

    def _fail_all(self, exc: BaseException) -> None:
        error = RuntimeError(f"the initializer of thread pool {self.pool.name!r} raised {exc!r}")
        error.__cause__ = exc
        for call in self._stop():
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed
                call.loop.call_soon_threadsafe(_settle, call.future, None, error)

    def close(self) -> list[threading.Thread]:
        """Stop taking calls; cancel those not started. Returns the threads to join."""
        for call in self._stop():
            with contextlib.suppress(RuntimeError):
                call.loop.call_soon_threadsafe(call.future.cancel)
        return self.threads

    def _stop(self) -> list[_Call]:
        """Stop taking calls and wake every idle thread; returns the calls that never started."""
        with self.lock:
            self.closed = True
            calls, self.calls = list(self.calls), collections.deque()
            self.wake.notify_all()
        return calls


class LazyThreadPool:
    """At most `size` threads named `name_0`, `name_1`, ...: the first starts with the first call, more
    only while calls wait and the threads are blocked (see the module docstring). Reusable after close
    (a later call starts new threads).

    `run` is safe to cancel: the awaiting task stops waiting at once; the call itself finishes in its
    thread (Python cannot interrupt it) and its result is dropped. `initializer` runs once in each
    thread as it starts; if it raises, the pool's waiting calls fail with that error.
    `grow_after=0` starts a thread for every call that finds none free (for CPU-bound work, where
    `size` is the cores to use). `floor`: up to this many threads start so, as calls find none free,
    whatever the calls do (the workers a caller asked for); more only by the rule. `spare_cores`: see
    the module docstring.
    """

    def __init__(
        self,
        size: int,
        name: str,
        initializer: Callable[[], None] | None = None,
        grow_after: float = GROW_AFTER_S,
        *,
        spare_cores: bool = False,
        floor: int = 1,
    ) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.floor = min(max(1, floor), size)
        self.name = name
        self.initializer = initializer
        self.grow_after = grow_after
        self.spare_cores = spare_cores
        self._crew: _Crew | None = None
        self._lock = threading.Lock()

    @property
    def threads(self) -> int:
        """How many threads run now."""
        crew = self._crew
        return 0 if crew is None else len(crew.threads)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in the pool and await its result."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        call = _Call(fn, args, future)
        while True:
            with self._lock:
                if self._crew is None or self._crew.closed:
                    self._crew = _Crew(self)
                crew = self._crew
            if crew.submit(call):  # else `close` came in between: a call after it starts anew
                return await future

    def close(self, timeout: float = 2.0) -> None:
        """Cancel queued calls and join the threads, waiting at most `timeout` seconds. Idempotent."""
        with self._lock:
            crew, self._crew = self._crew, None
        if crew is None:
            return
        deadline = time.monotonic() + timeout
        for thread in crew.close():
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))
