"""The seam between the transfer stage and CUDA: streams, events, copies, pinned memory.

`DeviceBackend` is every CUDA operation the transfer stage uses; `CudaBackend` does them with torch.cuda,
and the tests drive the stage with a fake that records the order of operations. Nothing here touches
torch.cuda until a `CudaBackend` is built.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

import torch

__all__ = ["CudaBackend", "DeviceBackend", "Event", "Pinning", "Stream", "register_host_memory"]

Pinning = Literal["staged", "registered", "pageable"]

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every device of the process


class Event(Protocol):
    """A device event (torch.cuda.Event's shape)."""

    def record(self, stream: Any) -> None: ...
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class Stream(Protocol):
    """A device stream (torch.cuda.Stream's shape)."""

    def wait_event(self, event: Any) -> None: ...


class DeviceBackend(Protocol):
    """The device operations the stage uses; `CudaBackend` runs them on a GPU, tests fake them."""

    device: torch.device

    def current_stream(self) -> Stream:
        """The calling thread's current stream on `device`."""
        ...

    def new_stream(self) -> Stream: ...
    def new_event(self) -> Event: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[object]: ...
    def copy_to_device(self, host: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
        """`host` on `device`, copied with non_blocking=True on the current stream."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None: ...
    def empty_pinned(self, nbytes: int) -> torch.Tensor: ...
    def is_pinned(self, tensor: torch.Tensor) -> bool: ...
    def host_register(self, tensor: torch.Tensor) -> bool: ...
    def host_unregister(self, tensor: torch.Tensor) -> None: ...


class CudaBackend:
    """`DeviceBackend` on one CUDA device (`cuda` means the current one). Initialises CUDA."""

    def __init__(self, device: torch.device) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={str(device)!r}: torch.cuda.is_available() is False")
        index = torch.cuda.current_device() if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={str(device)!r}: there are {torch.cuda.device_count()} GPUs")
        self.device = torch.device("cuda", index)
        self._registered: set[int] = set()  # addresses this backend registered

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()  # type: ignore[no-untyped-call]

    def use_stream(self, stream: Any) -> AbstractContextManager[object]:
        return torch.cuda.stream(stream)

    def copy_to_device(self, host: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
        return host.to(self.device, non_blocking=True, memory_format=fmt)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def host_register(self, tensor: torch.Tensor) -> bool:
        if tensor.is_pinned():  # pinned already (by torch, or registered by its owner)
            return True
        try:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
            err = cudart.cudaHostRegister(ptr, size, _HOST_REGISTER_PORTABLE)
        except (AssertionError, AttributeError, RuntimeError):  # no bindings: ROCm, old torch
            return False
        if int(err) != 0:
            # The failure stays this thread's "last CUDA error", which torch's next kernel launch
            # check would raise as its own; a launch here reads it (and so clears it).
            with contextlib.suppress(RuntimeError):
                torch.empty(1, device=self.device).zero_()
            return False
        self._registered.add(ptr)
        return True

    def host_unregister(self, tensor: torch.Tensor) -> None:
        ptr = tensor.data_ptr()
        if ptr in self._registered:
            self._registered.discard(ptr)
            torch.cuda.cudart().cudaHostUnregister(ptr)  # type: ignore[no-untyped-call]


def register_host_memory(tensor: torch.Tensor, backend: DeviceBackend) -> Pinning:
    """Page-lock `tensor`'s memory in place (cudaHostRegister), so copies from it need no staging.

    Returns "registered", or "staged" where the backend cannot register it: copies from it then go
    through the pinned pool. Blocking; call once per long-lived slab, never per batch.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("register_host_memory needs a contiguous CPU tensor")
    return "registered" if backend.host_register(tensor) else "staged"
