"""aioloader.mix(loaders, weights, rows_per_item=N) (and loaders mixed whole) resumed on another
world size: old ranks stop at different positions, partly through an item and on either side of a
loader's epoch end; the new ranks load every old rank's state and go on. Each row of each loader
epoch comes once, before the save or after the restore, but for the padding of the shares; each
new rank's stream is the same on every restore. What cannot be resumed so is refused, named.

Ranks are simulated in one process by rank / world_size, over real Parquet files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aioloader import Loader, MixedLoaders, StateError, mix, sources
from aioloader._mix.choices import Choices

SIZES = {"a": 701, "b": 198}  # rows (documents) of each source
FIRST = {"a": 0, "b": 100_000}  # the first id of each source: ids tell the sources apart


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each source as two Parquet files of an "id" column, in row groups of 23 rows."""
    folder = tmp_path_factory.mktemp("elastic")
    out: dict[str, list[str]] = {}
    for name, n in SIZES.items():
        out[name] = []
        for part, rows in enumerate(np.array_split(FIRST[name] + np.arange(n), 2)):
            path = folder / f"{name}-{part}.parquet"
            pq.write_table(pa.table({"id": rows}), path, row_group_size=23)
            out[name].append(str(path))
    return out


def same_rows(batch: Any) -> Any:
    return batch


def all_but_the_last_row(batch: Any) -> Any:
    return batch.slice(0, batch.num_rows - 1)


def mixed(
    corpus: dict[str, list[str]], stop: str, rank: int, world_size: int, *,
    rows_per_item: int | None = 16, decode: Any = None, weights: Any = (0.7, 0.3),
) -> Any:  # fmt: skip
    """A 0.7 / 0.3 mix (or `weights`) of a loader per source of RecordBatches of 20 rows, on
    `rank`."""
    loaders = [
        Loader(sources.parquet(corpus[name], ["id"], rows_per_sample=20, shuffle_buffer=30,
                               seed=i), batch_size=None, collate=None, decode=decode,
               rank=rank, world_size=world_size)
        for i, name in enumerate(SIZES)
    ]  # fmt: skip
    return mix(loaders, list(weights), seed=2, stop=stop, rows_per_item=rows_per_item)


def ids(items: list[Any]) -> list[int]:
    return [i for item in items for i in item.column("id").to_pylist()]


def run_world(
    corpus: dict[str, list[str]], stop: str, steps: list[int | None],
    states: list[dict[str, Any]] | None, ranks: list[int] | None = None, **kwargs: Any,
) -> tuple[list[list[int]], list[dict[str, Any]]]:  # fmt: skip
    """Each rank of a world of `len(steps)` (or those of `ranks`): after loading `states` (every
    old rank's), `steps[r]` items (None: to the epoch's end); the ids each rank took and its state
    (through JSON)."""
    taken, saved = [], []
    for rank in range(len(steps)) if ranks is None else ranks:
        n = steps[rank]
        with mixed(corpus, stop, rank, len(steps), **kwargs) as m:
            if states is not None:
                m.load_state_dict(states)
            it = iter(m)
            n = 10**9 if n is None else n
            taken.append(ids([item for _, item in zip(range(n), it, strict=False)]))
            saved.append(json.loads(json.dumps(m.state_dict())))
            it.close()
    return taken, saved


