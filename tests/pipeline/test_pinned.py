"""The pinned pool of the transfer stage: a slab is reused only after its copy completed, a full pool
waits in the staging thread only, every leaf of a batch in place in one slab (a fake CUDA backend)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from support.fakecuda import FakeBackend, copied_from

from aioloader._pipeline.transfer import DeviceStage


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
