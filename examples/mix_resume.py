"""Mixing two sources in set proportions, stopping mid-epoch and resuming exactly.

Two sources: "web", small text files on disk read with `aioloader.sources.files` (written into a
temporary folder first), and "books", a map-style dataset. `aioloader.mix` interleaves their samples
3:1 before batching, so every batch holds both; a `Loader` fetches from both at once. The example
runs the epoch once uninterrupted, then again in a second loader that stops after a few batches and
saves its state as JSON, and a third loader (a fresh mix, other concurrency, decode in another
executor) that loads the state and finishes the epoch. It prints whether the resumed sequence equals
the uninterrupted one.

Usage: python examples/mix_resume.py [--stop-after N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from aioloader import Loader, Mix, MixKey, mix
from aioloader.sources import files

WEB_PAGES, BOOK_PAGES = 60, 20
WEIGHTS = {"web": 3, "books": 1}


class Books:
    """A map-style dataset: page i of a book, as text."""

    def __len__(self) -> int:
        return BOOK_PAGES

    def __getitem__(self, i: int) -> bytes:
        return f"book page {i}".encode()


def decode(key: MixKey, raw: bytes) -> str:
    """The sample as "source:text": the key says which source it came from."""
    return f"{key.name}:{raw.decode()}"


def make_mix(root: Path) -> Mix:
    web = files(root, "*.txt")
    mixed: Mix = mix({"web": web, "books": Books()}, WEIGHTS, seed=7, stop="all_exhausted")
    return mixed


def run(root: Path, state: dict[str, Any] | None, stop_after: int | None, **kwargs: Any) -> tuple[
    list[list[str]], dict[str, Any]
]:  # fmt: skip
    """The batches of epoch 0 (from `state`, if given; at most `stop_after`) and the state after."""
    with Loader(make_mix(root), decode=decode, decode_with_key=True, batch_size=8, collate=None,
                **kwargs) as loader:  # fmt: skip
        if state is not None:
            loader.load_state_dict(state)
        got: list[list[str]] = []
        for batch in loader:
            got.append(batch)
            if len(got) == stop_after:
                break
        return got, loader.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stop-after", type=int, default=4, help="batches before the stop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        for i in range(WEB_PAGES):
            (root / f"page-{i:03d}.txt").write_text(f"web page {i}")
        whole, _ = run(root, None, None, concurrency=4, executor="inline")
        counts = Counter(sample.split(":")[0] for batch in whole for sample in batch)
        total = sum(counts.values())
        print(f"mix: weights {WEIGHTS}, stop='all_exhausted', seed=7, batches of 8")
        print(f"uninterrupted: {len(whole)} batches; " + ", ".join(
            f"{name} {n} ({100 * n / total:.0f}%)" for name, n in sorted(counts.items())
        ))  # fmt: skip
        print(f"first batch: {whole[0]}")
        head, state = run(root, None, args.stop_after, concurrency=4, executor="inline")
        saved = json.dumps(state)
        print(f"stopped after {len(head)} batches; state saved ({len(saved)} bytes of JSON)")
        tail, _ = run(root, json.loads(saved), None, concurrency=16, executor="thread")
        print(f"resumed in a fresh loader (concurrency 16, executor 'thread'): {len(tail)} batches")
        same = head + tail == whole
        print(f"resumed sequence equals the uninterrupted one: {'yes' if same else 'NO'}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
