"""Transfer stage: the ordering of copies, events and hand-over, checked through a fake device backend.

`FakeBackend` records every device operation (with its stream and thread) instead of running it; its
events complete only when a test says so, which makes "is the pinned buffer reused too early?" a
deterministic question. Tests marked `cuda` run the real backend and are skipped without a GPU.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from support.fakecuda import FakeBackend, Op, copied_from, hand_over_in_thread

from aioloader._pipeline.transfer import DeviceStage, make_device_stage, register_host_memory

# -- ordering: side stream, event, wait, record_stream ----------------------------------------------


def test_copies_are_issued_on_the_side_stream_from_pinned_memory_then_an_event_is_recorded(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    side = backend.streams[0].name
    stage.stage({"x": torch.ones(4), "y": torch.zeros(2, 3)})
    copies = backend.kinds("copy")
    assert len(copies) == 2
    assert all(op.stream == side for op in copies), copies
    assert all(pinned for _, pinned in (op.target for op in copies))
    assert side != backend.default.name
    kinds = [op.kind for op in backend.ops if op.kind in {"copy", "record"}]
    assert kinds == ["copy", "copy", "record"]
    assert backend.kinds("record")[0].stream == side


def test_consumer_stream_waits_on_the_copy_event_before_the_batch_is_handed_over(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    staging = backend.new_stream()  # the staging thread's own current stream must not be waited on
    with backend.use_stream(staging):
        staged = stage.stage(torch.arange(6.0))
    event = backend.kinds("record")[0].target
    consumer = backend.new_stream()
    batch, ops = hand_over_in_thread(stage, staged, consumer)
    assert Op("wait", consumer.name, event, "consumer") in ops
    assert not [op for op in ops if op.kind == "synchronize"]  # no host synchronisation
    assert torch.equal(batch, torch.arange(6.0))


def test_record_stream_marks_every_device_tensor_for_the_consumer_stream(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    staged = stage.stage([torch.ones(2), {"a": torch.zeros(3), "b": torch.ones(1, 1)}])
    consumer = backend.new_stream()
    batch, ops = hand_over_in_thread(stage, staged, consumer)
    leaves = [batch[0], batch[1]["a"], batch[1]["b"]]
    marked = {op.target for op in ops if op.kind == "record_stream" and op.stream == consumer.name}
    assert marked == {id(t) for t in leaves}


def test_hand_over_twice_is_an_error(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage()
    staged = stage.stage(torch.ones(1))
    stage.hand_over(staged)
    with pytest.raises(RuntimeError, match="already handed over"):
        stage.hand_over(staged)


# -- structure, formats, pinning modes --------------------------------------------------------------


Point = namedtuple("Point", ["x", "label"])


def test_nested_batches_are_moved_leaf_by_leaf_and_other_leaves_pass_through(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    tensors = [torch.full((2,), float(i)) for i in range(5)]
    array, name = np.arange(3), "sample"
    host = {
        "t": tensors[0],
        "meta": OrderedDict(name=name, id=3, array=array, none=None),
        "pair": (tensors[1], "s"),
        "list": [tensors[2], 1.5, [tensors[3]]],
        "point": Point(tensors[4], "label"),
    }
    batch = stage.hand_over(stage.stage(host))
    assert len(backend.kinds("copy")) == 5
    assert type(batch["meta"]) is OrderedDict
    assert type(batch["pair"]) is tuple
    assert type(batch["list"]) is list
    assert type(batch["point"]) is Point
    moved = [batch["t"], batch["pair"][0], batch["list"][0], batch["list"][2][0], batch["point"].x]
    for before, after in zip(tensors, moved, strict=True):
        assert after is not before
        assert torch.equal(after, before)
    assert batch["meta"]["name"] is name
    assert batch["meta"]["array"] is array
    assert batch["meta"]["none"] is None
    assert batch["point"].label == "label"
    assert batch["list"][1] == 1.5
    assert batch["pair"][1] == "s"
    assert host["t"] is tensors[0]  # the host batch is left as it was


def test_a_batch_without_tensors_is_handed_over_unchanged(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    assert stage.hand_over(stage.stage(["a", 1, None])) == ["a", 1, None]
    assert not backend.kinds("copy")
    assert not backend.kinds("alloc_pinned")


@pytest.mark.parametrize("memory_format", [None, torch.channels_last])
def test_channels_last_is_applied_to_4d_tensors_only(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
    memory_format: torch.memory_format | None,
) -> None:
    stage, _ = make_stage(memory_format=memory_format)
    host = {
        "img": torch.randn(2, 3, 4, 5),
        "vol": torch.randn(1, 2, 3, 4, 5),
        "seq": torch.randn(2, 3, 4),
    }
    batch = stage.hand_over(stage.stage(host))
    img_is_channels_last = batch["img"].is_contiguous(memory_format=torch.channels_last)
    assert img_is_channels_last == (memory_format is not None)
    assert batch["img"].is_contiguous() == (memory_format is None)
    assert batch["vol"].is_contiguous()
    assert batch["seq"].is_contiguous()
    for key, value in host.items():
        assert torch.equal(batch[key], value)


def test_registered_memory_is_copied_directly_and_kept_until_its_copy_completed(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    slab = torch.zeros(1024)
    assert stage.register_host_memory(slab) == "registered"
    leaf = slab[256:512].fill_(7.0)
    leaf_ptr, alive = leaf.data_ptr(), weakref.ref(leaf)
    batch = stage.hand_over(stage.stage({"x": leaf}))
    assert not backend.kinds("alloc_pinned")
    assert copied_from(backend) == [leaf_ptr]
    assert torch.equal(batch["x"], torch.full((256,), 7.0))
    del leaf
    gc.collect()
    assert alive() is not None  # its copy may still be reading it
    backend.events[0].complete()
    stage.stage(torch.ones(1))
    gc.collect()
    assert alive() is None
    stats = stage.stats()
    assert stats["pinning"] == "registered"
    assert stats["direct"] == 1
    stage.unregister_host_memory(slab)
    assert not backend.is_pinned(slab)


def test_registering_falls_back_to_staging_where_unsupported(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage(FakeBackend(register_ok=False))
    slab = torch.zeros(64)
    assert stage.register_host_memory(slab) == "staged"
    stage.stage(slab[:8])
    assert len(backend.kinds("alloc_pinned")) == 1
    assert copied_from(backend) != [slab.data_ptr()]
    assert stage.stats()["pinning"] == "staged"
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        register_host_memory(torch.zeros(4, 4).t(), backend)


def test_without_pin_memory_copies_come_from_pageable_memory(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage(pin_memory=False)
    host = torch.ones(8)
    stage.hand_over(stage.stage(host))
    assert backend.kinds("copy")[0].target == (host.data_ptr(), False)
    assert not backend.kinds("alloc_pinned")
    assert stage.stats()["pinning"] == "pageable"


# -- the factory and the CPU path -------------------------------------------------------------------


@pytest.mark.parametrize("device", [None, "cpu", torch.device("cpu")])
def test_no_stage_without_a_device(device: str | torch.device | None) -> None:
    assert make_device_stage(device) is None
    assert make_device_stage(device, pin_memory=False) is None


@pytest.mark.skipif(torch.accelerator.is_available(), reason="an accelerator is present")
def test_pin_memory_without_an_accelerator_warns_once_and_pins_nothing() -> None:
    with pytest.warns(UserWarning, match="no accelerator is found") as caught:
        assert make_device_stage(None, pin_memory=True) is None
    assert len(caught) == 1


@pytest.mark.parametrize(
    ("device", "expected"),
    [
        ("cuda", torch.device("cuda")),
        ("cuda:1", torch.device("cuda", 1)),
        (torch.device("cuda", 2), torch.device("cuda", 2)),
    ],
)
def test_cuda_devices_reach_the_backend(device: str | torch.device, expected: torch.device) -> None:
    seen: list[torch.device] = []

    def backend(target: torch.device) -> FakeBackend:
        seen.append(target)
        return FakeBackend(target)

    stage = make_device_stage(
        device, device_prefetch=3, memory_format=torch.channels_last, backend=backend
    )
    assert stage is not None
    assert seen == [expected]
    assert (stage.device_prefetch, stage.memory_format, stage.pin_memory) == (
        3,
        torch.channels_last,
        True,
    )
    stage.close()
    off = make_device_stage(device, pin_memory=False, backend=backend)
    assert off is not None
    assert not off.pin_memory


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"device": "mps"}, ValueError),
        ({"device": "not a device"}, ValueError),
        ({"device": "cuda", "device_prefetch": 0}, ValueError),
        ({"device": "cuda", "device_prefetch": 1.5}, TypeError),
        ({"device": "cuda", "memory_format": torch.contiguous_format}, ValueError),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        make_device_stage(backend=FakeBackend, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match=r"torch.cuda.is_available\(\) is False"):
        make_device_stage("cuda")


_CPU_PATH = r"""
import json, sys, threading
import torch

