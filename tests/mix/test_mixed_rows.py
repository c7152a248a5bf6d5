"""aioloader.mix(loaders, weights, rows_per_item=N): columnar loaders mixed row by row, by the mix's
rule per row, resumed exactly; packed; bad inputs named."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aioloader import Loader, MixedRows, StateError, mix, pack, sources
from aioloader._mix.choices import Choices

WEIGHTS = [0.7, 0.3]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Two sources of documents: "a" (ids 0 ..) and "b" (ids 100,000 ..), 2 files each."""
    folder = tmp_path_factory.mktemp("rows")
    rng = np.random.default_rng(7)
    out: dict[str, list[str]] = {}
    for name, first, rows in (("a", 0, 700), ("b", 100_000, 450)):
        out[name] = []
        for part in range(2):
            ids = np.arange(first + part * rows, first + (part + 1) * rows)
            lengths = rng.integers(1, 40, rows)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = rng.integers(1, 1000, int(offsets[-1]), dtype=np.int32)
            table = pa.table({
                "id": ids, "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            })  # fmt: skip
            path = folder / f"{name}-{part}.parquet"
            pq.write_table(table, path, row_group_size=100)
            out[name].append(str(path))
    return out


def loaders(corpus: dict[str, list[str]], rows_per_sample: int = 64) -> list[Loader[Any]]:
    return [
        Loader(
            sources.parquet(paths, ["id", "tokens"], rows_per_sample=rows_per_sample, seed=i),
            batch_size=None,
            collate=None,
        )
        for i, paths in enumerate(corpus.values())
    ]


def mixed(corpus: dict[str, list[str]], stop: str = "first_exhausted", rows: int = 50) -> MixedRows:
    out = mix(loaders(corpus), WEIGHTS, seed=3, stop=stop, rows_per_item=rows)
    assert isinstance(out, MixedRows)
    return out


def same(x: Any) -> Any:
    return x


def ids(tables: list[pa.Table]) -> list[int]:
    return [i for t in tables for i in t.column("id").to_pylist()]


def test_each_row_is_drawn_by_the_rule_and_each_loader_keeps_its_order(
    corpus: dict[str, list[str]],
) -> None:
    with mixed(corpus) as m:
        tables = list(m)
    assert all(t.num_rows == 50 for t in tables[:-1])
    assert 0 < tables[-1].num_rows <= 50
    got = ids(tables)
    drawn = Choices(WEIGHTS, 3, 0).span(0, len(got) + 1)
    assert [0 if i < 100_000 else 1 for i in got] == drawn[: len(got)].tolist()
    own = []
    for loader in loaders(corpus):
        with loader:
            own.append(ids(list(loader)))
    counts = np.bincount(drawn[: len(got)], minlength=2).tolist()
    assert [i for i in got if i < 100_000] == own[0][: counts[0]]
    assert [i for i in got if i >= 100_000] == own[1][: counts[1]]
    ended = int(drawn[len(got)])  # the epoch ended where a loader, run out, was drawn again
    assert counts[ended] == len(own[ended])
    assert len(set(got)) == len(got)


@pytest.mark.parametrize("at", [1, 5, 13])
def test_a_resume_at_any_item_gives_the_rest_of_the_run(
    corpus: dict[str, list[str]], at: int
) -> None:
    with mixed(corpus, stop="all_exhausted", rows=37) as m:
        whole = [t.column("id").to_pylist() for t in m]
    with mixed(corpus, stop="all_exhausted", rows=37) as m:
        it = iter(m)
        for _ in range(at):
            next(it)
        state = json.loads(json.dumps(m.state_dict()))
        it.close()  # type: ignore[attr-defined]
    assert any(own["used"] for own in state["sources"])  # saved in the middle of an item
    with mixed(corpus, stop="all_exhausted", rows=37) as m:
        m.load_state_dict(state)
        rest = [t.column("id").to_pylist() for t in m]
    assert rest == whole[at:]


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_resume_in_the_second_epoch_gives_the_rest_of_it(
    corpus: dict[str, list[str]], stop: str
) -> None:
    # the first epoch ended with a loader stopped midway: the state of its next epoch is that
    # epoch's, not what its last iteration had delivered
    with mixed(corpus, stop=stop, rows=37) as m:
        list(m)
        second = ids(list(m))
    with mixed(corpus, stop=stop, rows=37) as m:
        list(m)
        it = iter(m)
        head = ids([next(it) for _ in range(3)])
        state = json.loads(json.dumps(m.state_dict()))
        it.close()  # type: ignore[attr-defined]
    with mixed(corpus, stop=stop, rows=37) as m:
        m.load_state_dict(state)
        assert head + ids(list(m)) == second


@pytest.mark.parametrize("seed", range(4))
def test_a_resume_before_a_loader_is_first_drawn_loses_none_of_its_rows(
    corpus: dict[str, list[str]], seed: int
) -> None:
    # every loader's first item is taken at the epoch's start; a state saved before one of them
    # is drawn keeps it (its loader's state from before it, and no row of it used)
    def make() -> MixedRows:
        return mix(loaders(corpus), [0.95, 0.05], seed=seed, rows_per_item=2)  # type: ignore[no-any-return]

    with make() as m:
        whole = ids(list(m))
    with make() as m:
        it = iter(m)
        head = ids([next(it)])
        state = json.loads(json.dumps(m.state_dict()))
        it.close()  # type: ignore[attr-defined]
    with make() as m:
        m.load_state_dict(state)
        assert head + ids(list(m)) == whole


@pytest.mark.asyncio
async def test_async_for_gives_the_same_tables_and_resumes_alike(
    corpus: dict[str, list[str]],
) -> None:
    with mixed(corpus) as m:
        want = [t.column("id").to_pylist() for t in m]
    with mixed(corpus) as m:
        got = [t.column("id").to_pylist() async for t in m]
        assert got == want
    with mixed(corpus) as m:
        head = []
        async for t in m:
            head.append(t.column("id").to_pylist())
            if len(head) == 4:
                state = m.state_dict()
                break
    with mixed(corpus) as m:
        m.load_state_dict(state)
        rest = [t.column("id").to_pylist() async for t in m]
    assert head + rest == want


def test_packed_rows_resume_exactly_at_a_step(corpus: dict[str, list[str]]) -> None:
    def make() -> Any:
        return pack(mixed(corpus, stop="all_exhausted", rows=64), 32, batch_size=4, eos=0,
                    key="tokens")  # fmt: skip

    with make() as packed:
        whole = [b.tolist() for b in packed]
    assert len(whole) > 20
    with make() as packed:
        it = iter(packed)
        for _ in range(11):
            next(it)
        state = json.loads(json.dumps(packed.state_dict()))
        it.close()  # type: ignore[attr-defined]
    with make() as packed:
        packed.load_state_dict(state)
        assert [b.tolist() for b in packed] == whole[11:]


def test_a_second_epoch_is_another_order_and_the_same_rule(corpus: dict[str, list[str]]) -> None:
    with mixed(corpus) as m:
        first, second = ids(list(m)), ids(list(m))
    assert first != second
    drawn = Choices(WEIGHTS, 3, 1).span(0, len(second)).tolist()
    assert [0 if i < 100_000 else 1 for i in second] == drawn


# -- bad input ------------------------------------------------------------------------------------


def test_items_that_are_not_columnar_are_named() -> None:
    both = mix([Loader(list(range(10)), same, batch_size=None),
                Loader(list(range(5)), same, batch_size=None)], WEIGHTS, rows_per_item=4)  # fmt: skip
    with both, pytest.raises(TypeError, match=r"rows_per_item: loader sources\[\d\] gave a int"):
        list(both)


class Once:
    """Keys the first time it is iterated, none after."""

    def __init__(self) -> None:
        self.times = 0

    def __iter__(self) -> Any:
        self.times += 1
        return iter(range(3) if self.times == 1 else [])


def two_rows(key: int) -> pa.Table:
    return pa.table({"id": [key, key]})


@pytest.mark.parametrize("rows_per_item", [None, 2])
def test_a_loader_with_nothing_in_its_next_epoch_is_named(rows_per_item: int | None) -> None:
    """Mixed whole or by rows: the mix's own error, not a row reader's on its end marker."""
    again = Loader(Once(), two_rows, batch_size=None)
    other = Loader(list(range(10, 18)), two_rows, batch_size=None)
    by = {} if rows_per_item is None else {"rows_per_item": rows_per_item}
    both = mix([again, other], [1, 1], stop="all_exhausted", **by)
    with both, pytest.raises(ValueError, match=r"sources\[0\] gave nothing in its epoch 1"):
        list(both)


def test_loaders_of_other_columns_are_refused(corpus: dict[str, list[str]]) -> None:
    a = Loader(sources.parquet(corpus["a"], ["id"], rows_per_sample=16), batch_size=None,
               collate=None)  # fmt: skip
    b = Loader(sources.parquet(corpus["b"], ["id", "tokens"], rows_per_sample=16),
               batch_size=None, collate=None)  # fmt: skip
    both = mix({"a": a, "b": b}, [1, 1], rows_per_item=8)
    with both, pytest.raises(TypeError, match=r"needs the same columns from every loader"):
        list(both)


def test_rows_per_item_takes_loaders_only_and_a_count(corpus: dict[str, list[str]]) -> None:
    parts = [sources.parquet(p, ["id"], rows_per_sample=16) for p in corpus.values()]
    with pytest.raises(TypeError, match="rows_per_item: a mix by rows takes loaders"):
        mix(parts, WEIGHTS, rows_per_item=8)
    with pytest.raises(ValueError, match="rows_per_item"):
        mix(loaders(corpus), WEIGHTS, rows_per_item=0)


def test_a_state_of_another_mix_is_refused(corpus: dict[str, list[str]]) -> None:
    with mixed(corpus, rows=50) as m:
        state = m.state_dict()
    with mixed(corpus, rows=40) as m, pytest.raises(StateError, match="rows_per_item"):
        m.load_state_dict(state)
    state["sources"][0]["used"] = -1
    with mixed(corpus, rows=50) as m, pytest.raises(StateError, match="used"):
        m.load_state_dict(state)


def test_breaking_out_closes_the_loaders_iterations(corpus: dict[str, list[str]]) -> None:
    m = mixed(corpus)
    for _ in m:
        break
    assert ids(list(m)[:1])  # the next epoch runs
    m.close()
