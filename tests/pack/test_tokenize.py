"""aioloader.tokenize: text in Parquet tokenized in the loader's threads and packed, giving the rows
of the same documents tokenized beforehand; exact resume; a plain callable tokenizer; bad input."""

from __future__ import annotations

import importlib.util
import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aioloader import Loader, Packed, Tokenize, pack, sources, tokenize

EOS, WORDS = 0, 500


async def same(x: Any) -> Any:
    return x


def words(ids: np.ndarray) -> str:
    """A document's text: its token ids as words "w<id>" (a word-level vocabulary maps them back)."""
    return " ".join(f"w{i}" for i in ids.tolist())


def by_words(texts: list[str]) -> list[list[int]]:
    """A plain callable tokenizer: "w12 w7" -> [12, 7]."""
    return [[int(word[1:]) for word in text.split()] for text in texts]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two Parquet files, row groups of 19 rows: `text` (the documents, empty ones too) and
    `tokens` (list<int32>: the same documents tokenized beforehand) and an `id`."""
    folder = tmp_path_factory.mktemp("text")
    rng = np.random.default_rng(33)
    paths = []
    for part, rows in enumerate((130, 77)):
        docs = [rng.integers(1, WORDS, k, dtype=np.int32) for k in rng.integers(0, 90, rows)]
        table = pa.table({
            "id": pa.array(np.arange(rows) + 1000 * part),
            "text": pa.array([words(d) for d in docs]),
            "tokens": pa.array(docs, pa.list_(pa.int32())),
        })  # fmt: skip
        path = folder / f"part-{part}.parquet"
        pq.write_table(table, path, row_group_size=19)
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def word_level() -> Any:
    """A real `tokenizers.Tokenizer` made here (no download): whitespace words, "w<i>" -> i."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers is not installed")
    vocab = {"[UNK]": WORDS, **{f"w{i}": i for i in range(1, WORDS)}, "[BOS]": WORDS + 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="[BOS] $A", special_tokens=[("[BOS]", WORDS + 1)]
    )
    return tok


def packer(
    paths: list[str], column: str, rows_per_sample: int | None, decode: Any = None, **kwargs: Any
) -> Callable[[], Packed]:
    """A maker of packers over `column` of the files (shuffled, seed 3), packing field "tokens"."""

    def make() -> Packed:
        rows = sources.parquet(paths, [column], rows_per_sample=rows_per_sample, seed=3)
        loader = Loader(rows, batch_size=None, collate=None, decode=decode, **kwargs)
        return pack(loader, 48, batch_size=3, eos=EOS, key="tokens", targets=True)

    return make


def run(
    make: Callable[[], Packed], state: Any = None, n: int | None = None
) -> tuple[list[Any], Any]:
    """Up to `n` batches (None: the epoch) from a fresh packer after loading `state`, as lists;
    and its state then, through JSON."""
    with make() as packed:
        if state is not None:
            packed.load_state_dict(state)
        got: list[Any] = []
        for batch in packed:
            got.append(batch.tolist())
            if len(got) == n:
                break
        return got, json.loads(json.dumps(packed.state_dict()))


# -- the same rows as tokens tokenized beforehand ------------------------------------------------


@pytest.mark.parametrize("rows_per_sample", [None, 16])
def test_a_real_tokenizer_in_threads_packs_the_rows_of_the_pretokenized_corpus(
    corpus: list[str], word_level: Any, rows_per_sample: int | None
) -> None:
    upfront, _ = run(packer(corpus, "tokens", rows_per_sample))
    decode = tokenize(word_level, add_special_tokens=False)
    got, _ = run(packer(corpus, "text", rows_per_sample, decode, executor="thread", workers=3))
    assert len(upfront) > 20
    assert got == upfront


def test_special_tokens_are_added_by_default_and_left_out_when_asked(word_level: Any) -> None:
    assert tokenize(word_level)("w3 w4").tolist() == [WORDS + 1, 3, 4]
    assert tokenize(word_level, add_special_tokens=False)("w3 w4").tolist() == [3, 4]
    assert tokenize(word_level)("w3 nope").tolist() == [WORDS + 1, 3, WORDS]  # unknown word


