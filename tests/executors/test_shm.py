"""The shared-memory arena: slots are reused only once nothing views them, within a byte budget."""

from __future__ import annotations

import gc
import os
import stat
from typing import Any

import numpy as np
import pytest
import torch

from aioloader._executors.process import arena as arena_module
from aioloader._executors.process.arena import (
    NAME_PREFIX,
    SHM_DIR,
    Arena,
    arena_budget,
    check_room,
    size_class,
)


def our_entries() -> list[str]:
    return [name for name in os.listdir(SHM_DIR) if name.startswith(f"{NAME_PREFIX}{os.getpid()}-")]


@pytest.fixture
def arena() -> Any:
    arena = Arena(budget=4 << 20)
    yield arena
    arena.close()


@pytest.mark.parametrize("nbytes", [1, 4096, 4097, 100_000, 602_112, 5 << 20, (5 << 20) + 1])
def test_size_classes_hold_the_bytes_in_whole_pages_wasting_little(nbytes: int) -> None:
    size = size_class(nbytes)
    assert size >= nbytes
    assert size % 4096 == 0
    assert size <= max(4096, nbytes * 1.25 + 4096)


def test_slabs_are_private_and_unlinked_at_once(arena: Arena) -> None:
    slot = arena.acquire(10_000)
    assert slot is not None
    fd, size, _whole = arena.slab_fd(slot.slab_id)
    assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
    assert os.fstat(fd).st_nlink == 0  # no name left in /dev/shm, even while it is in use
    assert size >= slot.capacity
    assert our_entries() == []
    arena.release(slot)


def test_a_slot_is_reused_only_after_every_view_is_gone(arena: Arena) -> None:
    slot = arena.acquire(64 << 10)
    assert slot is not None
    owner = arena.view(slot, 0, 1024)
    tensor = torch.frombuffer(owner, dtype=torch.float32)[10:20]  # a view of a view
    array = owner.view(np.int32)[::2]
    del owner
    arena.release(slot)  # the lease ends; the views still pin it
    others = [arena.acquire(64 << 10) for _ in range(3)]
    assert slot not in others
    del tensor
    assert arena.acquire(64 << 10) is not slot  # `array` still views it
    del array
    gc.collect()
    assert arena.acquire(64 << 10) is slot


def test_a_slot_nobody_holds_returns_once_its_last_view_is_gone(arena: Arena) -> None:
    # the executor drops its Slot once a result is read: only the views keep the slot pinned
    slot = arena.acquire(1000)
    assert slot is not None
    slab = slot.slab
    view = arena.view(slot, 0, 8)
    arena.release(slot)
    del slot
    gc.collect()  # the slot is garbage to everyone but its view's finalizer
    assert slab.pinned == 1
    del view
    gc.collect()
    assert slab.pinned == 0
    assert slab.idle


def test_views_stay_valid_after_close() -> None:
    arena = Arena(budget=1 << 20)
    slot = arena.acquire(4096)
    assert slot is not None
    slot.write(b"\x07" * 16)
    view = torch.frombuffer(arena.view(slot, 0, 16), dtype=torch.uint8)
    arena.release(slot)
    arena.close()
    assert view.sum().item() == 7 * 16
    assert arena.acquire(16) is None  # closed


def test_the_budget_bounds_the_arena_and_acquire_never_blocks() -> None:
    arena = Arena(budget=1 << 20)
    slots = [arena.acquire(256 << 10) for _ in range(4)]
    assert all(s is not None for s in slots)
    assert arena.acquire(256 << 10) is None  # all held: the caller falls back to ordinary memory
    assert arena.mapped_bytes <= arena.budget
    arena.release(slots[2])  # type: ignore[arg-type]
    assert arena.acquire(256 << 10) is slots[2]
    arena.close()


