"""Text in, tokens out: `aioloader.tokenize(tokenizer)`, a loader's decode that turns text into the
token documents `pack` takes, so that a corpus need not be tokenized beforehand.

It runs where the loader's decode runs: in its decode threads (a `tokenizers.Tokenizer` lets go of
the GIL while it encodes a batch), in parallel and off the consumer's thread. What it takes and
gives, per sample:

- a pyarrow RecordBatch or Table with a string column `key` (`sources.parquet(...,
  rows_per_sample=N)`): one call of the tokenizer per record batch (per chunk of a Table), and the
  same rows with a list<int32> column `out` added, made from one flat array of token ids and its
  offsets (no Python step per token): the columnar path;
- a dict whose `key` field is a str (a Parquet row, a record): the dict with `out` added as a 1-D
  int32 numpy array;
- a str: its tokens, a 1-D int32 numpy array.

Tokenizing is a pure function of the sample, so a packer's exact resume holds unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Tokenize", "tokenize"]

Encode = Callable[[list[str]], Sequence[Any]]


class Tokenize:
    """A loader's decode that tokenizes a sample's text (see `tokenize()`, which makes it).

    It is not sent to worker processes: `executor="auto"` (a Loader's default) runs it in threads,
    and `executor="thread"` says so outright; `executor="process"` refuses it.
    """

    __slots__ = ("_encode", "add_special_tokens", "key", "out", "tokenizer")

    def __init__(self, tokenizer: Any, key: str, out: str, add_special_tokens: bool | None) -> None:
        self.tokenizer, self.key, self.out = tokenizer, key, out
        self.add_special_tokens = add_special_tokens
        self._encode = _encoder(tokenizer, add_special_tokens)

    def __repr__(self) -> str:
        special = "" if self.add_special_tokens is None else (
            f", add_special_tokens={self.add_special_tokens}"
        )  # fmt: skip
        name = getattr(self.tokenizer, "__qualname__", None) or (
            f"<{type(self.tokenizer).__name__}>"
        )  # a tokenizer's own repr may be its whole vocabulary
        return f"tokenize({name}, key={self.key!r}, out={self.out!r}{special})"

    aioloader_executor = "thread"  # what executor="auto" picks for it, without a log line

    def __reduce__(self) -> Any:
        raise TypeError(
            "aioloader.tokenize(...) runs in the loader's decode threads, not in worker "
            "processes: leave executor='auto' (threads for it) or pass executor='thread'"
        )

    def __call__(self, sample: Any) -> Any:
        """The sample with its text tokenized (see the module docstring). Thread-safe."""
        if isinstance(sample, str):
            return _flat(self._encode([sample]), 1, "the sample (a str)")[0]
        if type(sample) is dict or isinstance(sample, Mapping):
            return self._dict(sample)
        table = _columnar(sample)
        if table is not None:
            return self._table(table)
        raise TypeError(
            f"key: tokenize expected a sample of text (a str, a dict with a {self.key!r} field, "
            f"or a pyarrow RecordBatch or Table with a {self.key!r} column), got "
            f"{type(sample).__name__}"
        )

    def _dict(self, sample: Mapping[Any, Any]) -> dict[Any, Any]:
        if self.key not in sample:
            fields = sorted(map(str, sample))
            raise KeyError(f"key: the sample has no field {self.key!r} (its fields: {fields})")
        text = sample[self.key]
        if text is None:
            raise ValueError(f"key: sample key {self.key!r} is null, not text")
        if not isinstance(text, str):
            raise TypeError(
                f"key: sample key {self.key!r} holds {type(text).__name__}, not text (a str)"
            )
        values, _ = _flat(self._encode([text]), 1, f"sample key {self.key!r}")
        return {**sample, self.out: values}

    def _table(self, table: Any) -> Any:
        """A RecordBatch or Table with the `out` column (list<int32>) added or replaced."""
        import pyarrow as pa

        if self.key not in table.column_names:
            raise KeyError(
                f"key: the sample has no column {self.key!r} (its columns: {table.column_names})"
            )
        column = table.column(self.key)
        if isinstance(column, pa.ChunkedArray):
            tokens: Any = pa.chunked_array(
                [self._tokens(chunk) for chunk in column.chunks], pa.list_(pa.int32())
            )
        else:
            tokens = self._tokens(column)
        names = table.column_names
        if self.out in names:
            return table.set_column(names.index(self.out), self.out, tokens)
        return table.append_column(self.out, tokens)

    def _tokens(self, column: Any) -> Any:
        """One string array's rows tokenized, as a list<int32> array: one call of the tokenizer."""
        import pyarrow as pa

        kind = column.type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not _is_text(pa, kind):
            raise TypeError(f"key: column {self.key!r} of the sample is {kind}, not text (string)")
        if column.null_count:
            raise ValueError(
                f"key: column {self.key!r} of the sample has {column.null_count} null rows"
            )
        texts = column.to_pylist()
        values, offsets = _flat(self._encode(texts), len(texts), f"column {self.key!r}")
        if offsets[-1] < 2**31:
            return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values))
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def _encoder(tokenizer: Any, add_special_tokens: bool | None) -> Encode:
    """`texts -> token id lists` for a `tokenizers.Tokenizer` (its batch encode) or a callable."""
    batch = getattr(tokenizer, "encode_batch_fast", None) or getattr(
        tokenizer, "encode_batch", None
    )
    if callable(batch):
        special = True if add_special_tokens is None else add_special_tokens

        def encode(texts: list[str]) -> list[Any]:
            return [e.ids for e in batch(texts, add_special_tokens=special)]

        return encode
    if not callable(tokenizer):
        raise TypeError(
            "tokenizer: expected a tokenizers.Tokenizer or a callable f(list[str]) -> "
            f"list[list[int]], got {type(tokenizer).__name__}"
        )
    if add_special_tokens is not None:
        raise TypeError(
            "add_special_tokens: only for a tokenizers.Tokenizer; a callable tokenizer adds "
            "what it adds (leave add_special_tokens=None)"
        )
    encode_texts: Encode = tokenizer
    return encode_texts


