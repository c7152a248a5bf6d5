"""aioloader.mix over each kind of input: a dataset with its sampler, tar shards, HTTP and files over a
real server, Parquet; each mixes, and resumes the exact sequence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.faultproxy import Origin
from support.mixes import Squares, assert_resume_continues, batches, stream_keys, text
from support.shardfiles import write_shards
from torch.utils.data import DistributedSampler

from aioloader import FetchError, Loader, mix, sources


def test_a_dataset_with_its_sampler_takes_the_samplers_order_per_own_epoch() -> None:
    data = Squares("d", 6)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4)
    m = mix({"d": (data, sampler), "l": [("l", i) for i in range(50)]}, [1, 1], stop="cycle")
    keys = [k for k in stream_keys(m, 2, 60) if k.name == "d"]
    for e in (2, 3):
        sampler.set_epoch(e)
        assert [k.key for k in keys if k.epoch == e] == list(sampler)

    def loader() -> Loader[Any]:
        pair = (data, DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=4))
        return Loader(mix({"d": pair, "l": list(range(9))}, [1, 2], stop="cycle"), batch_size=4,
                      collate=None)  # fmt: skip

    with loader() as a:
        whole = batches(a, 20)
    with loader() as b:
        head = batches(b, 7)
        state = b.state_dict()
    with loader() as c:
        c.load_state_dict(state)
        assert head + batches(c, 13) == whole


def test_tar_shards_mix_and_resume(tmp_path: Path) -> None:
    shards = write_shards(tmp_path, [6, 6, 6])

    def loader() -> Loader[Any]:
        m = mix({"tar": sources.tar_shards(shards, shuffle_buffer=4), "sq": Squares("sq", 12)},
                [1, 1], seed=9, stop="all_exhausted")  # fmt: skip
        return Loader(m, batch_size=4, collate=None, decode=text, concurrency=8)

    with loader() as a:
        whole = batches(a)
    tar = [s for b in whole for s in b if isinstance(s, str)]
    assert set(tar) == {f"{s}-{i}" for s in range(3) for i in range(6)}  # each ran out once
    assert_resume_continues(loader, whole, 3)


def test_http_and_files_mix_over_a_real_server(origin: Origin, objects: dict[str, bytes],
                                               tmp_path: Path) -> None:  # fmt: skip
    for i in range(12):
        (tmp_path / f"{i:02d}.txt").write_bytes(f"file {i}".encode())
    names = sorted(objects)[:20]

    def loader(keys: list[str]) -> Loader[Any]:
        web = sources.http(origin.url + "/", keys=keys, attempts=1)
        m = mix(
            {"web": web, "disk": sources.files(tmp_path, "*.txt")}, [1, 1], stop="all_exhausted"
        )
        return Loader(m, batch_size=4, collate=None, concurrency=8)

    with loader(names) as a:
        got = [s for b in batches(a) for s in b]
    assert sorted(s for s in got if not s.startswith(b"file")) == sorted(objects[n] for n in names)
    assert {s for s in got if s.startswith(b"file")} == {f"file {i}".encode() for i in range(12)}
    with loader([*names, "obj/missing.bin"]) as b, pytest.raises(FetchError) as info:
        batches(b)
    assert "sources['web'] failed to fetch key 'obj/missing.bin'" in str(info.value)
    assert isinstance(info.value.__cause__, FetchError)  # the http source's own, with the status


def test_parquet_mixes_and_resumes(tmp_path: Path) -> None:
    """A Parquet source in a mix: every row once per epoch of it, and a resume that continues
    the exact sequence (its rows come through `sources.parquet`'s own keys)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = []
    for i in range(2):
        path = tmp_path / f"part-{i}.parquet"
        table = pa.table({"id": [f"pq-{i * 40 + j}" for j in range(40)]})
        pq.write_table(table, path, row_group_size=7)
        paths.append(str(path))

    def loader() -> Loader[Any]:
        m = mix({"pq": sources.parquet(paths, ["id"]), "sq": Squares("sq", 30)}, [2, 1],
                seed=4, stop="all_exhausted")  # fmt: skip
        return Loader(m, batch_size=5, collate=None, concurrency=6)

    with loader() as a:
        whole = batches(a)
    rows = [s["id"] for b in whole for s in b if isinstance(s, dict)]
    assert sorted(rows, key=lambda r: int(r[3:])) == [f"pq-{i}" for i in range(80)]
    assert_resume_continues(loader, whole, 4)
