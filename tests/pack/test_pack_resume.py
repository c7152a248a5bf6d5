"""aioloader.pack resumes exactly: at a random step, the rest of the sequence stream, in-process,
over Parquet files, over a 0.7 / 0.3 mix of them, on ranks, and with the columnar fast path."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aioloader import Loader, Packed, StateError, mix, pack, schedule, sources

EOS = 50_000


async def same(x: Any) -> Any:
    return x


def write_corpus(folder: Path, name: str, docs: int, seed: int) -> list[str]:
    """Three Parquet files of tokenized documents: `tokens` (list<int32>, 0 to 300 tokens) and
    three other columns, in row groups of 23 rows."""
    rng = np.random.default_rng(seed)
    paths, first = [], 0
    for part, n in enumerate(np.array_split(np.arange(docs), 3)):
        lengths = rng.integers(0, 300, len(n))
        tokens = [rng.integers(0, 32_000, k, dtype=np.int32) for k in lengths]
        table = pa.table({
            "id": pa.array(first + np.arange(len(n))),
            "tokens": pa.array(tokens, pa.list_(pa.int32())),
            "source": pa.array([name] * len(n)),
            "score": pa.array(rng.random(len(n))),
        })  # fmt: skip
        path = folder / f"{name}-{part}.parquet"
        pq.write_table(table, path, row_group_size=23)
        paths.append(str(path))
        first += len(n)
    return paths


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    folder = tmp_path_factory.mktemp("corpus")
    return {
        "web": write_corpus(folder, "web", 300, 1),
        "code": write_corpus(folder, "code", 160, 2),
    }


def entries(batch: Any) -> list[Any]:
    """A batch's rows, and its document ids where it has them, as lists."""
    if isinstance(batch, dict):
        return [batch["tokens"].tolist(), batch["document_ids"].tolist()]
    return [batch.tolist(), None]


def run(
    make: Callable[[], Packed], state: dict[str, Any] | None, n: int | None
) -> tuple[list[Any], dict[str, Any]]:
    """Up to `n` batches (None: the rest of the epoch) from a fresh packer, after loading `state`;
    and its state then (through JSON, as a checkpoint keeps it)."""
    with make() as packed:
        if state is not None:
            packed.load_state_dict(state)
        got: list[Any] = []
        for batch in packed if n != 0 else ():
            got += entries(batch)
            if n is not None and len(got) == 2 * n:
                break
        return got, json.loads(json.dumps(packed.state_dict()))


def assert_resumes(
    make: Callable[[], Packed], cuts: list[int], next_epoch_too: bool = True
) -> list[Any]:
    """Cut the epoch at each step of `cuts` in turn, each part in a fresh packer from the last
    part's state: the parts are the uninterrupted epoch, and the epoch after goes on as usual."""
    whole, _ = run(make, None, None)
    parts: list[Any] = []
    state = None
    for cut in cuts:
        got, state = run(make, state, cut)
        parts += got
    rest, state = run(make, state, None)
    assert parts + rest == whole
    if not next_epoch_too:
        return whole
    next_epoch, _ = run(make, state, None)
    with make() as packed:
        packed.set_epoch(1)
        assert next_epoch == [x for b in packed for x in entries(b)]
    return whole