@pytest.mark.parametrize("rows_per_sample", [None, 16])
def test_a_plain_callable_tokenizer_packs_the_same_rows(
    corpus: list[str], rows_per_sample: int | None
) -> None:
    upfront, _ = run(packer(corpus, "tokens", rows_per_sample))
    got, _ = run(packer(corpus, "text", rows_per_sample, tokenize(by_words)))
    assert got == upfront


def test_exact_resume_at_a_step_gives_the_rest_of_the_uninterrupted_run(corpus: list[str]) -> None:
    make = packer(corpus, "text", 16, tokenize(by_words))
    whole, _ = run(make)
    for step in (1, 7, len(whole) - 2):
        head, state = run(make, None, step)
        assert state["tokens"]  # the packer holds tokens of a document cut by the last row
        rest, _ = run(make, state)
        assert head + rest == whole


def test_the_columnar_path_gives_a_record_batch_with_a_list_of_int32_column() -> None:
    rows = pa.record_batch({"id": [7, 8, 9], "text": ["w1 w2", "", "w30"]})
    out = tokenize(by_words)(rows)
    assert isinstance(out, pa.RecordBatch)
    assert out.column_names == ["id", "text", "tokens"]
    assert out.column("tokens").type == pa.list_(pa.int32())
    assert out.column("tokens").to_pylist() == [[1, 2], [], [30]]


def test_a_table_of_chunks_and_an_out_column_already_there() -> None:
    chunk = pa.record_batch({"tokens": [[5]], "text": ["w4 w4 w1"]})
    table = pa.Table.from_batches([chunk, chunk.slice(0, 0), chunk])
    out = tokenize(by_words)(table)
    assert isinstance(out, pa.Table)
    assert out.column_names == ["tokens", "text"]  # replaced, in its place
    assert out.column("tokens").to_pylist() == [[4, 4, 1], [4, 4, 1]]


def test_a_dict_gets_its_tokens_and_a_str_becomes_them() -> None:
    row = {"text": "w9 w8", "id": 4}
    out = tokenize(by_words, key="text", out="ids")(row)
    assert out["id"] == 4
    assert out["text"] == "w9 w8"
    assert out["ids"].dtype == np.int32
    assert out["ids"].tolist() == [9, 8]
    assert "ids" not in row  # the sample itself is left as it was
    assert tokenize(by_words)("w2").tolist() == [2]


def test_a_callable_may_answer_numpy_arrays() -> None:
    def arrays(texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(ids, dtype=np.int64) for ids in by_words(texts)]

    rows = pa.record_batch({"text": ["w1 w2", "", "w3"]})
    assert tokenize(arrays)(rows).column("tokens").to_pylist() == [[1, 2], [], [3]]


# -- threads ---------------------------------------------------------------------------------------


@pytest.mark.in_process
def test_by_default_it_tokenizes_in_threads_in_parallel_off_the_consumers_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="aioloader")
    both = threading.Barrier(2, timeout=30)  # passed only by two tokenizer calls at once
    seen: set[str] = set()

    def together(texts: list[str]) -> list[list[int]]:
        seen.add(threading.current_thread().name)
        both.wait()
        return by_words(texts)

    samples = [{"text": f"w{i} w{i + 1}"} for i in range(1, 9)]
    loader = Loader(samples, same, decode=tokenize(together), batch_size=None, collate=None,
                    workers=2, concurrency=2)  # fmt: skip
    with pack(loader, 4, batch_size=1, eos=EOS, key="tokens") as packed:
        rows = [b.tolist() for b in packed]
    assert rows == [[[1, 2, 0, 2]], [[3, 0, 3, 4]], [[0, 4, 5, 0]], [[5, 6, 0, 6]],
                    [[7, 0, 7, 8]], [[0, 8, 9, 0]]]  # fmt: skip
    assert seen
    assert all(name.startswith("aioloader-decode") for name in seen)
    # made for threads: "auto" picks them without the line that asks for a module-level function
    assert not [r for r in caplog.records if "cannot be sent" in r.getMessage()]


def test_worker_processes_are_refused_with_the_reason(corpus: list[str]) -> None:
    make = packer(corpus, "text", 16, tokenize(by_words), executor="process", workers=1)
    with pytest.raises(TypeError, match="runs in the loader's decode threads"):
        run(make)


