"""A loader's state in a `torch.distributed.checkpoint` (DCP), beside the model's.

`DataCheckpoint(loader)` is DCP's `Stateful`: `dcp.save({"model": ..., "data":
DataCheckpoint(loader)}, checkpoint_id=...)` saves, and `dcp.load(...)` with one on each new rank
resumes. What it saves is every data-parallel rank's state, one entry each: at a save, each process
gathers the others' states (`all_gather_object` over the default group; small JSON, saved once,
as DCP saves a value every rank holds the same). The processes of one model-parallel group (a
`mesh=` loader's replicas) hold equal states, kept once. At a load each rank is given all of them,
as `load_state_dict(states)` takes them: on the saved data-parallel size it picks its own, on
another it resumes elastically (each remaining sample once, or `StateError` naming both sizes
where that cannot be kept). A loader, a mix of loaders and `pack` all take such a list.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DataCheckpoint"]

_KEY = "states"  # the one entry: every data-parallel rank's state, as JSON text


class DataCheckpoint:
    """`loader`'s state as DCP's `Stateful` (see the module docstring): `state_dict()` (a
    collective where a process group is up: every process calls it, as `dcp.save` and `dcp.load`
    do) and `load_state_dict(state)`.

    Args:
        loader: an `aioloader.Loader`, a mix of loaders, or `pack(...)`: anything with
            `state_dict()` and a `load_state_dict()` that takes every rank's states.
    """

    def __init__(self, loader: Any) -> None:
        for name in ("state_dict", "load_state_dict"):
            if not callable(getattr(loader, name, None)):
                raise TypeError(
                    f"loader: expected an aioloader Loader, mix or pack (it has no {name}()), "
                    f"got {type(loader).__name__}"
                )
        self.loader = loader

    def __repr__(self) -> str:
        return f"DataCheckpoint({self.loader!r})"

    def state_dict(self) -> dict[str, Any]:
        """{"states": every data-parallel rank's state, as JSON text} (the same on every process)."""
        own = json.dumps(self.loader.state_dict(), sort_keys=True)
        return {_KEY: "[" + ",".join(sorted(set(_gathered(own)))) + "]"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the loader from the saved ranks' states (its own, or all of them elastically)."""
        text = state.get(_KEY) if isinstance(state, dict) else None
        if not isinstance(text, str):
            raise TypeError(f"state: expected {{{_KEY!r}: JSON text}} as saved, got {state!r:.80}")
        self.loader.load_state_dict(json.loads(text))


def _gathered(own: str) -> list[str]:
    """`own` from every process of the default group (where one is up), else alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return [own]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, own)
    return [str(s) for s in out]
