"""Batches made in a worker's output slot (`process/slot_carver`), and how `wire.pack` names what is there."""

from __future__ import annotations

import numpy as np
import torch

from aioloader._executors.process.slot_carver import ALIGN, Carver
from aioloader._executors.process.wire import Unpacker, measure, pack


def test_a_carved_tensor_is_memory_of_the_slot() -> None:
    buf = memoryview(bytearray(4096))
    carver = Carver(buf)
    t = carver.take((4, 8), torch.float32)
    t.fill_(2.5)
    assert np.frombuffer(buf, np.float32, 32).tolist() == [2.5] * 32
    u = carver.take((3,), torch.int64)
    assert carver.placed[u.data_ptr()] == (128, 24)  # after the first, on a cache line
    assert carver.used == 128 + 24


def test_a_carver_out_of_room_hands_out_ordinary_tensors() -> None:
    carver = Carver(memoryview(bytearray(100)))
    t = carver.take((64,), torch.float32)  # 256 bytes: does not fit
    assert t.shape == (64,)
    assert carver.placed == {}
    assert carver.used == 0


def test_pack_names_carved_tensors_where_they_lie_and_copies_the_rest_after_them() -> None:
    buf = memoryview(bytearray(b"\xab" * 8192))
    carver = Carver(buf)
    batch = carver.take((2, 100), torch.float64)  # 1600 bytes at 0
    batch.fill_(1.0)
    extra = np.arange(10, dtype=np.int32)
    _, in_slot, needed = pack({"x": batch, "y": extra}, buf, carver)
    assert in_slot
    start = -(-1600 // ALIGN) * ALIGN
    assert needed == start + 40  # the array went after the carved tensor, which was not copied
    assert np.frombuffer(buf, np.int32, 10, start).tolist() == list(range(10))
    assert bytes(buf[start + 40 : start + 48]) == b"\xab" * 8  # nothing written past them
    assert measure({"x": batch, "y": extra}, carver) == needed


def test_an_array_that_does_not_fit_travels_in_band_and_is_counted_once() -> None:
    big = torch.arange(1000, dtype=torch.float32)
    arr = np.full((5, 5), 3, dtype=np.int16)
    data, in_slot, needed = pack([big, arr], memoryview(bytearray(100)))
    assert not in_slot
    # the tensor's bytes, once (torch's own pickling would add them again as a bytes object)
    assert needed == 4000 + (-(-4000 // ALIGN) * ALIGN - 4000) + 50
    out = Unpacker(data, None, None).load()
    assert torch.equal(out[0], big)
    np.testing.assert_array_equal(out[1], arr)
    out[0][0] = 7  # a writable copy
    assert measure([big, arr], None) == needed
