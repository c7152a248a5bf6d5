"""Tar shards' epoch, counted: which samples each reader streams, all readers the same number.

With every shard's sample count known (`sample_counts=`, or a first pass: `tar_counts.py`), one epoch
of N samples is laid out as numbered positions:

1. the shards in the epoch's order (shuffled from (seed, epoch), or as given), their samples
   concatenated: position p is sample p - start(s) of the shard s that holds it;
2. the positions not yet consumed (all of them, unless an elastic resume consumed some) are cut into
   one contiguous share per reader (rank, or rank and worker), all of one length: ceil(left /
   readers), the last share padded by wrapping around to the start (as the order stage pads keys),
   or floor with `drop_last` (as it drops them);
3. a share is read as segments, one per run of one shard in it (a shard cut at a share's edge is
   read by the two readers on either side of the cut, each keeping its own samples).

A reader then streams its segments as it streams whole shards (`parallel` at once, round-robin, then
the shuffle buffer), so the order of its stream is a function of its segments' lengths and the seed:
a saved state's delivered batches name positions without reading a byte (`TarShards.positions`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..._exceptions import FetchError
from ..._util.ranges import Ranges
from ..transport.redact import redact_url
from .parquet_order import remaining, share

__all__ = ["Segment", "check_counts", "given", "kept", "segments", "shard_order"]


@dataclass(frozen=True)
class Segment:
    """What a reader reads of one shard: `members`, the indices of the samples it keeps
    (ascending; None: all of them), and their epoch positions."""

    shard: int  # index into the source's shard list
    members: np.ndarray | None
    positions: np.ndarray | None  # None: not needed (one reader, all of every shard)


def shard_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The shard indices of `epoch` in reading order: shuffled from (seed, epoch), or as given."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def check_counts(counts: Any, shards: Sequence[str]) -> list[int] | None:
    """`sample_counts` as one int per shard (None stays None); errors name the argument."""
    if counts is None:
        return None
    if isinstance(counts, Mapping):
        missing = [s for s in shards if s not in counts]
        if missing:
            raise ValueError(f"sample_counts: no count for shard {missing[0]!r}")
        counts = [counts[s] for s in shards]
    if isinstance(counts, str | bytes) or not isinstance(counts, Sequence):
        raise TypeError(
            "sample_counts: expected one int per shard (a list, or a {shard: count} mapping), "
            f"got {type(counts).__name__}"
        )
    if len(counts) != len(shards):
        raise ValueError(f"sample_counts: {len(counts)} counts for {len(shards)} shards")
    out = []
    for i, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
            raise ValueError(f"sample_counts[{i}]: expected an int >= 0, got {c!r}")
        out.append(int(c))
    return out


def segments(
    counts: Sequence[int], order: Sequence[int], consumed: Ranges, slot: int, slots: int,
    drop_last: bool,
) -> list[Segment]:  # fmt: skip
    """Reader `slot` of `slots`: its segments of the epoch whose shards come in `order`, once
    the positions in `consumed` are taken out (steps 1-3 of the module's docstring)."""
    sizes = np.asarray([counts[s] for s in order], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    mine = share(remaining(consumed, int(starts[-1])), slot, slots, drop_last)
    if len(mine) == 0:
        return []
    which = np.searchsorted(starts, mine, side="right") - 1  # index into `order`
    cuts = np.flatnonzero((np.diff(which) != 0) | (np.diff(mine) < 0)) + 1  # wrapped: anew
    out = []
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(mine)], strict=True):
        k = int(which[a])
        positions = mine[a:b]
        members = positions - starts[k]
        whole = len(members) == sizes[k]  # a run is ascending: all of them, in order
        out.append(Segment(order[k], None if whole else members, positions))
    return out


async def kept(
    samples: AsyncGenerator[list[dict[str, Any]], None], members: np.ndarray | None,
    expected: int | None, shard: str, keep_going: bool,
) -> AsyncGenerator[list[dict[str, Any]], None]:  # fmt: skip
    """The samples of one shard's stream (in chunks) that a segment keeps (`members`; None: all of
    them), in chunks, closing the stream after the last; a shard with fewer samples than
    `expected` (or than the members need) is a FetchError naming it (with `keep_going`: yielded
    as the rest's error)."""
    member, k = 0, 0
    wanted = None if members is None else members.tolist()
    async with contextlib.aclosing(samples):
        async for chunk in samples:
            if not chunk:
                continue
            if wanted is None and "__error__" not in chunk[-1]:
                member += len(chunk)
                yield chunk
                continue
            out = []
            for sample in chunk:
                if "__error__" in sample:  # the rest of a broken shard
                    out.append(sample)
                    yield out
                    return
                if wanted is None:
                    out.append(sample)
                elif member == wanted[k]:
                    out.append(sample)
                    k += 1
                    if k == len(wanted):
                        yield out
                        return  # the rest of the shard is other readers'
                member += 1
            if out:
                yield out
    if members is None and (expected is None or member == expected):
        return
    label = redact_url(shard)
    error = FetchError(
        f"tar shard {label}: {member} samples, but sample_counts says {expected}", key=label
    )
    if not keep_going:
        raise error
    yield [{"__error__": error, "__url__": shard, "__key__": f"<rest of {label}>"}]


async def given(values: np.ndarray) -> AsyncGenerator[list[int], None]:
    """`values` as a stream (one chunk): the positions a segment stands for, where
    `TarShards.positions` replays a reader's merge."""
    yield values.tolist()