def _flat(ids: Any, n: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """The tokenizer's answer for `n` texts as (flat int32 token ids, int64 offsets of n + 1)."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence) or len(ids) != n:
        got = len(ids) if isinstance(ids, Sequence) else type(ids).__name__
        raise TypeError(
            f"tokenizer: for {what} it returned {got}, expected a list of {n} lists of token ids"
        )
    offsets = np.zeros(n + 1, dtype=np.int64)
    try:
        np.cumsum(np.fromiter(map(len, ids), dtype=np.int64, count=n), out=offsets[1:])
    except TypeError as exc:
        raise TypeError(
            f"tokenizer: for {what} it returned {ids[0]!r}..., not token id lists"
        ) from exc
    total = int(offsets[-1])
    if n and all(type(doc) is np.ndarray for doc in ids):
        values = np.concatenate(ids) if total else np.zeros(0, dtype=np.int32)
        _check_ids(values[:1].tolist(), what)
        return _int32(values, what), offsets
    first = next((doc for doc in ids if len(doc)), None)
    if first is not None:
        _check_ids(first[:1], what)
    try:
        values = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=total)
    except (OverflowError, ValueError) as exc:
        raise ValueError(f"tokenizer: for {what} it returned token ids that are not int32") from exc
    return values, offsets


def _check_ids(head: Any, what: str) -> None:
    """The first token id is an int (the rest are taken as what it is)."""
    for token in head:
        if isinstance(token, bool) or not isinstance(token, int | np.integer):
            raise TypeError(
                f"tokenizer: for {what} it returned a token id {token!r} "
                f"({type(token).__name__}), expected int"
            )


def _int32(values: np.ndarray, what: str) -> np.ndarray:
    if values.dtype.kind not in "iu":
        raise TypeError(f"tokenizer: for {what} it returned {values.dtype} token ids, not integers")
    if values.dtype != np.int32 and len(values):
        low, high = int(values.min()), int(values.max())
        if low < -(2**31) or high >= 2**31:
            raise ValueError(f"tokenizer: for {what} it returned token ids that are not int32")
    return values.astype(np.int32, copy=False)


def _is_text(pa: Any, kind: Any) -> bool:
    is_view = getattr(pa.types, "is_string_view", None)
    return bool(
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or (is_view is not None and is_view(kind))
    )


def _columnar(item: Any) -> Any:
    """`item` if it is a pyarrow RecordBatch or Table (without importing pyarrow otherwise)."""
    module = type(item).__module__
    if module.startswith("pyarrow") and type(item).__name__ in ("RecordBatch", "Table"):
        return item
    return None


def tokenize(
    tokenizer: Any,
    *,
    key: str = "text",
    out: str = "tokens",
    add_special_tokens: bool | None = None,
) -> Tokenize:
    """A loader's decode that tokenizes text on the fly, for `aioloader.pack`.

    Pass it as a Loader's `decode=`: it runs in the loader's decode threads, many samples at once
    and off your thread. The default `executor="auto"` runs it in threads (it is never sent to
    worker processes); `executor="thread"` says so, and `workers=` sets how many. A
    `tokenizers.Tokenizer` releases the GIL while it encodes, so the threads tokenize in parallel.

    Args:
        tokenizer: a `tokenizers.Tokenizer` (its `encode_batch_fast`, else `encode_batch`, once
            per sample), or any callable `f(texts: list[str]) -> list[list[int]]` (one list of
            token ids per text, in order; numpy integer arrays do too). A callable that holds the
            GIL tokenizes one sample at a time, whatever the threads.
        key: the sample's field or column that holds the text (str; a string column).
        out: the field or column the tokens go in (added, or replaced where there is one): give
            it to `pack(..., key=out)`.
        add_special_tokens: for a `tokenizers.Tokenizer`, whether its post-processor adds its
            special tokens (None: its default, True). `pack` adds `eos` after each document
            either way. Not for a callable tokenizer.

    Returns:
        A `Tokenize` callable: a str sample becomes a 1-D int32 array; a dict gets `out` (a 1-D
        int32 array); a RecordBatch or Table gets a list<int32> column `out`, built from one
        flat array of token ids and its offsets (one tokenizer call per record batch).

    Raises:
        TypeError naming the argument, here. At iteration (from the loader, noting the sample's
        key): KeyError for a missing field or column, ValueError for null text, TypeError for
        text that is not a str or a string column, or for a tokenizer's answer that is not a
        list of token id lists, one per text.

    Example:
        >>> rows = sources.parquet(paths, ["text"], rows_per_sample=256)  # doctest: +SKIP
        >>> loader = Loader(rows, decode=tokenize(tok), batch_size=None, collate=None)
        >>> packed = pack(loader, 2048, batch_size=8, eos=0, key="tokens")  # doctest: +SKIP
    """
    for name, value in (("key", key), ("out", out)):
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a field or column name (str), got {value!r}")
    if add_special_tokens is not None and not isinstance(add_special_tokens, bool):
        raise TypeError(
            f"add_special_tokens: expected True, False or None, got {add_special_tokens!r}"
        )
    return Tokenize(tokenizer, key, out, add_special_tokens)
