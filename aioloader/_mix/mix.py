"""`aioloader.mix`: several sources interleaved in set proportions, deterministically, resumable.

What a mix operates on: samples, before batching. `mix(sources, weights)` is itself a source: a
`Loader` over it fetches from every source at once (`concurrency` in flight, in the mix's order),
decodes and batches, so each batch holds the sources in proportion, and the loader's
`state_dict()` resumes it exactly. (Already-built loaders mix too, whole items at a time:
`loaders.py`.)

The rule, for epoch `e` of the mix:

- Position `p` draws source `i` with probability `weights[i] / sum(weights)`, from a generator seeded
  by (seed, e, p // 4096): the choice sequence depends on (seed, epoch, position) only, never on
  timing, on which source is ready, or on the sources' contents.
- Every source starts its own epoch `e` when the mix's epoch `e` starts and keeps its own position:
  it gives its keys in its own order (a permutation seeded from (seed, its index, its epoch) for a
  source with a length when `shuffle`; a streamed source orders itself, e.g. tar shards).
- A drawn source that has run out: with `stop="first_exhausted"` the epoch ends there; with
  `"all_exhausted"` the source starts its next epoch (its own reshuffle) while the others go on, and
  the epoch ends once every source of non-zero weight has run out at least once; with `"cycle"`
  sources restart forever (an endless epoch: train by steps).

So epoch `e` is a pure function of (seed, e) and the sources: any epoch can be started, skipped or
resumed without the ones before it, and the next does not depend on how far this one was read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._loader import Loader
from .._util.validate import check_int
from .choices import Schedule, check_stop, check_weights
from .loaders import MixedLoaders
from .rows import MixedRows
from .source import Mix, label

__all__ = ["mix"]


def mix(
    sources_or_loaders: Sequence[Any] | Mapping[str, Any],
    weights: Sequence[float] | Mapping[str, float] | Schedule,
    *,
    seed: int = 0,
    stop: str = "first_exhausted",
    shuffle: bool = True,
    rows_per_item: int | None = None,
) -> Any:
    """Interleave sources (or loaders) in the proportions `weights`, deterministically.

    Args:
        sources_or_loaders: the inputs, as a list or as a {name: input} mapping. Each is a `Source`
            (`sources.files`, `sources.s3`, `sources.tar_shards`, `sources.parquet`, ...), a
            map-style dataset, a list of samples, or an iterable or async iterable of samples (an
            IterableDataset). Or all of
            them `Loader`s: their items (batches, or samples when unbatched) are then mixed whole.
        weights: one non-negative number per input (or {name: weight}), not all zero; position `p`
            of an epoch draws input `i` with probability `weights[i] / sum(weights)`. Or
            `aioloader.schedule(...)`: weights that change with the position (each position still
            draws with the weights in force there).
        seed: the choices and every input's shuffle derive from it, the epoch and the position.
        stop: when an epoch ends: "first_exhausted" (the first input that runs out ends it),
            "all_exhausted" (inputs that run out start their next epoch until every one has run
            out once) or "cycle" (inputs restart forever: an endless epoch).
        shuffle: permute each input that has a length, per its own epoch (streams order themselves).
        rows_per_item: mix loaders of columnar items (pyarrow RecordBatches or Tables, e.g.
            `Loader(sources.parquet(..., rows_per_sample=M), batch_size=None, collate=None)`)
            row by row: each position is one row (one document), and the mix yields Tables of
            this many rows (see `rows.py`). None (default): items are mixed whole.

    Returns:
        For sources, a `Mix`: a source for `Loader(mix(...), batch_size=..., ...)`, whose batches
        hold the sources in proportion and whose `state_dict()` resumes it exactly. For loaders, a
        `MixedLoaders` to iterate, with its own `state_dict()` / `load_state_dict()` (with
        `rows_per_item`, a `MixedRows`).

    Example:
        >>> both = mix({"a": list(range(6)), "b": ["x", "y"]}, {"a": 3, "b": 1}, seed=1)
        >>> with Loader(both, batch_size=4, collate=None) as loader:  # doctest: +SKIP
        ...     [batch for batch in loader]
    """
    names: list[str | None]
    if isinstance(sources_or_loaders, Mapping):
        names = [_check_name(n) for n in sources_or_loaders]
        inputs = list(sources_or_loaders.values())
    elif isinstance(sources_or_loaders, Sequence) and not isinstance(sources_or_loaders, str):
        inputs, names = list(sources_or_loaders), [None] * len(sources_or_loaders)
    else:
        raise TypeError(
            "sources_or_loaders: expected a list or a {name: source} mapping, got "
            f"{type(sources_or_loaders).__name__}"
        )
    if not inputs:
        raise ValueError("sources_or_loaders: nothing to mix")
    checked = check_weights(weights, names)
    check_int("seed", seed, minimum=0)
    stop = check_stop(stop)
    if not isinstance(shuffle, bool):
        raise TypeError(f"shuffle: expected True or False, got {shuffle!r}")
    loaders = [isinstance(x, Loader) for x in inputs]
    if rows_per_item is not None:
        check_int("rows_per_item", rows_per_item, minimum=1)
        if not all(loaders):
            raise TypeError(
                "rows_per_item: a mix by rows takes loaders of columnar items (Loader("
                "sources.parquet(..., rows_per_sample=N), batch_size=None, collate=None)), not "
                "sources"
            )
        return MixedRows(inputs, names, checked, seed=seed, stop=stop, rows_per_item=rows_per_item)
    if all(loaders):
        return MixedLoaders(inputs, names, checked, seed=seed, stop=stop)
    if any(loaders):
        raise TypeError(
            f"sources_or_loaders: {label(loaders.index(True), names[loaders.index(True)])} is a "
            "Loader and others are not; mix sources (then one Loader over the mix) or only loaders"
        )
    return Mix(inputs, names, checked, seed=seed, stop=stop, shuffle=shuffle)


def _check_name(name: Any) -> str:
    if not isinstance(name, str):
        raise TypeError(f"sources_or_loaders: names must be strings, got {name!r}")
    return name
