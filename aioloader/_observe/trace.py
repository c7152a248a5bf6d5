"""Chrome / Perfetto trace export: every fetch, decode, collate, transfer and consumer wait as a span.

While a `Tracer` is attached (`Recorder.tracer`), the recorder hands it each finished span as
(stage, t0, t1, key), `perf_counter` seconds. Writing turns them into the Trace Event Format that
chrome://tracing and https://ui.perfetto.dev open: one process per stage, and within it one track
("fetch slot 3", "decode slot 0", ...) per span that was running at the same time, so that the spans of
one track never overlap. Tracks are assigned when the file is written, by start time, each span to the
lowest free track: a stage with `n` spans in flight at most gets `n` tracks.

Spans are kept in memory until written (about 100 bytes each), at most `MAX_SPANS`; later ones are
counted and dropped, and the file says how many in its metadata.
"""

from __future__ import annotations

import heapq
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["ENV_VAR", "MAX_SPANS", "Trace", "Tracer", "chrome_events", "env_trace_path"]

ENV_VAR = "AIOLOADER_TRACE"
MAX_SPANS = 2_000_000
_TRACKS = ("fetch", "decode", "collate", "transfer", "consumer wait")
_PER_SAMPLE = ("fetch", "decode")  # spans whose key is a sample key; the others name a batch index
_KEY_CHARS = 80

_Span = tuple[str, float, float, Any]
_env_loaders = 0  # loaders traced through the environment so far in this process
_env_lock = threading.Lock()


def env_trace_path() -> Path | None:
    """Where `AIOLOADER_TRACE` says this new loader's trace goes (None: not set).

    The first loader of the process writes the path itself; the n-th after it writes `stem.n.suffix`
    beside it, so that a script with a train and a validation loader keeps both traces.
    """
    global _env_loaders
    value = os.environ.get(ENV_VAR)
    if not value:
        return None
    with _env_lock:
        n, _env_loaders = _env_loaders, _env_loaders + 1
    path = Path(value)
    return path if n == 0 else path.with_name(f"{path.stem}.{n}{path.suffix}")


class Tracer:
    """Collects spans from the event loop's thread and the consumer's thread."""

    def __init__(self, max_spans: int = MAX_SPANS) -> None:
        self.t0 = time.perf_counter()
        self.spans: list[_Span] = []
        self.dropped = 0
        self._max = max_spans
        self._lock = threading.Lock()  # guards `spans` and `dropped` (two threads add to them)

    def span(self, stage: str, t0: float, t1: float, key: Any) -> None:
        with self._lock:
            if len(self.spans) < self._max:
                self.spans.append((stage, t0, t1, key))
            else:
                self.dropped += 1

    def recorded(self) -> list[_Span]:
        """A copy of the spans recorded so far."""
        with self._lock:
            return list(self.spans)


def _tracks(spans: list[_Span]) -> list[int]:
    """For spans sorted by start: the lowest track free at each start (interval partitioning)."""
    free: list[int] = []  # track numbers free now (a heap)
    busy: list[tuple[float, int]] = []  # (end, track) of the spans running (a heap)
    out = []
    for _, t0, t1, _ in spans:
        while busy and busy[0][0] <= t0:
            heapq.heappush(free, heapq.heappop(busy)[1])
        track = heapq.heappop(free) if free else len(busy)
        heapq.heappush(busy, (t1, track))
        out.append(track)
    return out


def _args(stage: str, key: Any) -> dict[str, Any]:
    if key is None:
        return {}
    if stage in _PER_SAMPLE:
        text = repr(key)
        return {"key": text if len(text) <= _KEY_CHARS else text[: _KEY_CHARS - 3] + "..."}
    return {"batch": key}


def chrome_events(tracer: Tracer) -> list[dict[str, Any]]:
    """The tracer's spans as Trace Event Format events ("X" spans, "M" names), times in µs."""
    events: list[dict[str, Any]] = []
    spans = sorted(tracer.recorded(), key=lambda s: (s[1], s[2]))
    names = list(_TRACKS) + sorted({s[0] for s in spans} - set(_TRACKS))
    for pid, stage in enumerate(names, start=1):
        mine = [s for s in spans if s[0] == stage]
        if not mine:
            continue
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": stage}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
        tracks = _tracks(mine) if stage != "consumer wait" else [0] * len(mine)
        for tid in sorted(set(tracks)):
            label = stage if stage in ("collate", "consumer wait") else f"{stage} slot {tid}"
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                           "args": {"name": label}})  # fmt: skip
        for (_, t0, t1, key), tid in zip(mine, tracks, strict=True):
            events.append({
                "ph": "X", "name": stage, "cat": stage, "pid": pid, "tid": tid,
                "ts": round((t0 - tracer.t0) * 1e6, 3), "dur": round((t1 - t0) * 1e6, 3),
                "args": _args(stage, key),
            })  # fmt: skip
    return events


class Trace:
    """A trace being recorded into `path`; returned by `loader.trace(path)`.

    Recording starts when it is made. `write()` writes the file (every span so far) and may be called
    again; `close()` (or the end of a `with` block, or the loader's close) detaches it and writes the
    file a last time. Idempotent; the file is replaced atomically.

    Example:
        >>> with loader.trace("load.json"):  # doctest: +SKIP
        ...     for batch in loader:
        ...         ...
    """

    def __init__(self, path: str | os.PathLike[str], recorder: Any) -> None:
        self.path = Path(path)
        self.tracer = Tracer()
        self._recorder = recorder
        self._lock = threading.Lock()
        self.closed = False
        recorder.tracer = self.tracer

    def write(self) -> Path:
        """Write every span recorded so far to `path` (blocking file I/O); returns the path."""
        with self._lock:
            doc = {
                "traceEvents": chrome_events(self.tracer),
                "displayTimeUnit": "ms",
                "otherData": {"producer": "aioloader", "dropped_spans": self.tracer.dropped},
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(self.path)
        return self.path

    def close(self) -> None:
        """Stop recording and write the file. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._recorder.tracer is self.tracer:
            self._recorder.tracer = None
        self.write()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
