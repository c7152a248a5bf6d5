"""The transfer stage on a real GPU (CudaBackend): every value of every dtype and structure arrives,
with a slow copy stream, channels-last and registered memory, through both loaders to a busy default
stream. Marked `cuda`; skipped without a GPU."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.fakecuda import FakeEpoch

from aioloader._pipeline.handover import LoopThread
from aioloader._pipeline.stages import END
from aioloader._pipeline.transfer import CudaBackend, make_device_stage

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
Point = namedtuple("Point", ["x", "label"])

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


def assert_device_copy_of(device_batch: Any, host: Any) -> None:
    """`device_batch` is `host` copied to the GPU: same structure, dtypes and values, on cuda."""
    if isinstance(host, torch.Tensor):
        assert device_batch.device.type == "cuda"
        assert device_batch.dtype == host.dtype
        assert torch.equal(device_batch.cpu(), host)
    elif isinstance(host, dict):
        assert device_batch.keys() == host.keys()
        for key in host:
            assert_device_copy_of(device_batch[key], host[key])
    elif isinstance(host, list | tuple):
        assert type(device_batch) is type(host)
        assert len(device_batch) == len(host)
        for a, b in zip(device_batch, host, strict=True):
            assert_device_copy_of(a, b)
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
                assert_device_copy_of(stage.hand_over(staged), expected)
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
