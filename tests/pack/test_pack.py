"""aioloader.pack: rows equal a plain-Python packer's, boundaries, every shape of item, bad input."""

from __future__ import annotations

import asyncio
import importlib.util
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.fakes import cancel_after_first

from aioloader import Loader, Packed, StateError, pack


async def same(x: Any) -> Any:
    return x


def reference(
    docs: list[list[int]], seq_len: int, batch_size: int, eos: int | None, *, targets: bool,
    drop_last: bool,
) -> list[dict[str, list[list[int]]]]:  # fmt: skip
    """The plain-Python packer: one token at a time, one row at a time."""
    stream: list[int] = []
    first: list[bool] = []
    for doc in docs:
        tokens = list(doc) + ([] if eos is None else [eos])
        stream += tokens
        first += [i == 0 for i in range(len(tokens))]
    width = seq_len + (1 if targets else 0)
    rows = []
    j = 0
    while j * seq_len + width <= len(stream):
        start = j * seq_len
        tokens, ids, positions = [], [], []
        doc, pos = -1, 0
        for t in range(start, start + width):
            if t == start or first[t]:
                doc, pos = doc + 1, 0
            else:
                pos += 1
            tokens.append(stream[t])
            ids.append(doc)
            positions.append(pos)
        rows.append((tokens, ids, positions))
        j += 1
    out = []
    for b in range(0, len(rows), batch_size):
        chunk = rows[b : b + batch_size]
        if drop_last and len(chunk) < batch_size:
            break
        out.append({
            "tokens": [r[0] for r in chunk], "document_ids": [r[1] for r in chunk],
            "positions": [r[2] for r in chunk],
        })  # fmt: skip
    return out


def items_of(docs: list[list[int]], how: str, dtype: str) -> list[Any]:
    """The documents as a loader would yield them: one by one (arrays, tensors, dicts), in lists,
    or as pyarrow RecordBatches of a few rows (slices of one) or Tables of a few such chunks."""
    arrays = [np.asarray(d, dtype=dtype) for d in docs]
    if how == "arrays":
        return arrays
    if how == "tensors":
        return [torch.from_numpy(a) for a in arrays]
    if how == "dicts":
        return [{"tokens": a, "id": i} for i, a in enumerate(arrays)]
    if how == "lists":
        return [arrays[i : i + 3] for i in range(0, len(arrays), 3)]
    kind = pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))
    whole = pa.record_batch({"tokens": pa.array(docs, kind), "n": list(range(len(docs)))})
    pieces = [whole.slice(i, 4) for i in range(0, len(docs), 4)]  # slices: offsets not from 0
    if how == "record_batches":
        return pieces
    return [pa.Table.from_batches(pieces[i : i + 3]) for i in range(0, len(pieces), 3)]  # chunked


def plain(batch: Any) -> dict[str, list[list[int]]]:
    if isinstance(batch, dict):
        return {k: v.tolist() for k, v in batch.items()}
    return {"tokens": batch.tolist()}


documents = st.lists(st.lists(st.integers(0, 500), max_size=30), max_size=40)


def run_lengths(row: list[int]) -> list[int]:
    """The lengths of the runs of equal values in `row`, in order."""
    cuts = [i for i in range(1, len(row)) if row[i] != row[i - 1]]
    return [b - a for a, b in zip([0, *cuts], [*cuts, len(row)], strict=True)]


@settings(max_examples=30, deadline=None)
@given(
    docs=documents, seq_len=st.integers(1, 12), batch_size=st.integers(1, 4),
    eos=st.sampled_from([None, 999]), targets=st.booleans(), boundaries=st.booleans(),
)  # fmt: skip
def test_varlen_gives_the_rows_segments_flattened_as_flash_attention_takes_them(
    docs: list[list[int]], seq_len: int, batch_size: int, eos: int | None, targets: bool,
    boundaries: bool,
) -> None:  # fmt: skip
    loader = Loader(items_of(docs, "arrays", "int32"), same, batch_size=None, collate=None)
    kwargs: dict[str, Any] = {"batch_size": batch_size, "eos": eos, "targets": targets}
    with pack(loader, seq_len, boundaries=True, **kwargs) as marked:
        segmented = list(marked)
    loader = Loader(items_of(docs, "arrays", "int32"), same, batch_size=None, collate=None)
    with pack(loader, seq_len, boundaries=boundaries, varlen=True, **kwargs) as packed:
        got = list(packed)
    assert len(got) == len(segmented)
    for batch, want in zip(got, segmented, strict=True):
        assert torch.equal(batch["tokens"], want["tokens"])
        assert ("document_ids" in batch) == boundaries
        # the inputs' segments (with targets, a row's last token is only a target), row by row
        lengths = [
            n for row in want["document_ids"][:, :seq_len].tolist() for n in run_lengths(row)
        ]
        cu_seqlens = batch["cu_seqlens"]
        assert cu_seqlens.dtype == torch.int32
        assert cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
        assert cu_seqlens[-1] == len(want["tokens"]) * seq_len
        assert batch["max_seqlen"] == max(lengths)


