"""A fake CUDA backend (streams, events, copies) for the tests of the transfer stage, and what those
tests drive it with: `FakeEpoch` (an epoch of given items), `hand_over_in_thread`, `copied_from`."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from aioloader._pipeline.stages import END
from aioloader._pipeline.transfer import DeviceStage, Staged


@dataclass(frozen=True)
class Op:
    """One recorded device operation: what, on which stream, naming which event/tensor, from which thread."""

    kind: str
    stream: str = ""
    target: Any = None
    thread: str = ""


class FakeStream:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend, self.name = backend, name

    def wait_event(self, event: FakeEvent) -> None:
        self.backend.note("wait", self.name, event.name)


class FakeEvent:
    """Completes only when the test calls `complete()` (or something synchronizes on it)."""

    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend, self.name = backend, name
        self.recorded_on: str | None = None
        self.done = False

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.name
        self.backend.note("record", stream.name, self.name)

    def query(self) -> bool:
        return self.recorded_on is None or self.done  # as CUDA: an unrecorded event is complete

    def synchronize(self) -> None:
        self.backend.note("synchronize", "", self.name)
        self.done = True

    def complete(self) -> None:
        self.done = True


class FakeBackend:
    """Records the operations a `DeviceStage` issues; "device" tensors are CPU clones."""

    def __init__(self, device: torch.device | None = None, *, register_ok: bool = True) -> None:
        self.device = device or torch.device("cuda", 0)
        self.register_ok = register_ok
        self.ops: list[Op] = []
        self.streams: list[FakeStream] = []
        self.events: list[FakeEvent] = []
        self.pinned: list[torch.Tensor] = []  # pinned buffers and registered tensors
        self.fail_copy: Callable[[torch.Tensor], bool] = lambda _t: False
        self._lock = threading.Lock()
        self._local = threading.local()
        self.default = FakeStream(self, "default")

    def note(self, kind: str, stream: str = "", target: Any = None) -> None:
        with self._lock:
            self.ops.append(Op(kind, stream, target, threading.current_thread().name))

    def kinds(self, kind: str) -> list[Op]:
        return [op for op in self.ops if op.kind == kind]

    def current_stream(self) -> FakeStream:
        return getattr(self._local, "stream", None) or self.default

    def new_stream(self) -> FakeStream:
        self.streams.append(FakeStream(self, f"stream{len(self.streams)}"))
        return self.streams[-1]

    def new_event(self) -> FakeEvent:
        self.events.append(FakeEvent(self, f"event{len(self.events)}"))
        return self.events[-1]

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def copy_to_device(self, host: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
        if self.fail_copy(host):
            raise RuntimeError("fake copy failed")
        self.note("copy", self.current_stream().name, (host.data_ptr(), self.is_pinned(host)))
        return host.clone(memory_format=fmt)

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.note("record_stream", stream.name, id(tensor))

    def empty_pinned(self, nbytes: int) -> torch.Tensor:
        self.note("alloc_pinned", "", nbytes)
        self.pinned.append(torch.empty(nbytes, dtype=torch.uint8))
        return self.pinned[-1]

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        return any(
            b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size() for b in self.pinned
        )

    def host_register(self, tensor: torch.Tensor) -> bool:
        if self.register_ok:
            self.pinned.append(tensor)
        return self.register_ok

    def host_unregister(self, tensor: torch.Tensor) -> None:
        self.pinned = [b for b in self.pinned if b is not tensor]


class FakeEpoch:
    """An `Epoch` that yields `(i, items[i])`, raising items that are exceptions, then `(-1, END)`."""

    def __init__(self, items: list[Any], check: Callable[[], None] = lambda: None) -> None:
        self.items = items
        self.check = check
        self.pulled = 0
        self.closed = self.cancelled = False
        self._loop = asyncio.get_running_loop()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    async def get(self) -> tuple[int, Any]:
        self.check()
        await asyncio.sleep(0)
        if self.pulled == len(self.items):
            return -1, END
        self.pulled += 1
        item = self.items[self.pulled - 1]
        if isinstance(item, BaseException):
            raise item
        return self.pulled - 1, item

    async def aclose(self) -> None:
        self.closed = True

    def cancel(self) -> None:
        self.cancelled = True


def hand_over_in_thread(
    stage: DeviceStage, staged: Staged, stream: FakeStream
) -> tuple[Any, list[Op]]:
    """Hand `staged` over in a new "consumer" thread whose current stream is `stream`."""
    backend = stage.backend
    assert isinstance(backend, FakeBackend)
    result: dict[str, Any] = {}

    def consume() -> None:
        with backend.use_stream(stream):
            before = len(backend.ops)
            result["batch"] = stage.hand_over(staged)
            result["ops"] = backend.ops[before:]  # what had happened when the batch came back

    thread = threading.Thread(target=consume, name="consumer")
    thread.start()
    thread.join()
    return result["batch"], result["ops"]


def copied_from(backend: FakeBackend) -> list[int]:
    """The source addresses of the copies `backend` was asked for, in order."""
    return [op.target[0] for op in backend.kinds("copy")]