@pytest.mark.parametrize("kind", ["callable", "tokenizers"])
@pytest.mark.in_process
def test_breaking_out_ends_the_epoch_and_closes_the_threads(
    corpus: list[str], kind: str, request: pytest.FixtureRequest,
    threads_stopped: Callable[[], list[str]],
) -> None:  # fmt: skip
    tokenizer = by_words if kind == "callable" else request.getfixturevalue("word_level")
    rows = sources.parquet(corpus, ["text"], rows_per_sample=8, seed=3)
    loader = Loader(rows, batch_size=None, collate=None, decode=tokenize(tokenizer),
                    executor="thread", workers=2, prefetch=1)  # fmt: skip
    with pack(loader, 16, batch_size=2, eos=EOS, key="tokens") as packed:
        for i, _ in enumerate(packed):
            if i == 2:
                break
        assert not loader._epochs.live  # the loader's epoch ended with the packer's
        assert len(list(packed)) > 3  # and the next epoch runs whole
    assert threads_stopped() == []


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokenizer", "kwargs", "error", "match"),
    [
        (42, {}, TypeError, "tokenizer: expected a tokenizers.Tokenizer or a callable"),
        (by_words, {"key": 3}, TypeError, "key: expected a field or column name"),
        (by_words, {"out": None}, TypeError, "out: expected a field or column name"),
        (by_words, {"add_special_tokens": False}, TypeError, "add_special_tokens: only for"),
        (by_words, {"add_special_tokens": 1}, TypeError, "add_special_tokens: expected True"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(
    tokenizer: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        tokenize(tokenizer, **kwargs)


@pytest.mark.parametrize(
    ("sample", "error", "match"),
    [
        (pa.record_batch({"text": ["w1", None, None]}), ValueError,
         "key: column 'text' of the sample has 2 null rows"),
        (pa.record_batch({"text": [1, 2]}), TypeError, "column 'text' of the sample is int64, not text"),
        (pa.record_batch({"body": ["w1"]}), KeyError, r"no column 'text' \(its columns: \['body'\]\)"),
        ({"body": "w1"}, KeyError, r"no field 'text' \(its fields: \['body'\]\)"),
        ({"text": None}, ValueError, "sample key 'text' is null"),
        ({"text": b"w1"}, TypeError, "sample key 'text' holds bytes, not text"),
        (b"w1", TypeError, "tokenize expected a sample of text .* got bytes"),
    ],
)  # fmt: skip
def test_bad_samples_are_named_by_their_key(
    sample: Any, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        tokenize(by_words)(sample)


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (lambda texts: by_words(texts)[1:], TypeError, "it returned 1, expected a list of 2 lists"),
        (lambda texts: "w1", TypeError, "expected a list of 2 lists"),
        (lambda texts: [1, 2], TypeError, "not token id lists"),
        (lambda texts: [[1.5], []], TypeError, r"a token id 1.5 \(float\), expected int"),
        (lambda texts: [[1], [2**40]], ValueError, "token ids that are not int32"),
        (lambda texts: [np.ones(1), np.ones(2)], TypeError, r"token id 1.0 \(float\)"),
    ],
)  # fmt: skip
def test_a_tokenizers_bad_answer_is_named(answer: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        tokenize(answer)(pa.record_batch({"text": ["w1", "w2"]}))


def test_null_text_in_a_parquet_file_reaches_the_consumer_named(tmp_path: Path) -> None:
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": ["w1 w2", None, "w3"]}), path)
    rows = sources.parquet([str(path)], ["text"], rows_per_sample=3)
    loader = Loader(rows, batch_size=None, collate=None, decode=tokenize(by_words))
    with (
        pack(loader, 4, batch_size=1, eos=EOS, key="tokens") as packed,
        pytest.raises(ValueError, match="column 'text' of the sample has 1 null rows"),
    ):
        list(packed)


def test_it_is_the_public_decode_type() -> None:
    made = tokenize(by_words, key="body")
    assert isinstance(made, Tokenize)
    assert repr(made) == "tokenize(by_words, key='body', out='tokens')"


def test_the_pretraining_examples_text_gives_its_token_batches(tmp_path: Path) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "pretraining.py"
    spec = importlib.util.spec_from_file_location("pretraining_example", path)
    assert spec is not None
    assert spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    files = example.write_corpora(tmp_path)
    heads = []
    for text in (False, True):
        with example.make_packed(files, text) as packed:
            heads.append([b["tokens"].tolist() for b in itertools.islice(packed, 12)])
    assert heads[1] == heads[0]