@settings(max_examples=40, deadline=None)
@given(
    docs=documents,
    seq_len=st.integers(1, 12),
    batch_size=st.integers(1, 4),
    eos=st.sampled_from([None, 0, 999]),
    targets=st.booleans(),
    boundaries=st.booleans(),
    drop_last=st.booleans(),
    how=st.sampled_from(["arrays", "tensors", "dicts", "lists", "record_batches", "tables"]),
    dtype=st.sampled_from(["int32", "int64", "uint16"]),
)
def test_batches_equal_the_plain_python_packer(
    docs: list[list[int]], seq_len: int, batch_size: int, eos: int | None, targets: bool,
    boundaries: bool, drop_last: bool, how: str, dtype: str,
) -> None:  # fmt: skip
    key = "tokens" if how in ("dicts", "record_batches", "tables") else None
    loader = Loader(items_of(docs, how, dtype), same, batch_size=None, collate=None)
    with pack(loader, seq_len, batch_size=batch_size, eos=eos, key=key, targets=targets,
              boundaries=boundaries, drop_last=drop_last) as packed:  # fmt: skip
        got = [plain(b) for b in packed]
        again = [plain(b) for b in packed]  # the next epoch: the same documents, nothing carried
    want = reference(docs, seq_len, batch_size, eos, targets=targets, drop_last=drop_last)
    if not boundaries:
        want = [{"tokens": b["tokens"]} for b in want]
    assert got == want
    assert again == want


@pytest.mark.parametrize("how", ["arrays", "record_batches", "tables"])
@pytest.mark.parametrize("eos", [None, 0])
def test_a_batch_written_over_changes_no_other_batch_nor_the_documents(
    how: str, eos: int | None
) -> None:
    # a batch within one run of tokens the packer made is a view of that run: writing over it
    # (each batch in turn, and the state saved between) must leave the later batches, the
    # state's held tokens and the loader's own documents as they were
    docs = [list(range(i * 50, i * 50 + n)) for i, n in enumerate([300, 7, 90, 41, 260, 3, 120])]
    items = items_of(docs, how, "int64")
    before = [np.array(x, copy=True) for x in items] if how == "arrays" else None
    key = None if how == "arrays" else "tokens"

    def make() -> Packed:
        loader = Loader(items, same, batch_size=None, collate=None)
        return pack(loader, 16, batch_size=2, eos=eos, key=key)

    with make() as packed:
        want = [b.tolist() for b in packed]
    got, states = [], []
    with make() as packed:
        for batch in packed:
            got.append(batch.tolist())
            batch.fill_(-7)
            states.append(packed.state_dict())
    assert got == want
    assert all(-7 not in s["tokens"] for s in states)
    if before is not None:
        assert all(np.array_equal(a, b) for a, b in zip(items, before, strict=True))
    with make() as resumed:
        resumed.load_state_dict(states[4])
        assert [b.tolist() for b in resumed] == want[5:]


def test_rows_are_tensors_of_the_dtype_asked() -> None:
    docs = [np.arange(10, dtype=np.int32), np.arange(3, dtype=np.int16)]  # 15 tokens: 3 rows
    loader = Loader(docs, same, batch_size=None, collate=None)
    with pack(loader, 4, batch_size=2, eos=3, dtype=torch.int32, targets=True) as packed:
        batches = list(packed)
    assert [tuple(b.shape) for b in batches] == [(2, 5), (1, 5)]
    assert all(b.dtype == torch.int32 for b in batches)
    inputs, targets = batches[0][:, :-1], batches[0][:, 1:]
    assert inputs.flatten().tolist()[1:] == targets.flatten().tolist()[:-1]


def test_boundaries_mark_every_document_and_every_row_start() -> None:
    docs = [np.array([1, 2, 3, 4, 5, 6]), np.array([7]), np.array([8, 9])]
    loader = Loader(docs, same, batch_size=None, collate=None)
    with pack(loader, 4, batch_size=3, eos=0, boundaries=True) as packed:
        (batch,) = list(packed)
    # the stream: 1 2 3 4 | 5 6 0 7 | 0 8 9 0
    assert batch["tokens"].tolist() == [[1, 2, 3, 4], [5, 6, 0, 7], [0, 8, 9, 0]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 1, 1, 1]]
    assert batch["positions"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 0, 1, 2]]
    assert all(v.dtype == torch.int64 for v in batch.values())


