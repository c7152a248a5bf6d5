"""Default collate (same output as torch's) and the recycled batch buffers behind it."""

from __future__ import annotations

import collections
import re
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.compare import assert_same
from torch.utils.data import default_collate as torch_collate

import aioloader
from aioloader import BufferPool, CollateError, Loader
from aioloader._pipeline.collate import make_collate

Point = collections.namedtuple("Point", ["x", "y"])


def sample(i: int) -> dict[str, Any]:
    """One sample with every kind of leaf default_collate handles, nested."""
    return {
        "tensor": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i,
        "scalar_tensor": torch.tensor(i, dtype=torch.int16),
        "bools": torch.tensor([True, i % 2 == 0]),
        "array": np.full((3,), i, dtype=np.float64),
        "int_array": np.arange(4, dtype=np.int32) * i,
        "int": i,
        "float": i / 2,
        "bool": i % 2 == 1,
        "np_float": np.float32(i + 0.5),
        "np_int": np.int64(i),
        "np_bool": np.bool_(i % 3 == 0),
        "str": f"s{i}",
        "bytes": bytes([i]),
        "tuple": (i, torch.ones(2) * i),
        "list": [i, [float(i), "x"]],
        "point": Point(x=np.ones(2, dtype=np.uint8) * i, y=f"p{i}"),
    }


CASES: dict[str, list[Any]] = {
    "tensors": [torch.randn(3, 4) for _ in range(5)],
    "0-d tensors": [torch.tensor(float(i)) for i in range(3)],
    "int tensors": [torch.arange(5) * i for i in range(4)],
    "half tensors": [torch.ones(2, dtype=torch.float16) * i for i in range(3)],
    "arrays": [np.random.default_rng(i).random((2, 2)) for i in range(3)],
    "bool arrays": [np.array([True, False]) for _ in range(2)],
    "0-d arrays": [np.array(i, dtype=np.int8) for i in range(3)],
    "ints": [1, 2, 3],
    "floats": [1.5, 2.5],
    "int then float": [2, 1.5],
    "numpy scalars": [np.float64(1.25), np.float64(2.5)],
    "numpy ints": [np.int32(1), np.int32(7)],
    "strings": ["a", "bc"],
    "bytes": [b"a", b"bc"],
    "dicts": [{"a": i, "b": torch.zeros(2) + i} for i in range(3)],
    "tuples": [(i, float(i)) for i in range(3)],
    "lists": [[i, i + 1] for i in range(3)],
    "namedtuples": [Point(i, torch.ones(1) * i) for i in range(3)],
    "nested": [sample(i) for i in range(4)],
    "one sample": [sample(9)],
}


@pytest.mark.parametrize("samples", CASES.values(), ids=CASES.keys())
def test_default_collate_matches_torch(samples: list[Any]) -> None:
    assert_same(aioloader.default_collate(samples), torch_collate(samples))


@pytest.mark.parametrize("samples", CASES.values(), ids=CASES.keys())
def test_pooled_collate_matches_torch(samples: list[Any]) -> None:
    collate = make_collate(BufferPool(per_shape=2))
    for _ in range(3):  # fresh buffers, then recycled ones
        assert_same(collate(samples), torch_collate(samples))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_loader_default_collate_matches_torch(batch_size: int) -> None:
    async def fetch(i: int) -> dict[str, Any]:
        return sample(i)

    with Loader(range(7), fetch, batch_size=batch_size) as loader:
        batches = list(loader)
    expected = [
        torch_collate([sample(i) for i in range(s, min(s + batch_size, 7))])
        for s in range(0, 7, batch_size)
    ]
    assert_same(batches, expected)


DTYPES = [torch.float32, torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 4), max_size=3),
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 5),
    as_numpy=st.booleans(),
)
def test_pooled_collate_matches_torch_for_any_shape_and_dtype(
    shape: list[int], dtype: torch.dtype, n: int, as_numpy: bool
) -> None:
    gen = torch.Generator().manual_seed(n)
    samples: list[Any] = [(torch.rand(shape, generator=gen) * 100).to(dtype) for _ in range(n)]
    if as_numpy:
        samples = [s.numpy() for s in samples]
    collate = make_collate(BufferPool(per_shape=1))
    first = collate(samples)
    assert_same(first, torch_collate(samples))
    del first
    assert_same(collate(samples), torch_collate(samples))


# -- errors -------------------------------------------------------------------------------------


def test_mismatched_shapes_raise_collate_error_naming_the_shapes() -> None:
    samples = [torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3, 2)]
    with pytest.raises(CollateError, match=r"\(2, 3\).*\(3, 2\)") as info:
        aioloader.default_collate(samples)
    assert isinstance(info.value, TypeError)


