"""`pin_memory=True` without a device: each batch's CPU tensors are pinned on the host, off the consumer.

This is what torch's DataLoader does with `pin_memory=True`, so that a training loop written for it
(`batch.to(device, non_blocking=True)`) gets an asynchronous copy from aioloader's DataLoader too.
`Feed` takes each host batch from the epoch, at most `device_prefetch` ahead of the consumer, and pins it
in the transfer thread; `hand_over` returns it as it is.

Pinned memory comes from torch's own caching host allocator (`Tensor.pin_memory()`), which hands a block
out again only once the copies that read it have completed, so a batch the consumer still copies from is
never overwritten. A leaf that is already pinned is kept; an object with a `pin_memory()` method (a
custom batch type) is pinned by that method, as torch's DataLoader does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._observe.stats import Recorder
from .._util.threads import LazyThreadPool
from .feed import Feed, StageCounts, Staged, _Batches, map_leaves

__all__ = ["PinStage"]


def pin_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` in pinned host memory (`t` itself when it is pinned already)."""
    return t if t.is_pinned() else t.pin_memory()


class PinStage:
    """Pins host batches ahead of the consumer; `BatchStage`'s interface.

    Args:
        device_prefetch: pinned batches not yet handed over, at most (`Feed` keeps it).
        pin: how one CPU tensor is pinned (a seam for tests on machines without an accelerator).
    """

    def __init__(
        self, *, device_prefetch: int = 2, pin: Callable[[torch.Tensor], torch.Tensor] = pin_tensor
    ) -> None:
        self.device_prefetch = device_prefetch
        self._pin = pin
        self._counts = StageCounts("leaves")
        self._threads = LazyThreadPool(1, "aioloader-transfer")

    def stage(self, batch: Any) -> Staged:
        """`batch` with every CPU tensor leaf pinned. Blocks for the copies into pinned memory."""
        leaves = [0]

        def pin(t: torch.Tensor) -> torch.Tensor:
            leaves[0] += 1
            return self._pin(t)

        out = map_leaves(batch, pin, other=_pin_object)
        self._counts.add(staged=1, ahead=1, leaves=leaves[0])
        return Staged(out, [], None)

    async def astage(self, batch: Any) -> Staged:
        """`stage(batch)` in the transfer thread. Safe to cancel: the pinned batch is then dropped."""
        return await self._threads.run(self.stage, batch)

    def hand_over(self, staged: Staged) -> Any:
        """Return `staged`'s pinned batch and free its slot. Call it once per batch."""
        if staged.handed_over:
            raise RuntimeError("this batch was already handed over")
        staged.handed_over = True
        batch, staged.batch = staged.batch, None
        self._counts.add(handed_over=1, ahead=-1)
        if staged.on_hand_over is not None:
            staged.on_hand_over()
        return batch

    def feed(self, epoch: _Batches, recorder: Recorder | None = None) -> Feed:
        """Pin `epoch`'s batches ahead of the consumer (see `Feed`); call on the epoch's loop."""
        return Feed(self, epoch, recorder)

    def stats(self) -> dict[str, Any]:
        """A snapshot: "staged" / "handed_over" batches, "ahead" (and "ahead_peak"), "leaves" pinned."""
        return self._counts.snapshot() | {"device": "cpu", "pinning": "pinned on the host"}

    def close(self) -> None:
        """Stop the transfer thread (2 s at most). Idempotent."""
        self._threads.close()


def _pin_object(obj: Any) -> Any:
    """A custom batch type's own `pin_memory()`, as torch's DataLoader calls it; else `obj`."""
    pin = getattr(obj, "pin_memory", None)
    return pin() if callable(pin) and not isinstance(obj, type) else obj
