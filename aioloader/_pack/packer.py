"""The packer: runs of documents in, batches of fixed-length rows out, vectorised.

The stream is every document of the epoch, in the loader's order, each followed by EOS; it is cut
into rows of `seq_len` tokens, in order, and `batch_size` rows make a batch. A document longer
than what is left of a row goes on at the start of the next row (greedy concatenation: no token
is dropped or padded, except at the end of an epoch).

With `targets=True` a row holds `seq_len + 1` tokens and the next row starts with the last of
them (rows step by `seq_len`), so `inputs = batch[:, :-1]`, `targets = batch[:, 1:]` and every
token of the stream is a target once.

What is held between batches is the tokens of documents read but not yet in a row (`pending`):
a queue of runs and how far into the first of them the rows have reached. Nothing is copied
until a batch takes it, so a long document is not moved once per batch; a batch within one run
of tokens made by the packer's reader is a view of it (batches view disjoint parts of it).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
import torch

from .documents import Run

__all__ = ["Packer"]


class Packer:
    """Greedy packing of runs into batches of `batch_size` rows of `seq_len` (+1) tokens."""

    def __init__(
        self, seq_len: int, batch_size: int, *, targets: bool, boundaries: bool,
        dtype: np.dtype[Any], varlen: bool = False,
    ) -> None:  # fmt: skip
        self.seq_len, self.batch_size = seq_len, batch_size
        self.extra = 1 if targets else 0  # the token a row shares with the next
        self.boundaries, self.varlen, self.dtype = boundaries, varlen, dtype
        self.marks = boundaries or varlen  # documents' first tokens are tracked
        self._runs: deque[Run] = deque()
        self._head = 0  # tokens of the first run already in rows
        self.pending = 0  # tokens held, not yet in a row

    def clear(self) -> None:
        self._runs.clear()
        self._head = self.pending = 0

    def add(self, run: Run) -> None:
        if len(run.tokens):
            self._runs.append(run)
            self.pending += len(run.tokens)

    def ready(self) -> bool:
        """Whether a full batch can be taken."""
        return self.pending >= self.batch_size * self.seq_len + self.extra

    def take(self, rows: int | None = None) -> Any:
        """The next batch of `rows` rows (default: `batch_size`): a tensor [rows, seq_len (+1)],
        or a dict of "tokens" and, with boundaries, "document_ids" and "positions", with varlen,
        "cu_seqlens" and "max_seqlen" (`varlen`)."""
        rows = self.batch_size if rows is None else rows
        step, extra = self.seq_len, self.extra
        flat, first = self._read(rows * step + extra, rows * step)
        tokens = _rows(flat, rows, step, extra)
        if not self.marks:
            return torch.from_numpy(tokens)
        assert first is not None
        starts = _rows(first, rows, step, extra)
        out: dict[str, Any] = {"tokens": torch.from_numpy(tokens)}
        if self.boundaries:
            ids, positions = segments(starts)
            out["document_ids"], out["positions"] = (
                torch.from_numpy(ids),
                torch.from_numpy(positions),
            )
        if self.varlen:  # of the rows' inputs: with targets, all but each row's last token
            cu_seqlens, out["max_seqlen"] = varlen(starts[:, :step])
            out["cu_seqlens"] = torch.from_numpy(cu_seqlens)
        return out

    def last(self) -> Any:
        """At the end of an epoch: the full rows still held as one shorter batch (None if not
        one row is full); whatever is left is dropped."""
        rows = max(self.pending - self.extra, 0) // self.seq_len
        batch = self.take(rows) if rows else None
        self.clear()
        return batch

    def _read(
        self, n: int, advance: int, marks: bool | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Copy the next `n` tokens out (and, with `marks` (default: with boundaries), a mask of
        documents' first tokens), then drop `advance` of them from what is held."""
        marks = self.marks if marks is None else marks
        if not marks and self._runs:  # within the first run: a view of it, nothing copied
            run, head = self._runs[0], self._head
            # (a batch of no extra token is that view itself: only of tokens made here)
            if len(run.tokens) - head >= n and (run.own or n != advance):
                flat = run.tokens[head : head + n]
                self._drop(advance)
                return flat, None
        flat = np.empty(n, dtype=self.dtype)
        first = np.zeros(n, dtype=bool) if marks else None
        filled, head = 0, self._head
        for run in self._runs:
            if filled == n:
                break
            k = min(len(run.tokens) - head, n - filled)
            flat[filled : filled + k] = run.tokens[head : head + k]
            if first is not None:
                lo, hi = np.searchsorted(run.starts, (head, head + k))
                first[run.starts[lo:hi] - head + filled] = True
            filled, head = filled + k, 0
        self._drop(advance)
        return flat, first

    def _drop(self, n: int) -> None:
        self.pending -= n
        while n:
            run = self._runs[0]
            left = len(run.tokens) - self._head
            if n < left:
                self._head += n
                return
            n -= left
            self._runs.popleft()
            self._head = 0

    # -- state ------------------------------------------------------------------------------------

    def held(self) -> dict[str, list[int]]:
        """The tokens held and where documents start among them (JSON-ready)."""
        tokens, first = self._read(self.pending, 0, marks=True)
        assert first is not None
        values: list[int] = tokens.tolist()
        starts: list[int] = np.flatnonzero(first).tolist()
        return {"tokens": values, "starts": starts}

    def hold(self, tokens: list[int], starts: list[int]) -> None:
        """Hold what `held()` gave (replacing anything held)."""
        self.clear()
        self.add(
            Run(np.array(tokens, dtype=self.dtype), np.asarray(starts, dtype=np.int64), own=True)
        )


def _rows(flat: np.ndarray, rows: int, step: int, extra: int) -> np.ndarray:
    """`flat` as `rows` rows of `step + extra` tokens, each starting `step` after the last."""
    if not extra:
        return flat.reshape(rows, step)
    out = np.empty((rows, step + 1), dtype=flat.dtype)
    out[:, :step] = flat[:-1].reshape(rows, step)
    out[:, step] = flat[step::step]
    return out


def varlen(starts: np.ndarray) -> tuple[np.ndarray, int]:
    """(cu_seqlens, max_seqlen) of the batch's rows flattened, as flash-attention's varlen
    functions take them: int32 offsets of every segment's first token, then the token count, and
    the longest segment. Segments as `segments` counts them (a row's start begins one)."""
    marks = _segment_starts(starts)
    begins = np.flatnonzero(marks.reshape(-1))
    cu_seqlens = np.append(begins, marks.size).astype(np.int32)
    return cu_seqlens, int(np.diff(cu_seqlens).max(initial=0))


def segments(starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token of each row: its segment's number in the row (0, 1, ...) and its position in
    its segment. A segment is one document's tokens in the row: a document cut by a row's start
    begins a new segment there (position 0), so attention never spans two rows' parts."""
    rows, width = starts.shape
    marks = _segment_starts(starts)
    ids = np.cumsum(marks, axis=1, dtype=np.int64) - 1
    column = np.broadcast_to(np.arange(width, dtype=np.int64), (rows, width))
    begun = np.maximum.accumulate(np.where(marks, column, 0), axis=1)
    return ids, column - begun


def _segment_starts(starts: np.ndarray) -> np.ndarray:
    """Where each row's segments begin: its documents' first tokens, and the row's own start."""
    marks = starts.copy()
    marks[:, 0] = True
    return marks
