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

import asyncio
import contextlib
import copy
import threading
import warnings
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._observe.stats import Recorder
from .._util.threads import LazyThreadPool
from .._util.validate import check_int
from .cuda import CudaBackend, DeviceBackend, Event, Pinning, register_host_memory
from .pinned import PinnedPool, Slab, round_up, slab_size
from .stages import END

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


@dataclass(eq=False)
class Staged:
    """A batch whose copies to the device are issued; pass it to `DeviceStage.hand_over`."""

    batch: Any
    tensors: list[torch.Tensor]
    event: Event | None  # None: nothing to wait for (pinned on the host only)
    on_hand_over: Callable[[], None] | None = None
    handed_over: bool = False


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
        self._counts_lock = threading.Lock()
        self._counts = dict.fromkeys(("staged", "handed_over", "ahead", "ahead_peak", "direct"), 0)
        self._pinning = {"registered": 0, "staged": 0}  # outcomes of register_host_memory
        self._threads = LazyThreadPool(1, "aioloader-transfer")

    def stage(self, batch: Any) -> Staged:
        """Issue the copies of `batch`'s CPU tensor leaves to the device; returns without waiting for them.

        Blocks for the host copy into pinned memory, and when every pinned slab is still being read.
        Thread-safe (calls are serialised); call it off the consumer's thread.
        """
        hosts: list[torch.Tensor] = []
        _map(batch, _collect_into(hosts))
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
        out = _map(batch, lambda _: next(moved))
        self._count(staged=1, ahead=1, direct=len(direct))
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
        self._count(handed_over=1, ahead=-1)
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
        with self._counts_lock:
            counts = dict(self._counts)
            registered = self._pinning["registered"] > 0 and self._pinning["staged"] == 0
        pinning = "registered" if registered else "staged" if self.pin_memory else "pageable"
        return counts | {
            "device": str(self.device), "pinning": pinning, "slabs": len(pool.slabs),
            "slab_bytes": sum(map(slab_size, list(pool.slabs))), "slabs_allocated": pool.allocated,
            "slabs_reused": pool.reused, "slab_waits": pool.waits,
        }  # fmt: skip

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            for name, delta in deltas.items():
                self._counts[name] += delta
            self._counts["ahead_peak"] = max(self._counts["ahead_peak"], self._counts["ahead"])

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


class BatchStage(Protocol):
    """What `Feed` and the loader's epochs drive: `DeviceStage`, or `PinStage` (pinned on the host only)."""

    device_prefetch: int

    async def astage(self, batch: Any) -> Staged: ...
    def hand_over(self, staged: Staged) -> Any: ...
    def feed(self, epoch: _Batches, recorder: Recorder | None = None) -> Feed: ...
    def stats(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class _Batches(Protocol):
    """What `Feed` wraps: an `Epoch` (get, aclose, cancel, loop)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...
    async def get(self) -> tuple[int, Any]: ...
    async def aclose(self) -> None: ...
    def cancel(self) -> None: ...
    def stuck(self) -> tuple[str, list[tuple[Any, float]]]: ...


class Feed:
    """An epoch whose batches are staged on the device ahead of the consumer; `Epoch`'s interface.

    `get()` returns `(index, Staged)`, or `(-1, END)` after the last batch, and raises the epoch's error
    in its place (a staging error carries the note "stage 'transfer'"). The consumer passes the `Staged`
    to `DeviceStage.hand_over` in its own thread; that frees its slot, so at most `device_prefetch`
    batches are staged and not handed over. Construct it on the epoch's event loop.
    """

    def __init__(
        self, stage: BatchStage, epoch: _Batches, recorder: Recorder | None = None
    ) -> None:
        self._stage, self._epoch = stage, epoch
        self._rec = recorder or Recorder()  # times each staging as the "transfer" stage
        self._slots = asyncio.Semaphore(stage.device_prefetch)
        self._out: asyncio.Queue[tuple[tuple[int, Any], BaseException | None]] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run(), name="aioloader-transfer")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this feed and its epoch run on."""
        return self._loop

    def stuck(self) -> tuple[str, list[tuple[Any, float]]]:
        """The epoch's `stuck()`: where its oldest work in flight is."""
        return self._epoch.stuck()

    async def get(self) -> tuple[int, Any]:
        """The next `(index, Staged)`, `(-1, END)` after the last; safe to cancel."""
        return _got(await self._out.get())

    def ready(self) -> tuple[int, Any] | None:
        """`get()` at once when a staged batch is waiting, else None."""
        return None if self._out.empty() else _got(self._out.get_nowait())

    async def aclose(self) -> None:
        """Cancel the staging and the epoch and wait until both have ended. Idempotent."""
        self._task.cancel()
        try:
            await asyncio.wait([self._task])
        finally:
            await self._epoch.aclose()

    def cancel(self) -> None:
        """Ask the feed and its epoch to stop (non-blocking; call on the feed's loop)."""
        self._task.cancel()
        self._epoch.cancel()

    async def _run(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                index, batch = await self._epoch.get()
            except Exception as exc:
                return self._out.put_nowait(((-1, None), exc))
            if batch is END:
                return self._out.put_nowait(((-1, END), None))
            t0 = self._rec.start("transfer")
            try:
                staged = await self._stage.astage(batch)
            except asyncio.CancelledError:
                self._rec.cancelled("transfer", t0)
                raise
            except Exception as exc:
                self._rec.stop("transfer", t0, error=True, key=index)
                exc.add_note("aioloader: raised in stage 'transfer'")
                return self._out.put_nowait(((-1, None), exc))
            self._rec.stop("transfer", t0, key=index)
            del batch  # the host batch's buffers may be recycled now
            staged.on_hand_over = self._release
            self._out.put_nowait(((index, staged), None))

    def _release(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for the slot
            self._loop.call_soon_threadsafe(self._slots.release)


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
        from .pin import PinStage  # torch's DataLoader(pin_memory=True): pinned host batches

        return PinStage(device_prefetch=device_prefetch)
    if target.type != "cuda":
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {str(target)!r}")
    return DeviceStage(
        backend(target), device_prefetch=device_prefetch, pin_memory=pin_memory is not False,
        memory_format=memory_format,
    )  # fmt: skip


def _map(
    obj: Any, fn: Callable[[torch.Tensor], Any], other: Callable[[Any], Any] | None = None
) -> Any:
    """`obj` with `fn` applied to each CPU tensor leaf, depth first; other leaves kept as they are,
    or passed through `other` where given."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.device.type == "cpu" else obj
    if isinstance(obj, Mapping):
        moved = {key: _map(value, fn, other) for key, value in obj.items()}
        if isinstance(obj, MutableMapping):
            out = copy.copy(obj)
            out.update(moved)
            return out
        return _rebuilt(obj, moved, dict)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map(value, fn, other) for value in obj))
    if isinstance(obj, list | tuple):
        return _rebuilt(
            obj, [_map(value, fn, other) for value in obj], list if isinstance(obj, list) else tuple
        )
    return obj if other is None else other(obj)


def _rebuilt(obj: Any, items: Any, fallback: Callable[[Any], Any]) -> Any:
    try:
        return type(obj)(items)
    except TypeError:
        return fallback(items)


def _collect_into(found: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def collect(t: torch.Tensor) -> torch.Tensor:
        found.append(t)
        return t

    return collect


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _got(out: tuple[tuple[int, Any], BaseException | None]) -> tuple[int, Any]:
    item, error = out
    if error is not None:
        raise error
    return item
