"""loader.trace(path) and AIOLOADER_TRACE: a Chrome/Perfetto trace of every span, well ordered."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

import aioloader._observe.trace as trace_module
from aioloader import Loader
from aioloader._observe.trace import Tracer, _tracks, chrome_events

BATCH = 4


async def jittery(key: int) -> bytes:
    await asyncio.sleep(random.Random(key).uniform(0, 0.01))
    return bytes(32)


def decode(raw: bytes) -> int:
    time.sleep(0.001)
    return len(raw)


def spans(doc: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == name]


def end(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = tmp_path_factory.mktemp("trace") / "load.json"
    loader = Loader(range(32), jittery, decode=decode, executor="thread", workers=2,
                    batch_size=BATCH, concurrency=4)  # fmt: skip
    with loader, loader.trace(path):
        assert len(list(loader)) == 32 // BATCH
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def test_every_sample_is_fetched_before_it_is_decoded(doc: dict[str, Any]) -> None:
    fetches = {e["args"]["key"]: e for e in spans(doc, "fetch")}
    decodes = {e["args"]["key"]: e for e in spans(doc, "decode")}
    assert sorted(fetches) == sorted(decodes) == sorted(str(k) for k in range(32))
    for key, d in decodes.items():
        assert end(fetches[key]) <= d["ts"] + 1e-3


def test_each_batch_is_collated_after_the_decodes_of_its_samples(doc: dict[str, Any]) -> None:
    decodes = {int(e["args"]["key"]): e for e in spans(doc, "decode")}
    collates = spans(doc, "collate")
    assert sorted(e["args"]["batch"] for e in collates) == list(range(32 // BATCH))
    for c in collates:
        keys = range(c["args"]["batch"] * BATCH, (c["args"]["batch"] + 1) * BATCH)
        assert max(end(decodes[k]) for k in keys) <= c["ts"] + 1e-3


def test_no_two_spans_of_a_track_overlap(doc: dict[str, Any]) -> None:
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in doc["traceEvents"]:
        if e["ph"] == "X":
            tracks[e["pid"], e["tid"]].append(e)
    for events in tracks.values():
        events.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(events):
            assert end(a) <= b["ts"] + 1e-3


def test_tracks_are_named_and_fetch_slots_stay_within_the_concurrency(doc: dict[str, Any]) -> None:
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] in ("thread_name", "process_name")}  # fmt: skip
    slots = [n for n in names.values() if n.startswith("fetch slot")]
    assert 1 <= len(slots) <= 4
    assert {"fetch", "decode", "collate", "consumer wait"} <= set(names.values())


def test_the_consumer_waits_are_there(doc: dict[str, Any]) -> None:
    waits = spans(doc, "consumer wait")
    assert len(waits) >= 32 // BATCH  # one per batch, and one for the end of the epoch
    first = min(waits, key=lambda e: e["ts"])  # the wait for the first batch
    assert end(first) >= min(end(e) for e in spans(doc, "collate"))


def test_a_trace_is_written_when_the_loader_closes(tmp_path: Path) -> None:
    path = tmp_path / "at-close.json"
    with Loader(range(8), jittery, batch_size=4, collate=None) as loader:
        trace = loader.trace(path)
        list(loader)
        assert not path.exists()
    assert trace.closed
    assert len(spans(json.loads(path.read_text()), "fetch")) == 8


def test_a_new_trace_ends_the_previous_one(tmp_path: Path) -> None:
    with Loader(range(4), jittery, collate=None) as loader:
        first = loader.trace(tmp_path / "1.json")
        list(loader)
        loader.trace(tmp_path / "2.json")
        list(loader)
    assert first.closed
    assert len(spans(json.loads((tmp_path / "1.json").read_text()), "fetch")) == 4
    assert len(spans(json.loads((tmp_path / "2.json").read_text()), "fetch")) == 4


_SCRIPT = """
import asyncio
from aioloader import Loader

async def fetch(key):
    return key

with Loader(range(6), fetch, batch_size=3, collate=None) as a:
    list(a)
with Loader(range(2), fetch, collate=None) as b:
    list(b)
"""


def test_the_environment_variable_traces_a_script_it_does_not_edit(tmp_path: Path) -> None:
    path = tmp_path / "env.json"
    env = {**__import__("os").environ, "AIOLOADER_TRACE": str(path)}
    subprocess.run([sys.executable, "-c", _SCRIPT], env=env, check=True, timeout=60)
    assert len(spans(json.loads(path.read_text()), "fetch")) == 6
    second = tmp_path / "env.1.json"  # the script's second loader
    assert len(spans(json.loads(second.read_text()), "fetch")) == 2


def test_env_trace_path_names_later_loaders_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace_module, "_env_loaders", 0)
    monkeypatch.delenv("AIOLOADER_TRACE", raising=False)
    assert trace_module.env_trace_path() is None
    monkeypatch.setenv("AIOLOADER_TRACE", "/x/t.json")
    assert [trace_module.env_trace_path() for _ in range(2)] == [Path("/x/t.json"),
                                                                 Path("/x/t.1.json")]  # fmt: skip


def test_tracks_partition_overlapping_spans_with_the_fewest_tracks() -> None:
    spans_in = [("fetch", 0.0, 3.0, 1), ("fetch", 1.0, 2.0, 2), ("fetch", 2.0, 4.0, 3),
                ("fetch", 3.0, 5.0, 4), ("fetch", 3.5, 3.6, 5)]  # fmt: skip
    assert _tracks(spans_in) == [0, 1, 1, 0, 2]


def test_the_span_cap_counts_what_it_drops() -> None:
    tracer = Tracer(max_spans=2)
    for i in range(5):
        tracer.span("fetch", tracer.t0 + i, tracer.t0 + i + 0.5, i)
    assert len(tracer.spans) == 2
    assert tracer.dropped == 3
    events = chrome_events(tracer)
    assert [e["ts"] for e in events if e["ph"] == "X"] == [0.0, 1e6]
