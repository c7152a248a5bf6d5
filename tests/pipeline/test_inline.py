"""Batches made where their indices are (`_pipeline/inline.py`): samples in memory, and datasets read
one call at a time, in the consumer's own thread, with no pipeline; and what `diagnose()` says of
such reads when they wait."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, default_collate

from aioloader import DataLoader, Loader
from aioloader._pipeline.collate import make_collate


def _aioloader_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("aioloader")}


@pytest.mark.in_process
def test_a_list_is_its_own_samples_batched_in_the_consumers_thread() -> None:
    before = _aioloader_threads()
    with Loader(list(range(10)), batch_size=4) as loader:
        seen = []
        for batch in loader:
            seen.append(batch.tolist())
            assert _aioloader_threads() == before  # no loop thread, no fetch thread
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
        assert loader.stats().batches == 3


class Entered(Dataset[int]):
    """Counts the calls inside `__getitem__` at once."""

    def __init__(self, n: int = 32, wait_s: float = 0.002) -> None:
        self.n, self.wait_s = n, wait_s
        self.inside = self.most = 0
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(self.wait_s)
        with self.lock:
            self.inside -= 1
        return i


class SaysThreadSafe(Entered):
    thread_safe = True


@pytest.mark.parametrize("mode", ["for", "async for"])
@pytest.mark.in_process
def test_a_loaders_dataset_is_read_one_call_at_a_time_unless_thread_safe(mode: str) -> None:
    for cls, one_at_a_time in ((Entered, True), (SaysThreadSafe, False)):
        dataset = cls()
        with Loader(dataset, batch_size=8) as loader:
            if mode == "for":
                got = list(loader)
            else:

                async def read(loader: Any = loader) -> list[Any]:
                    return [b async for b in loader]

                got = asyncio.run(read())
        assert torch.cat(got).tolist() == list(range(32))
        assert (dataset.most == 1) is one_at_a_time


class Fails(Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> int:
        if i == 6:
            raise KeyError("missing")
        return i


def test_an_inline_read_error_names_its_key() -> None:
    with Loader(Fails(), batch_size=4) as loader, pytest.raises(KeyError) as err:
        list(loader)  # a Loader's error ends its epoch
    assert "aioloader: raised in stage 'fetch' for key 6" in err.value.__notes__
    with DataLoader(Fails(), batch_size=4) as torch_like:  # ... a DataLoader's, its batch
        it = iter(torch_like)
        assert next(it).tolist() == [0, 1, 2, 3]
        with pytest.raises(KeyError):
            next(it)
        assert next(it).tolist() == [8, 9, 10, 11]


def test_an_inline_epoch_resumes_exactly() -> None:
    with Loader(list(range(20)), batch_size=4, shuffle=True, seed=3) as loader:
        full = [b.tolist() for b in loader]
    with Loader(list(range(20)), batch_size=4, shuffle=True, seed=3) as loader:
        it = iter(loader)
        head = [next(it).tolist() for _ in range(2)]
        state = loader.state_dict()
        it.close()  # type: ignore[attr-defined]
    with Loader(list(range(20)), batch_size=4, shuffle=True, seed=3) as loader:
        loader.load_state_dict(state)
        assert head + [b.tolist() for b in loader] == full


def test_diagnose_says_what_reads_side_by_side_would_save_and_how() -> None:
    with DataLoader(Entered(n=96, wait_s=0.003), batch_size=8) as loader:
        list(loader)
        verdict = loader.diagnose()
    assert verdict.bottleneck == "fetch"
    assert "one at a time" in verdict.text
    assert "thread_safe = True" in verdict.text
    assert "x less time" in verdict.text
    assert any(line.startswith("reads: 96 in 12 batches") for line in verdict.evidence)


@pytest.mark.parametrize(
    "batch",
    [
        [1, 2, 3],
        [1.5, 2.0, -3.25],
        [1, 2.5],  # a float among ints: torch's own collate
        [True, False],
        [1, True, np.int64(7)],
        [2.0, np.float32(0.5)],
        [-(2**63), 2**63 - 1],
    ],
)
def test_python_numbers_collate_as_torchs_default_collate(batch: list[Any]) -> None:
    ours, theirs = make_collate(None)(batch), default_collate(batch)
    assert ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)


def test_numbers_out_of_range_fail_as_in_torch() -> None:
    for collate in (default_collate, make_collate(None)):
        with pytest.raises(ValueError, match="Overflow"):
            collate([1, 2**70])
