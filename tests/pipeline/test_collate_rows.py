"""Batch rows written in place by process workers (`RowPlan` in `_pipeline/collate.py`): a batch's
rows land in shared memory as the workers decode, only for the batches being decoded, the collate
buffers and sample slots freed; a sample that differs ends it and is named; the plan learns one shape."""

from __future__ import annotations

import gc
import os
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support.compare import assert_same
from torch.utils.data import default_collate as torch_collate

import aioloader
from aioloader import CollateError, Loader
from aioloader._executors.process.arena import SLAB_LINKS
from aioloader._pipeline.epoch import ROWS_AHEAD_PER_WORKER


def _ident(key: int) -> int:
    return key


def _image(key: int) -> torch.Tensor:
    return torch.full((3, 8, 8), float(key))


def _big_image(key: int) -> torch.Tensor:
    return torch.full((3, 512, 512), float(key))  # 3 MiB: a batch of 4 fills a slab of its own


def _array(key: int) -> np.ndarray[Any, Any]:
    return np.full((4, 5), key, dtype=np.int16)


def _ragged(key: int) -> torch.Tensor:
    return torch.full((2 if key == 13 else 3,), float(key))


def _fails_on_7(key: int) -> torch.Tensor:
    if key == 7:
        raise ValueError("bad sample 7")
    return torch.full((3,), float(key))


def _rows_epoch(decode: Any, keys: int = 24, **options: Any) -> tuple[list[Any], dict[str, int]]:
    """One epoch through 2 workers, with few samples in flight so that the shape is known (from the
    first result) while most batches are still to be decoded."""
    options = {"concurrency": 2, "prefetch": 1, **options}
    with aioloader.ProcessExecutor(2) as pool:
        with Loader(list(range(keys)), _ident, decode=decode, batch_size=4, executor=pool,
                    **options) as loader:  # fmt: skip
            batches = list(loader)
        return batches, pool.stats()


@pytest.mark.parametrize("decode", [_image, _array])
def test_process_workers_write_batches_in_place(decode: Any) -> None:
    batches, stats = _rows_epoch(decode)
    expected = [torch_collate([torch.as_tensor(decode(k)) for k in range(i, i + 4)])
                for i in range(0, 24, 4)]  # fmt: skip
    for ours, theirs in zip(batches, expected, strict=True):
        assert_same(ours, theirs)
    # the first batch teaches the shape; from then on every sample lands in its batch's row
    assert stats["results_in_rows"] >= 24 - 8, stats


def test_once_rows_are_written_in_place_the_collate_buffers_and_sample_slots_are_freed() -> None:
    with aioloader.ProcessExecutor(2) as pool:
        loader = Loader(list(range(24)), _ident, decode=_big_image, batch_size=4, executor=pool,
                        concurrency=2, prefetch=1)  # fmt: skip
        with loader:
            it = iter(loader)
            first = next(it)  # (collated by copy, into a recycled buffer: the shape is learnt)
            assert loader._pool is not None
            del first
            rest = list(it)
            assert [b[0, 0, 0, 0].item() for b in rest] == [4.0, 8.0, 12.0, 16.0, 20.0]
            assert pool.stats()["results_in_rows"] >= 24 - 8
            del rest, it
            # batches now live in shared memory: the recycled buffers are let go for good...
            assert loader._pool.kept_bytes == 0
            assert loader._pool.per_shape == 0
        # ...and so are the slabs whose slots held single samples, once nothing views them, at
        # the next batch buffer made (as the next epoch's first batch would)
        arena = pool._pool._state.arena
        assert arena is not None
        gc.collect()
        buffer = pool.batch_buffer((4, 3, 512, 512), torch.float32)
        assert buffer is not None
        assert not [s for s in arena._slabs.values() if s.size != s.slot_size and s.idle]


def _slow_image(key: int) -> torch.Tensor:
    time.sleep(0.002)
    return torch.full((3, 64, 64), float(key))


def _in_shared_memory(t: torch.Tensor) -> bool:
    ptr = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= ptr < end:
                return len(fields) > 5 and fields[5].startswith(SLAB_LINKS)
    return False


