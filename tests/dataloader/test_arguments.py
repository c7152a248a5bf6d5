"""DataLoader's arguments checked as torch checks them (`_torch/arguments.py`): the same errors and
warnings, fixed attributes, the start method, what does not pickle named at construction."""

from __future__ import annotations

import multiprocessing
import os
import warnings
from typing import Any

import pytest
import torch
from support.datasets import MapDataset, Stream
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data import IterableDataset

from aioloader import DataLoader

BAD_ARGUMENTS = {
    "negative_workers": dict(num_workers=-1),
    "negative_timeout": dict(timeout=-1),
    "prefetch_without_workers": dict(prefetch_factor=2),
    "negative_prefetch": dict(num_workers=1, prefetch_factor=-1),
    "persistent_without_workers": dict(persistent_workers=True),
    "sampler_and_shuffle": dict(sampler=[0, 1], shuffle=True),
    "batch_sampler_and_batch_size": dict(batch_sampler=[[0]], batch_size=2),
    "batch_sampler_and_shuffle": dict(batch_sampler=[[0]], shuffle=True),
    "batch_sampler_and_drop_last": dict(batch_sampler=[[0]], drop_last=True),
    "no_batch_size_and_drop_last": dict(batch_size=None, drop_last=True),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGUMENTS))
def test_same_validation_errors_as_torch(case: str) -> None:
    kwargs = BAD_ARGUMENTS[case]
    with pytest.raises(ValueError, match="option") as torch_error:
        TorchDataLoader(MapDataset(), **kwargs)
    with pytest.raises(ValueError, match="option") as our_error:
        DataLoader(MapDataset(), **kwargs)
    assert str(our_error.value) == str(torch_error.value)


@pytest.mark.parametrize(
    "kwargs", [dict(shuffle=True), dict(sampler=[0]), dict(batch_sampler=[[0]])], ids=str
)
def test_iterable_dataset_validation_same_as_torch(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="IterableDataset") as torch_error:
        TorchDataLoader(Stream(), **kwargs)
    with pytest.raises(ValueError, match="IterableDataset") as our_error:
        DataLoader(Stream(), **kwargs)
    assert str(our_error.value) == str(torch_error.value)


def test_pin_memory_without_accelerator_warns_once() -> None:
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with pytest.warns(UserWarning, match="no accelerator is found") as record:
        loader = DataLoader(MapDataset(4), batch_size=2, pin_memory=True)
    with loader:
        assert len(list(loader)) == 2
    assert len(record) == 1


def test_without_fork_what_does_not_pickle_is_named_at_construction() -> None:
    class Local(MapDataset):
        def __init__(self) -> None:
            super().__init__(4)
            self.transform = lambda x: x

    with pytest.raises(
        TypeError, match=r"dataset\.transform does not pickle.*worker_mode='thread'"
    ):
        DataLoader(Local(), batch_size=2, num_workers=1, multiprocessing_context="spawn")


def test_fixed_attributes_cannot_be_set_after_construction() -> None:
    loader = DataLoader(MapDataset(4), batch_size=2)
    for name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(loader, name, None)
    loader.num_workers = 0  # others may change, as in torch
    loader.close()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(num_workers=0, multiprocessing_context="fork"), ValueError, "num_workers > 0"),
        (dict(num_workers=1, multiprocessing_context="nope"), ValueError, "'forkserver'"),
        (dict(num_workers=1, multiprocessing_context=3), TypeError, "valid context object"),
    ],
)
def test_multiprocessing_context_is_checked_as_torch_does(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        TorchDataLoader(MapDataset(4), **kwargs)
    with pytest.raises(error, match=match):
        DataLoader(MapDataset(4), **kwargs)


def test_a_context_object_picks_the_start_method() -> None:
    context = multiprocessing.get_context("fork")
    with DataLoader(
        MapDataset(6, "tensor"), batch_size=3, num_workers=1, multiprocessing_context=context
    ) as loader:
        assert [b.shape[0] for b in loader] == [3, 3]
        assert loader._workers is not None
        assert loader._workers.start_method == "fork"


def test_more_workers_than_cpus_warns() -> None:
    many = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 64) + 1
    with pytest.warns(UserWarning, match=f"will create {many} worker processes"):
        DataLoader(MapDataset(4), num_workers=many).close()


class ShortStream(IterableDataset[Any]):
    def __iter__(self) -> Any:
        return iter(range(5))

    def __len__(self) -> int:
        return 2


def test_an_iterable_dataset_longer_than_its_len_warns() -> None:
    with DataLoader(ShortStream(), batch_size=1) as loader:
        assert len(loader) == 2
        with pytest.warns(UserWarning, match="reported to be 2.*samples have been fetched") as w:
            assert len(list(loader)) == 5
    assert [str(x.message).split("but ")[1][0] for x in w] == ["3", "4", "5"]  # as torch warns


def test_an_iter_datapipe_accepts_shuffle() -> None:
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(10)).shuffle()  # shuffle=True turns its shuffler on
    with DataLoader(pipe, batch_size=5, shuffle=True) as loader:
        got = sorted(x for b in loader for x in b.tolist())
    assert got == list(range(10))


def test_an_iterable_dataset_does_not_warn_until_len_was_asked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loader's own use of the length arms nothing
        with DataLoader(ShortStream(), batch_size=1) as loader:
            got = [batch for batch in loader]  # not list(): it asks len(), as it would of torch
            assert len(got) == 5