def test_a_document_longer_than_many_batches_is_cut_without_loss() -> None:
    long = np.arange(10_000, dtype=np.int64)
    loader = Loader([long, np.array([5])], same, batch_size=None, collate=None)
    with pack(loader, 100, batch_size=3, eos=-1) as packed:
        flat = torch.cat([b.flatten() for b in packed]).tolist()
    assert flat == [*range(10_000), -1, 5, -1][: len(flat)]
    assert len(flat) == 10_000 // 100 * 100  # 10,003 tokens: 100 rows of 100


@pytest.mark.asyncio
async def test_async_for_gives_the_same_batches() -> None:
    docs = [np.arange(n) for n in range(1, 40)]

    def make() -> Packed:
        return pack(Loader(docs, same, batch_size=None, collate=None), 16, batch_size=3, eos=99)

    with make() as packed:
        want = [b.tolist() for b in packed]
    async with make() as packed:
        got = [b.tolist() async for b in packed]
    assert got == want


def test_a_batch_the_consumer_drops_is_freed_before_it_asks_for_the_next() -> None:
    docs = [np.arange(n) for n in range(1, 40)]
    with pack(
        Loader(docs, same, batch_size=None, collate=None), 16, batch_size=3, eos=99
    ) as packed:
        batches = iter(packed)
        for _ in range(3):
            freed = weakref.ref(next(batches))
            assert freed() is None  # not held by the packer while the consumer has it


@pytest.mark.asyncio
async def test_a_batch_dropped_in_async_for_is_freed_before_the_next_is_asked_for() -> None:
    docs = [np.arange(n) for n in range(1, 40)]
    async with pack(
        Loader(docs, same, batch_size=None, collate=None), 16, batch_size=3, eos=99
    ) as packed:
        batches = aiter(packed)
        for _ in range(3):
            freed = weakref.ref(await anext(batches))
            assert freed() is None
        await batches.aclose()  # type: ignore[attr-defined]


# -- early break and cleanup ---------------------------------------------------------------------


@pytest.mark.in_process
def test_breaking_out_closes_the_loaders_epoch() -> None:
    docs = [np.arange(50) for _ in range(200)]
    loader = Loader(docs, same, batch_size=None, collate=None, prefetch=1, concurrency=2)
    with pack(loader, 32, batch_size=2, eos=0) as packed:
        for i, _ in enumerate(packed):
            if i == 3:
                break
        assert not loader._epochs.live  # the loader's epoch ended with the packer's
        assert len(list(packed)) == (200 * 51) // 64  # and the next epoch runs whole


@pytest.mark.asyncio
async def test_cancelling_the_consumer_leaves_nothing_running(
    caller_tasks_left: Callable[..., Any],
) -> None:
    before = asyncio.all_tasks()
    docs = [np.arange(50) for _ in range(10_000)]
    loader = Loader(docs, same, batch_size=None, collate=None, use_caller_loop=True)
    packed = pack(loader, 32, batch_size=2, eos=0)
    await cancel_after_first(packed)
    await packed.aclose()
    assert await caller_tasks_left(before) == set()


# -- bad input -----------------------------------------------------------------------------------


