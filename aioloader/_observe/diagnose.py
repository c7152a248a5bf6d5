"""`loader.diagnose()`: which stage sets the pace, in plain words, with the numbers that say so.

The reasoning, from a `LoaderStats` snapshot:
1. If the consumer rarely waits for data (after its first batch), the model is the bottleneck.
2. A source that retries or is throttled is named as the cause when the consumer waits.
3. Otherwise the stage that spent the largest share of the time full (every fetch slot or decode
   worker taken: `StageStats.full_pct`) is the bottleneck, if it was full most of the time.
4. Decode that runs inline and keeps the event loop busy, or no stage full while the consumer waits,
   points at the event loop itself.
5. Reads that run one at a time in the consumer's thread (a dataset that may not be shared, at
   `num_workers=0`: `_pipeline/inline.py`) are the bottleneck whenever the consumer waits; the
   text says what reading them side by side would save, from the share of their time they spent
   off the CPU, and how to allow it.

A tar-shard source's reads are its fetch stage (see `_observe/stats.py`): when its readers are the limit, the
advice is its `parallel=`. Latencies are shown split into the time at work and the time waiting for a
worker or slot; the advice names the argument of the API in use (`workers` for `Loader`,
`num_workers` for `DataLoader`) and never more workers than there are cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .stats import LoaderStats, StageStats

__all__ = ["BOTTLENECKS", "Diagnosis", "diagnose"]

BOTTLENECKS = ("fetch", "decode", "collate", "transfer", "consumer", "loop")
CONSUMER_BOUND_PCT = 10.0  # data-bound below this: the loader is ahead of the model
SATURATED = 0.6  # share of the consumer's time a stage was full from which it is the limit
INLINE_BUSY = 0.5  # ... for inline decode: the share of the loop's time spent decoding
RETRY_SHARE = 0.05  # retries per fetch from which the source's retries are the story
SIDE_BY_SIDE = 16  # reads side by side, for what one-at-a-time reads would gain (the default)


@dataclass(frozen=True)
class Diagnosis:
    """A verdict: `bottleneck` (one of `BOTTLENECKS`), what to do (`text`), and the facts behind it.

    `str(diagnosis)` is the text followed by the evidence, one fact a line.
    """

    bottleneck: str
    text: str
    evidence: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n".join([self.text, *(f"  - {line}" for line in self.evidence)])


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.1f} ms"


def usable_cores() -> int:
    """The cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def _latency(s: StageStats) -> str:
    """ "p50 X, p95 Y (Z at work and W waiting for a slot, on average)"."""
    text = f"p50 {_ms(s.latency_p50_s)}, p95 {_ms(s.latency_p95_s)}"
    if s.service_mean_s is None or s.queued_mean_s is None:
        return text
    return (
        f"{text} ({_ms(s.service_mean_s)} at work and {_ms(s.queued_mean_s)} waiting for a "
        "slot, on average)"
    )


class _View:
    """The snapshot seen from the consumer: its span of time, its waits, each stage's full share."""

    def __init__(self, st: LoaderStats, workers_argument: str, cores: int) -> None:
        self.st = st
        self.workers_argument = workers_argument
        self.cores = cores
        self.shards = st.extra.get("shard_readers") is not None  # fetch: a tar-shard stream's reads
        since = st.consumer_wait_s * 100.0 / st.data_bound_pct if st.data_bound_pct > 0 else 0.0
        self.active = since if since > 0 else st.wall_s  # the time the consumer has been asking
        first = st.first_batch_s if st.batches >= 2 and st.first_batch_s is not None else 0.0
        span = self.active - first
        wait = st.consumer_wait_s - first
        self.data_bound = 100.0 * wait / span if span > 0 else st.data_bound_pct
        f = st.stages["fetch"]
        self.retry_share = f.retries / max(1, f.items + f.errors)
        self.throttles = int(st.extra.get("throttles", 0))

    def full(self, s: StageStats) -> float:
        """Share of the consumer's time that every slot of the stage was taken."""
        return min(1.0, s.full_pct / 100.0 * self.st.wall_s / max(self.active, 1e-9))

    def evidence(self) -> list[str]:
        st, lines = self.st, []
        for name, s in st.stages.items():
            if s.items or s.errors or s.busy:
                limit = "-" if s.limit is None else s.limit
                what = "shard readers reading" if name == "fetch" and self.shards else "slots taken"
                lines.append(
                    f"{name}: all {limit} {what} {100 * self.full(s):.0f}% of the time, "
                    f"{s.busy_mean:.1f} in flight on average, {_latency(s)}, "
                    f"{s.items_per_s:.0f} items/s, {s.bytes_per_s / 1e6:.1f} MB/s, "
                    f"{s.errors} errors, {s.retries} retries"
                )
        lines.append(
            f"consumer: waited {st.consumer_wait_s:.2f} s for data over {st.batches} batches "
            f"({self.data_bound:.0f}% of its time after the first batch), "
            f"{st.ready_batches} batches ready now"
        )
        if st.max_bytes_in_flight:
            share = 100 * st.held_bytes / st.max_bytes_in_flight
            lines.append(
                f"memory: {share:.0f}% of max_bytes_in_flight ({st.max_bytes_in_flight / 2**20:.0f}"
                f" MiB: {st.budget_origin}) held now"
            )
        return lines


