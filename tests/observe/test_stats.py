"""loader.stats(): what each stage counts, the consumer's waits, the table, and stats=False."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from support.fakecuda import FakeBackend
from support.fakes import FakeSource

from aioloader import Loader
from aioloader._observe.stats import STAGES, LoaderStats, NullRecorder, Recorder, StageCounters
from aioloader._pipeline.transfer import DeviceStage


async def fetch(key: int) -> bytes:
    await asyncio.sleep(0)
    return bytes(100)


def decode(raw: bytes) -> list[int]:
    return [len(raw)]


def test_every_stage_counts_items_bytes_and_latencies() -> None:
    with Loader(range(20), fetch, decode=decode, batch_size=5, collate=None) as loader:
        assert len(list(loader)) == 4
        st = loader.stats()
    f, d, c = st.stages["fetch"], st.stages["decode"], st.stages["collate"]
    assert (f.items, f.bytes, f.errors) == (20, 2000, 0)
    assert d.items == 20
    assert c.items == 0  # collate=None: the list is the batch, nothing to run
    assert f.latency_p50_s is not None
    assert f.latency_p50_s <= f.latency_p95_s <= f.latency_p99_s  # type: ignore[operator]
    assert f.items_per_s > 0
    assert f.bytes_per_s > 0
    assert (st.batches, st.samples) == (4, 20)
    assert st.first_batch_s is not None
    assert st.consumer_wait_s >= st.first_batch_s
    assert 0.0 <= st.data_bound_pct <= 100.0
    assert (st.held_samples, st.held_bytes, st.ready_batches) == (0, 0, 0)
    assert set(st.stages) == set(STAGES)


def test_collate_is_counted_per_batch() -> None:
    with Loader(range(12), fetch, decode=decode, batch_size=4) as loader:
        list(loader)
        assert loader.stats().stages["collate"].items == 3


def test_busy_full_and_area_follow_the_stage() -> None:
    s = StageCounters(0.0)
    s.cap = 2
    s.enter(1.0)
    s.enter(2.0)  # two in flight from t=2: the stage is full
    s.leave(5.0, 1.0)
    s.leave(6.0, 2.0)
    assert s.area == pytest.approx(4.0 + 4.0)  # the integral of `busy`: 1 + 2 * 3 + 1
    assert s.full == pytest.approx(3.0)
    assert s.busy == 0
    assert s.full_since < 0


def test_cancelled_fetches_are_neither_items_nor_errors() -> None:
    async def slow(key: int) -> int:
        await asyncio.sleep(0 if key < 4 else 10)
        return key

    with Loader(range(40), slow, batch_size=4, collate=None, concurrency=8) as loader:
        for _ in loader:
            break
    st = loader.stats()
    assert st.stages["fetch"].errors == 0
    assert st.stages["fetch"].busy == 0


class RetryingSource(FakeSource):
    def stats(self) -> dict[str, int]:
        return {"requests": len(self.fetched) + 3, "retries": 3}


def test_the_source_stats_are_merged_and_its_retries_count_for_fetch() -> None:
    with Loader(RetryingSource(6), batch_size=3, collate=None) as loader:
        list(loader)
        st = loader.stats()
    assert st.extra["retries"] == 3
    assert st.extra["requests"] == 9
    assert st.stages["fetch"].retries == 3


def test_skips_and_errors_are_counted() -> None:
    async def failing(key: int) -> int:
        if key % 5 == 0:
            raise ValueError(f"bad {key}")
        return key

    with Loader(range(20), failing, batch_size=4, collate=None, on_error="skip",
                max_skipped=None) as loader:  # fmt: skip
        list(loader)
        st = loader.stats()
    assert st.stages["fetch"].errors == 4
    assert st.stages["fetch"].skipped == 4
    assert st.skipped_count == 4
    assert st.skipped[0] == (0, "ValueError: bad 0")


def test_the_table_names_every_stage_and_the_budget() -> None:
    with Loader(range(8), fetch, batch_size=4, max_bytes_in_flight=1 << 20) as loader:
        list(loader)
        table = loader.stats().table()
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["stage", "items", "items/s"]
    for stage in STAGES:
        assert any(line.startswith(stage) for line in lines)
    assert "data-bound" in table
    assert "1.0 MB budget" in table
    assert "fetch concurrency: 16" in table


def test_loader_stats_documents_its_fields() -> None:
    doc = LoaderStats.__doc__ or ""
    for name in ("data_bound_pct", "held_bytes", "concurrency", "extra", "ready_batches"):
        assert name in doc


@pytest.mark.in_process
def test_stats_false_keeps_the_loader_working_and_counts_nothing() -> None:
    with Loader(range(10), fetch, batch_size=5, collate=None, stats=False) as loader:
        assert len(list(loader)) == 2
        st = loader.stats()
        assert isinstance(loader._stages.recorder, NullRecorder)
        with pytest.raises(ValueError, match="stats=True"):
            loader.trace("never.json")
    assert st.stages["fetch"].items == 0
    assert st.consumer_wait_s == 0.0
    assert st.batches == 2  # what the pipeline needs to run is still counted


@pytest.mark.in_process
def test_a_device_stage_counts_transfers() -> None:
    async def tensor(key: int) -> Any:
        import torch

        return torch.full((2,), float(key))

    loader: Loader[Any] = Loader(range(6), tensor, batch_size=2)
    loader._epochs.device = DeviceStage(FakeBackend())
    with loader:
        assert len(list(loader)) == 3
        st = loader.stats()
    assert st.stages["transfer"].items == 3
    assert st.stages["transfer"].latency_p50_s is not None
    assert st.extra["transfer"]["staged"] == 3


def test_a_recorder_traces_only_while_a_tracer_is_set() -> None:
    rec, spans = Recorder(), []

    class Tracer:
        def span(self, *args: Any) -> None:
            spans.append(args)

    t0 = rec.start("fetch")
    rec.stop("fetch", t0, 3, key="a")
    rec.tracer = Tracer()
    t0 = rec.start("decode")
    rec.stop("decode", t0, 3, key="a")
    assert [s[0] for s in spans] == ["decode"]


def test_waiting_for_a_slot_is_split_from_the_time_at_work() -> None:
    s = StageCounters(0.0)
    s.cap = 1
    s.enter(0.0)
    s.enter(1.0)  # the second waits for the one slot from t=1...
    s.leave(3.0, 0.0)
    s.leave(5.0, 1.0)  # ...until t=3, then works until t=5
    assert s.area == pytest.approx(3.0 + 4.0)
    assert s.queued == pytest.approx(2.0)  # the latency the second spent waiting


def test_a_pooled_decode_reports_its_work_apart_from_its_queue() -> None:
    def slow(raw: bytes) -> int:
        time.sleep(0.01)
        return len(raw)

    with Loader(range(24), fetch, decode=slow, executor="thread", workers=1, batch_size=4,
                collate=None, concurrency=8) as loader:  # fmt: skip
        list(loader)
        d = loader.stats().stages["decode"]
    assert d.service_mean_s is not None
    assert d.queued_mean_s is not None
    assert d.service_mean_s >= 0.01  # one worker sleeping 10 ms a decode: at work >= 10 ms each
    assert d.latency_p50_s is not None
    assert d.latency_p50_s > d.service_mean_s
    assert d.queued_mean_s > 0  # the rest of the latency was waiting for the worker
