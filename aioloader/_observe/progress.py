"""`loader.iter(progress=True)`: a tqdm bar over the batches with what the loader is doing.

The bar counts batches (its total is `len(loader)` when known); its postfix, refreshed at most every
`REFRESH_S`, shows samples/s, MB/s fetched and the share of that interval the consumer spent waiting
for data (`wait`). tqdm comes with the "profile" extra: `pip install 'aioloader[profile]'`.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

from .stats import LoaderStats

__all__ = ["REFRESH_S", "Observed", "live_line", "with_progress"]

T = TypeVar("T")
REFRESH_S = 0.5
_MISSING = "progress=True needs tqdm: pip install 'aioloader[profile]' (or pip install tqdm)"


class Observed(Protocol):
    """What these tools read of a loader: its stats, and its length in batches."""

    def stats(self) -> LoaderStats: ...
    def __len__(self) -> int: ...


def live_line(before: LoaderStats, now: LoaderStats) -> str:
    """What happened between two snapshots: samples/s, MB/s fetched, batches/s and data-wait %."""
    dt = max(now.wall_s - before.wall_s, 1e-9)
    samples = (now.samples - before.samples) / dt
    mb = (now.stages["fetch"].bytes - before.stages["fetch"].bytes) / dt / 1e6
    batches = (now.batches - before.batches) / dt
    wait = 100.0 * (now.consumer_wait_s - before.consumer_wait_s) / dt
    return (
        f"{batches:.1f} batches/s, {samples:.0f} samples/s, {mb:.1f} MB/s, "
        f"wait {min(100.0, wait):.0f}%"
    )


def tqdm_class() -> Any:
    """tqdm's bar class; ImportError with the install hint when tqdm is missing."""
    try:
        module = importlib.import_module("tqdm")
    except ImportError as exc:
        raise ImportError(_MISSING) from exc
    return module.tqdm


def with_progress(
    loader: Observed, batches: Iterator[T], *, total: int | None = None, **bar: Any
) -> Iterator[T]:
    """Yield `batches` while a tqdm bar (stderr; `bar` are tqdm's options) shows the loader's pace.

    Raises ImportError at once when tqdm is missing. Closing the returned iterator closes `batches`
    (and so stops the epoch) and the bar.
    """
    tqdm = tqdm_class()
    if total is None:
        try:
            total = len(loader)
        except TypeError:
            total = None
    bar.setdefault("unit", "batch")
    bar.setdefault("dynamic_ncols", True)
    return _shown(loader, batches, tqdm(total=total, **bar))


def _shown(loader: Observed, batches: Iterator[T], progress: Any) -> Iterator[T]:
    last, shown = loader.stats(), time.perf_counter()
    try:
        for batch in batches:
            progress.update(1)
            if time.perf_counter() - shown >= REFRESH_S:
                current, shown = loader.stats(), time.perf_counter()
                progress.set_postfix_str(live_line(last, current), refresh=False)
                last = current
            yield batch
    finally:
        progress.close()
        close = getattr(batches, "close", None)
        if close is not None:
            close()
