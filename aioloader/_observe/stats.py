"""Counters the pipeline keeps as it runs, and the snapshot `loader.stats()` returns.

The pipeline calls `Recorder.start(stage)` / `Recorder.stop(...)` around each fetch, decode, collate
and transfer, all on the event loop's thread, so the counters need no lock. The consumer's waits are
added from the consumer's thread alone (`waited`). `snapshot` runs on any thread: it reads numbers
(a read may be one call behind) and copies the latencies (`LatencyWindow`).
Cost: two `perf_counter()` calls and a few additions per stage per sample (about 1 µs;
`benchmarks/stats_overhead.py` measures it, and `Loader(stats=False)` swaps in a `NullRecorder` that
does none of it).

Occupancy without a clock of its own: `area`, the integral of calls in flight over time, is the sum of
the calls' durations; `full`, the time with `cap` or more in flight, is timed from the call that
reached the cap to the one that left it; `queued`, the integral of the calls beyond `cap` (waiting
for a worker, not being served), is added up at each start and stop from the clock they read anyway.
A call's latency is its waiting plus its service: `queued / items` and `(area - queued) / items`
are the two means.

A tar-shard source reads its samples before the pipeline asks for them (the keys it streams carry
them), so its own read counters (`shard_*` in its `stats()`) stand for the fetch stage.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STAGES",
    "LatencyWindow",
    "LoaderStats",
    "NullRecorder",
    "Recorder",
    "StageCounters",
    "StageStats",
    "nbytes",
]

STAGES = ("fetch", "decode", "collate", "transfer")
_LATENCY_WINDOW = 2048  # latencies kept per stage for the percentiles
_SKIPPED_LISTED = 100  # skipped keys listed with their reasons (all are counted)
_clock = time.perf_counter
_BUFFERS = (bytes, bytearray, memoryview)  # exact types: their len() is their bytes
_NO_BYTES = (str, int, float, bool, type(None))  # exact types that hold no buffer


def nbytes(obj: Any) -> int:
    """Bytes held by a sample: buffers, arrays and tensors, summed through containers."""
    kind = type(obj)
    if kind in _BUFFERS:
        return len(obj)
    if kind in _NO_BYTES:
        return 0
    if kind is dict:
        return sum([nbytes(v) for v in obj.values()])
    if kind is tuple or kind is list:
        return sum([nbytes(v) for v in obj])
    if isinstance(obj, bytes | bytearray | memoryview):
        return len(obj)
    size = getattr(obj, "nbytes", None)
    if isinstance(size, int):
        return size
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.element_size() * obj.numel())
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(nbytes(v) for v in obj)
    return 0


@dataclass
class StageStats:
    """One stage since the loader started (or since `stats(reset=True)`)."""

    items: int = 0
    bytes: int = 0
    items_per_s: float = 0.0
    bytes_per_s: float = 0.0
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    latency_p99_s: float | None = None
    busy: int = 0  # in flight now
    busy_mean: float = 0.0  # in flight, averaged over the wall time
    limit: int | None = None  # the most that may be in flight (concurrency, workers)
    full_pct: float = 0.0  # share of the wall time with `limit` or more in flight (all slots taken)
    service_mean_s: float | None = None  # mean time an item was worked on (holding a slot)
    queued_mean_s: float | None = None  # mean time an item waited for a slot (latency = the two)
    errors: int = 0
    retries: int = 0
    skipped: int = 0


@dataclass
class LoaderStats:
    """What `loader.stats()` returns: every stage, the consumer, and the bounds, since the start.

    Attributes:
        wall_s: seconds since the loader started (or its counters were reset).
        stages: "fetch", "decode", "collate" and "transfer" -> `StageStats`: items and bytes done,
            their rates, latency percentiles, `busy` (in flight now), `busy_mean` against `limit`
            (the stage's occupancy: `busy_mean / limit` near 1 means it runs flat out; above 1,
            items queue for a worker), the mean latency split into `service_mean_s` (worked on)
            and `queued_mean_s` (waiting for a worker or slot), errors, retries (fetch: the
            source's) and skipped samples. For a tar-shard source, fetch counts the shard reads:
            samples read, their bytes, the time reading them, against `parallel` readers.
        batches, samples: handed to the consumer.
        consumer_wait_s: time the consumer spent waiting for its next batch.
        data_bound_pct: that wait as a share of the consumer's time since it first asked (100: the
            consumer always waits for data; near 0: the loader is ahead and the model sets the pace).
        first_batch_s: the first wait (start-up), included in the two above; None before it.
        ready_batches: batches collated and waiting for the consumer (the output queue).
        held_samples, held_bytes: samples and bytes held from launch to hand-over, against
            `max_bytes_in_flight` (None: no byte bound); `budget_origin` says where that figure
            came from (given, a quarter of RAM, or the memory cgroup's limit and what it left free).
        reserved_bytes: bytes reserved for the fetches in flight whose size is not known yet (the
            mean size so far each); peak_held_bytes: the most `held_bytes` has been.
        concurrency: the fetch limit now (it moves with `concurrency="auto"`).
        skipped: (key, reason) of the first 100 skipped samples; `skipped_count` counts them all.
        extra: the source's own `stats()` (retries, throttles, ...) and, with a device, "transfer".

    Example:
        >>> async def fetch(i: int) -> int:
        ...     return i
        >>> with Loader(range(8), fetch, batch_size=4) as loader:  # doctest: +SKIP
        ...     batches = list(loader)
        ...     print(loader.stats().table())
    """

    wall_s: float
    stages: dict[str, StageStats]
    batches: int
    samples: int
    consumer_wait_s: float
    data_bound_pct: float
    ready_batches: int
    held_samples: int
    held_bytes: int
    max_bytes_in_flight: int | None
    concurrency: int
    skipped: list[tuple[Any, str]] = field(default_factory=list)
    skipped_count: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    first_batch_s: float | None = None
    reserved_bytes: int = 0
    peak_held_bytes: int = 0
    budget_origin: str = "given"

    def table(self) -> str:
        """These numbers as a plain-text table, one row per stage, then the consumer and memory."""
        return format_table(self)


class LatencyWindow:
    """The last `size` latencies: added by one thread (`append`), read by any (`sorted`).

    A list overwritten in place, not a deque: a list is copied under its own lock on a free-threaded
    build, where copying or iterating a deque that another thread appends to raises "deque mutated
    during iteration" (`deque.copy` too, measured on 3.13t).
    """

    __slots__ = ("_items", "_next", "_size")

    def __init__(self, size: int = _LATENCY_WINDOW) -> None:
        self._items: list[float] = []
        self._size = size
        self._next = 0  # where the next latency goes, once the window is full

    def append(self, latency: float) -> None:
        items = self._items
        if len(items) < self._size:
            items.append(latency)
            return
        items[self._next] = latency
        self._next = (self._next + 1) % self._size

    def sorted(self) -> list[float]:
        """The latencies kept, sorted (a copy)."""
        return sorted(self._items.copy())

    def __len__(self) -> int:
        return len(self._items)


class StageCounters:
    """One stage's running counters (a `Recorder` keeps one per stage; a shard reader its own)."""

    __slots__ = (
        "area",
        "busy",
        "bytes",
        "cap",
        "changed",
        "errors",
        "full",
        "full_since",
        "items",
        "last",
        "latencies",
        "queued",
        "retries",
        "skipped",
    )

    def __init__(self, now: float) -> None:
        self.items = self.bytes = self.errors = self.retries = self.skipped = self.busy = 0
        self.area = 0.0  # the durations of the calls that ended: the integral of `busy` over time
        self.full = 0.0  # time with `busy >= cap`, up to `full_since`
        self.full_since = -1.0  # when `busy` last reached `cap` (-1: below it now)
        self.cap = 0  # the stage's limit, as the pipeline last said (0: none)
        self.last = now  # when the last call ended
        self.queued = 0.0  # the integral of the calls beyond `cap`, up to `changed`
        self.changed = now  # when `busy` last changed
        self.latencies = LatencyWindow()

    def enter(self, now: float) -> None:
        if self.busy > self.cap > 0:
            self.queued += (now - self.changed) * (self.busy - self.cap)
        self.changed = now
        self.busy += 1
        if self.full_since < 0 and self.busy >= self.cap > 0:
            self.full_since = now

    def leave(self, now: float, t0: float) -> None:
        if self.busy > self.cap > 0:
            self.queued += (now - self.changed) * (self.busy - self.cap)
        self.changed = now
        self.busy -= 1
        self.area += now - t0
        self.last = now
        if self.full_since >= 0 and self.busy < self.cap:
            self.full += now - self.full_since
            self.full_since = -1.0


class Recorder:
    """The pipeline's counters; one per loader, shared by its epochs."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        now = time.perf_counter()
        self.t0 = now
        self.stages = {name: StageCounters(now) for name in STAGES}
        self.batches = self.samples = 0
        self.consumer_wait = 0.0
        self.first_wait: float | None = None
        self.first_wait_s: float | None = None
        self.ready = self.held_samples = self.held_bytes = 0
        self.peak_held_bytes = self.reserved_bytes = 0
        self.skipped: list[tuple[Any, str]] = []
        self.skipped_count = 0
        self.tracer: Any = None  # a `_observe/trace.Tracer` while tracing

    def start(self, stage: str) -> float:
        now = _clock()
        s = self.stages[stage]
        if s.busy > s.cap > 0:  # `StageCounters.enter` inlined: runs for each stage of each sample
            s.queued += (now - s.changed) * (s.busy - s.cap)
        s.changed = now
        s.busy += 1
        if s.busy >= s.cap > 0 > s.full_since:
            s.full_since = now
        return now

    def stop(
        self, stage: str, t0: float, nbytes: int = 0, error: bool = False, key: Any = None
    ) -> None:
        now = _clock()
        s = self.stages[stage]
        if s.busy > s.cap > 0:  # `StageCounters.leave` inlined
            s.queued += (now - s.changed) * (s.busy - s.cap)
        s.changed = now
        s.busy -= 1
        s.area += now - t0
        s.last = now
        if s.full_since >= 0 and s.busy < s.cap:
            s.full += now - s.full_since
            s.full_since = -1.0
        if error:
            s.errors += 1
        else:
            s.items += 1
            s.bytes += nbytes
            s.latencies.append(now - t0)
        if self.tracer is not None:
            self.tracer.span(stage, t0, now, key)

    def cancelled(self, stage: str, t0: float) -> None:
        """A call started at `t0` with `start(stage)` was cancelled: not an item, not an error."""
        self.stages[stage].leave(_clock(), t0)

    def skip(self, stage: str, key: Any, reason: str) -> None:
        self.stages[stage].skipped += 1
        self.skipped_count += 1
        if len(self.skipped) < _SKIPPED_LISTED:
            self.skipped.append((key, reason))

    # What an epoch holds and has made, as it goes (`_pipeline/admission.py` and `outbox.py` say
    # when): held samples and bytes against the bounds, batches made and not yet taken, batches and
    # samples taken. The arithmetic is here once, so that each caller only says what happened.

    def launched(self, reserved: int) -> None:
        """A sample was admitted: it holds a place until its batch is taken; `reserved`: the byte
        budget's reservation for the samples launched and not measured yet, now."""
        self.held_samples += 1
        self.reserved_bytes = reserved

    def held(self, nbytes: int, reserved: int) -> None:
        """A batch being made holds `nbytes` more (a sample fetched, or grown by decode)."""
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.reserved_bytes = reserved

    def let_go(self, samples: int, nbytes: int) -> None:
        """A batch was handed over: the `samples` places and `nbytes` it held are free."""
        self.held_samples -= samples
        self.held_bytes -= nbytes

    def made(self) -> None:
        """A batch was made and waits to be taken (`ready_batches`)."""
        self.ready += 1

    def unmade(self) -> None:
        """A batch counted as made goes out as an error instead (a skip past `max_skipped`)."""
        self.ready -= 1

    def taken(self, made: bool, samples: int) -> None:
        """A made batch was taken by the consumer (`made`: not one whose every sample was
        skipped, which counts as no batch and no samples)."""
        self.ready -= 1
        if made:
            self.batches += 1
            self.samples += samples

    def waited(self, t0: float, t1: float) -> None:
        """The consumer waited from t0 to t1 (perf_counter) for its next batch (on the consumer's
        thread: it alone writes `consumer_wait` and `first_wait`)."""
        if self.first_wait is None:
            self.first_wait, self.first_wait_s = t0, t1 - t0
        self.consumer_wait += t1 - t0
        if self.tracer is not None:
            self.tracer.span("consumer wait", t0, t1, None)

    def snapshot(
        self, limits: dict[str, int | None], extra: dict[str, Any]
    ) -> dict[str, StageStats]:
        now = time.perf_counter()
        wall = max(now - self.t0, 1e-9)
        out = {}
        for name, s in self.stages.items():
            s.cap = limits.get(name) or 0  # a single store: safe beside the loop's thread
            since = s.full_since
            full = s.full + (now - since if since >= 0 else 0.0)
            lat = s.latencies.sorted()
            ended = s.items + s.errors
            queued = min(s.queued, s.area) / ended if ended else None
            out[name] = StageStats(
                items=s.items, bytes=s.bytes, items_per_s=s.items / wall, bytes_per_s=s.bytes / wall,
                latency_p50_s=_pct(lat, 0.50), latency_p95_s=_pct(lat, 0.95),
                latency_p99_s=_pct(lat, 0.99),
                busy=s.busy, busy_mean=s.area / wall, limit=limits.get(name),
                full_pct=100.0 * full / wall,
                service_mean_s=None if queued is None else s.area / ended - queued,
                queued_mean_s=queued, errors=s.errors, retries=s.retries, skipped=s.skipped,
            )  # fmt: skip
        if "shard_readers" in extra:
            out["fetch"] = _shard_reads(out["fetch"], extra, wall)
        out["fetch"].retries += int(extra.get("retries", 0))
        return out


def _shard_reads(fetch: StageStats, extra: dict[str, Any], wall: float) -> StageStats:
    """The fetch stage of a tar-shard source: its readers' counters (`TarShards.stats()`)."""
    items, reading = int(extra["shard_samples"]), float(extra["shard_read_s"])
    return StageStats(
        items=items, bytes=int(extra["shard_bytes"]), items_per_s=items / wall,
        bytes_per_s=extra["shard_bytes"] / wall, latency_p50_s=extra.get("shard_read_p50_s"),
        latency_p95_s=extra.get("shard_read_p95_s"), latency_p99_s=extra.get("shard_read_p99_s"),
        busy=int(extra["shard_reading"]), busy_mean=reading / wall,
        limit=int(extra["shard_readers"]), full_pct=100.0 * extra["shard_all_reading_s"] / wall,
        service_mean_s=reading / items if items else None, queued_mean_s=0.0 if items else None,
        errors=fetch.errors, retries=fetch.retries, skipped=fetch.skipped,
    )  # fmt: skip


class NullRecorder(Recorder):
    """Keeps only what the pipeline needs to run (`Loader(stats=False)`): no timings, no trace.

    The occupancy counters (held samples and bytes, batches: `launched`, `held`, ... `taken`) stay exact;
    stage rates, latencies and the consumer's waits read zero.
    """

    def start(self, stage: str) -> float:
        return 0.0

    def stop(
        self, stage: str, t0: float, nbytes: int = 0, error: bool = False, key: Any = None
    ) -> None:
        pass

    def cancelled(self, stage: str, t0: float) -> None:
        pass

    def waited(self, t0: float, t1: float) -> None:
        pass


def _pct(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


# `LoaderStats.table()`: the snapshot as plain text, one row per stage, then the consumer and memory.


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_table(st: LoaderStats) -> str:
    """The table `LoaderStats.table()` returns."""
    # "work ms" and "wait ms": the mean latency split into time at work and time waiting for a slot
    head = ("stage", "items", "items/s", "MB/s", "p50 ms", "p95 ms", "p99 ms", "work ms",
            "wait ms", "busy/limit", "full %", "errors", "retries", "skipped")  # fmt: skip
    rows = [head]
    for name, s in st.stages.items():
        limit = "-" if s.limit is None else str(s.limit)
        rows.append((
            name, str(s.items), f"{s.items_per_s:.1f}", f"{s.bytes_per_s / 1e6:.2f}",
            _ms(s.latency_p50_s), _ms(s.latency_p95_s), _ms(s.latency_p99_s),
            _ms(s.service_mean_s), _ms(s.queued_mean_s), f"{s.busy_mean:.1f}/{limit}",
            f"{s.full_pct:.0f}", str(s.errors), str(s.retries), str(s.skipped),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(r, widths, strict=True))) for r in rows]  # fmt: skip
    first = "" if st.first_batch_s is None else f", first batch after {st.first_batch_s:.2f} s"
    budget = "no byte budget" if st.max_bytes_in_flight is None else (
        f"of a {_size(st.max_bytes_in_flight)} budget "
        f"({100 * st.held_bytes / st.max_bytes_in_flight:.1f}%; {st.budget_origin})")  # fmt: skip
    lines += [
        f"consumer: {st.batches} batches, {st.samples} samples in {st.wall_s:.2f} s; waited "
        f"{st.consumer_wait_s:.2f} s for data ({st.data_bound_pct:.1f}% data-bound{first}); "
        f"{st.ready_batches} batches ready",
        f"memory: {_size(st.held_bytes)} in {st.held_samples} samples held, {budget}",
        f"fetch concurrency: {st.concurrency}; skipped: {st.skipped_count}",
    ]
    return "\n".join(lines)
