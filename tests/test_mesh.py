"""`Loader(..., mesh=world_mesh["dp"])`: a 2 (data) x 2 (tensor) device mesh of four real torchrun
processes on gloo. The ranks of one tensor-parallel group read the same batches, in the same order,
and save the same place; the two data-parallel groups share the data, each sample once per epoch;
a mix packed over the same loader follows the same rule. Explicit coordinates (`rank`,
`world_size`) and a mesh together are refused; a process outside the mesh is named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.torchrun import torchrun

from aioloader import Loader
from aioloader._util.ranks import mesh_rank


def test_a_2x2_mesh_shares_data_by_its_data_parallel_part(tmp_path: Path) -> None:
    written = [tmp_path / f"rank{r}.json" for r in range(4)]
    torchrun("mesh_shards.py", 4, tmp_path, written=written)
    ranks = [json.loads(p.read_text()) for p in written]
    groups: dict[int, list[dict[str, Any]]] = {}
    for r in ranks:
        groups.setdefault(r["coordinate"][0], []).append(r)  # by the data-parallel coordinate
    assert sorted(groups) == [0, 1]
    for dp, (a, b) in groups.items():  # a tensor-parallel pair: the same batches and place
        assert a["coordinate"][1] != b["coordinate"][1]
        assert a["keys"] == b["keys"]
        assert a["rows"] == b["rows"]
        assert a["place"] == b["place"] == [dp, 2]
    first, second = (sorted(k for batch in groups[dp][0]["keys"] for k in batch) for dp in (0, 1))
    assert not set(first) & set(second)  # the data-parallel ranks share the data
    assert sorted(first + second) == list(range(40))  # every sample once (no padding here)
    assert groups[0][0]["rows"] != groups[1][0]["rows"]


def test_a_mesh_with_rank_or_world_size_or_not_a_mesh_is_refused() -> None:
    class Mesh:  # what a DeviceMesh says of this process
        shape = (2, 3)

        def __init__(self, here: list[int] | None) -> None:
            self.here = here

        def get_coordinate(self) -> list[int] | None:
            return self.here

    assert mesh_rank(Mesh([1, 2])) == (5, 6)  # row-major over the dimensions given
    with pytest.raises(ValueError, match=r"mesh: give the data-parallel mesh or rank and world"):
        Loader(range(4), float, mesh=Mesh([0, 0]), rank=0, world_size=2)
    with pytest.raises(ValueError, match=r"mesh: this process is not one of the mesh's ranks"):
        Loader(range(4), float, mesh=Mesh(None))
    with pytest.raises(TypeError, match=r"mesh: expected a torch.distributed DeviceMesh"):
        Loader(range(4), float, mesh=2)
    with Loader(range(12), float, batch_size=2, collate=list, mesh=Mesh([1, 0])) as loader:
        assert [k for b in loader for k in b] == [3.0, 9.0]  # rank 3 of 6
        assert (loader.state_dict()["rank"], loader.state_dict()["world_size"]) == (3, 6)