def test_batches_decoded_before_the_row_shape_was_known_land_in_shared_memory_too() -> None:
    # not in fresh memory: freeing a batch-sized block raises glibc's mmap threshold to its size,
    # after which the allocator keeps that much freed memory for good in every arena
    batches, _ = _rows_epoch(_big_image, keys=12)
    assert [b[0, 0, 0, 0].item() for b in batches] == [0.0, 4.0, 8.0]
    assert all(_in_shared_memory(b) for b in batches)


def _gated_image(gate: str, key: int) -> torch.Tensor:
    """`_slow_image`, but samples past the second batch wait while the file `gate` is missing."""
    while key >= 16 and not os.path.exists(gate):
        time.sleep(0.002)
    return _slow_image(key)


def test_rows_are_taken_only_for_the_batches_being_decoded(tmp_path: Path) -> None:
    # 64 fetches in flight finish at once; their decodes are sent ROWS_AHEAD_PER_WORKER per worker
    # ahead (8 samples: one batch here), so batch buffers are taken for the batches whose decodes
    # were sent, not for the 8 whose samples are fetched. In the second epoch (the first taught the
    # plan the row shape) the third batch's decodes wait at a gate: meanwhile the first three
    # batches hold buffers and nothing else may (with 32 ahead per worker, all 8 are taken). Timing
    # cannot move the count: what is sent is bounded, whenever the consumer comes
    assert ROWS_AHEAD_PER_WORKER * 2 == 8
    gate = tmp_path / "open"
    gate.touch()
    with aioloader.ProcessExecutor(2) as pool:
        taken = 0
        batch_buffer = pool.batch_buffer

        def counting(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
            nonlocal taken
            buffer = batch_buffer(shape, dtype)
            taken += buffer is not None
            return buffer

        pool.batch_buffer = counting  # type: ignore[method-assign]
        with Loader(list(range(64)), _ident, decode=partial(_gated_image, str(gate)), batch_size=8,
                    executor=pool, concurrency=64, prefetch=1) as loader:  # fmt: skip
            assert [b[0, 0, 0, 0].item() for b in loader] == [8.0 * i for i in range(8)]
            gate.unlink()
            taken = 0
            batches = iter(loader)
            assert next(batches)[0, 0, 0, 0].item() == 0
            time.sleep(0.3)  # time for more buffers to be taken, were any to be
            held = taken
            gate.touch()
            rest = [batch[0, 0, 0, 0].item() for batch in batches]
        assert rest == [8.0 * i for i in range(1, 8)]
        assert held <= 3, held
        assert pool.stats()["results_in_rows"] >= 2 * 64 - 16


def test_rows_stop_when_a_sample_differs_and_collate_names_it() -> None:
    with pytest.raises(CollateError, match=r"different shapes.*\(2,\)"):
        _rows_epoch(_ragged)
    batches, stats = _rows_epoch(_ragged, keys=12)  # 13 is not among them: rows all the way
    assert stats["results_in_rows"] >= 4
    assert [b[:, 0].tolist() for b in batches] == [[float(k) for k in range(i, i + 4)]
                                                   for i in range(0, 12, 4)]  # fmt: skip


def test_a_skipped_sample_leaves_its_batch_collated_from_the_rest() -> None:
    batches, stats = _rows_epoch(_fails_on_7, on_error="skip", max_skipped=1)
    assert [b[:, 0].tolist() for b in batches][1] == [4.0, 5.0, 6.0]
    assert [len(b) for b in batches] == [4, 3, 4, 4, 4, 4]
    assert stats["results_in_rows"] >= 24 - 8


def test_row_plan_learns_one_shape_and_turns_off_for_good() -> None:
    from aioloader._pipeline.collate import RowPlan

    made: list[tuple[int, ...]] = []

    class Executor:
        def batch_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> str:
            made.append(shape)
            return "buffer"

    plan = RowPlan(Executor())
    assert plan.buffer(4) is None  # nothing seen yet
    plan.observe(torch.zeros(2, 3))
    plan.observe(np.zeros((2, 3), dtype=np.float32))
    assert plan.buffer(4) == "buffer"
    assert made == [(4, 2, 3)]
    plan.observe(torch.zeros(2, 4))
    assert plan.off
    assert plan.buffer(4) is None
    plan = RowPlan(Executor())
    plan.observe({"x": torch.zeros(1)})  # not one tensor: never
    assert plan.off
