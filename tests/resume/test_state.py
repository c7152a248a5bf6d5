"""Exact resume: state_dict() / load_state_dict() on Loader and DataLoader."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from typing import Any

import numpy as np
import pytest
import torch

import aioloader
from aioloader import DataLoader, Loader, StateError

N = 50


def payload(key: int) -> np.ndarray:
    return np.full((3,), key, dtype=np.int64)


async def jittery(key: int) -> np.ndarray:
    await asyncio.sleep(random.random() * 0.004)
    return payload(key)


def make(**kwargs: Any) -> Loader[Any]:
    options: dict[str, Any] = dict(batch_size=4, shuffle=True, seed=5)
    options.update(kwargs)
    return Loader(list(range(N)), options.pop("fetch", jittery), **options)


def digest(batch: Any) -> str:
    return hashlib.sha1(batch.numpy().tobytes()).hexdigest()


def run_epochs(loader: Loader[Any], epochs: int) -> list[list[str]]:
    return [[digest(b) for b in loader] for _ in range(epochs)]


def take(loader: Loader[Any], n: int) -> tuple[list[str], dict[str, Any]]:
    """The first `n` batches of the next epoch and the JSON round-tripped state after them."""
    batches = iter(loader)
    got = [digest(next(batches)) for _ in range(n)]
    state = json.loads(json.dumps(loader.state_dict()))
    batches.close()  # type: ignore[attr-defined]
    return got, state


def test_resume_mid_epoch_continues_byte_for_byte() -> None:
    with make() as reference:
        expected = run_epochs(reference, 3)
    with make() as first:
        list(first)  # epoch 0
        head, state = take(first, 5)
    assert state["epoch"] == 1
    with make() as resumed:
        resumed.load_state_dict(state)
        assert resumed.state_dict() == state  # nothing moved before iterating
        rest = run_epochs(resumed, 2)
    assert head + rest[0] == expected[1]
    assert rest[1] == expected[2]


def test_resume_twice_equals_uninterrupted() -> None:
    with make() as reference:
        expected = run_epochs(reference, 1)[0]
    with make() as a:
        one, state = take(a, 3)
    with make() as b:
        b.load_state_dict(state)
        two, state = take(b, 4)
    with make() as c:
        c.load_state_dict(state)
        three = [digest(x) for x in c]
    assert one + two + three == expected


def test_resume_with_other_concurrency_executor_and_order() -> None:
    with make() as reference:
        expected = run_epochs(reference, 1)[0]
    with make(concurrency=2) as a:
        head, state = take(a, 6)
    with make(concurrency=32, executor="thread", decode=lambda x: x, prefetch=5) as b:
        b.load_state_dict(state)
        rest = [digest(x) for x in b]
    assert head + rest == expected


def test_out_of_order_resume_loses_and_repeats_nothing() -> None:
    async def first_slow(key: int) -> np.ndarray:
        await asyncio.sleep(0.05 if key % 7 == 0 else random.random() * 0.002)
        return payload(key)

    with make(in_order=False, fetch=first_slow, concurrency=8) as a:
        head, state = take(a, 6)
    assert state["in_order"] is False
    with make(in_order=False, fetch=first_slow) as b:
        b.load_state_dict(state)
        rest = [digest(x) for x in b]
    with make() as reference:
        expected = run_epochs(reference, 1)[0]
    assert sorted(head + rest) == sorted(expected)
    assert len(head + rest) == len(expected)


def keys_of(batches: list[Any]) -> list[int]:
    return [int(k) for b in batches for k in b[:, 0]]


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 3), (3, 2), (2, 1)])
def test_elastic_resume_delivers_each_remaining_sample_once(old_world: int, new_world: int) -> None:
    delivered: list[int] = []
    states = []
    for rank in range(old_world):
        with make(rank=rank, world_size=old_world) as loader:
            it = iter(loader)
            delivered += keys_of([next(it) for _ in range(3)])
            states.append(loader.state_dict())
            it.close()  # type: ignore[attr-defined]
    rest: list[list[int]] = []
    for rank in range(new_world):
        with make(rank=rank, world_size=new_world) as loader:
            loader.load_state_dict(states)
            rest.append(keys_of(list(loader)))
    assert len({len(r) for r in rest}) == 1, "every new rank takes the same number of samples"
    left = set(range(N)) - set(delivered)
    after = [k for r in rest for k in r]
    assert set(after) == left  # complete
    assert len(after) - len(left) < new_world  # only wrap-around padding repeats
    assert not set(after) & set(delivered)  # nothing delivered before comes again


def test_elastic_resume_from_one_lockstep_state() -> None:
    states = []
    for rank in range(2):
        with make(rank=rank, world_size=2) as loader:
            it = iter(loader)
            [next(it) for _ in range(2)]
            states.append(loader.state_dict())
            it.close()  # type: ignore[attr-defined]
    outcomes = []
    for given in (states, states[:1]):  # all ranks' states, or rank 0's alone
        with make() as single:
            single.load_state_dict(given)
            outcomes.append(keys_of(list(single)))
    assert outcomes[0] == outcomes[1]
    assert len(outcomes[0]) == N - 16


def test_elastic_out_of_order_needs_every_rank() -> None:
    with make(rank=0, world_size=2, in_order=False) as loader:
        _, state = take(loader, 1)
    with make() as other, pytest.raises(StateError, match="every") as err:
        other.load_state_dict(state)
    assert err.value.field == "states"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(batch_size=5), "batch_size"),
        (dict(seed=6), "seed"),
        (dict(shuffle=False), "shuffle"),
        (dict(drop_last=True), "drop_last"),
    ],
)
def test_incompatible_state_names_the_field(change: dict[str, Any], field: str) -> None:
    with make() as a:
        _, state = take(a, 1)
    with make(**change) as b, pytest.raises(StateError, match=field) as err:
        b.load_state_dict(state)
    assert err.value.field == field


def test_state_from_another_dataset_is_refused() -> None:
    with make() as a:
        _, state = take(a, 1)
    other = Loader(list(range(1, N + 1)), jittery, batch_size=4, shuffle=True, seed=5)
    with other, pytest.raises(StateError, match="keys") as err:
        other.load_state_dict(state)
    assert err.value.field == "keys"
    with make() as b, pytest.raises(StateError, match="version"):
        b.load_state_dict(dict(state, version=99))


class Squares(torch.utils.data.Dataset[Any]):
    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> Any:
        return {"x": torch.tensor([i, i * i]), "i": i}


@pytest.mark.parametrize("generator", [True, False])
def test_dataloader_resume_matches_torch(generator: bool) -> None:
    def gen() -> torch.Generator | None:
        return torch.Generator().manual_seed(3) if generator else None

    def loader() -> DataLoader:
        return DataLoader(Squares(), batch_size=5, shuffle=True, generator=gen())

    torch.manual_seed(123)
    reference = torch.utils.data.DataLoader(Squares(), 5, shuffle=True, generator=gen())
    expected = [b["i"].tolist() for b in reference]
    torch.manual_seed(123)
    with loader() as ours:
        it = iter(ours)
        head = [next(it)["i"].tolist() for _ in range(3)]
        state = json.loads(json.dumps(ours.state_dict()))
        it.close()
    torch.manual_seed(999)  # the resumed process has another global RNG state
    with loader() as resumed:
        resumed.load_state_dict(state)
        rest = [b["i"].tolist() for b in resumed]
    assert head + rest == expected


def test_state_of_a_fresh_loader_points_at_its_next_epoch() -> None:
    with make() as loader:
        loader.set_epoch(4)
        state = loader.state_dict()
    assert (state["epoch"], state["delivered"], state["consumed"]) == (4, [], [])
    assert isinstance(json.dumps(state), str)
    assert aioloader.StateError is StateError


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 3), (3, 2)])
def test_dataloader_elastic_resume_with_distributed_sampler(old_world: int, new_world: int) -> None:
    from torch.utils.data import DistributedSampler

    def loader(rank: int, world: int) -> DataLoader:
        sampler = DistributedSampler(Squares(), num_replicas=world, rank=rank, seed=4)
        sampler.set_epoch(1)
        return DataLoader(Squares(), batch_size=3, sampler=sampler)

    delivered: list[int] = []
    states = []
    for rank in range(old_world):
        with loader(rank, old_world) as ours:
            it = iter(ours)
            delivered += [i for _ in range(2) for i in next(it)["i"].tolist()]
            states.append(ours.state_dict())
            it.close()
    rest = []
    for rank in range(new_world):
        with loader(rank, new_world) as ours:
            ours.load_state_dict(states)
            rest.append([i for b in ours for i in b["i"].tolist()])
    assert len({len(r) for r in rest}) == 1  # equal steps on the new ranks
    after = [i for r in rest for i in r]
    assert set(after) == set(range(37)) - set(delivered)
    assert len(after) - len(set(after)) < new_world  # wrap-around padding only


def test_a_refused_elastic_load_leaves_the_random_state_as_it_was() -> None:
    """The plan takes the saved random state before the old ranks' batches are counted; where the
    load is then refused (a rank's state missing), the loader's random state is put back."""
    from torch.utils.data import DistributedSampler

    def loader(rank: int, world: int) -> DataLoader:
        sampler = DistributedSampler(Squares(), num_replicas=world, rank=rank, shuffle=False)
        return DataLoader(Squares(), batch_size=3, sampler=sampler)  # the global random state

    states = []
    for rank in range(3):
        with loader(rank, 3) as ours:
            it = iter(ours)
            next(it)
            states.append(ours.state_dict())
            it.close()
    with loader(0, 2) as ours:
        before = ours.state_dict()
        with pytest.raises(StateError, match="need ranks"):
            ours.load_state_dict([states[0], states[2]])
        assert ours.state_dict() == before
