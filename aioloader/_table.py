"""`LoaderStats.table()`: the snapshot as plain text, one row per stage, then the consumer and memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._stats import LoaderStats

__all__ = ["format_table"]


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
        f"({100 * st.held_bytes / st.max_bytes_in_flight:.1f}%)")  # fmt: skip
    lines += [
        f"consumer: {st.batches} batches, {st.samples} samples in {st.wall_s:.2f} s; waited "
        f"{st.consumer_wait_s:.2f} s for data ({st.data_bound_pct:.1f}% data-bound{first}); "
        f"{st.ready_batches} batches ready",
        f"memory: {_size(st.held_bytes)} in {st.held_samples} samples held, {budget}",
        f"fetch concurrency: {st.concurrency}; skipped: {st.skipped_count}",
    ]
    return "\n".join(lines)