def by_epoch(worlds: list[list[list[int]]], name: str, epochs: int = 4) -> list[list[list[int]]]:
    """The rows of source `name` each world delivered, per epoch of its loader. Each rank takes a
    loader's epochs one after the other, an equal share of each: ceil(rows left / ranks) rows,
    where the rows left of an epoch are those no earlier world delivered."""
    seen: list[set[int]] = [set() for _ in range(epochs)]
    out = []
    for taken in worlds:
        shares = [-(-(SIZES[name] - len(seen[k])) // len(taken)) for k in range(epochs)]
        parts: list[list[int]] = [[] for _ in range(epochs)]
        for rank in taken:
            rows = [i for i in rank if FIRST[name] <= i < FIRST[name] + SIZES[name]]
            for k, share in enumerate(shares):
                parts[k] += rows[:share]
                rows = rows[share:]
            assert not rows, "more epochs than counted"
        for k in range(epochs):
            seen[k] |= set(parts[k])
        out.append(parts)
    return out


def assert_each_row_once(worlds: list[list[list[int]]], whole_epochs: dict[str, int]) -> None:
    """No world delivers a row of a loader epoch an earlier world delivered; within an epoch, a
    row comes twice only as padding (fewer than the ranks of the worlds); the first
    `whole_epochs[name]` epochs of each source come whole."""
    ranks = sum(len(taken) for taken in worlds)
    for name in SIZES:
        parts = by_epoch(worlds, name)
        for k in range(len(parts[0])):
            for w in range(1, len(worlds)):
                earlier = {i for part in parts[:w] for i in part[k]}
                assert not earlier & set(parts[w][k]), f"{name}: epoch {k} delivered again"
            rows = [i for part in parts for i in part[k]]
            assert len(rows) - len(set(rows)) < ranks, f"{name}: epoch {k} repeats rows"
            if k < whole_epochs.get(name, 0):
                assert len(set(rows)) == SIZES[name], f"{name}: epoch {k} lost rows"


def loader_epochs(states: list[dict[str, Any]]) -> set[tuple[int, ...]]:
    return {tuple(own["epoch"] for own in s["sources"]) for s in states}


@pytest.mark.parametrize(
    ("stop", "old_steps", "new_steps", "straddles"),
    [
        ("all_exhausted", [0, 5, 7, 9], [None] * 3, False),  # rank 0: nothing drawn yet
        ("all_exhausted", [3, 7, 12, 14], [None] * 3, True),  # ranks 2, 3 past b's epoch end
        ("cycle", [3, 7, 12, 14], [20] * 5, True),
    ],
)
def test_elastic_resume_delivers_each_row_of_each_loader_epoch_once(
    corpus: dict[str, list[str]], stop: str, old_steps: list[int], new_steps: list[int | None],
    straddles: bool,
) -> None:  # fmt: skip
    before, states = run_world(corpus, stop, list(old_steps), None)
    assert any(own["used"] for s in states for own in s["sources"])  # items partly used
    assert (len(loader_epochs(states)) > 1) == straddles
    after, _ = run_world(corpus, stop, new_steps, states)
    assert len({len(taken) for taken in after}) == 1, "every new rank as many rows"
    assert_each_row_once([before, after], {"a": 1, "b": 1})  # each ran out: its first epoch whole
    again, _ = run_world(corpus, stop, new_steps, states, ranks=[1])
    assert again[0] == after[1]  # a new rank's stream follows from the states alone


def test_elastic_resume_twice_goes_on_with_the_epochs_the_first_one_left(
    corpus: dict[str, list[str]],
) -> None:
    """4 ranks, on either side of b's epoch end; 3 ranks, which resume b's first epoch and hold
    what the old ranks had delivered of its second; 2 ranks, to the end of the mix's epoch."""
    four, states = run_world(corpus, "all_exhausted", [3, 7, 12, 14], None)
    three, states = run_world(corpus, "all_exhausted", [5, 1, 9], states)
    assert any(own.get("later") for s in states for own in s["sources"])
    two, _ = run_world(corpus, "all_exhausted", [None, None], states)
    assert_each_row_once([four, three, two], {"a": 1, "b": 1})


def test_a_rank_resumed_elastically_resumes_again_on_its_world_size(
    corpus: dict[str, list[str]],
) -> None:
    # what the old ranks delivered of b's next epoch is held in the state until b starts it
    _, states = run_world(corpus, "all_exhausted", [3, 7, 12, 14], None)
    (whole,), _ = run_world(corpus, "all_exhausted", [None] * 3, states, ranks=[1])
    (head,), saved = run_world(corpus, "all_exhausted", [1] * 3, states, ranks=[1])
    assert saved[0]["sources"][1]["later"]
    with mixed(corpus, "all_exhausted", 1, 3) as m:
        m.load_state_dict(saved[0])
        assert head + ids(list(m)) == whole


@pytest.mark.asyncio
async def test_async_for_gives_the_same_rows_after_an_elastic_resume(
    corpus: dict[str, list[str]],
) -> None:
    _, states = run_world(corpus, "all_exhausted", [3, 7, 12, 14], None)
    (want,), _ = run_world(corpus, "all_exhausted", [None] * 3, states, ranks=[2])
    with mixed(corpus, "all_exhausted", 2, 3) as m:
        m.load_state_dict(states)
        assert ids([item async for item in m]) == want


def test_fewer_and_more_ranks_and_one_rank(corpus: dict[str, list[str]]) -> None:
    one, states = run_world(corpus, "all_exhausted", [9], None)
    five, states = run_world(corpus, "all_exhausted", [2, 1, 4, 3, 2], states)
    rest, _ = run_world(corpus, "all_exhausted", [None], states)
    assert_each_row_once([one, five, rest], {"a": 1, "b": 1})


def test_loaders_mixed_whole_resume_on_another_world_size(corpus: dict[str, list[str]]) -> None:
    def run(steps: list[int | None], states: Any) -> tuple[list[list[int]], list[Any]]:
        return run_world(corpus, "cycle", steps, states, rows_per_item=None)

    before, states = run([2, 5, 9, 11], None)
    assert len(loader_epochs(states)) > 1  # ranks on either side of b's epoch end
    middle, states = run([3, 1, 4], states)
    after, _ = run([8, 8], states)
    assert_each_row_once([before, middle, after], {"b": 1})


@pytest.mark.parametrize("rows_per_item", [16, None])
def test_other_weights_draw_from_the_furthest_old_ranks_position(
    corpus: dict[str, list[str]], rows_per_item: int | None
) -> None:
    """Loaders mixed by rows or whole, resumed on another world size under other weights: each
    row once; the new weights draw from the furthest old rank's position on; states say so."""
    before, states = run_world(corpus, "all_exhausted", [3, 7, 12, 14], None,
                               rows_per_item=rows_per_item)  # fmt: skip
    after, saved = run_world(corpus, "all_exhausted", [None] * 3, states,
                             rows_per_item=rows_per_item, weights=[0.6, 0.4])  # fmt: skip
    assert_each_row_once([before, after], {"a": 1, "b": 1})
    furthest = max(s["position"] for s in states)
    assert saved[0]["weights_changed"] == [{"epoch": 0, "position": furthest, "was": [0.7, 0.3]}]
    if rows_per_item:  # (a row a position)
        drawn = Choices([0.6, 0.4], 2, 0).span(furthest, 40).tolist()
        assert [int(i >= FIRST["b"]) for i in after[1][:40]] == drawn


def test_the_state_says_its_rank_and_world_size(corpus: dict[str, list[str]]) -> None:
    _, states = run_world(corpus, "cycle", [1, 1], None)
    assert [(s["rank"], s["world_size"]) for s in states] == [(0, 2), (1, 2)]
    with mixed(corpus, "cycle", 1, 2) as m:
        m.load_state_dict(states)  # its own, out of every rank's
        assert m.state_dict() == states[1]


def test_a_process_decode_after_the_restore(corpus: dict[str, list[str]]) -> None:
    before, states = run_world(corpus, "all_exhausted", [4, 6], None)
    after, _ = run_world(corpus, "all_exhausted", [None] * 3, states, decode=same_rows)
    assert_each_row_once([before, after], {"a": 1, "b": 1})


# -- what is refused ----------------------------------------------------------------------------------


def test_one_old_ranks_state_on_another_world_size_is_refused(
    corpus: dict[str, list[str]],
) -> None:
    _, states = run_world(corpus, "cycle", [3, 4], None)
    with (
        mixed(corpus, "cycle", 0, 3) as m,
        pytest.raises(StateError, match=r"each of the 2 ranks that saved them, got ranks \[0\]"),
    ):
        m.load_state_dict(states[0])
    with (
        mixed(corpus, "cycle", 0, 2) as m,
        pytest.raises(StateError, match=r"0 of them are this rank's \(0 of 2\)") as e,
    ):
        m.load_state_dict(states[1:])
    assert e.value.field == "states"


@pytest.mark.parametrize("rows_per_item", [16, None])
def test_a_mix_ending_at_the_first_exhausted_refuses_another_world_size(
    corpus: dict[str, list[str]], rows_per_item: int | None
) -> None:
    # where its epoch ends moves with the world size (the first loader to run out of a rank's
    # share), so the epoch's rest as it would have gone on cannot be told: refused, not guessed
    # (before: the new ranks ended where one loader ran out of its new share, and rows of the
    # other that the old ranks would still have delivered were never delivered)
    _, states = run_world(
        corpus, "first_exhausted", [2, 9, 4, 6], None, rows_per_item=rows_per_item
    )
    with (
        mixed(corpus, "first_exhausted", 0, 3, rows_per_item=rows_per_item) as m,
        pytest.raises(StateError, match=r"saved on world size 4 cannot resume on 3") as e,
    ):
        m.load_state_dict(states)
    assert e.value.field == "world_size"
    again, _ = run_world(corpus, "first_exhausted", [None] * 4, states, rows_per_item=rows_per_item)
    assert all(again)  # on the saved world size it goes on


def test_states_from_two_epochs_of_the_mix_are_refused(corpus: dict[str, list[str]]) -> None:
    # rank 1 ran to the epoch's end (every loader run out): its state is of the next epoch
    _, states = run_world(corpus, "all_exhausted", [2, None], None)
    assert [s["epoch"] for s in states] == [0, 1]
    with (
        mixed(corpus, "all_exhausted", 0, 3) as m,
        pytest.raises(StateError, match=r"different epochs of the mix \[0, 1\]") as e,
    ):
        m.load_state_dict(states)
    assert e.value.field == "epoch"


def test_items_that_are_not_one_row_per_key_are_refused(corpus: dict[str, list[str]]) -> None:
    # a decode that drops a row of each item: the rows used cannot be told apart by their keys
    _, states = run_world(corpus, "cycle", [3, 4], None, decode=all_but_the_last_row)
    with (
        mixed(corpus, "cycle", 0, 3, decode=all_but_the_last_row) as m,
        pytest.raises(StateError, match=r"partly used item has 19 rows and 20 keys") as e,
    ):
        m.load_state_dict(states)
    assert e.value.field == "world_size"
    with mixed(corpus, "cycle", 1, 2, decode=all_but_the_last_row) as m:
        m.load_state_dict(states)  # on the saved world size it resumes


def test_a_partly_used_item_without_its_group_is_refused(corpus: dict[str, list[str]]) -> None:
    _, states = run_world(corpus, "cycle", [3, 4], None)
    own = next(own for own in states[0]["sources"] if own["used"])
    del own["group"]  # (as a state saved before states said it)
    with (
        mixed(corpus, "cycle", 0, 3) as m,
        pytest.raises(StateError, match="does not say the item's group") as e,
    ):
        m.load_state_dict(states)
    assert e.value.field == "group"


def test_a_mix_of_loaders_on_other_ranks_resumes_from_its_own_state_only(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": list(range(40))}), path, row_group_size=8)

    def make(rank: int, world: int) -> MixedLoaders:
        here = Loader(sources.parquet([str(path)]), batch_size=4, collate=list, rank=rank,
                      world_size=world)  # fmt: skip
        whole = Loader(sources.parquet([str(path)]), batch_size=4, collate=list)  # every rank's
        return mix([here, whole], [1, 1], seed=1)  # type: ignore[no-any-return]

    states = []
    for rank in range(2):
        with make(rank, 2) as m:
            it = iter(m)
            next(it)
            states.append(m.state_dict())
            it.close()  # type: ignore[attr-defined]
    assert "rank" not in states[0]  # the mix has no one place
    with make(0, 3) as m, pytest.raises(StateError, match="on different ranks or world") as e:
        m.load_state_dict(states)
    assert e.value.field == "states"
