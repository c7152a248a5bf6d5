"""`python -m aioloader profile`: run a loader for N batches, sample its stats, plot them.

A `Sampler` thread takes `loader.stats()` every `interval` seconds (0.1 s: 100 points for a 10-second
run) while the batches are drawn; `plot` turns consecutive snapshots into panels over time, saved as a
PNG with matplotlib (the "profile" extra): samples per second (per stage and the consumer's), batches
per second, the share of time the consumer waited for data, fetches in flight against their limit,
and decode's busy workers and the samples queued for one against the number of workers. Nothing here
prints; the CLI does.
"""

from __future__ import annotations

import importlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from .progress import Observed, with_progress
from .stats import STAGES, LoaderStats

__all__ = ["PANELS", "SAMPLE_INTERVAL_S", "Sampler", "draw", "figure", "plot", "series"]

SAMPLE_INTERVAL_S = 0.1
MATPLOTLIB_MISSING = "matplotlib is not installed: no plot (pip install 'aioloader[profile]')"


class Profiled(Observed, Protocol):
    """A loader, as profiling reads it: its stats, its length, its batches."""

    def __iter__(self) -> Iterator[Any]: ...


class Sampler:
    """Takes `loader.stats()` every `interval` seconds on a thread, from `start()` to `stop()`."""

    def __init__(self, loader: Profiled, interval: float = SAMPLE_INTERVAL_S) -> None:
        self.loader, self.interval = loader, interval
        self.samples: list[LoaderStats] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="aioloader-profile", daemon=True)

    def _main(self) -> None:
        while True:
            self.samples.append(self.loader.stats())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(self.loader.stats())


def draw(loader: Profiled, batches: int, *, progress: bool = True) -> Iterator[Any]:
    """Up to `batches` batches, over as many epochs as it takes (stops at an empty epoch)."""

    def endless() -> Iterator[Any]:
        while True:
            got = 0
            for batch in loader:
                got += 1
                yield batch
            if got == 0:
                return

    stream = endless()
    shown = with_progress(loader, stream, total=batches) if progress else stream
    try:
        for count, batch in enumerate(shown, start=1):
            yield batch
            if count >= batches:
                return
    finally:
        close = getattr(shown, "close", None)
        if close is not None:
            close()


def series(samples: list[LoaderStats]) -> dict[str, list[float]]:
    """Per interval between snapshots: "t" (s, at its end); rates over the interval:
    "<stage> items/s", "consumer samples/s", "consumer batches/s", "data wait %" (the share of the
    interval the consumer spent waiting for data, as far as its waits have ended); occupancy at its
    end: "<stage> in flight" and "<stage> limit", "decode running" and "decode queued" (in flight
    beyond the workers), "held samples", "ready batches", "concurrency"."""
    out: dict[str, list[float]] = {"t": []}
    gaps = sorted(b.wall_s - a.wall_s for a, b in itertools.pairwise(samples))
    shortest = gaps[len(gaps) // 2] / 2 if gaps else 0.0
    for a, b in itertools.pairwise(samples):
        dt = b.wall_s - a.wall_s
        if dt <= 0 or dt < shortest:
            continue  # the stub of an interval (the last, cut short by the end): its rates are noise
        wait = 100.0 * (b.consumer_wait_s - a.consumer_wait_s) / dt
        row = {
            "t": b.wall_s,
            "consumer samples/s": (b.samples - a.samples) / dt,
            "consumer batches/s": (b.batches - a.batches) / dt,
            "data wait %": min(100.0, max(0.0, wait)),
        }
        for name in STAGES:
            stage = b.stages[name]
            row[f"{name} items/s"] = (stage.items - a.stages[name].items) / dt
            row[f"{name} in flight"] = float(stage.busy)
            row[f"{name} limit"] = float(stage.limit or 0)
        decode = b.stages["decode"]
        workers = decode.limit or decode.busy
        row["decode running"] = float(min(decode.busy, workers))
        row["decode queued"] = float(max(0, decode.busy - workers))
        row |= {"held samples": float(b.held_samples), "ready batches": float(b.ready_batches),
                "concurrency": float(b.concurrency)}  # fmt: skip
        for key, value in row.items():
            out.setdefault(key, []).append(value)
    return out


# (title, y label, series drawn): one panel each, sharing the time axis; a limit is drawn dashed
PANELS: list[tuple[str, str, list[str]]] = [
    ("Samples per second", "samples/s",
     ["fetch items/s", "decode items/s", "consumer samples/s"]),
    ("Batches per second", "batches/s", ["collate items/s", "consumer batches/s"]),
    ("The consumer waiting for data", "% of the time", ["data wait %"]),
    ("Fetch: in flight against its limit", "fetches", ["fetch in flight", "fetch limit"]),
    ("Decode: workers busy, samples queued for one", "samples",
     ["decode running", "decode queued", "decode limit"]),
]  # fmt: skip
_LABELS = {"fetch limit": "fetch limit (concurrency)", "decode limit": "decode workers"}
_FILLED = {"fetch in flight", "decode running"}


def figure(samples: list[LoaderStats]) -> Any:
    """The matplotlib Figure `plot` saves (raises ImportError without matplotlib)."""
    figure_module = importlib.import_module("matplotlib.figure")
    data = series(samples)
    fig = figure_module.Figure(figsize=(10, 13), layout="constrained")
    axes = fig.subplots(len(PANELS), 1, sharex=True)
    for ax, (title, ylabel, keys) in zip(axes, PANELS, strict=True):
        for key in keys:
            if not _used(data, key):
                continue  # a stage this loader does not use
            values = data[key]
            style = "--" if key.endswith("limit") else "-"
            (line,) = ax.plot(data["t"], values, style, marker=".", markersize=3,
                              label=_LABELS.get(key, key))  # fmt: skip
            if key in _FILLED:  # seen under a limit drawn at the same height
                ax.fill_between(data["t"], values, color=line.get_color(), alpha=0.25)
        ax.set(ylabel=ylabel, title=title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize="small")
    axes[2].set_ylim(0, 105)
    axes[-1].set(xlabel="seconds since the loader started")
    return fig


def _used(data: dict[str, list[float]], key: str) -> bool:
    stage = key.split()[0]
    if stage not in STAGES:
        return key in data
    return any(data.get(f"{stage} items/s", [])) or any(data.get(f"{stage} in flight", []))


def plot(samples: list[LoaderStats], path: str | Path) -> Path | None:
    """Save throughput, data wait and occupancy over time to `path` (PNG); None when matplotlib
    is missing."""
    try:
        fig = figure(samples)
    except ImportError:
        return None
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out
