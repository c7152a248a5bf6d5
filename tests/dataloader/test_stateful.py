"""A dataset's, its iterator's and a sampler's own states saved and restored with a DataLoader's
(`_torch/stateful.py`): each resume is compared with the uninterrupted run, in this process and in
worker processes, mid-epoch, before the first batch and at an epoch's end; `StatefulDataLoader`'s
stricter points (another num_workers refused, a failing worker_init_fn raised at iter())."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

import aioloader
from aioloader import DataLoader as FrontDoor
from aioloader import NumWorkersChanged, StateError, StatefulDataLoader

DataLoader = functools.partial(FrontDoor, worker_mode="process")


def _ids(batch: Any) -> Any:
    return batch


class Noisy(Dataset[int]):
    """Each sample is drawn from torch's generator of the process that reads it; the dataset's
    state is that generator's, as a user's augmenting dataset would keep it."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> int:
        return i * 1000 + int(torch.randint(1000, ()).item())

    def state_dict(self) -> dict[str, Any]:
        return {"rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


class Counted(Iterator[int]):
    """An iterator with a state of its own; `made` counts every item it ever made (a resume that
    ran the stream again from its start would make the items before the state again)."""

    made = 0

    def __init__(self, items: list[int]) -> None:
        self.items, self.i = items, 0

    def __next__(self) -> int:
        if self.i >= len(self.items):
            raise StopIteration
        Counted.made += 1
        self.i += 1
        return self.items[self.i - 1]

    def state_dict(self) -> dict[str, int]:
        return {"i": self.i}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.i = state["i"]


class Shards(IterableDataset[int]):
    """Worker w of n streams its own share: uneven shares, one empty, as sharded datasets are."""

    sizes = (6, 25)

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        sizes = self.sizes if info is not None else (sum(self.sizes),)
        w = info.id if info is not None else 0
        start = sum(sizes[:w])
        return Counted(list(range(start, start + sizes[w])))


class Drawn(Sampler[int]):
    """A sampler whose iterator keeps its place (torchdata's stateful samplers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return Counted(list(range(self.n - 1, -1, -1)))


def _lists(batches: Any) -> list[Any]:
    return [b.tolist() for b in batches]


def _resumed(make: Any, stop: int) -> tuple[list[Any], list[Any], dict[str, Any]]:
    """(the uninterrupted epoch's batches after `stop`, a new loader's from the state saved there,
    that state), as lists."""
    with make() as loader:
        it = iter(loader)
        for _ in range(stop):
            next(it)
        state = loader.state_dict()
        rest = _lists(it)
    with make() as again:
        again.load_state_dict(state)
        return rest, _lists(again), state


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_with_its_own_state_resumes_mid_epoch_as_the_uninterrupted_run(
    workers: int,
) -> None:
    """Its generator is the one the next batches are drawn from: restored where each batch was
    read (per worker), the rest of the epoch is the same samples."""
    torch.manual_seed(3)
    make = functools.partial(DataLoader, Noisy(), batch_size=4, num_workers=workers)
    rest, got, state = _resumed(make, 5)
    assert got == rest
    assert len(got) == 7
    json.dumps(state)  # (as JSON-ready as the dataset's own state)


def test_a_stateful_iterator_in_workers_goes_on_from_its_state_not_from_its_start() -> None:
    """Per worker: its place in its stream and its iterator's state; the empty share stays ended
    and the round robin goes on from the worker after the last batch handed over."""
    make = functools.partial(DataLoader, Shards(), batch_size=4, num_workers=2)
    with make() as loader:
        it = iter(loader)
        head = _lists(next(it) for _ in range(5))
        state = loader.state_dict()
        rest = _lists(it)
    with make() as again:
        again.load_state_dict(state)
        got = _lists(again)
    assert got == rest
    assert sorted(x for b in head + got for x in b) == list(range(31))
    assert state["own_states"]["workers"]["0"]["ended"] is True


def test_a_stateful_iterable_here_is_not_run_again_from_its_start() -> None:
    make = functools.partial(DataLoader, Shards(), batch_size=5, num_workers=0)
    rest, _, state = _resumed(make, 4)
    with make() as again:
        again.load_state_dict(state)
        Counted.made = 0
        assert _lists(again) == rest
    assert Counted.made == 31 - 20  # the 20 items handed over were not made again


@pytest.mark.parametrize("workers", [0, 2])
def test_a_samplers_own_state_is_restored_and_its_iterator_goes_on(workers: int) -> None:
    make = functools.partial(
        DataLoader, list(range(40)), sampler=Drawn(40), batch_size=3, num_workers=workers
    )
    rest, got, state = _resumed(make, 6)
    assert got == rest
    assert state["own_states"]["sampler"]["iter"] == {"i": 18}


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_at_the_epochs_end_or_before_its_first_batch_resumes_the_next_epoch(
    persistent: bool,
) -> None:
    """Persistent workers carry their generators into the next epoch: restored with them."""
    torch.manual_seed(5)
    make = functools.partial(
        DataLoader, Noisy(), batch_size=8, shuffle=True, num_workers=2,
        persistent_workers=persistent, generator=torch.Generator().manual_seed(1),
    )  # fmt: skip
    with make() as loader:
        list(loader)
        at_end = loader.state_dict()
        second = _lists(loader)
    with make() as again:
        again.load_state_dict(at_end)
        assert again.state_dict() == at_end  # (loaded, not begun: what was loaded)
        assert _lists(again) == second
    with make() as before:
        it = iter(before)
        at_start = before.state_dict()
        first = _lists(it)
    with make() as fresh:
        fresh.load_state_dict(at_start)
        assert _lists(fresh) == first


def test_another_num_workers_resumes_a_plain_map_dataset_and_refuses_dataset_states() -> None:
    plain = functools.partial(DataLoader, list(range(30)), batch_size=4)
    with plain(num_workers=0) as loader, plain(num_workers=2) as moved:
        it = iter(loader)
        head = _lists(next(it) for _ in range(3))
        moved.load_state_dict(loader.state_dict())
        assert head + _lists(moved) == _lists(plain())
    with DataLoader(Noisy(), batch_size=4, num_workers=0) as own:
        next(iter(own))
        state = own.state_dict()
    with (
        DataLoader(Noisy(), batch_size=4, num_workers=2) as other,
        pytest.raises(StateError, match="num_workers=0") as info,
    ):
        other.load_state_dict(state)
    assert info.value.field == "num_workers"


def _broken_init(worker_id: int) -> None:
    raise ZeroDivisionError(f"Error in worker_init_fn {worker_id}")


def test_stateful_dataloader_keeps_torchdatas_stricter_points() -> None:
    assert issubclass(StatefulDataLoader, aioloader.DataLoader)
    loader = StatefulDataLoader(list(range(12)), batch_size=2, snapshot_every_n_steps=5)
    assert loader.snapshot_every_n_steps == 5
    other = StatefulDataLoader(list(range(12)), batch_size=2, num_workers=2)
    other.load_state_dict(loader.state_dict())
    with loader, other, pytest.raises(NumWorkersChanged, match="num_workers=0") as info:
        iter(other)
    assert isinstance(info.value, AssertionError)
    assert info.value.field == "num_workers"
    failing = StatefulDataLoader(
        list(range(8)), batch_size=2, num_workers=2, worker_init_fn=_broken_init
    )
    with failing, pytest.raises(ZeroDivisionError, match="Error in worker_init_fn"):
        iter(failing)
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        StatefulDataLoader(list(range(4)), snapshot_every_n_steps=-1)


def test_dataset_states_are_not_shared_out_among_another_number_of_ranks() -> None:
    """A plain dataset resumes elastically (tests/resume); one with its own state is refused."""
    from torch.utils.data import DistributedSampler

    def ranked(rank: int, world: int) -> Any:
        dataset = Noisy()
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(dataset, sampler=sampler, batch_size=2)

    states = []
    for rank in range(2):
        with ranked(rank, 2) as loader:
            next(iter(loader))
            states.append(loader.state_dict())
    with ranked(0, 3) as loader, pytest.raises(StateError, match="states of their own") as info:
        loader.load_state_dict(states)
    assert info.value.field == "world_size"
