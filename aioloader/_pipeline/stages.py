"""What an epoch runs with: the stages' callables and bounds, and what may stand in a batch's place."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._executors.base import Executor, KeyedDecode, workers_of, writes_rows
from .._observe.stats import LoaderStats, Recorder
from .._tuning.bounds import ErrorPolicy, FixedConcurrency, SampleSizes, Tuner
from .._tuning.memory import MemoryBudget
from .collate import RowPlan, stacks
from .fetch import Fetcher

__all__ = ["END", "SKIPPED", "BatchFailed", "Gap", "Stages"]


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


END: Any = _Marker("END")
SKIPPED: Any = _Marker("SKIPPED")  # a batch whose every sample was skipped


class BatchFailed:
    """In a batch's place (`batch_errors`): the error that ended that batch, not the epoch."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Gap:
    """A decoded result that stands for no sample at all (e.g. a worker's stream has ended): it is
    left out of its batch without counting as skipped, and a batch of gaps is not delivered."""


@dataclass
class Stages:
    """The callables and bounds that an epoch runs with (owned by the loader, shared by epochs)."""

    fetch: Fetcher
    decode: Callable[[Any], Any] | None
    decoder: Executor
    collate: Callable[[list[Any]], Any] | None
    collator: Executor
    concurrency: int
    prefetch: int
    in_order: bool
    group_size: int
    seed: int = 0
    recorder: Recorder = field(default_factory=Recorder)
    tuner: Tuner | None = None
    errors: ErrorPolicy = field(default_factory=ErrorPolicy)
    budget: MemoryBudget = field(default_factory=lambda: MemoryBudget(None))  # and its shares
    pool_bytes: int = 0  # of max_bytes, what the recycled batch buffers may keep

    rows: RowPlan | None = None  # set when process workers may write batch rows in place
    batch_errors: bool = False  # an error ends its batch, not the epoch (see the module docstring)
    sizes: SampleSizes = field(default_factory=SampleSizes)  # what the byte budget estimates from
    size_of: Callable[[Any], int | None] | None = None  # a source's `size`: bytes before fetching
    keyed: bool = False  # decode is given (key, raw) (`decode_with_key`)

    def __post_init__(self) -> None:
        if self.tuner is None:
            self.tuner = FixedConcurrency(self.concurrency)
        self.keyed = isinstance(self.decode, KeyedDecode)
        if self.decode is not None and stacks(self.collate) and writes_rows(self.decoder):
            self.rows = RowPlan(self.decoder)
        for name, limit in self.limits().items():
            self.recorder.stages[name].cap = limit or 0

    def limits(self) -> dict[str, int | None]:
        """The most items each stage may work on at once, now."""
        assert self.tuner is not None
        return {
            "fetch": self.tuner.limit, "decode": workers_of(self.decoder),
            "collate": 1, "transfer": 1,
        }  # fmt: skip

    def snapshot(self, extra: dict[str, Any]) -> LoaderStats:
        """`loader.stats()`: the recorder's counters with this pipeline's limits."""
        rec = self.recorder
        assert self.tuner is not None
        stages = rec.snapshot(self.limits(), extra)
        wall = time.perf_counter() - rec.t0
        since = wall if rec.first_wait is None else time.perf_counter() - rec.first_wait
        return LoaderStats(
            wall_s=wall, stages=stages, batches=rec.batches, samples=rec.samples,
            consumer_wait_s=rec.consumer_wait,
            data_bound_pct=100.0 * rec.consumer_wait / since if since > 0 else 0.0,
            ready_batches=rec.ready, held_samples=rec.held_samples, held_bytes=rec.held_bytes,
            max_bytes_in_flight=self.budget.max_bytes, concurrency=self.tuner.limit,
            skipped=list(rec.skipped), skipped_count=rec.skipped_count, extra=extra,
            first_batch_s=rec.first_wait_s, reserved_bytes=rec.reserved_bytes,
            peak_held_bytes=rec.peak_held_bytes, budget_origin=self.budget.origin,
        )  # fmt: skip
