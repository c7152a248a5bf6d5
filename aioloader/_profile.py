"""`python -m aioloader profile`: run a loader for N batches, sample its stats, plot them.

A `Sampler` thread takes `loader.stats()` every `interval` seconds while the batches are drawn;
`plot` turns consecutive snapshots into throughput per stage and queue occupancy over time and saves
them as a PNG with matplotlib (the "profile" extra). Nothing here prints; the CLI does.
"""

from __future__ import annotations

import importlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._loader import Loader
from ._progress import with_progress
from ._stats import STAGES, LoaderStats

__all__ = ["SAMPLE_INTERVAL_S", "Sampler", "draw", "plot", "series"]

SAMPLE_INTERVAL_S = 0.25
MATPLOTLIB_MISSING = "matplotlib is not installed: no plot (pip install 'aioloader[profile]')"


class Sampler:
    """Takes `loader.stats()` every `interval` seconds on a thread, from `start()` to `stop()`."""

    def __init__(self, loader: Loader[Any], interval: float = SAMPLE_INTERVAL_S) -> None:
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


def draw(loader: Loader[Any], batches: int, *, progress: bool = True) -> Iterator[Any]:
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
    """Per interval between snapshots: "t" (s), "<stage> items/s", "consumer samples/s", and the
    occupancy at its end: "<stage> in flight", "held samples", "ready batches", "concurrency"."""
    out: dict[str, list[float]] = {"t": []}
    for a, b in itertools.pairwise(samples):
        dt = b.wall_s - a.wall_s
        if dt <= 0:
            continue
        row = {"t": b.wall_s, "consumer samples/s": (b.samples - a.samples) / dt}
        for name in STAGES:
            row[f"{name} items/s"] = (b.stages[name].items - a.stages[name].items) / dt
            row[f"{name} in flight"] = float(b.stages[name].busy)
        row |= {"held samples": float(b.held_samples), "ready batches": float(b.ready_batches),
                "concurrency": float(b.concurrency)}  # fmt: skip
        for key, value in row.items():
            out.setdefault(key, []).append(value)
    return out


def plot(samples: list[LoaderStats], path: str | Path) -> Path | None:
    """Save throughput and occupancy over time to `path` (PNG); None when matplotlib is missing."""
    try:
        figure_module = importlib.import_module("matplotlib.figure")
    except ImportError:
        return None
    data = series(samples)
    fig = figure_module.Figure(figsize=(10, 7), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    for key in [f"{s} items/s" for s in STAGES] + ["consumer samples/s"]:
        if any(data.get(key, [])):
            top.plot(data["t"], data[key], label=key)
    top.set(ylabel="per second", title="Throughput per stage")
    for key in [f"{s} in flight" for s in STAGES] + [
        "held samples",
        "ready batches",
        "concurrency",
    ]:
        if any(data.get(key, [])):
            style = "--" if key == "concurrency" else "-"
            bottom.plot(data["t"], data[key], style, label=key)
    bottom.set(xlabel="seconds since the loader started", ylabel="items", title="Occupancy")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize="small")
    out = Path(path)
    fig.savefig(out, dpi=100)
    return out
