"""Transfer stage: pinned staging, the host-to-device copy on a side stream, and the hand-over.

One batch, with `device="cuda"`:

    loop thread      `Feed` waits for a device slot (at most `device_prefetch` batches ahead of the
                     consumer), takes the next host batch from the epoch and stages it in the transfer
                     thread.
    transfer thread  `DeviceStage.stage` copies every CPU tensor leaf into one slab taken from a pool of
                     recycled pinned buffers, issues the copies to the device with non_blocking=True on a
                     side stream and records an event after them.
    consumer thread  `DeviceStage.hand_over` makes the consumer's current stream wait on that event (on
                     the device: the host never waits), marks every device tensor with `record_stream` for
                     that stream, and frees the slot.

A pinned slab is handed out again only once the event of the copy that read it has completed
(`event.query()`); the transfer thread waits for the oldest copy only when every slab is still being read.
Host memory that is already pinned (a slab registered with `register_host_memory`) is copied without
staging and kept referenced until its copy has completed.

Every CUDA call goes through a `DeviceBackend`, so tests drive the ordering with a fake one. Nothing here
touches torch.cuda unless a CUDA device is asked for.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._observe.stats import Recorder
from .._util.threads import LazyThreadPool
from .._util.validate import check_int
from .cuda import CudaBackend, DeviceBackend, Event, Pinning, register_host_memory
from .feed import BatchStage, Feed, StageCounts, Staged, _Batches, map_leaves
from .pin import PinStage
from .pinned import PinnedPool, Slab, round_up, slab_size

__all__ = [
    "BatchStage",
    "CudaBackend",
    "DeviceBackend",
    "DeviceStage",
    "Feed",
    "Staged",
    "make_device_stage",
    "register_host_memory",
]


_ALIGN = 256  # bytes: where each leaf starts inside a pinned slab
# Slabs beyond `device_prefetch`: the one being filled, and one whose copy may still run after hand-over.
_SPARE_SLABS = 2
_NO_ACCELERATOR = (
    "'pin_memory' argument is set as true but no accelerator is found, "
    "then device pinned memory won't be used."
)


class DeviceStage:
    """Moves host batches to one device, `device_prefetch` at most ahead of the consumer.

    Args:
        backend: the device operations (`CudaBackend` for a GPU).
        device_prefetch: batches staged on the device and not yet handed over, at most (Feed keeps it).
        pin_memory: stage CPU tensors through pinned memory (False: copy from pageable memory).
        memory_format: `torch.channels_last` to lay out 4-D tensors so on the device; None keeps them.

    Example:
        >>> stage = make_device_stage("cuda")  # doctest: +SKIP
        >>> staged = stage.stage({"x": torch.ones(2, 3)})  # in a pipeline thread  # doctest: +SKIP
        >>> batch = stage.hand_over(staged)  # in the consumer's thread  # doctest: +SKIP
    """

    def __init__(
        self,
        backend: DeviceBackend,
        *,
        device_prefetch: int = 2,
        pin_memory: bool = True,
        memory_format: torch.memory_format | None = None,
    ) -> None:
        self.backend, self.device = backend, backend.device
        self.device_prefetch = device_prefetch
        self.pin_memory = pin_memory
        self.memory_format = memory_format
        self._side = backend.new_stream()
        self._pool = PinnedPool(backend, device_prefetch + _SPARE_SLABS)
        self._held: list[tuple[Event, list[torch.Tensor]]] = []  # copied directly, until copied
        self._lock = threading.Lock()  # serialises stage(); guards the pool and _held
        self._counts_lock = threading.Lock()  # guards _pinning
        self._counts = StageCounts("direct")
        self._pinning = {"registered": 0, "staged": 0}  # outcomes of register_host_memory
        self._threads = LazyThreadPool(1, "aioloader-transfer")

    def stage(self, batch: Any) -> Staged:
        """Issue the copies of `batch`'s CPU tensor leaves to the device; returns without waiting for them.

        Blocks for the host copy into pinned memory, and when every pinned slab is still being read.
        Thread-safe (calls are serialised); call it off the consumer's thread.
        """
        hosts: list[torch.Tensor] = []
        map_leaves(batch, _collect_into(hosts))
        with self._lock, torch.no_grad():
            self._held = [(e, refs) for e, refs in self._held if not e.query()]
            sources, slab, direct = self._pin(hosts)
            event = self.backend.new_event()
            with self.backend.use_stream(self._side):
                devs = [self.backend.copy_to_device(s, self._format(s)) for s in sources]
                event.record(self._side)
            if slab is not None:
                slab.event = event
            if direct:
                self._held.append((event, direct))
        moved = iter(devs)
        out = map_leaves(batch, lambda _: next(moved))
        self._counts.add(staged=1, ahead=1, direct=len(direct))
        return Staged(out, devs, event)

    def _pin(
        self, hosts: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], Slab | None, list[torch.Tensor]]:
        """Copy the leaves to stage into one pinned slab; the others are copied to the device as they are."""
        offsets: list[int | None] = []  # where each leaf goes in the slab; None: copied directly
        total = 0
        for t in hosts:
            stage = self.pin_memory and t.numel() > 0 and not self.backend.is_pinned(t)
            offsets.append(total if stage else None)
            total += round_up(_nbytes(t), _ALIGN) if stage else 0
        slab = self._pool.take(total) if total else None
        sources: list[torch.Tensor] = []
        direct: list[torch.Tensor] = []
        for t, offset in zip(hosts, offsets, strict=True):
            if offset is None or slab is None:
                sources.append(t)
                direct.append(t)
                continue
            view = slab.buffer[offset : offset + _nbytes(t)].view(t.dtype).view(t.shape)
            sources.append(view.copy_(t))
        return sources, slab, direct

    def _format(self, t: torch.Tensor) -> torch.memory_format:
        if self.memory_format is not None and t.dim() == 4:
            return self.memory_format
        return torch.preserve_format

    def hand_over(self, staged: Staged) -> Any:
        """Return `staged`'s batch, safe to use on the calling thread's current stream.

        Never blocks the host: the current stream waits on the copies' event on the device, and each
        device tensor is marked as used by that stream so that the caching allocator keeps its memory
        until the consumer's work on it has run. Call it once per batch, in the consumer's thread.
        """
        if staged.handed_over:
            raise RuntimeError("this batch was already handed over")
        staged.handed_over = True
        stream = self.backend.current_stream()
        assert staged.event is not None
        stream.wait_event(staged.event)
        for t in staged.tensors:
            self.backend.record_stream(t, stream)
        batch, staged.batch, staged.tensors = staged.batch, None, []
        self._counts.add(handed_over=1, ahead=-1)
        if staged.on_hand_over is not None:
            staged.on_hand_over()
        return batch

    async def astage(self, batch: Any) -> Staged:
        """`stage(batch)` in the transfer thread. Safe to cancel: the staged batch is then dropped."""
        return await self._threads.run(self.stage, batch)

    def feed(self, epoch: _Batches, recorder: Recorder | None = None) -> Feed:
        """Stage `epoch`'s batches ahead of the consumer (see `Feed`); call on the epoch's loop."""
        return Feed(self, epoch, recorder)

    def register_host_memory(self, tensor: torch.Tensor) -> Pinning:
        """`register_host_memory(tensor, self.backend)`, reported in `stats()["pinning"]`."""
        pinning = register_host_memory(tensor, self.backend)
        with self._counts_lock:
            self._pinning[pinning] += 1
        return pinning

    def unregister_host_memory(self, tensor: torch.Tensor) -> None:
        """Undo `register_host_memory`, after every copy issued so far has completed. Blocking."""
        with self._lock:
            for event, _ in self._held:
                event.synchronize()
            self._held.clear()
            self.backend.host_unregister(tensor)

    def stats(self) -> dict[str, Any]:
        """A snapshot of this stage's counters; never waits for a copy.

        "pinning": how host memory was pinned: "staged" (through the pool), "registered" (in place,
        by `register_host_memory`) or "pageable" (pin_memory=False); "staged" / "handed_over":
        batches; "ahead" (and its "ahead_peak"): staged and not yet handed over; "direct": leaves
        copied without staging; "slabs", "slab_bytes", "slabs_allocated", "slabs_reused" and
        "slab_waits" (stagings that waited for a copy because every slab was still being read).
        """
        pool = self._pool  # changed under `_lock` only; read here without it: numbers and a copy
        counts = self._counts.snapshot()
        with self._counts_lock:
            registered = self._pinning["registered"] > 0 and self._pinning["staged"] == 0
        pinning = "registered" if registered else "staged" if self.pin_memory else "pageable"
        return counts | {
            "device": str(self.device), "pinning": pinning, "slabs": len(pool.slabs),
            "slab_bytes": sum(map(slab_size, list(pool.slabs))), "slabs_allocated": pool.allocated,
            "slabs_reused": pool.reused, "slab_waits": pool.waits,
        }  # fmt: skip

    def close(self) -> None:
        """Stop the transfer thread; release the pinned slabs once the copies reading them have ended.

        Idempotent. Blocks until the copies in flight end (milliseconds) and the thread stops (2 s at most).
        """
        self._threads.close()
        with self._lock:
            events = [s.event for s in self._pool.slabs if s.event is not None]
            for event in events + [e for e, _ in self._held]:
                with contextlib.suppress(RuntimeError):  # a broken device: nothing left to wait for
                    event.synchronize()
            self._pool.slabs.clear()
            self._held.clear()


def make_device_stage(
    device: str | torch.device | None,
    *,
    pin_memory: bool | None = None,
    device_prefetch: int = 2,
    memory_format: torch.memory_format | None = None,
    backend: Callable[[torch.device], DeviceBackend] = CudaBackend,
    accelerator: Callable[[], bool] | None = None,
    stacklevel: int = 2,
) -> BatchStage | None:
    """The transfer stage for `device`, or None where there is nothing to transfer.

    For `device=None` or a CPU device: None without touching CUDA, unless `pin_memory=True`. Then,
    as torch's DataLoader does, each batch's CPU tensors are pinned on the host (a `PinStage`, so
    that the consumer's `.to(device, non_blocking=True)` does not wait), or, when no accelerator
    is present, a warning is given once and nothing is pinned. `pin_memory=None` means: pin when
    a device is given. Raises ValueError for other device types, RuntimeError when
    CUDA is asked for and absent.
    """
    check_int("device_prefetch", device_prefetch, minimum=1)
    if memory_format not in (None, torch.channels_last):
        raise ValueError(f"memory_format must be None or torch.channels_last, got {memory_format}")
    try:
        target = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device: not a device: {device!r}") from exc
    if target is None or target.type == "cpu":
        if not pin_memory:
            return None
        if not (accelerator or torch.accelerator.is_available)():
            warnings.warn(_NO_ACCELERATOR, stacklevel=stacklevel)
            return None
        return PinStage(device_prefetch=device_prefetch)
    if target.type != "cuda":
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {str(target)!r}")
    return DeviceStage(
        backend(target), device_prefetch=device_prefetch, pin_memory=pin_memory is not False,
        memory_format=memory_format,
    )  # fmt: skip


def _collect_into(found: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    return collect


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
