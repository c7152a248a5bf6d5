"""The packer's saved state: the tokens it held, checked when loaded, and shared out anew when
the ranks that saved them were more or fewer than the ranks that load them.

A packer's state is `{"version", "kind", "config", "epoch", "loader", "tokens", "starts"}`: the
loader's own state, and the tokens of documents the loader delivered that were not yet in a row
(`starts`: where documents begin among them).

On another world size (elastic: every old rank's state given), the loader shares the documents no
old rank was delivered among the new ranks (its own elastic resume), and the tokens the old ranks
held go to new rank `r` from every old rank `j` with `j % world_size == r`, in rank order (each
old rank's part begins a segment of its own): each token is still delivered once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._exceptions import StateError

__all__ = ["Held", "held_of", "place_of", "share_held"]

Held = tuple[int, list[int], list[int]]  # (epoch, tokens, starts)


def place_of(state: Mapping[str, Any]) -> tuple[int, int]:
    """(rank, world size) of the loader that saved `state` (0 and 1 when it does not say)."""
    loader = state.get("loader")
    if not isinstance(loader, Mapping):
        raise StateError("loader: expected the loader's state", field="loader")
    return int(loader.get("rank", 0)), int(loader.get("world_size", 1))


def held_of(state: Mapping[str, Any]) -> Held:
    """The epoch and the tokens held in `state`, checked (StateError naming the field)."""
    tokens, starts = _ints(state, "tokens"), _ints(state, "starts")
    if starts and (min(starts) < 0 or max(starts) >= len(tokens)):
        raise StateError("starts: a document starts outside the tokens held", field="starts")
    epoch = state.get("epoch")
    if type(epoch) is not int or epoch < 0:
        raise StateError(f"epoch: expected an int >= 0, got {epoch!r}", field="epoch")
    return epoch, tokens, starts


def share_held(states: Sequence[Mapping[str, Any]], rank: int, world_size: int) -> Held:
    """What new rank `rank` of `world_size` holds from every old rank's state (see above)."""
    places = [place_of(s) for s in states]
    old_world = places[0][1]
    if sorted(places) != [(r, old_world) for r in range(old_world)]:
        raise StateError(
            f"states: resuming on another world size needs one state of each of the "
            f"{old_world} ranks that saved them, got ranks {sorted(r for r, _ in places)}",
            field="states",
        )
    held = {place[0]: held_of(s) for place, s in zip(places, states, strict=True)}
    if len({epoch for epoch, _, _ in held.values()}) != 1:
        raise StateError("states: the ranks' states are from different epochs", field="epoch")
    tokens: list[int] = []
    starts: list[int] = []
    for old in range(rank, old_world, world_size):
        _, theirs, their_starts = held[old]
        if theirs and their_starts[:1] != [0]:  # the rest of a document cut by a row: a segment
            starts.append(len(tokens))
        starts += [len(tokens) + s for s in their_starts]
        tokens += theirs
    return held[0][0], tokens, starts


def _ints(state: Mapping[str, Any], name: str) -> list[int]:
    value = state.get(name)
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise StateError(f"{name}: expected a list of ints", field=name)
    return value
