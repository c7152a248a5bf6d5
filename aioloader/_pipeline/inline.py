"""A batch made where its indices are: read and collated in the consumer's own thread.

Where the reads do not wait and there is no decode (an in-memory dataset of tokens, rows or indices;
a torch dataset at `num_workers=0` that is not thread-safe), the pipeline's tasks, hand-overs and
thread hops cost more than the work: measured before this path, 42 µs a sample against torch's
0.84 on a dataset whose `__getitem__` returns an int. `InlineRead` makes a group's batch with one
call per sample and one collate, as torch's main-process loading does: no task, no thread, no lock.

It also counts what the reads cost (`stats()`'s extra "inline_reads"): their wall time, and the part
of it they were off the CPU (blocked on I/O or a lock). From these `diagnose()` says how much faster
an epoch would be with reads side by side, and how to allow them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .order import Group

__all__ = ["InlineRead", "note_error"]


def note_error(exc: BaseException, stage: str, keys: list[Any]) -> BaseException:
    """`exc`, with a note naming the stage and the key(s) it was raised for."""
    what = "" if not keys else f" for key {keys[0]!r}" if len(keys) == 1 else f" for keys {keys!r}"
    exc.add_note(f"aioloader: raised in stage {stage!r}{what}")
    return exc


class InlineRead:
    """group -> its batch (or its one sample, unbatched): `fetch` each key, then `collate` (None:
    the list), in the calling thread. Blocks as long as the reads; an error is raised with a note
    naming the key (or, from collate, the stage)."""

    __slots__ = ("batches", "blocked_s", "collate", "fetch", "read_s", "samples")

    def __init__(self, fetch: Callable[[Any], Any], collate: Callable[[list[Any]], Any] | None):
        self.fetch, self.collate = fetch, collate
        self.batches = self.samples = 0
        self.read_s = self.blocked_s = 0.0  # the reads' wall time, and the part off the CPU

    def __call__(self, group: Group) -> Any:
        fetch = self.fetch
        samples: list[Any] = []
        append = samples.append
        t0, cpu0 = time.perf_counter(), time.thread_time()
        key = None
        try:
            for _, key in group.items:
                append(fetch(key))
        except Exception as exc:
            note_error(exc, "fetch", [key])
            raise
        wall = time.perf_counter() - t0
        self.read_s += wall
        self.blocked_s += max(0.0, wall - (time.thread_time() - cpu0))
        self.batches += 1
        self.samples += len(samples)
        if not group.batched:
            return samples[0]
        if self.collate is None:
            return samples
        try:
            return self.collate(samples)
        except Exception as exc:
            note_error(exc, "collate", [k for _, k in group.items])
            raise

    def stats(self) -> dict[str, float]:
        """What the reads cost so far (for `stats().extra["inline_reads"]`)."""
        return {
            "batches": self.batches, "samples": self.samples, "read_s": self.read_s,
            "blocked_s": self.blocked_s,
        }  # fmt: skip
