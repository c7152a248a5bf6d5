"""Transfer stage: the ordering of copies, events and hand-over, checked through a fake device backend.

`FakeBackend` records every device operation (with its stream and thread) instead of running it; its
events complete only when a test says so, which makes "is the pinned buffer reused too early?" a
deterministic question. Tests marked `cuda` run the real backend and are skipped without a GPU.
"""

from __future__ import annotations

import asyncio
import gc
import json
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from support.fakecuda import FakeBackend, FakeStream, Op

from aioloader._pipeline.loop_thread import LoopThread
from aioloader._pipeline.stages import END
from aioloader._pipeline.transfer import (
    CudaBackend,
    DeviceStage,
    Staged,
    make_device_stage,
    register_host_memory,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- the fake backend ------------------------------------------------------------------------------


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


class Boom(Exception):
    pass


@pytest.fixture
def make_stage() -> Iterator[Callable[..., tuple[DeviceStage, FakeBackend]]]:
    """`make_stage(**kwargs)`: a DeviceStage on a fresh FakeBackend, closed after the test."""
    stages: list[DeviceStage] = []

    def make(backend: FakeBackend | None = None, **kwargs: Any) -> tuple[DeviceStage, FakeBackend]:
        backend = backend or FakeBackend()
        stages.append(DeviceStage(backend, **kwargs))
        return stages[-1], backend

    yield make
    for stage in stages:
        stage.close()


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


# -- the pinned pool ---------------------------------------------------------------------------------


def copied_from(backend: FakeBackend) -> list[int]:
    return [op.target[0] for op in backend.kinds("copy")]


def test_a_pinned_slab_is_reused_only_after_its_copy_event_completed(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    stage.hand_over(stage.stage(torch.ones(1000)))  # handed over, but its copy has not completed
    stage.stage(torch.ones(1000))
    first, second = copied_from(backend)
    assert first != second
    assert stage.stats()["slabs_allocated"] == 2
    backend.events[0].complete()
    stage.stage(torch.ones(1000))
    assert copied_from(backend)[2] == first
    assert (stage.stats()["slabs_allocated"], stage.stats()["slabs_reused"]) == (2, 1)


def test_a_full_pool_waits_for_the_oldest_copy_in_the_staging_thread_only(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage(device_prefetch=1)  # 1 + 2 spare slabs
    for _ in range(3):
        stage.stage(torch.ones(10))
    assert not backend.kinds("synchronize")
    stage.stage(torch.ones(10))  # every slab is being read
    assert [op.target for op in backend.kinds("synchronize")] == ["event0"]
    assert copied_from(backend)[3] == copied_from(backend)[0]
    stats = stage.stats()
    assert (stats["slabs"], stats["slabs_allocated"], stats["slab_waits"]) == (3, 3, 1)


def test_a_bigger_batch_replaces_a_free_smaller_slab_when_the_pool_is_full(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage(device_prefetch=1)
    for _ in range(3):
        stage.stage(torch.ones(10))
    for event in backend.events:
        event.complete()
    stage.stage(torch.ones(1 << 19))  # 2 MiB: no slab fits
    stats = stage.stats()
    assert (stats["slabs"], stats["slabs_allocated"], stats["slab_waits"]) == (3, 4, 0)
    assert stats["slab_bytes"] == 2 * (1 << 20) + (2 << 20)


def test_one_slab_holds_every_leaf_of_a_batch_each_in_place(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    host = {"f": torch.randn(3, 5), "i": torch.arange(7), "b": torch.tensor([True, False])}
    batch = stage.hand_over(stage.stage(host))
    assert len(backend.kinds("alloc_pinned")) == 1
    for key, value in host.items():
        assert batch[key].dtype == value.dtype
        assert torch.equal(batch[key], value)


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


# -- Feed: staging ahead of the consumer, bounded ---------------------------------------------------


@pytest.mark.asyncio
async def test_feed_stages_at_most_device_prefetch_batches_ahead(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage(device_prefetch=2)
    over_limit: list[int] = []

    def check() -> (
        None
    ):  # on every pull: never more than device_prefetch staged and not handed over
        if stage.stats()["ahead"] >= stage.device_prefetch:
            over_limit.append(stage.stats()["ahead"])

    epoch = FakeEpoch([torch.full((4,), float(i)) for i in range(6)], check)
    feed = stage.feed(epoch)
    _, first = await feed.get()
    await feed.get()
    for _ in range(20):  # a third pull would come at once: nothing but the slot holds it back
        await asyncio.sleep(0)
    assert epoch.pulled == 2
    assert stage.stats()["ahead"] == 2
    stage.hand_over(first)
    await feed.get()
    assert epoch.pulled == 3
    await feed.aclose()
    assert epoch.closed
    assert not over_limit


@pytest.mark.asyncio
async def test_feed_delivers_in_order_then_end(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage(device_prefetch=3)
    feed = stage.feed(FakeEpoch([torch.full((2,), float(i)) for i in range(5)]))
    seen = []
    while True:
        index, staged = await feed.get()
        if staged is END:
            break
        seen.append((index, stage.hand_over(staged)[0].item()))
    assert seen == [(i, float(i)) for i in range(5)]
    assert stage.stats()["ahead_peak"] <= 3
    await feed.aclose()


@pytest.mark.asyncio
async def test_feed_raises_the_epoch_error_after_the_batches_before_it(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage()
    feed = stage.feed(FakeEpoch([torch.ones(1), torch.ones(1), Boom("in fetch")]))
    for _ in range(2):
        stage.hand_over((await feed.get())[1])
    with pytest.raises(Boom, match="in fetch"):
        await feed.get()
    await feed.aclose()


@pytest.mark.asyncio
async def test_a_staging_error_names_the_transfer_stage(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, backend = make_stage()
    backend.fail_copy = lambda t: t.numel() == 3
    feed = stage.feed(FakeEpoch([torch.ones(2), torch.ones(3)]))
    stage.hand_over((await feed.get())[1])
    with pytest.raises(RuntimeError, match="fake copy failed") as caught:
        await feed.get()
    assert "aioloader: raised in stage 'transfer'" in caught.value.__notes__
    await feed.aclose()


@pytest.mark.asyncio
async def test_feed_cancel_and_aclose_reach_the_epoch(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    stage, _ = make_stage()
    epoch = FakeEpoch([torch.ones(1)] * 4)
    feed = stage.feed(epoch)
    await feed.get()
    feed.cancel()
    assert epoch.cancelled
    await feed.aclose()
    await feed.aclose()  # idempotent
    assert epoch.closed


def test_feed_on_a_loop_thread_hands_over_in_the_consumer_thread(
    make_stage: Callable[..., tuple[DeviceStage, FakeBackend]],
) -> None:
    """The shape of `for batch in loader`: the feed runs on the loop thread, hand-over in the caller's."""
    stage, backend = make_stage()
    runner = LoopThread()
    consumer = backend.new_stream()

    async def open_feed() -> Any:
        return stage.feed(FakeEpoch([torch.full((3,), float(i)) for i in range(8)]))

    try:
        feed = runner.run(open_feed())
        values = []
        with backend.use_stream(consumer):
            while (item := runner.run(feed.get(), 10.0))[1] is not END:
                values.append(stage.hand_over(item[1])[0].item())
        runner.run(feed.aclose(), 10.0)
    finally:
        runner.stop()
    assert values == [float(i) for i in range(8)]
    waits = backend.kinds("wait")
    assert len(waits) == 8
    assert {(op.stream, op.thread) for op in waits} == {
        (consumer.name, threading.current_thread().name)
    }
    assert {op.thread for op in backend.kinds("copy")} == {"aioloader-transfer_0"}
    assert stage.stats()["ahead_peak"] <= stage.device_prefetch


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
    assert report == {"stages": True, "batches": 3, "calls": [], "initialized": False}


# -- on a GPU ----------------------------------------------------------------------------------------

_DTYPES = [
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
]  # fmt: skip


def host_batch(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    leaves = {str(dtype): (torch.rand(3, 17, generator=gen) * 100).to(dtype) for dtype in _DTYPES}
    return {
        "leaves": leaves,
        "nested": (torch.randn(2, 3, 8, 8, generator=gen), [torch.arange(5), "text"]),
        "point": Point(torch.randn(4, generator=gen).t(), seed),
        "scalar": torch.tensor(float(seed)),
        "empty": torch.empty(0, 3),
        "strided": torch.randn(6, 4, generator=gen)[::2, 1:],
    }


def assert_same(device_batch: Any, host: Any) -> None:
    if isinstance(host, torch.Tensor):
        assert device_batch.device.type == "cuda"
        assert device_batch.dtype == host.dtype
        assert torch.equal(device_batch.cpu(), host)
    elif isinstance(host, dict):
        assert device_batch.keys() == host.keys()
        for key in host:
            assert_same(device_batch[key], host[key])
    elif isinstance(host, list | tuple):
        assert type(device_batch) is type(host)
        assert len(device_batch) == len(host)
        for a, b in zip(device_batch, host, strict=True):
            assert_same(a, b)
    else:
        assert device_batch == host


@pytest.mark.cuda
@needs_cuda
def test_gpu_batches_equal_host_batches_across_dtypes_and_structures() -> None:
    stage = make_device_stage("cuda")
    assert stage is not None
    try:
        consumer = torch.cuda.Stream()
        with torch.cuda.stream(consumer):
            for seed in range(6):
                host = host_batch(seed)
                expected = host_batch(seed)
                staged = stage.stage(host)
                for leaf in host["leaves"].values():  # the copies must not read the host batch
                    leaf.zero_()
                assert_same(stage.hand_over(staged), expected)
        assert stage.stats()["slabs"] <= stage.device_prefetch + 2
    finally:
        stage.close()


class SlowCopyBackend(CudaBackend):
    """Each copy first keeps the side stream busy, so that copies are still running when slabs are sought."""

    def copy_to_device(self, host: torch.Tensor, fmt: torch.memory_format) -> torch.Tensor:
        torch.cuda._sleep(2_000_000)  # on the current (side) stream
        return super().copy_to_device(host, fmt)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("slow", ["consumer", "copies"])
def test_gpu_feed_keeps_every_value_with_a_slow_stream(slow: str) -> None:
    """A busy consumer stream tests wait + record_stream; busy copies test the slab events."""
    backend = SlowCopyBackend if slow == "copies" else CudaBackend
    stage = make_device_stage("cuda", device_prefetch=2, backend=backend)
    assert stage is not None
    runner = LoopThread()

    async def open_feed() -> Any:
        return stage.feed(FakeEpoch([torch.full((256, 1024), float(i)) for i in range(40)]))

    try:
        feed = runner.run(open_feed())
        consumer = torch.cuda.Stream()
        results = []
        with torch.cuda.stream(consumer):
            while (item := runner.run(feed.get(), 30.0))[1] is not END:
                batch = stage.hand_over(item[1])
                if slow == "consumer":
                    torch.cuda._sleep(2_000_000)  # busy before it reads the batch
                results.append((batch == float(item[0])).all())
                del batch  # its memory must not serve a later copy before the check above has run
        runner.run(feed.aclose(), 10.0)
        assert len(results) == 40
        # The checks ran on `consumer`, which the default stream (where `bool` reads them) does not
        # wait for: torch's streams do not synchronise with it.
        consumer.synchronize()
        assert all(bool(r) for r in results)
        stats = stage.stats()
        assert stats["slabs_reused"] + stats["slab_waits"] > 0
        assert stats["ahead_peak"] <= 2
    finally:
        runner.stop()
        stage.close()


@pytest.mark.cuda
@needs_cuda
def test_gpu_channels_last_and_registered_memory() -> None:
    stage = make_device_stage("cuda", memory_format=torch.channels_last)
    assert stage is not None
    try:
        slab = torch.randn(4, 3, 16, 16)
        pinning = stage.register_host_memory(slab)
        batch = stage.hand_over(stage.stage({"img": slab, "seq": torch.randn(2, 3, 4)}))
        assert batch["img"].is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(batch["img"].cpu(), slab)
        if pinning == "registered":
            assert stage.stats()["direct"] == 1
            assert stage.stats()["pinning"] == "registered"
            stage.unregister_host_memory(slab)
    finally:
        stage.close()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("front", ["Loader", "DataLoader"])
def test_gpu_loaders_hand_over_every_value_to_a_busy_default_stream(front: str) -> None:
    """End to end on a real GPU: the consumer's (default) stream is busy before each batch is read."""
    from aioloader import DataLoader, Loader

    loader: Any
    if front == "Loader":
        loader = Loader(range(24), _sample, batch_size=4, device="cuda")
    else:
        loader = DataLoader(_Indexed(24, _sample), batch_size=4, num_workers=2, device="cuda")
    sums = []
    with loader:
        for batch in loader:
            assert batch.device.type == "cuda"
            torch.cuda._sleep(1_000_000)  # a model step still running on the default stream
            sums.append(batch[:, 0, 0].sum())
    torch.cuda.synchronize()
    assert [float(s) for s in sums] == [
        float(4 * b + 4 * b + 1 + 4 * b + 2 + 4 * b + 3) for b in range(6)
    ]


def _sample(i: int) -> torch.Tensor:
    return torch.full((64, 1024), float(i))


class _Indexed(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, n: int, make: Callable[[int], torch.Tensor]) -> None:
        self.n, self.make = n, make

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.make(i)


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


def test_cpu_device_means_no_stage() -> None:
    from aioloader import Loader

    with Loader([1, 2], lambda k: torch.tensor(k), batch_size=2, device="cpu") as loader:
        assert loader._epochs.device is None
        assert torch.equal(next(iter(loader)), torch.tensor([1, 2]))
