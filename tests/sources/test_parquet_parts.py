"""A row group wanted now decodes in parts: its first samples go on before its last rows are
decoded; one read ahead decodes whole. Either way the samples are the file's rows. (Parts are
pyarrow's decodes: lists of token ids that `parquet_lists` reads decode whole at once, so here it
reads none.)"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support.parquetfiles import write_tokens

from aioloader._util.ranges import Ranges
from aioloader.sources import Parquet
from aioloader.sources.formats import parquet_lists

ROWS, GROUP, PER_SAMPLE = 3_000, 1_500, 100


@pytest.fixture(autouse=True)
def _pyarrow_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parquet_lists, "decode", lambda *args: None)


def tokens_file(path: Path) -> pa.Table:
    return write_tokens(path, ROWS, GROUP, seed=3, longest=60)


class HeldAfterAPart(Parquet):
    """The real source, whose decodes in parts stop after their first part until `go` is set
    (decodes of whole row groups are counted in `whole`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.go = threading.Event()
        self.whole: list[int] = []

    def _decode(
        self, meta: Any, rg: int, pieces: Any, path: Any, arrived: Callable[[Any], None] | None
    ) -> tuple[Any, int]:
        if arrived is None:
            self.whole.append(rg)
            return super()._decode(meta, rg, pieces, path, None)
        parts = 0

        def held(part: Any) -> None:
            nonlocal parts
            arrived(part)
            parts += 1
            if parts == 1 and not self.go.wait(60):
                raise AssertionError("the first sample did not come from the first part")

        return super()._decode(meta, rg, pieces, path, held)


@pytest.mark.asyncio
async def test_the_first_sample_comes_before_its_row_group_is_decoded(tmp_path: Path) -> None:
    path = tmp_path / "tokens.parquet"
    table = tokens_file(path)
    src = HeldAfterAPart(str(path), ["tokens"], rows_per_sample=PER_SAMPLE, row_groups_in_flight=2)
    walk = src.refs(0, src.share(Ranges()))
    try:
        _, ref = next(walk)
        ((group, _),) = ref.parts
        first = await src.fetch(ref)
        assert group.task is not None
        assert not group.task.done()  # still decoding its rest
        src.go.set()
        await src.group(1).value(src)  # read ahead meanwhile, wanted by no sample yet
        samples = [first] + [await src.fetch(r) for _, r in walk]
    finally:
        walk.close()
        src.go.set()
        await src.aclose()
    assert all(isinstance(s, pa.RecordBatch) for s in samples)
    assert pa.Table.from_batches(samples).equals(table.select(["tokens"]))
    assert src.whole == [1]  # the second row group was read ahead: decoded whole


@pytest.mark.asyncio
async def test_a_sample_waiting_for_a_later_part_may_be_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "tokens.parquet"
    table = tokens_file(path)
    src = HeldAfterAPart(str(path), ["tokens"], rows_per_sample=PER_SAMPLE, row_groups_in_flight=1)
    walk = src.refs(0, src.share(Ranges()))
    try:
        refs = [next(walk)[1] for _ in range(5)]  # rows 0..499: the first part holds 0..255
        first = await src.fetch(refs[0])
        waiting = asyncio.ensure_future(src.fetch(refs[3]))  # rows 300..399: the second part's
        for _ in range(3):
            await asyncio.sleep(0)
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        ((group, _),) = refs[0].parts
        assert group.task is not None
        assert not group.task.done()  # the read goes on for the rest
        src.go.set()
        again = await src.fetch(refs[3])
    finally:
        walk.close()
        src.go.set()
        await src.aclose()
    expected = table.select(["tokens"])
    assert pa.Table.from_batches([first]).equals(expected.slice(0, PER_SAMPLE))
    assert pa.Table.from_batches([again]).equals(expected.slice(3 * PER_SAMPLE, PER_SAMPLE))
