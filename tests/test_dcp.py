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
    torchrun("dcp_resume.py", world, "resume", out, out / "checkpoint", 0, written=written)
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


@pytest.mark.slow
def test_a_2x2_mesh_saves_and_resumes_as_3x2(tmp_path: Path) -> None:
    # data-parallel size 2 -> 3, tensor-parallel 2 both times: the tensor-parallel pairs read the
    # same batches before and after, and the data-parallel groups the uninterrupted epoch of 2
    def taken(mode: str, ranks: int) -> dict[int, list[int]]:
        records = [
            json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(ranks)
        ]
        by_dp: dict[int, list[int]] = {}
        for r in records:
            dp = r["coordinate"][0]
            assert by_dp.setdefault(dp, r["taken"]) == r["taken"]  # its pair read the same
        return by_dp

    checkpoint = tmp_path / "checkpoint"
    written = [tmp_path / f"save-rank{r}.json" for r in range(4)]
    torchrun("dcp_resume.py", 4, "save", tmp_path, checkpoint, STEPS, "2x2", written=written)
    before = taken("save", 4)
    written = [tmp_path / f"resume-rank{r}.json" for r in range(6)]
    torchrun("dcp_resume.py", 6, "resume", tmp_path, checkpoint, 0, "3x2", written=written)
    after = taken("resume", 6)
    assert len({len(a) for a in after.values()}) == 1  # equal steps
    got = Counter(k for part in (before, after) for keys in part.values() for k in keys)
    want = Counter()  # the uninterrupted epoch on 2 data-parallel ranks
    for rank in range(2):
        both = aioloader.mix([list(range(60)), list(range(100, 137))], [2, 1], seed=4)
        with aioloader.Loader(both, batch_size=4, collate=list, rank=rank, world_size=2) as ld:
            want.update(k for batch in ld for k in batch)
    assert set(got) == set(want)
    assert sum((got - Counter(set(got))).values()) <= (2 - 1 + 3 - 1) * 2  # padding only


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
