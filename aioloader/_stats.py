"""Counters the pipeline keeps as it runs, and the snapshot `loader.stats()` returns.

The pipeline calls `Recorder.start(stage)` / `Recorder.stop(...)` around each fetch, decode, collate
and transfer, all on the event loop's thread, so the counters need no lock. The consumer's waits are
added from the consumer's thread with single float additions. Cost: two `perf_counter()` calls and a
few additions per stage per sample.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STAGES", "LoaderStats", "Recorder", "StageStats", "nbytes"]

STAGES = ("fetch", "decode", "collate", "transfer")
_LATENCY_WINDOW = 2048  # latencies kept per stage for the percentiles
_SKIPPED_LISTED = 100  # skipped keys listed with their reasons (all are counted)


def nbytes(obj: Any) -> int:
    """Bytes held by a sample: buffers, arrays and tensors, summed through containers."""
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
    errors: int = 0
    retries: int = 0
    skipped: int = 0


@dataclass
class LoaderStats:
    """What `loader.stats()` returns: per stage, the consumer, and the bounds."""

    wall_s: float
    stages: dict[str, StageStats]
    batches: int
    samples: int
    consumer_wait_s: float
    data_bound_pct: float  # share of the consumer's time spent waiting for the next batch
    ready_batches: int  # batches collated and waiting for the consumer
    held_samples: int
    held_bytes: int
    max_bytes_in_flight: int | None
    concurrency: int  # the fetch limit now (moves with concurrency="auto")
    skipped: list[tuple[Any, str]] = field(default_factory=list)  # (key, reason), the first 100
    skipped_count: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # from the source and the device stage


class _Stage:
    __slots__ = (
        "area",
        "busy",
        "bytes",
        "errors",
        "items",
        "last",
        "latencies",
        "retries",
        "skipped",
    )

    def __init__(self, now: float) -> None:
        self.items = self.bytes = self.errors = self.retries = self.skipped = self.busy = 0
        self.area = 0.0  # integral of `busy` over time
        self.last = now
        self.latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)

    def move(self, now: float, delta: int) -> None:
        self.area += self.busy * (now - self.last)
        self.last = now
        self.busy += delta


class Recorder:
    """The pipeline's counters; one per loader, shared by its epochs."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        now = time.perf_counter()
        self.t0 = now
        self.stages = {name: _Stage(now) for name in STAGES}
        self.batches = self.samples = 0
        self.consumer_wait = 0.0
        self.first_wait: float | None = None
        self.ready = self.held_samples = self.held_bytes = 0
        self.skipped: list[tuple[Any, str]] = []
        self.skipped_count = 0
        self.tracer: Any = None  # a `_trace.Tracer` while tracing

    def start(self, stage: str) -> float:
        now = time.perf_counter()
        self.stages[stage].move(now, +1)
        return now

    def stop(
        self, stage: str, t0: float, nbytes: int = 0, error: bool = False, key: Any = None
    ) -> None:
        now = time.perf_counter()
        s = self.stages[stage]
        s.move(now, -1)
        if error:
            s.errors += 1
        else:
            s.items += 1
            s.bytes += nbytes
            s.latencies.append(now - t0)
        if self.tracer is not None:
            self.tracer.span(stage, t0, now, key)

    def skip(self, stage: str, key: Any, reason: str) -> None:
        self.stages[stage].skipped += 1
        self.skipped_count += 1
        if len(self.skipped) < _SKIPPED_LISTED:
            self.skipped.append((key, reason))

    def waited(self, t0: float, t1: float) -> None:
        """The consumer waited from t0 to t1 (perf_counter) for its next batch."""
        if self.first_wait is None:
            self.first_wait = t0
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
            lat = sorted(s.latencies)
            out[name] = StageStats(
                items=s.items, bytes=s.bytes, items_per_s=s.items / wall, bytes_per_s=s.bytes / wall,
                latency_p50_s=_pct(lat, 0.50), latency_p95_s=_pct(lat, 0.95),
                latency_p99_s=_pct(lat, 0.99),
                busy=s.busy, busy_mean=(s.area + s.busy * (now - s.last)) / wall,
                limit=limits.get(name), errors=s.errors, retries=s.retries, skipped=s.skipped,
            )  # fmt: skip
        out["fetch"].retries += int(extra.get("retries", 0))
        return out


def _pct(ordered: list[float], q: float) -> float | None:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None