def _fetch_text(v: _View) -> str:
    f, st = v.st.stages["fetch"], v.st
    if v.retry_share >= RETRY_SHARE or v.throttles:
        return (
            f"Fetch is the bottleneck, and the source is retrying: {f.retries} retries "
            f"({100 * v.retry_share:.0f}% of fetches) and {v.throttles} throttled answers. The "
            "store is failing or throttling requests (timeouts, 429/503 SlowDown) and each retry "
            "waits out its backoff: check the store's health and request rate before raising "
            "concurrency."
        )
    if v.shards:
        readers = f.limit or 1
        return (
            f"Fetch is the bottleneck: the tar shards are read {readers} at a time and all "
            f"{readers} readers were reading {100 * v.full(f):.0f}% of the time "
            f"({f.bytes_per_s / 1e6:.1f} MB/s, {f.items_per_s:.0f} samples/s, "
            f"{_ms(f.latency_p50_s)} per sample p50). Read more shards at once: "
            f"tar_shards(..., parallel={2 * readers})."
        )
    bound = f.limit or st.concurrency
    rate = bound / f.latency_p50_s if f.latency_p50_s else 0.0
    return (
        f"Fetch is the bottleneck: all {bound} fetch slots were taken {100 * v.full(f):.0f}% of "
        f"the time and each fetch takes {_ms(f.latency_p50_s)} (p50), so fetch cannot go past "
        f"about {rate:.0f} items/s. Raise concurrency (e.g. concurrency={2 * bound}) or use "
        "concurrency='auto'."
    )


def _inline_fact(reads: dict[str, float]) -> str:
    per_read = reads["read_s"] / reads["samples"]
    off = reads["blocked_s"] / reads["read_s"] if reads["read_s"] else 0.0
    return (
        f"reads: {reads['samples']:.0f} in {reads['batches']:.0f} batches, one at a time in the "
        f"consumer's thread, {_ms(per_read)} each, {100 * off:.0f}% of it off the CPU"
    )


def _inline_text(v: _View, reads: dict[str, float]) -> str:
    """Reads run one at a time in the consumer's thread (`_pipeline/inline.py`): what reading
    them side by side would save, and how to allow it."""
    batches = max(1.0, reads["batches"])
    per_batch = v.active / batches  # the consumer's whole step: its reads, collate and its own work
    read, blocked = reads["read_s"] / batches, reads["blocked_s"] / batches
    if blocked < read / 4:
        return (
            f"Reading the dataset is the bottleneck: its reads run one at a time in this thread "
            f"and compute ({100 * (1 - blocked / max(read, 1e-12)):.0f}% of their time on the "
            f"CPU). Worker processes read on every core: {v.workers_argument}={v.cores}."
        )
    side_by_side = max(read - blocked, read / SIDE_BY_SIDE)
    faster = per_batch / max(1e-12, per_batch - read + side_by_side)
    return (
        f"Reading the dataset is the bottleneck: its reads run one at a time in this thread, as "
        f"torch's main process reads them (the dataset does not say several threads may call it "
        f"at once), and {100 * blocked / read:.0f}% of their time they waited off the CPU (disk, "
        f"network). With {SIDE_BY_SIDE} reads side by side an epoch would take about "
        f"{faster:.1f}x less time. To allow them: declare `thread_safe = True` on the dataset's "
        "class if several threads may call it at once (no handle shared between calls), make "
        f"`__getitem__` an `async def`, or use {v.workers_argument}=N (worker processes, where "
        "each read thread reads its own copy of the dataset)."
    )