def test_mismatched_shapes_in_the_loader_note_the_keys() -> None:
    async def fetch(key: str) -> torch.Tensor:
        return torch.zeros(4 if key == "odd" else 3)

    keys = ["a", "b", "c", "odd"]
    with Loader(keys, fetch, batch_size=2) as loader, pytest.raises(CollateError) as info:
        list(loader)
    assert "(3,)" in str(info.value)
    assert "(4,)" in str(info.value)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "collate" in notes
    assert "'c'" in notes
    assert "'odd'" in notes
    assert "'a'" not in notes


@pytest.mark.parametrize(
    "samples",
    [[np.array(["a"]), np.array(["b"])], [None, None], [object(), object()], [1, "a"]],
    ids=["string arrays", "None", "objects", "int then str"],
)
def test_what_torch_rejects_is_rejected_with_a_type_error(samples: list[Any]) -> None:
    with pytest.raises(TypeError):
        torch_collate(samples)
    with pytest.raises(TypeError):
        aioloader.default_collate(samples)


# -- the buffer pool ----------------------------------------------------------------------------


def test_pool_reuses_a_buffer_nobody_refers_to() -> None:
    pool = BufferPool(per_shape=2)
    first = pool.take((4, 3), torch.float32)
    first_id = id(first)
    del first
    again = pool.take((4, 3), torch.float32)
    assert id(again) == first_id
    assert (pool.allocated, pool.reused) == (1, 1)


def test_pool_keys_buffers_by_shape_and_dtype() -> None:
    pool = BufferPool(per_shape=2)
    a = pool.take((4,), torch.float32)
    del a
    b = pool.take((4,), torch.float64)
    c = pool.take((5,), torch.float32)
    assert b.dtype == torch.float64
    assert c.shape == (5,)
    assert pool.reused == 0
    assert pool.allocated == 3


@pytest.mark.parametrize(
    "keep",
    [
        lambda t: t,
        lambda t: t[0],
        lambda t: t.view(-1),
        lambda t: t.numpy(),
        lambda t: [t],
        lambda t: t.untyped_storage(),
    ],
    ids=["tensor", "row view", "flat view", "numpy array", "container", "storage"],
)
def test_pool_never_hands_out_a_buffer_still_referred_to(keep: Any) -> None:
    pool = BufferPool(per_shape=4)
    buf = pool.take((3, 2), torch.int64)
    buf.fill_(7)
    kept = keep(buf)
    del buf
    for _ in range(3):
        other = pool.take((3, 2), torch.int64)
        other.fill_(-1)
        del other
    assert pool.reused == 2  # the last two takes reused the first `other`, never the kept buffer
    assert pool.allocated == 2
    assert (values(kept) == 7).all()


def values(kept: Any) -> torch.Tensor:
    """The elements a kept tensor, view, array, list of them or storage refers to."""
    if isinstance(kept, list):
        return values(kept[0])
    if isinstance(kept, torch.UntypedStorage):
        return torch.empty(0, dtype=torch.int64).set_(kept)
    return torch.as_tensor(kept)


def test_pool_keeps_at_most_per_shape_buffers() -> None:
    pool = BufferPool(per_shape=2)
    held = [pool.take((2,), torch.float32) for _ in range(4)]
    assert pool.allocated == 4
    ids = [id(t) for t in held]
    del held
    again = [pool.take((2,), torch.float32) for _ in range(4)]
    assert pool.reused == 2
    assert {id(t) for t in again[:2]} == set(ids[:2])
    pool.clear()
    del again
    pool.take((2,), torch.float32)
    assert pool.reused == 2


def test_pool_rejects_a_negative_size() -> None:
    with pytest.raises(ValueError, match="per_shape"):
        BufferPool(per_shape=-1)


# -- recycling through the loader ---------------------------------------------------------------


async def fixed_shape(i: int) -> torch.Tensor:
    return torch.full((16, 8), float(i))


@pytest.mark.in_process
def test_loader_recycles_batches_the_consumer_drops() -> None:
    pool = BufferPool(per_shape=6)
    collate = make_collate(pool)
    with Loader(range(64), fixed_shape, batch_size=4, concurrency=4, collate=collate) as loader:
        for epoch in range(2):
            for i, batch in enumerate(loader):
                assert batch[0, 0, 0].item() == 4 * i, (epoch, i)
    # Held at most: 2 batches of prefetch and 4 samples in flight (3 batches), plus the consumer's.
    assert pool.allocated <= 6
    assert pool.reused == 32 - pool.allocated


@pytest.mark.in_process
def test_loader_default_collate_hands_a_dropped_buffer_out_again() -> None:
    seen: list[weakref.ref[torch.Tensor]] = []
    recycled = 0
    with Loader(range(48), fixed_shape, batch_size=4, prefetch=1) as loader:
        for i, batch in enumerate(loader):
            recycled += any(ref() is batch for ref in seen)
            seen.append(weakref.ref(batch))
            assert torch.equal(batch[:, 0, 0], torch.arange(4 * i, 4 * i + 4, dtype=torch.float32))
    assert recycled > 0


