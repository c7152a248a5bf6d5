"""`DataLoader(pin_memory=True)` without a device pins each batch on the host, as torch's DataLoader does.

A training loop written for torch (`batch.to(device, non_blocking=True)`) only gets an asynchronous copy
from pinned memory. Without an accelerator, `Tensor.pin_memory()` cannot run, so the CPU tests stand one
in (an accelerator that says it is there, and a `pin_memory` that records what it pinned); the tests
marked `cuda` pin for real.
"""

from __future__ import annotations

import threading
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch

from aioloader import DataLoader, Loader
from aioloader._pipeline.pin import PinStage
from aioloader._pipeline.transfer import make_device_stage

Pair = namedtuple("Pair", ["x", "y"])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Samples(torch.utils.data.Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": torch.full((3,), float(i)), "pair": Pair(torch.tensor(i), i), "name": f"s{i}"}


class Pinned:
    """What the stand-in pins: the copies it made (by id) and the threads it ran on."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.kept: list[torch.Tensor] = []  # alive, so that no later tensor takes one of their ids
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        with self.lock:
            self.ids.add(id(out))
            self.kept.append(out)
            self.threads.add(threading.current_thread().name)
        return out


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> Pinned:
    """An accelerator that is present, and a `Tensor.pin_memory` that records the copies it makes."""
    recorder = Pinned()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: recorder(self))
    return recorder


def leaves(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in leaves(v)]
    if isinstance(batch, list | tuple):
        return [t for v in batch for t in leaves(v)]
    return []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_tensor_of_every_batch_is_pinned_off_the_consumer_thread(
    pinned: Pinned, num_workers: int
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an accelerator is present: no warning
        loader = DataLoader(Samples(10), batch_size=4, num_workers=num_workers, pin_memory=True)
    with loader:
        batches = list(loader)
    assert [b["x"][:, 0].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert isinstance(batches[0]["pair"], Pair)
    assert batches[0]["pair"].y.tolist() == [0, 1, 2, 3]
    assert batches[0]["name"] == ["s0", "s1", "s2", "s3"]
    found = [t for b in batches for t in leaves(b)]
    assert len(found) == 3 * 3
    assert all(id(t) in pinned.ids for t in found)  # each leaf handed over is a pinned copy
    assert threading.current_thread().name not in pinned.threads
    assert loader.stats().extra["transfer"]["staged"] == 3


def test_without_pin_memory_nothing_is_pinned(pinned: Pinned) -> None:
    with DataLoader(Samples(4), batch_size=2) as loader:
        assert len(list(loader)) == 2
    assert not pinned.ids


def test_a_custom_batch_type_is_pinned_by_its_own_method(pinned: Pinned) -> None:
    class Batch:
        def __init__(self, items: list[int]) -> None:
            self.data = torch.tensor(items)
            self.was_pinned = False

        def pin_memory(self) -> Batch:
            self.was_pinned = True
            return self

    with DataLoader(list(range(6)), batch_size=3, collate_fn=Batch, pin_memory=True) as loader:
        batches = list(loader)
    assert [b.data.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
    assert all(b.was_pinned for b in batches)


def test_the_native_loader_pins_when_asked_and_not_by_default(pinned: Pinned) -> None:
    async def fetch(i: int) -> torch.Tensor:
        return torch.tensor([i])

    with Loader(range(4), fetch, batch_size=2, pin_memory=True) as loader:
        assert all(id(b) in pinned.ids for b in loader)
    with Loader(range(4), fetch, batch_size=2) as loader:
        assert not any(id(b) in pinned.ids for b in loader)


def test_no_accelerator_warns_and_pins_nothing() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator is found"):
        assert make_device_stage(None, pin_memory=True) is None
    assert make_device_stage(None, pin_memory=False) is None
    assert isinstance(make_device_stage("cpu", pin_memory=True, accelerator=lambda: True), PinStage)


def test_a_pin_error_names_the_stage_and_the_loader_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(self: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "pin_memory", fail)
    loader = DataLoader(Samples(4), batch_size=2, pin_memory=True)
    with loader, pytest.raises(RuntimeError, match="out of pinned memory") as caught:
        list(loader)
    assert any("stage 'transfer'" in note for note in getattr(caught.value, "__notes__", []))


def test_a_batch_is_handed_over_once() -> None:
    stage = PinStage(pin=lambda t: t)
    staged = stage.stage(torch.ones(2))
    assert torch.equal(stage.hand_over(staged), torch.ones(2))
    with pytest.raises(RuntimeError, match="already handed over"):
        stage.hand_over(staged)
    stage.close()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_workers", [0, 2])
def test_gpu_batches_are_pinned_and_copy_without_waiting(num_workers: int) -> None:
    with DataLoader(Samples(12), batch_size=4, num_workers=num_workers, pin_memory=True) as loader:
        for i, batch in enumerate(loader):
            assert all(t.is_pinned() for t in leaves(batch))
            on_gpu = batch["x"].to("cuda", non_blocking=True)
            torch.cuda.current_stream().synchronize()
            assert on_gpu[:, 0].tolist() == [float(4 * i + k) for k in range(4)]