@settings(max_examples=15, deadline=None)
@given(
    docs=st.lists(st.integers(0, 60), min_size=1, max_size=60),
    seq_len=st.integers(1, 20),
    targets=st.booleans(),
    data=st.data(),
)
def test_resume_at_any_step_gives_the_rest_of_the_stream(
    docs: list[int], seq_len: int, targets: bool, data: st.DataObject
) -> None:
    documents = [np.arange(n, dtype=np.int32) + 1000 * i for i, n in enumerate(docs)]

    def make() -> Packed:
        loader = Loader(documents, same, batch_size=None, collate=None, concurrency=4)
        return pack(loader, seq_len, batch_size=2, eos=EOS, targets=targets)

    whole, _ = run(make, None, None)
    k = data.draw(st.integers(0, max(len(whole) // 2 - 1, 0)), label="k")  # a step in the epoch
    head, state = run(make, None, k)
    rest, _ = run(make, state, None)
    assert head + rest == whole


def parquet_packer(
    corpora: dict[str, list[str]], *, boundaries: bool = False, rows_per_sample: int | None = None,
    rank: int = 0, world_size: int = 1,
) -> Callable[[], Packed]:  # fmt: skip
    def make() -> Packed:
        source = sources.parquet(corpora["web"], ["tokens"], shuffle_buffer=40, seed=3,
                                 rows_per_sample=rows_per_sample)  # fmt: skip
        loader = Loader(source, batch_size=None, collate=None, rank=rank, world_size=world_size)
        return pack(loader, 128, batch_size=4, eos=EOS, key="tokens", boundaries=boundaries)

    return make


def test_parquet_files_resume_at_random_steps(corpora: dict[str, list[str]]) -> None:
    make = parquet_packer(corpora, boundaries=True)
    whole = assert_resumes(make, [0, 1, random.Random(7).randint(1, 40)])
    tokens = [t for batch in whole[::2] for row in batch for t in row]
    docs = [d for p in corpora["web"] for d in pq.read_table(p).column("tokens").to_pylist()]
    assert tokens.count(EOS) == len(docs) - 1 or tokens.count(EOS) == len(docs)  # the tail cut


def test_the_columnar_fast_path_gives_the_same_rows_as_one_document_at_a_time(
    corpora: dict[str, list[str]],
) -> None:
    def rows(make: Callable[[], Packed]) -> list[Any]:
        with make() as packed:
            return [b.tolist() for b in packed]

    def stored_order(rows_per_sample: int | None) -> Packed:
        source = sources.parquet(corpora["web"], ["tokens"], shuffle=False,
                                 rows_per_sample=rows_per_sample)  # fmt: skip
        loader = Loader(source, batch_size=None, collate=None)
        return pack(loader, 128, batch_size=4, eos=EOS, key="tokens")

    one_by_one = rows(lambda: stored_order(None))
    assert one_by_one == rows(lambda: stored_order(64))
    docs = [d for p in corpora["web"] for d in pq.read_table(p).column("tokens").to_pylist()]
    stream = [t for d in docs for t in [*d, EOS]]
    assert [t for b in one_by_one for row in b for t in row] == stream[: len(stream) // 128 * 128]


def test_the_columnar_fast_path_resumes_mid_record_batch(corpora: dict[str, list[str]]) -> None:
    assert_resumes(
        parquet_packer(corpora, rows_per_sample=50), [random.Random(3).randint(1, 30), 2]
    )


def mixed_packer(
    corpora: dict[str, list[str]], *, stop: str = "first_exhausted", rank: int = 0,
    world_size: int = 1,
) -> Callable[[], Packed]:  # fmt: skip
    def make() -> Packed:
        web = sources.parquet(corpora["web"], ["tokens"], shuffle_buffer=30, seed=1)
        code = sources.parquet(corpora["code"], ["tokens"], seed=2)
        both = mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, seed=9, stop=stop)
        loader = Loader(both, batch_size=None, collate=None, rank=rank, world_size=world_size)
        return pack(loader, 64, batch_size=4, eos=EOS, key="tokens", boundaries=True)

    return make


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_mix_of_parquet_sources_resumes_at_random_steps(
    corpora: dict[str, list[str]], stop: str
) -> None:
    rng = random.Random(stop)
    whole = assert_resumes(
        mixed_packer(corpora, stop=stop), [rng.randint(1, 30), rng.randint(0, 5)]
    )
    assert len(whole) > 2 * 10


def found(state: Any, key: str) -> Any:
    """The first value under `key` anywhere in a nested state."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        state = list(state.values())
    if isinstance(state, list):
        for item in state:
            if (value := found(item, key)) is not None:
                return value
    return None


def test_a_mix_packed_takes_other_weights_from_its_saved_position() -> None:
    """Packed, a mix of sources loaded under other weights goes on as the run whose schedule
    changed at the loader's saved position: the same packed rows."""
    a = [np.arange(n, dtype=np.int32) for n in range(5, 45)]
    b = [np.arange(n, dtype=np.int32) + 10_000 for n in range(3, 30)]

    def packer(weights: Any) -> Callable[[], Packed]:
        return lambda: pack(Loader(mix([a, b], weights, seed=1, stop="cycle"), batch_size=None,
                                   collate=None), 16, batch_size=2, eos=EOS)  # fmt: skip

    head, state = run(packer([0.75, 0.25]), None, 12)
    rest, later = run(packer([0.25, 0.75]), state, 20)
    change = found(later, "weights_changed")
    assert change[0]["was"] == [0.75, 0.25]
    spliced = schedule([(0, [0.75, 0.25]), (change[0]["position"], [0.25, 0.75])])
    whole, _ = run(packer(spliced), None, 32)
    assert head + rest == whole


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_pack_their_own_share_and_resume(corpora: dict[str, list[str]], rank: int) -> None:
    mine = assert_resumes(
        mixed_packer(corpora, rank=rank, world_size=2), [random.Random(rank).randint(1, 12)]
    )
    other, _ = run(mixed_packer(corpora, rank=1 - rank, world_size=2), None, None)
    assert mine[0] != other[0]  # each rank its own documents


def test_resume_with_process_decode_and_another_concurrency(corpora: dict[str, list[str]]) -> None:
    def make(**kwargs: Any) -> Callable[[], Packed]:
        def made() -> Packed:
            loader = Loader(sources.parquet(corpora["code"], ["tokens"], seed=5), batch_size=None,
                            collate=None, **kwargs)  # fmt: skip
            return pack(loader, 32, batch_size=2, eos=EOS, key="tokens", targets=True)

        return made

    whole, _ = run(make(concurrency=4), None, None)
    head, state = run(make(concurrency=2), None, 17)
    rest, _ = run(
        make(concurrency=16, decode=same_rows, executor="process", workers=2), state, None
    )
    assert head + rest == whole


def same_rows(row: Any) -> Any:
    return row


def test_a_state_saved_before_iterating_or_after_loading_is_the_same(
    corpora: dict[str, list[str]],
) -> None:
    make = parquet_packer(corpora)
    _, state = run(make, None, 5)
    with make() as packed:
        packed.load_state_dict(state)
        assert json.loads(json.dumps(packed.state_dict())) == state
    assert len(state["tokens"]) > 0


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two files of 150 documents each of 20 to 60 tokens, every token a number no other has."""
    folder = tmp_path_factory.mktemp("numbered")
    rng = np.random.default_rng(4)
    paths = []
    for part in range(2):
        docs = [1000 * (150 * part + i) + np.arange(rng.integers(20, 60)) for i in range(150)]
        path = folder / f"numbered-{part}.parquet"
        pq.write_table(pa.table({"tokens": pa.array(docs, pa.list_(pa.int32()))}), path,
                       row_group_size=16)  # fmt: skip
        paths.append(str(path))
    return paths


def test_resume_on_another_world_size_delivers_every_token_once(numbered: list[str]) -> None:
    """4 ranks stop at different steps; 3 ranks load all four states and finish the epoch. The
    tokens the old ranks held come out on the new ones: none is lost but the ends of the new
    ranks' epochs (less than a row each), none repeats but the loader's wrap-around padding."""

    def make(rank: int, world_size: int) -> Packed:
        source = sources.parquet(numbered, ["tokens"], shuffle_buffer=20, seed=6)
        loader = Loader(source, batch_size=None, collate=None, rank=rank, world_size=world_size)
        return pack(loader, 16, batch_size=4, eos=EOS, key="tokens", boundaries=True)

    seen: list[int] = []
    states = []
    for rank in range(4):
        with make(rank, 4) as packed:
            for step, batch in enumerate(packed):
                seen += batch["tokens"].flatten().tolist()
                if step == 2 + rank:
                    break
            states.append(json.loads(json.dumps(packed.state_dict())))
    held = sum(len(s["tokens"]) for s in states)
    assert held > 3 * 16  # more than the epoch ends may drop: a lost held token would show
    for rank in range(3):
        with make(rank, 3) as packed:
            packed.load_state_dict(states)
            seen += [t for b in packed for t in b["tokens"].flatten().tolist()]
    tokens = [t for t in seen if t != EOS]
    every = {t for p in numbered for d in pq.read_table(p).column("tokens").to_pylist() for t in d}
    lost = every - set(tokens)
    assert 0 < len(lost) < 3 * 16  # the new ranks' epoch ends
    repeated = len(tokens) - len(set(tokens))
    assert repeated <= 3 * 60  # a few padding documents (the loader's elastic share), no more
    assert set(tokens) <= every


def test_a_ranks_state_on_another_rank_or_world_size_is_refused(numbered: list[str]) -> None:
    def make(rank: int, world_size: int) -> Packed:
        loader = Loader(sources.parquet(numbered, ["tokens"]), batch_size=None, collate=None,
                        rank=rank, world_size=world_size)  # fmt: skip
        return pack(loader, 16, batch_size=2, eos=EOS, key="tokens")

    _, state = run(lambda: make(0, 2), None, 3)
    with make(1, 2) as other, pytest.raises(StateError, match="0 of them are this rank's") as e:
        other.load_state_dict(state)
    assert e.value.field == "states"
    with make(0, 3) as other, pytest.raises(StateError, match=r"this rank's \(0 of 3\)"):
        other.load_state_dict([state])
    with (
        make(0, 3) as other,
        pytest.raises(StateError, match=r"of the 2 ranks .* got ranks \[0, 0\]"),
    ):
        other.load_state_dict([state, state])


def test_loaders_mixed_whole_pack_and_resume(corpora: dict[str, list[str]]) -> None:
    def make() -> Packed:
        loaders = [
            Loader(sources.parquet(corpora[name], ["tokens"], rows_per_sample=20, seed=i),
                   batch_size=None, collate=None)
            for i, name in enumerate(("web", "code"))
        ]  # fmt: skip
        return pack(mix(loaders, [0.7, 0.3], seed=2), 64, batch_size=2, eos=EOS, key="tokens")

    assert_resumes(make, [random.Random(11).randint(1, 40), 3])


def rows_packer(
    corpora: dict[str, list[str]], *, stop: str = "all_exhausted", rank: int = 0,
    world_size: int = 1, weights: Any = (0.7, 0.3), **kwargs: Any,
) -> Callable[[], Packed]:  # fmt: skip
    """A 0.7 / 0.3 mix (or `weights`) by rows (per document) of loaders of RecordBatches of 20
    documents."""

    def make() -> Packed:
        loaders = [
            Loader(sources.parquet(corpora[name], ["tokens"], rows_per_sample=20, seed=i),
                   batch_size=None, collate=None, rank=rank, world_size=world_size, **kwargs)
            for i, name in enumerate(("web", "code"))
        ]  # fmt: skip
        rows = mix(loaders, weights, seed=2, stop=stop, rows_per_item=16)
        return pack(rows, 64, batch_size=2, eos=EOS, key="tokens", boundaries=True)

    return make


@pytest.mark.parametrize("interpolate", ["step", "linear"])
def test_a_schedule_mixed_by_rows_and_packed_resumes_at_random_steps(
    corpora: dict[str, list[str]], interpolate: str
) -> None:
    # the weights move from mostly "web" to mostly "code" a third of the way through the epoch's
    # rows: a resume anywhere goes on with the weights in force there, as the uninterrupted run
    weights = schedule([(0, [0.9, 0.1]), (150, [0.2, 0.8])], interpolate=interpolate)
    make = rows_packer(corpora, weights=weights)
    rng = random.Random(interpolate)
    assert_resumes(make, [rng.randint(1, 30), rng.randint(1, 30)])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_mix_by_rows_packs_as_the_tables_it_makes(
    corpora: dict[str, list[str]], asynchronous: bool
) -> None:
    # pack reads a mix by rows as runs of rows (each loader's item converted once, nothing
    # joined): its batches, boundaries included, are those of packing the Tables the mix yields
    def loaders() -> list[Loader[Any]]:
        return [
            Loader(sources.parquet(corpora[name], ["tokens"], rows_per_sample=20, seed=i),
                   batch_size=None, collate=None)
            for i, name in enumerate(("web", "code"))
        ]  # fmt: skip

    with mix(loaders(), [0.7, 0.3], seed=2, rows_per_item=16) as rows:
        tables = list(rows)
    assert len(tables) > 20
    assert any(t.column("tokens").num_chunks > 1 for t in tables)
    joined = Loader(tables, lambda t: t, batch_size=None, collate=None)
    with pack(joined, 64, batch_size=2, eos=EOS, key="tokens", boundaries=True) as packed:
        want = [entry for batch in packed for entry in entries(batch)]
    rows = mix(loaders(), [0.7, 0.3], seed=2, rows_per_item=16)
    with pack(rows, 64, batch_size=2, eos=EOS, key="tokens", boundaries=True) as packed:
        if asynchronous:

            async def drain() -> list[Any]:
                return [entry async for batch in packed for entry in entries(batch)]

            got = asyncio.run(drain())
        else:
            got = [entry for batch in packed for entry in entries(batch)]
    assert got == want


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_loaders_mixed_by_rows_resume_at_random_steps_and_at_90_percent(
    corpora: dict[str, list[str]], stop: str
) -> None:
    make = rows_packer(corpora, stop=stop)
    whole, _ = run(make, None, None)
    batches = len(whole) // 2
    assert batches > 20
    rng = random.Random(stop)
    assert_resumes(make, [rng.randint(1, 40), rng.randint(0, 5)])
    assert_resumes(make, [batches * 9 // 10])


@pytest.mark.parametrize("rank", [0, 1])
def test_loaders_mixed_by_rows_on_ranks_resume(corpora: dict[str, list[str]], rank: int) -> None:
    mine = assert_resumes(
        rows_packer(corpora, rank=rank, world_size=2), [random.Random(rank).randint(1, 20)]
    )
    other, _ = run(rows_packer(corpora, rank=1 - rank, world_size=2), None, None)
    assert mine[0] != other[0]  # each rank its own documents


def test_loaders_mixed_by_rows_resume_with_process_decode(corpora: dict[str, list[str]]) -> None:
    whole, _ = run(rows_packer(corpora), None, None)
    head, state = run(rows_packer(corpora), None, 13)
    processes = rows_packer(corpora, decode=same_rows, executor="process", workers=2)
    rest, _ = run(processes, state, None)
    assert head + rest == whole


@pytest.mark.parametrize(
    ("stop", "steps"), [("first_exhausted", [2, 5, 8, 11]), ("all_exhausted", [3, 10, 40, 50])]
)
def test_loaders_mixed_by_rows_resume_on_another_world_size(
    numbered: list[str], stop: str, steps: list[int]
) -> None:
    """A 0.7 / 0.3 mix by rows of a loader per file: 4 ranks stop at different steps (partly
    through items; some past the first loader's epoch end, in its next epoch), 3 ranks load all
    four states and finish the epoch. The loader that ends the epoch (the last to run out) gives
    each of its tokens once, but for the new ranks' epoch ends (less than a row each) and the
    padding of the shares; the other every one (its first epoch, then part of its next). With
    "first_exhausted" (the epoch ends where the world size moves it) the load is refused."""

    def make(rank: int, world_size: int) -> Packed:
        loaders = [
            Loader(sources.parquet([path], ["tokens"], rows_per_sample=10, shuffle_buffer=20,
                                   seed=i), batch_size=None, collate=None, rank=rank,
                   world_size=world_size)
            for i, path in enumerate(numbered)
        ]  # fmt: skip
        rows = mix(loaders, [0.7, 0.3], seed=5, stop=stop, rows_per_item=8)
        return pack(rows, 16, batch_size=4, eos=EOS, key="tokens", boundaries=True)

    seen: list[int] = []
    states = []
    for rank in range(4):
        with make(rank, 4) as packed:
            for step, batch in enumerate(packed):
                seen += batch["tokens"].flatten().tolist()
                if step == steps[rank]:
                    break
            states.append(json.loads(json.dumps(packed.state_dict())))
    assert sum(len(s["tokens"]) for s in states) > 3 * 16  # tokens held: a lost one would show
    assert any(own["used"] for s in states for own in s["loader"]["sources"])
    epochs = {own["epoch"] for s in states for own in s["loader"]["sources"][:1]}
    assert (epochs == {0, 1}) == (stop == "all_exhausted")  # on either side of its epoch end
    if stop == "first_exhausted":
        with make(0, 3) as packed, pytest.raises(StateError, match=r"world size 4 cannot resume"):
            packed.load_state_dict(states)
        return
    for rank in range(3):
        with make(rank, 3) as packed:
            packed.load_state_dict(states)
            seen += [t for b in packed for t in b["tokens"].flatten().tolist()]
    tokens = [t for t in seen if t != EOS]
    first, second = (  # (less EOS: a document holds a token equal to it)
        {t for d in pq.read_table(p).column("tokens").to_pylist() for t in d} - {EOS}
        for p in numbered
    )
    assert set(tokens) <= first | second
    ends, other = second, first
    ended = [t for t in tokens if t in ends]  # (a loader of one file: its tokens are its own)
    assert len(ends - set(ended)) < 3 * 16  # the new ranks' epoch ends
    assert len(ended) - len(set(ended)) <= 2 * 60  # a padding document or two, no more
    assert {t for t in tokens if t in other} == other
