"""The optional peers of `streams.py`: LitData and Mosaic Streaming, each writing the samples in its own
format with its own writer and reading them back from the bucket (the `bench` extra pins them).

They may live in another environment than aioloader's (their pins pull their own torch and
torchvision): `streams.py --peers-python PYTHON` runs them there. `missing(kind, python)` says why a
peer cannot run (None: it can); `write(kind, folder, n, shards)` writes its format under `folder`
(in that interpreter); `run_<kind>(spec)` makes its loader in a contender's process.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MODULES = {"litdata": "litdata", "mosaic": "streaming"}


def missing(kind: str, python: str) -> str | None:
    """Why `kind` cannot run under `python` (None: it can): its import's error, last line."""
    module = MODULES[kind]
    out = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                         check=False, timeout=300)  # fmt: skip
    if out.returncode == 0:
        return None
    last = (out.stderr.strip().splitlines() or ["?"])[-1]
    return f"import {module} fails under {python}: {last[:200]}"


def collate(batch: list[dict[str, Any]]) -> tuple[Any, Any]:
    import torch

    return torch.tensor([len(s["bin"]) for s in batch]), torch.tensor(
        [int(s["cls"]) for s in batch]
    )


# -- litdata ----------------------------------------------------------------------------------------------


class _LitSample:
    """What litdata's `optimize` calls per input: the sample of that number (picklable)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, i: int) -> dict[str, Any]:
        from _streamsamples import make_samples, sample_bytes

        if not hasattr(self, "data"):
            self.data = make_samples(self.n)
        sizes, pool = self.data
        return {"bin": sample_bytes(i, sizes, pool), "cls": i}


def write_litdata(folder: Path, n: int, shards: int) -> None:
    import litdata

    litdata.optimize(fn=_LitSample(n), inputs=list(range(n)), output_dir=str(folder),
                     chunk_size=-(-n // shards), num_workers=1)  # fmt: skip


def run_litdata(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    import botocore.config
    import litdata

    data = spec["data"]
    from litdata.streaming import downloader

    # its obstore client refuses an http endpoint unless allow_http is set, which 0.2.76 takes
    # from no argument: set it in the client options that module gives every store it makes
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"  # type: ignore[typeddict-unknown-key]
    cache = spec.get("cache_dir") or os.path.join(spec["work"], f"litdata-{os.getpid()}")
    options = {
        "endpoint_url": data["endpoint"], "aws_access_key_id": data["credentials"][0],
        "aws_secret_access_key": data["credentials"][1], "region_name": "us-east-1",
        "config": botocore.config.Config(s3={"addressing_style": "path"}),
    }  # fmt: skip
    ds = litdata.StreamingDataset(f"s3://{data['bucket']}/{data['litdata']}", cache_dir=cache,
                                  shuffle=True, storage_options=options)  # fmt: skip
    loader = litdata.StreamingDataLoader(ds, batch_size=64, num_workers=spec["workers"],
                                         collate_fn=collate)  # fmt: skip
    return loader, lambda: None


# -- mosaic -----------------------------------------------------------------------------------------------


def write_mosaic(folder: Path, n: int, shards: int) -> None:
    from _streamsamples import make_samples, sample_bytes
    from streaming import MDSWriter

    sizes, pool = make_samples(n)
    limit = sum(sizes) // shards + 2 * max(sizes)
    with MDSWriter(out=str(folder), columns={"bin": "bytes", "cls": "int"}, size_limit=limit) as w:
        for i in range(n):
            w.write({"bin": sample_bytes(i, sizes, pool), "cls": i})


def run_mosaic(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    data = spec["data"]
    os.environ.update(S3_ENDPOINT_URL=data["endpoint"], AWS_ACCESS_KEY_ID=data["credentials"][0],
                      AWS_SECRET_ACCESS_KEY=data["credentials"][1])  # fmt: skip
    local = spec.get("cache_dir") or os.path.join(spec["work"], f"mosaic-{os.getpid()}")
    ds = StreamingDataset(remote=f"s3://{data['bucket']}/{data['mosaic']}", local=local,
                          shuffle=True, batch_size=64)  # fmt: skip
    # its index was fetched here, in the parent, with a boto3 client that forked workers would
    # share (and corrupt shards through: "Relative sample index 62 is not present in the shard"):
    # drop it before they fork. 0.13 keeps it in each stream's downloader (`clean_up` drops it)
    for stream in getattr(ds, "streams", []):
        downloader = getattr(stream, "_downloader", None)
        if downloader is not None:
            downloader.clean_up()
        if hasattr(stream, "_client"):  # where older releases kept it
            stream._client = None
    loader = DataLoader(ds, batch_size=64, num_workers=spec["workers"], collate_fn=collate)
    return loader, lambda: None


def write(kind: str, folder: Path, n: int, shards: int) -> None:
    {"litdata": write_litdata, "mosaic": write_mosaic}[kind](folder, n, shards)