def test_an_idle_slab_of_another_size_is_retired_for_room() -> None:
    arena = Arena(budget=1 << 20)
    small = arena.acquire(100_000)
    assert small is not None
    arena.release(small)
    big = arena.acquire(900_000)  # needs the room the idle small-slot slab takes
    assert big is not None
    assert arena.take_dropped() == [small.slab_id]
    assert arena.take_dropped() == []
    arena.release(big)
    arena.close()


def test_batch_slabs_find_room_while_pinned_sample_slabs_fill_their_quota(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a full prefetch queue pins every sample slab: a batch buffer (whose rows free them) must
    # still be made, or the loader never leaves per-sample slots
    monkeypatch.setattr(arena_module, "MAX_SLABS", 2)
    arena = Arena(budget=64 << 20)
    per_slab = arena_module.SLAB_BYTES // size_class(1 << 20)
    samples = [arena.acquire(1 << 20) for _ in range(2 * per_slab)]
    assert all(s is not None for s in samples)
    assert arena.acquire(1 << 20) is None  # sample slabs: at their quota
    batch = arena.acquire(20 << 20)
    assert batch is not None
    assert batch.slab.size == batch.capacity
    for slot in [*samples, batch]:
        arena.release(slot)  # type: ignore[arg-type]
    arena.close()


def test_a_batch_slot_up_to_twice_as_large_is_reused_for_a_smaller_batch() -> None:
    arena = Arena(budget=64 << 20)
    full = arena.acquire(20 << 20)  # an epoch's batches...
    assert full is not None
    arena.release(full)
    last = arena.acquire(15 << 20)  # ...and its last, shorter one: no new slab
    assert last is full
    arena.release(last)
    tiny = arena.acquire(8 << 20)  # under half: a slab of its own size
    assert tiny is not None
    assert tiny.slab is not full.slab
    arena.release(tiny)
    arena.close()


def test_idle_sample_slabs_are_retired_on_request_and_busy_ones_kept() -> None:
    arena = Arena(budget=64 << 20)
    idle, busy = arena.acquire(600_000), arena.acquire(600_000)
    other = arena.acquire(100_000)  # another class, busy
    batch = arena.acquire(20 << 20)
    assert idle is not None
    assert busy is not None
    assert other is not None
    assert batch is not None
    arena.release(idle)
    arena.release(batch)
    arena.retire_idle_samples()
    assert arena.take_dropped() == []  # `busy` pins the slab `idle` shares
    arena.release(busy)
    arena.retire_idle_samples()
    assert arena.take_dropped() == [idle.slab_id]  # the batch slab stays, idle or not
    assert arena.acquire(20 << 20) is batch
    arena.close()


def test_too_small_dev_shm_is_named_with_the_size_needed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs(SHM_DIR)

    class Tiny:
        f_bavail, f_frsize = 1000, real.f_frsize

    monkeypatch.setattr(arena_module.os, "statvfs", lambda path: Tiny())
    with pytest.raises(OSError, match=r"/dev/shm has .* MiB free .* needs 64\.0 MiB"):
        check_room(64 << 20)
    # where slabs are files in /dev/shm (asked for, or no memfd_create), its room is checked
    with pytest.raises(OSError, match="/dev/shm"):
        arena_budget(None, SHM_DIR)
    with pytest.raises(OSError, match="/dev/shm"):
        Arena(budget=64 << 20, directory=SHM_DIR)
    # anonymous memory does not live in /dev/shm: its size does not bound the arena
    if arena_module.MEMFD:
        assert arena_budget(None) == arena_module.DEFAULT_ARENA_BYTES
        Arena(budget=64 << 20).close()


def links_to(target: str) -> list[int]:
    """This process's descriptors open on `target` (a slab's /proc link text)."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                out.append(int(name))
        except OSError:
            pass  # the listing's own descriptor, gone already
    return out


def mapped(target: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(line.rstrip("\n").endswith(target) for line in maps)


def test_a_slab_holds_one_descriptor_open_and_none_once_closed_while_views_remain() -> None:
    arena = Arena(budget=4 << 20)
    small, large = arena.acquire(100), arena.acquire(300_000)  # two size classes: two slabs
    assert small is not None
    assert large is not None
    targets = [os.readlink(f"/proc/self/fd/{arena.slab_fd(s.slab_id)[0]}") for s in (small, large)]
    assert [len(links_to(t)) for t in targets] == [1, 1]  # the mapping itself keeps none
    small.write(b"\x05" * 100)
    large.write(b"\x09" * 300_000)
    kept = torch.frombuffer(arena.view(small, 0, 100), dtype=torch.uint8)
    arena.release(small)
    arena.release(large)  # `large` is idle: close() unmaps it at once
    arena.close()
    assert [links_to(t) for t in targets] == [[], []]  # the held view pins no descriptor
    assert mapped(targets[0])
    assert not mapped(targets[1])
    assert kept.sum().item() == 5 * 100  # and its data is still there
    kept[:4] = 1  # and writable
    assert kept[:5].tolist() == [1, 1, 1, 1, 5]
    del kept
    assert not mapped(targets[0])  # the last view gone, the slab is unmapped at once
    assert small.slab_id >= 0  # (though the slot object itself is still held)


def test_a_retired_slab_is_unmapped_and_refuses_access_rather_than_faulting() -> None:
    arena = Arena(budget=1 << 20)
    small = arena.acquire(100_000)
    assert small is not None
    target = os.readlink(f"/proc/self/fd/{arena.slab_fd(small.slab_id)[0]}")
    arena.release(small)
    assert arena.acquire(900_000) is not None  # retires the idle small-slot slab
    assert not mapped(target)
    assert links_to(target) == []
    with pytest.raises(ValueError, match="unmapped"):
        small.write(b"late")
    arena.close()


def test_a_loaders_own_pool_gets_an_arena_as_large_as_its_share_of_the_memory_budget() -> None:
    from aioloader import Loader
    from aioloader._executors.process.arena import MIN_ARENA_BYTES
    from aioloader._tuning.memory import MemoryBudget

    st = os.statvfs("/dev/shm")
    half_free = st.f_bavail * st.f_frsize // 2
    assert MemoryBudget(None).arena_bytes() is None
    assert MemoryBudget(1).arena_bytes() == MIN_ARENA_BYTES
    # files in /dev/shm: half its free space
    assert MemoryBudget(1 << 40).arena_bytes(directory=SHM_DIR) <= half_free
    if arena_module.MEMFD:  # anonymous memory: the budget alone
        assert MemoryBudget(1 << 40).arena_bytes() == 1 << 40
        half_free = 1 << 62
    budget = 700 << 20
    with Loader(range(4), abs, decode=abs, executor="process", workers=1,
                max_bytes_in_flight=budget) as loader:  # fmt: skip
        assert list(loader) == [0, 1, 2, 3]
        arena = loader.stats().extra["decode_pool"]["arena_budget"]
    # the samples' share (the batch-buffer pool keeps the other half), not the 256 MiB of a bare pool
    assert arena == min(budget - budget // 2, half_free)


def test_a_worker_gets_a_slot_of_its_own_slabs_first_and_only_those_when_asked() -> None:
    arena = Arena(budget=128 << 20)
    size = 20 << 20  # one slot per slab: a whole batch
    a, b = arena.acquire(size), arena.acquire(size)
    assert a is not None
    assert b is not None
    arena.release(a)
    arena.release(b)
    mine = arena.acquire(size, prefer={b.slab_id})
    assert mine is not None
    assert mine.slab_id == b.slab_id  # not the first free one: the one this worker has mapped
    other = arena.acquire(size, prefer={b.slab_id}, only=True)
    assert other is not None
    assert other.slab_id not in (a.slab_id, b.slab_id)  # a new slab, not another worker's
    assert arena.acquire(size, prefer={b.slab_id}, only=True, new=False) is None
    assert arena.whole_slabs({a.slab_id, b.slab_id, other.slab_id}, size) == 3
    arena.close()