def _decode_text(v: _View, executor: str) -> str:
    d = v.st.stages["decode"]
    workers = d.limit or 1
    if executor == "inline":
        return (
            f"The event loop is the bottleneck: decode runs inline on it and took "
            f"{100 * v.full(d):.0f}% of its time, so fetches wait for it. Run decode in a pool: "
            "executor='thread' (decoders that release the GIL) or executor='process'."
        )
    arg, more = v.workers_argument, min(2 * workers, v.cores)
    if more > workers:
        advice = f"add workers ({arg}={more}, at most one per core: {v.cores})"
        if executor != "process":
            advice += (
                " or, if the decoder holds the GIL (pure-Python work), move it to processes "
                "with executor='process'"
            )
    else:
        advice = (
            f"make each decode cheaper (smaller images, a faster decoder, work moved to the "
            f"device): {arg}={workers} already uses every one of the {v.cores} cores, and more "
            "workers would only share them"
        )
        if executor != "process":
            advice += "; if the decoder holds the GIL, executor='process' runs it on all of them"
    why = v.st.extra.get("decode_pool", {}).get("reads_one_at_a_time")
    if why:  # a DataLoader's workers, each reading its batch one call at a time
        advice = (
            f"let each worker read its batch's samples side by side: now it reads them one "
            f"call at a time, since its read threads cannot each get a copy of the dataset: "
            f"{why}. Open handles lazily in `__getitem__` (not in `__init__`), so that the dataset "
            "pickles; or, if several threads may call it at once, declare `thread_safe = True` "
            f"on its class; or {advice}"
        )
    waiting = max(0.0, d.busy_mean - workers)
    return (
        f"Decode is the bottleneck: all {workers} decode workers were busy "
        f"{100 * v.full(d):.0f}% of the time and {waiting:.1f} samples waited for one on "
        f"average (a decode works {_ms(d.service_mean_s)} and waits {_ms(d.queued_mean_s)} for "
        f"a worker, on average). To go faster, {advice}."
    )


def _text(name: str, v: _View, executor: str) -> str:
    if name == "fetch":
        return _fetch_text(v)
    if name == "decode":
        return _decode_text(v, executor)
    if name == "collate":
        c = v.st.stages["collate"]
        return (
            f"Collate is the bottleneck: the collate thread was busy {100 * v.full(c):.0f}% of the "
            f"time, {_ms(c.latency_p50_s)} per batch. Use the default collate (recycled buffers), "
            "or return fixed-shape arrays from decode so that batching is a plain stack."
        )
    if name == "transfer":
        return (
            "The host-to-device transfer is the bottleneck: staging batches on the device takes "
            "longer than the model uses them. Keep pin_memory on, send smaller dtypes (uint8, "
            "float16) and convert on the device."
        )
    return (
        "The event loop is the bottleneck: the consumer waits, yet no stage is full. Something "
        "blocks the loop (a blocking call inside an async fetch), the loader's bounds hold it back "
        "(prefetch, max_bytes_in_flight), or the per-sample overhead dominates: make samples "
        "larger, or fetch several keys per call."
    )


def diagnose(
    st: LoaderStats,
    *,
    executor: str = "inline",
    workers_argument: str = "workers",
    cores: int | None = None,
) -> Diagnosis:
    """The verdict for one snapshot.

    Args:
        executor: where decode runs ("inline", "thread", "process").
        workers_argument: the argument that sets the decode workers in the API in use.
        cores: the cores to advise workers up to (None: those this process may use).
    """
    v = _View(st, workers_argument, usable_cores() if cores is None else cores)
    evidence = v.evidence()
    if v.data_bound < CONSUMER_BOUND_PCT and st.batches > 0:
        return Diagnosis("consumer", (
            f"The consumer is the bottleneck: it waited for data only {v.data_bound:.0f}% of its "
            "time after the first batch. The model (the training step) sets the pace and the "
            "loader keeps up; loading faster would not help."
        ), evidence)  # fmt: skip
    if v.retry_share >= RETRY_SHARE or v.throttles > 0:
        return Diagnosis("fetch", _fetch_text(v), evidence)
    reads = st.extra.get("inline_reads")
    if reads and reads["samples"]:  # read one at a time in the consumer's thread
        return Diagnosis("fetch", _inline_text(v, reads), [*evidence, _inline_fact(reads)])
    full = {name: v.full(s) for name, s in st.stages.items() if s.items or s.busy}
    busiest = max(full, key=lambda n: full[n], default="loop")
    inline = busiest == "decode" and executor == "inline"
    if full.get(busiest, 0.0) < (INLINE_BUSY if inline else SATURATED):
        busiest = "loop"
    bottleneck = "loop" if inline else busiest
    return Diagnosis(bottleneck, _text(busiest, v, executor), evidence)
