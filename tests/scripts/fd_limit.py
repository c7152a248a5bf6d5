"""One epoch of 1,000 batches under `ulimit -n 64`, the consumer holding every batch it gets.

Usage: fd_limit.py EXECUTOR BATCH [EXECUTOR BATCH ...]   (EXECUTOR: thread|process; BATCH: n|none)

For each pair, one after the other: a files source over 1,000 small files (each holding its index),
decoded into tensors by EXECUTOR, batched by BATCH (none: unbatched) so that the epoch yields 1,000
batches, all kept in a list. RLIMIT_NOFILE is set to 64 (soft and hard) before the first loader is
made. Prints one JSON line per pair:
  {"executor", "batch", "delivered", "intact", "error", "fds_before", "fds_max", "fds_holding",
   "fds_after_close"}
`fds_holding`: descriptors open once the epoch ended (loader still open, batches held);
`fds_after_close`: once the loader is closed, batches still held; `fds_before`: before the loader.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from leakcheck import settle, warm_up

import aioloader
from aioloader.sources import files

LIMIT = 64
BATCHES = 1000
SAMPLE_BYTES = 64


def decode(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int32)


def index_of(sample: torch.Tensor) -> int:
    return int(sample[0]) + 256 * int(sample[1])


def open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    except OSError:
        return -1  # EMFILE: the limit is reached


def run(root: Path, executor: str, batch: int | None) -> dict[str, Any]:
    samples = BATCHES * (batch or 1)
    keys = [f"{i % len(os.listdir(root)):05d}.bin" for i in range(samples)]
    source = files(root)
    held: list[Any] = []
    out: dict[str, Any] = {"executor": executor, "batch": batch, "error": None}
    out["fds_before"] = fds_max = open_fds()
    loader = aioloader.Loader(
        keys, source.fetch, decode=decode, executor=executor, workers=2, batch_size=batch,
        concurrency=16, timeout=60,
    )  # fmt: skip
    try:
        for item in loader:
            held.append(item)
            fds_max = max(fds_max, open_fds())
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["fds_holding"] = open_fds()
    loader.close()
    settle()
    out["fds_after_close"] = open_fds()
    out["fds_max"] = fds_max
    out["delivered"] = len(held)
    flat = [s for b in held for s in (b if batch else [b])]
    out["intact"] = [index_of(s) for s in flat] == [int(k[:5]) for k in keys[: len(flat)]]
    return out


def main(pairs: list[tuple[str, int | None]]) -> None:
    with tempfile.TemporaryDirectory(prefix="aioloader-fdlimit-") as tmp:
        root = Path(tmp)
        for i in range(BATCHES):
            body = bytearray((i + j) % 256 for j in range(SAMPLE_BYTES))
            body[0:2] = i.to_bytes(2, "little")
            (root / f"{i:05d}.bin").write_bytes(bytes(body))
        warm_up()
        resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
        for executor, batch in pairs:
            print(json.dumps(run(root, executor, batch)), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    main([(e, None if b == "none" else int(b)) for e, b in zip(args[::2], args[1::2], strict=True)])
