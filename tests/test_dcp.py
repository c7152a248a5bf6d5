"""`aioloader.DataCheckpoint`: a loader's state saved with `torch.distributed.checkpoint` beside a
model's, by real torchrun ranks on gloo: four data-parallel ranks save part-way through an epoch of
a mix, and three resume from the checkpoint (five too, in `make test-slow`): what all of them
deliver is the uninterrupted epoch, each sample once but for the padding of the new shares."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support.torchrun import torchrun

import aioloader

SAVED_WORLD, STEPS = 4, 3


def uninterrupted() -> Counter[int]:
    got: Counter[int] = Counter()
    for rank in range(SAVED_WORLD):
        both = aioloader.mix([list(range(60)), list(range(100, 137))], [2, 1], seed=4)
        with aioloader.Loader(both, batch_size=4, collate=list, rank=rank,
                              world_size=SAVED_WORLD) as loader:  # fmt: skip
            got.update(k for batch in loader for k in batch)
    return got


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Counter[int]]:
    out = tmp_path_factory.mktemp("dcp")
    written = [out / f"save-rank{r}.json" for r in range(SAVED_WORLD)]
    torchrun("dcp_resume.py", SAVED_WORLD, "save", out, out / "checkpoint", STEPS, written=written)
    before: Counter[int] = Counter()
    for rank in range(SAVED_WORLD):
        before.update(json.loads((out / f"save-rank{rank}.json").read_text()))
    assert sum(before.values()) == SAVED_WORLD * STEPS * 4
    return out, before


def resumed_on(world: int, saved: tuple[Path, Counter[int]]) -> None:
    out, before = saved
    written = [out / f"resume-rank{r}.json" for r in range(world)]
    torchrun("dcp_resume.py", world, "resume", out, out / "checkpoint", written=written)
    after = [json.loads((out / f"resume-rank{r}.json").read_text()) for r in range(world)]
    assert len({len(a) for a in after}) == 1  # every new rank as many samples: equal steps
    got = before + Counter(k for a in after for k in a)
    want = uninterrupted()
    assert set(got) == set(want)  # nothing lost, nothing from beyond the epoch
    repeats = got - Counter(set(got))
    assert sum(repeats.values()) <= (SAVED_WORLD - 1 + world - 1) * 2, repeats  # padding only


def test_four_ranks_save_and_three_resume_the_epoch_exactly(saved: Any) -> None:
    resumed_on(3, saved)


@pytest.mark.slow
def test_four_ranks_save_and_five_resume_the_epoch_exactly(saved: Any) -> None:
    resumed_on(5, saved)


def test_without_a_process_group_it_saves_and_loads_this_loaders_state(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    def make() -> aioloader.Loader[int]:
        return aioloader.Loader(range(20), float, batch_size=4, collate=list, shuffle=True, seed=1)

    with make() as loader:
        whole = list(loader)
    with make() as loader:
        it = iter(loader)
        head = [next(it), next(it)]
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"data": aioloader.DataCheckpoint(loader)}, checkpoint_id=tmp_path)
        it.close()  # type: ignore[attr-defined]
    with make() as again:
        with pytest.warns(UserWarning, match="single process"):
            dcp.load({"data": aioloader.DataCheckpoint(again)}, checkpoint_id=tmp_path)
        assert head + list(again) == whole
    with pytest.raises(TypeError, match=r"loader: expected an aioloader Loader, mix or pack"):
        aioloader.DataCheckpoint(object())