@pytest.mark.in_process
def test_batches_the_consumer_keeps_never_change() -> None:
    kept: list[tuple[Any, torch.Tensor]] = []
    dropped: list[weakref.ref[torch.Tensor]] = []
    recycled = 0
    with Loader(range(120), fixed_shape, batch_size=4, prefetch=3, concurrency=2) as loader:
        for epoch in range(2):
            for i, batch in enumerate(loader):
                recycled += any(ref() is batch for ref in dropped)
                if epoch == 0 and i == 0:
                    kept.append((batch, batch.clone()))
                elif epoch == 0 and i == 1:
                    kept.append((batch[0], batch[0].clone()))  # a view keeps the buffer
                elif epoch == 0 and i == 2:
                    kept.append((batch.numpy(), batch.clone()))  # and so does a numpy array
                elif epoch == 0 and i == 3:
                    kept.append((batch[1:3].numpy(), batch[1:3].clone()))
                else:
                    dropped.append(weakref.ref(batch))
                del batch  # the rest are dropped, and their buffers recycled
    assert recycled > 10  # so a kept buffer would have been overwritten, were it handed out again
    for i, (item, clone) in enumerate(kept):
        assert torch.equal(torch.as_tensor(item), clone), f"kept batch {i} changed"


# -- stacking as samples are read (process workers' one-by-one reads) ----------------------------


class Slot:
    """A worker's output slot as `StackAsRead` sees it (a `Carver`), granted after `grant_after`
    patient asks; counts what it hands out."""

    def __init__(self, grant_after: int = 0, nbytes: int = 1 << 20) -> None:
        from aioloader._executors.process.slot_carver import Carver

        self.carver = Carver(None, self._ask)
        self.grant_after, self.asks, self.nbytes = grant_after, [], nbytes

    def _ask(self, patient: bool) -> memoryview | None:
        self.asks.append(patient)
        if patient and len(self.asks) <= self.grant_after:
            return None
        return memoryview(bytearray(self.nbytes))


def stacked_as_read(samples: list[Any], slot: Slot) -> Any:
    from aioloader._pipeline.collate import StackAsRead

    reading = StackAsRead(slot.carver, len(samples))
    for s in samples:
        reading.append(s)
    return make_collate(slot.carver)(reading.samples)


@pytest.mark.parametrize("samples", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("grant_after", [0, 2, 99])
def test_stacking_as_samples_are_read_matches_torch(samples: list[Any], grant_after: int) -> None:
    slot = Slot(grant_after)
    assert_same(stacked_as_read(samples, slot), torch_collate(samples))


def test_samples_read_are_stacked_once_into_the_slot() -> None:
    """Each leaf's batch is taken from the slot once and filled row by row: the collate returns
    those batches as they are (no second stack), and the samples' own tensors are not kept."""
    samples = [(torch.full((4, 8), float(i)), np.full(3, i, np.int32), i) for i in range(6)]
    slot = Slot(grant_after=1)  # the first patient ask is refused: sample 0 waits, then is placed
    from aioloader._pipeline.collate import StackAsRead

    reading = StackAsRead(slot.carver, 6)
    for s in samples:
        reading.append(s)
    kept = weakref.ref(samples[3][0])
    del samples, s
    assert kept() is None  # row 3 holds its values; the sample's tensor is gone
    batch = make_collate(slot.carver)(reading.samples)
    used = slot.carver.used
    assert slot.carver.where(batch[0]) == 0
    assert slot.carver.where(batch[1]) is not None
    assert used == 6 * 4 * 8 * 4 + 6 * 3 * 4  # two batches carved, nothing stacked again
    assert torch.equal(batch[0][:, 0, 0], torch.arange(6.0))
    assert batch[1].dtype == torch.int32
    assert torch.equal(batch[1][:, 0], torch.arange(6, dtype=torch.int32))
    assert torch.equal(batch[2], torch.arange(6))
    assert slot.asks == [True, True]  # asked at the first sample, granted at the second


def test_a_user_tensor_whose_rows_are_the_samples_is_copied_not_returned() -> None:
    data = torch.arange(12.0).reshape(4, 3)
    batch = make_collate(Slot().carver)([data[i] for i in range(4)])
    assert torch.equal(batch, data)
    assert batch.data_ptr() != data.data_ptr()


@pytest.mark.parametrize(
    "second",
    [
        torch.zeros(3),
        torch.zeros(2, dtype=torch.float64),
        (torch.zeros(2), 1),
        np.zeros(2, np.float32),
    ],
    ids=["shape", "dtype", "structure", "array for tensor"],
)
def test_a_sample_that_differs_ends_the_stacking_and_collates_as_before(second: Any) -> None:
    """From the sample that differs, samples are kept as they are: the batch (or the error) is the
    one the default collate gives for the samples themselves."""
    samples = [torch.ones(2), second, torch.ones(2)]
    try:
        expected: Any = make_collate(Slot().carver)(samples)
    except (TypeError, RuntimeError) as exc:
        with pytest.raises(type(exc), match=re.escape(str(exc))):
            stacked_as_read(samples, Slot())
    else:
        assert_same(stacked_as_read(samples, Slot()), expected)
