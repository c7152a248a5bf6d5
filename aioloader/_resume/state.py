"""Where an epoch stands, and the saved state that lets a new process continue it exactly.

A state is a small JSON-serialisable dict that records *what was delivered*, never timing:

    {"version": 1, "kind": "Loader", "config": {...}, "epoch": 2, "rank": 0, "world_size": 2,
     "consumed": [[0, 40]], "delivered": [[0, 3], [5, 6]], "in_order": true}

- `consumed`: indices into the epoch's permutation that were delivered before the current plan (only
  non-empty after an elastic resume);
- `delivered`: the plan's group indices already handed to the consumer (any set, so `in_order=False`
  loses and repeats nothing);
- `own_states` (a DataLoader's): its dataset's, iterator's and sampler's own states as of the last
  batch handed over, with each worker's place in its stream (`_torch/stateful.py`).

Resuming with the same world size skips the delivered groups of the same plan: the remaining batches
are byte for byte those of an uninterrupted run. Resuming with another world size (elastic) adds
every rank's delivered samples to `consumed` and shares what is left of the epoch among the new
ranks: each left sample is delivered once (plus wrap-around padding, as for any epoch), in
permutation order. With a single state from a run whose ranks stepped in lockstep (DDP with
`in_order=True`), the other ranks are taken to have delivered the same group indices; otherwise pass
every rank's state.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._exceptions import StateError
from .._protocol import HasDigest
from .._util.ranges import Ranges, ranges_of

__all__ = ["STATE_VERSION", "Progress", "Resume", "check_config", "keys_digest", "pick_own"]

STATE_VERSION = 1
_DIGEST_SAMPLES = 64


@dataclass
class Progress:
    """The epoch being delivered: its plan (by `consumed`) and the groups handed over so far."""

    epoch: int
    consumed: Ranges = field(default_factory=Ranges)
    delivered: Ranges = field(default_factory=Ranges)


@dataclass
class Resume:
    """What the next iteration of `epoch` starts from."""

    epoch: int
    consumed: Ranges
    skip: set[int]


def keys_digest(keys: Any) -> str:
    """A short fingerprint of a key sequence: its length and a spread of its keys."""
    if not isinstance(keys, Sequence):
        said = f":{keys.digest()}" if isinstance(keys, HasDigest) else ""  # a mix's keys
        return f"unsized:{type(keys).__name__}{said}"
    n = len(keys)
    picks = sorted(
        {(i * max(n - 1, 0)) // max(_DIGEST_SAMPLES - 1, 1) for i in range(_DIGEST_SAMPLES)}
    )
    h = hashlib.blake2b(digest_size=8)
    h.update(str(n).encode())
    for i in picks if n else []:
        h.update(repr(keys[i]).encode())
    return f"{n}:{h.hexdigest()}"


def check_config(state: Mapping[str, Any], kind: str, config: Mapping[str, Any]) -> None:
    """Raise StateError naming the first field where `state` does not fit this loader."""
    if not isinstance(state, Mapping):
        raise StateError(f"state must be a dict, got {type(state).__name__}", field="state")
    if state.get("version") != STATE_VERSION:
        raise StateError(
            f"state version {state.get('version')!r} is not {STATE_VERSION}", field="version"
        )
    if state.get("kind") != kind:
        raise StateError(f"state is from a {state.get('kind')!r}, not a {kind!r}", field="kind")
    saved = state.get("config", {})
    for name, value in config.items():
        if saved.get(name) != value:
            raise StateError(
                f"state does not fit this loader: config field {name!r} was "
                f"{saved.get(name)!r}, is {value!r}",
                field=name,
            )


def pick_own(
    states: Sequence[Mapping[str, Any]], rank: int, world_size: int
) -> Mapping[str, Any] | None:
    """The state saved by this rank at this world size, if there is one."""
    for s in states:
        if s.get("rank") == rank and s.get("world_size") == world_size:
            return s
    return None


def elastic_consumed(
    states: Sequence[Mapping[str, Any]],
    group_indices: Callable[[int, int, int, Ranges], list[int]],
    left_out: Callable[[int, Ranges, int], Ranges] | None = None,
) -> tuple[int, Ranges]:
    """(epoch, consumed) once every saved rank's delivered groups are counted as consumed.

    `group_indices(rank, world_size, group, consumed)` gives the permutation indices of a group of
    the plan that rank had; `left_out(epoch, consumed, world_size)`, where the epoch may end before
    every index is reached (a mix), those the uninterrupted epoch would not reach: consumed too.
    """
    first = states[0]
    epoch, old_world = int(first["epoch"]), int(first["world_size"])
    consumed = Ranges(first.get("consumed", []))
    for s in states:
        if int(s["epoch"]) != epoch or Ranges(s.get("consumed", [])) != consumed:
            raise StateError("states: the ranks' states are from different points", field="epoch")
    if len(states) == 1 and old_world > 1:
        if not first.get("in_order", True):
            raise StateError(
                "states: with in_order=False the ranks delivered different batches; pass every "
                "rank's state to resume on another world size",
                field="states",
            )
        states = [dict(first, rank=r) for r in range(old_world)]
    ranks = sorted(int(s["rank"]) for s in states)
    if ranks != list(range(old_world)):
        raise StateError(f"states: need ranks 0..{old_world - 1}, got {ranks}", field="rank")
    taken: list[int] = []
    for s in states:
        for g in Ranges(s.get("delivered", [])):
            taken.extend(group_indices(int(s["rank"]), old_world, g, consumed))
    left = Ranges() if left_out is None else left_out(epoch, consumed, old_world)
    # (as arrays: what is left out may be most of an epoch, no Python step per int)
    return epoch, ranges_of(
        np.concatenate([consumed.array(), np.asarray(taken, np.int64), left.array()])
    )