def a_loader(items: list[Any] | None = None) -> Loader[Any]:
    return Loader(items or [np.arange(3)], same, batch_size=None, collate=None)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seq_len": 0}, ValueError, "seq_len must be >= 1"),
        ({"seq_len": 2.5}, TypeError, "seq_len must be an int"),
        ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
        ({"eos": "</s>"}, TypeError, "eos: expected an int token id or None"),
        ({"eos": 1.0}, TypeError, "eos: expected an int"),
        ({"eos": True}, TypeError, "eos: expected an int"),
        ({"eos": 2**40, "dtype": torch.int32}, ValueError, "eos: .* does not fit dtype"),
        ({"dtype": torch.float32}, TypeError, "dtype: expected an integer torch dtype"),
        ({"key": 3}, TypeError, "key: expected a field name"),
        ({"targets": 1}, TypeError, "targets: expected True or False"),
        ({"boundaries": "yes"}, TypeError, "boundaries: expected True or False"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    args = {"seq_len": 8, "batch_size": 2, "eos": 0, **kwargs}
    with a_loader() as loader, pytest.raises(error, match=match):
        pack(loader, args.pop("seq_len"), **args)


def test_a_loader_is_required() -> None:
    with pytest.raises(TypeError, match="loader: expected an aioloader Loader"):
        pack([np.arange(3)], 8, batch_size=2, eos=0)


@pytest.mark.parametrize(
    ("items", "key", "error", "match"),
    [
        ([np.arange(3), np.zeros((2, 4), np.int64)], None, ValueError,
         r"item 1 of this pass over epoch 0: expected a 1-D array of token ids, got shape \(2, 4\)"),
        ([np.arange(3.0)], None, TypeError, "item 0 .*: expected integer token ids, got dtype float64"),
        ([torch.ones(3, dtype=torch.bool)], None, TypeError, "expected integer token ids, got dtype bool"),
        (["some text"], None, TypeError, "item 0 .*: expected a document as a 1-D integer numpy"),
        ([{"text": np.arange(3)}], "tokens", KeyError, "key: item 0 .* has no field 'tokens'"),
        ([{"tokens": np.arange(3)}], None, TypeError, "key: item 0 .* is a dict"),
        ([{"tokens": np.arange(4.0)}], "tokens", TypeError, "sample key 'tokens': expected integer"),
        ([[np.arange(3), np.ones((1, 1), np.int64)]], None, ValueError, "item 0 .*, its element 1"),
        ([pa.record_batch({"tokens": pa.array([[1.5]])})], "tokens", TypeError,
         "key: column 'tokens' of item 0 .* holds double"),
        ([pa.record_batch({"tokens": pa.array([1, 2])})], "tokens", TypeError,
         "key: column 'tokens' .* is int64, not a list"),
        ([pa.record_batch({"tokens": pa.array([[1], None])})], "tokens", ValueError,
         "key: column 'tokens' .* has 1 null rows"),
        ([pa.record_batch({"ids": pa.array([[1]])})], "tokens", KeyError, "has no column 'tokens'"),
        ([pa.record_batch({"tokens": pa.array([[1]])})], None, TypeError, "key: item 0 .* RecordBatch"),
    ],
)  # fmt: skip
def test_bad_documents_are_named_by_item_and_sample_key(
    items: list[Any], key: str | None, error: type[Exception], match: str
) -> None:
    with pack(a_loader(items), 2, batch_size=1, eos=0, key=key) as packed, pytest.raises(
        error, match=match
    ):  # fmt: skip
        list(packed)


def test_a_state_that_does_not_fit_is_refused() -> None:
    with pack(a_loader(), 2, batch_size=1, eos=0) as packed:
        state = packed.state_dict()
    with pack(a_loader(), 3, batch_size=1, eos=0) as other, pytest.raises(
        StateError, match="config field 'seq_len' was 2, is 3"
    ):  # fmt: skip
        other.load_state_dict(state)
    with pack(a_loader(), 2, batch_size=1, eos=0) as packed:
        for name, bad in (("tokens", ["a"]), ("starts", [5]), ("epoch", -1), ("loader", None)):
            with pytest.raises(StateError) as caught:
                packed.load_state_dict({**state, name: bad})
            assert caught.value.field == name


def test_a_record_batch_is_read_without_importing_pandas(tmp_path: Path) -> None:
    # pyarrow's `to_numpy()` imports pandas where it is installed: seconds before a first batch
    if importlib.util.find_spec("pandas") is None:
        pytest.skip("pandas is not installed here: nothing could import it")
    path = tmp_path / "batch.arrow"
    batch = pa.record_batch({"tokens": pa.array([[1, 2], [3]])})
    with pa.ipc.new_file(path, batch.schema) as writer:  # read back without pa.array's checks
        writer.write_batch(batch)
    code = (
        "import sys, numpy as np, pyarrow as pa\n"
        "from aioloader._pack.documents import run_of\n"
        f"batch = pa.ipc.open_file({str(path)!r}).get_batch(0)\n"
        "before = 'pandas' in sys.modules\n"
        "run = run_of(batch, key='tokens', eos=0, dtype=np.dtype('int64'), where='x')\n"
        "assert run.tokens.tolist() == [1, 2, 0, 3, 0]\n"
        "print(before, 'pandas' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False False"


@pytest.mark.in_process
def test_a_bad_document_mid_epoch_ends_the_epoch_and_the_next_runs_again() -> None:
    docs = [np.arange(40) for _ in range(30)]
    docs[17] = np.arange(40.0)  # not token ids
    loader = Loader(docs, same, batch_size=None, collate=None, prefetch=1)
    with pack(loader, 16, batch_size=2, eos=0) as packed:
        for _ in range(2):
            got = []
            with pytest.raises(TypeError, match="item 17 of this pass over epoch"):
                got.extend(packed)
            assert len(got) == 17 * 41 // 32  # the batches before it came out whole
            assert not loader._epochs.live