calls = []

def profile(frame, event, arg):
    if event == "call" and "/torch/cuda/" in frame.f_code.co_filename.replace("\\", "/"):
        calls.append(frame.f_code.co_name)
    elif event == "c_call" and getattr(arg, "__name__", "").startswith("_cuda"):
        calls.append(arg.__name__)

threading.setprofile(profile)
sys.setprofile(profile)
import aioloader
from aioloader._pipeline.transfer import make_device_stage

stages = [make_device_stage(d, pin_memory=p) for d in (None, "cpu", torch.device("cpu"))
          for p in (None, False)]

async def fetch(i):
    return torch.full((3, 4), float(i))

with aioloader.Loader(range(10), fetch, batch_size=4) as loader:
    batches = [b.tolist() for b in loader]
sys.setprofile(None)
threading.setprofile(None)
print(json.dumps({"stages": stages == [None] * 6, "batches": len(batches), "calls": sorted(set(calls)),
                  "initialized": torch.cuda.is_initialized()}))
"""


def test_the_cpu_path_never_touches_cuda() -> None:
    """Importing the module, building the stage for no device and iterating a loader call no torch.cuda."""
    done = subprocess.run(
        [sys.executable, "-c", _CPU_PATH], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # `is_initialized` only reads a flag (a process pool asks it before it forks: beside the trainer)
    calls = set(report.pop("calls")) - {"is_initialized"}
    assert report == {"stages": True, "batches": 3, "initialized": False}
    assert calls == set()


# -- on a GPU ----------------------------------------------------------------------------------------

# -- wired into the loaders ------------------------------------------------------------------------


def test_loader_device_stage_end_to_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loader(device=...) stages every batch and hands it over on the consumer's stream."""
    import functools

    import aioloader._loader as loader_module
    from aioloader import Loader

    backend = FakeBackend()
    monkeypatch.setattr(
        loader_module,
        "make_device_stage",
        functools.partial(make_device_stage, backend=lambda _device: backend),
    )

    def fetch(i: int) -> dict[str, Any]:
        return {"x": torch.full((3, 4, 4), float(i)), "name": f"k{i}"}

    with Loader(
        list(range(6)), fetch, batch_size=2, device="cuda:0", memory_format=torch.channels_last
    ) as loader:
        batches = list(loader)
    assert [b["name"] for b in batches] == [["k0", "k1"], ["k2", "k3"], ["k4", "k5"]]
    assert all(b["x"].is_contiguous(memory_format=torch.channels_last) for b in batches)
    assert [float(b["x"][0, 0, 0, 0]) for b in batches] == [0.0, 2.0, 4.0]
    side = {op.stream for op in backend.kinds("copy")}
    assert side
    assert "default" not in side
    waits = backend.kinds("wait")
    assert len(waits) == 3
    assert all(w.stream == "default" for w in waits)  # the consumer's stream waited
    assert all(w.thread == "MainThread" for w in waits)  # at hand-over, in the consumer's thread
    assert len(backend.kinds("record_stream")) == 3


@pytest.mark.in_process
def test_cpu_device_means_no_stage() -> None:
    from aioloader import Loader

    with Loader([1, 2], lambda k: torch.tensor(k), batch_size=2, device="cpu") as loader:
        assert loader._epochs.device is None
        assert torch.equal(next(iter(loader)), torch.tensor([1, 2]))
