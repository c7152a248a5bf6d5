"""Loaders mixed (whole or by rows) resumed on another world size, from every old rank's state.

Every rank of a mix draws the same loaders at the same positions, and each loader deals every rank
an equal share (padded), so the ranks run out of a loader at the same position. Their states can
still stand in different epochs of a loader: ranks stop at different positions (a packer's ranks
take different numbers of documents per step), and a loader that ran out on one rank (stop
"all_exhausted" or "cycle") has begun its next epoch there, not yet on a rank that stopped before.

So, per loader, what the old ranks delivered is counted epoch by epoch of that loader, from its
lowest epoch among them to its highest. Of epoch `k`:

- a rank in epoch `k` delivered the groups its loader state says and, in a mix by rows, the first
  rows of its partly used item (as many of that group's indices: one per row);
- a rank past `k` delivered its whole share of `k`; a rank before `k`, nothing of it.

Those indices, with the ones an earlier resume had consumed, are the epoch's consumed indices. The
loader resumes its lowest epoch without them (its own elastic resume: the rest shared among the new
ranks, each new rank as many), and each later epoch up to the highest starts without its own when
the mix moves the loader on to it (`Resumed.later`). Every document of each of those epochs comes
once, before the save or after the restore (but for the padding of the new shares).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._exceptions import StateError
from .._loader import Loader
from .._util.ranges import Ranges, ranges_of

__all__ = ["Resumed", "Seen", "resume_loader"]


@dataclass
class Seen:
    """What one old rank's state says of one loader: its epoch there, its state in it (None:
    nothing of the epoch delivered, as at the mix's epoch start), a partly used item (group,
    rows used, rows), and the consumed indices an earlier resume left for its later epochs."""

    rank: int
    epoch: int
    state: Mapping[str, Any] | None
    part: tuple[int, int, int] | None = None
    later: dict[int, Ranges] = field(default_factory=dict)


@dataclass
class Resumed:
    """Where a loader resumes: its epoch and the indices of it consumed, and those of its later
    epochs (only the ones where any are)."""

    epoch: int
    consumed: Ranges
    later: dict[int, Ranges]


def resume_loader(
    loader: Loader[Any], label: str, seen: Sequence[Seen], world_size: int
) -> Resumed:
    """What loader `label` (`seen`: every one of the `world_size` old ranks') resumes from; see
    the module docstring. StateError naming the loader and the field where the states disagree
    or the loader cannot say what an old rank was dealt."""
    low = min(s.epoch for s in seen)
    high = max(s.epoch for s in seen)
    beyond = {k for s in seen for k in s.later if k > high}
    counted: dict[int, Ranges] = {}
    for k in [*range(low, high + 1), *sorted(beyond)]:
        before = _agreed(label, k, seen)
        parts = [before.array()]
        try:
            for s in seen:
                if s.epoch > k:  # its whole share of `k`
                    parts.append(loader.indices(k, s.rank, world_size, before, None))
                elif s.epoch == k and s.state is not None:
                    parts.append(loader.indices(k, s.rank, world_size, before, _groups(s.state)))
                    if s.part is not None:
                        parts.append(_used_rows(loader, k, s, world_size, before))
        except StateError as e:
            raise StateError(f"{label}: {e}", field=e.field) from e
        counted[k] = ranges_of(np.concatenate(parts))
    later = {k: r for k, r in counted.items() if k > low and len(r)}
    return Resumed(low, counted[low], later)


def _agreed(label: str, k: int, seen: Sequence[Seen]) -> Ranges:
    """The indices of epoch `k` consumed before the old ranks ran it: what every rank in it
    began it without, and what every rank before it holds for it (one and the same)."""
    said = [
        Ranges(s.state.get("consumed", []))
        for s in seen
        if s.epoch == k and s.state is not None
    ] + [s.later.get(k, Ranges()) for s in seen if s.epoch < k]  # fmt: skip
    if any(r != said[0] for r in said[1:]):
        raise StateError(
            f"{label}: the old ranks' states began its epoch {k} from different resumes",
            field="consumed",
        )
    return said[0] if said else Ranges()


def _groups(state: Mapping[str, Any]) -> list[int]:
    return list(Ranges(state.get("delivered", [])))


def _used_rows(loader: Loader[Any], k: int, s: Seen, world_size: int, before: Ranges) -> np.ndarray:
    """The indices of the rows of rank `s`'s partly used item that the mix used: as many of its
    group's first indices, where the group has one index per row of the item."""
    assert s.part is not None
    group, used, rows = s.part
    indices = loader.indices(k, s.rank, world_size, before, [group])
    if len(indices) != rows:
        raise StateError(
            f"rank {s.rank}'s partly used item has {rows} rows and {len(indices)} "
            "keys, so the rows used cannot be told apart from the rest on another world size; "
            "a mix by rows resumes there from loaders of one row per key "
            "(Loader(sources.parquet(..., rows_per_sample=N), batch_size=None, collate=None), "
            "its decode keeping the rows), or on the saved world size",
            field="world_size",
        )
    return indices[:used]
