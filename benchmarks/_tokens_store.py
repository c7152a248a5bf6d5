"""`tokens.py --store`: the workload's files on an object store, as issue 33 measured it.

SeaweedFS (S3) on 127.0.0.1, reached through the benchmarks' proxy that holds each request 20 ms
(`_delayproxy.py`). The parent starts both, puts the corpus's Parquet files (and LitData's
`optimize`d chunks, made first on disk) into the bucket, and hands each contender the proxy's
address in `STORE_ENV`: a contender then reads nothing from the local files.

- aioloader reads `s3://bucket/tokens/<file>` with `sources.parquet(..., s3_options=...)`;
- LitData reads `s3://bucket/litdata/<source>` with `storage_options` (its boto3 client and
  obstore, told `allow_http`), into cache folders of its process, empty when its first loader is
  made; the restore's loader finds the chunks there (its state names the folders: a state saved
  with other ones is refused), as a job restarted on the same machine would;
- Grain opens `bucket/tokens/<file>` through pyarrow's `S3FileSystem` (`ParquetIterDataset` hands
  its keyword arguments to `pyarrow.parquet.ParquetFile`, which takes a `filesystem`);
- HF datasets reads `arrows3://bucket/tokens/<file>`: pyarrow's `S3FileSystem` through fsspec's
  wrapper of it, registered under that protocol (its own way to S3, fsspec's `s3fs`, pins through
  `aiobotocore` a botocore other than the one LitData's boto3 needs in the same environment).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STORE_ENV = "AIOLOADER_BENCH_TOKENS_STORE"
DELAY_MS = 20.0
RUNS_ON_STORE = ("aioloader", "aioloader-batches", "aioloader-per-doc", "litdata", "grain", "hf")


def store() -> dict[str, Any] | None:
    """The store a contender reads from (None: the local files)."""
    raw = os.environ.get(STORE_ENV)
    return json.loads(raw) if raw else None


def in_bucket(
    files: dict[str, list[str]], where: dict[str, Any], scheme: str = "s3://"
) -> dict[str, list[str]]:  # fmt: skip
    """Each source's files as their copies in the bucket: `scheme` + "bucket/tokens/<file>"."""
    return {
        name: [f"{scheme}{where['bucket']}/tokens/{Path(p).name}" for p in paths]
        for name, paths in files.items()
    }


def s3_options(where: dict[str, Any]) -> dict[str, Any]:
    """aioloader's `s3_options` for the store."""
    return {
        "endpoint_url": where["endpoint"], "credentials": tuple(where["credentials"]),
        "region": where["region"],
    }  # fmt: skip


def boto3_options(where: dict[str, Any]) -> dict[str, Any]:
    """LitData's `storage_options` (its boto3 client's arguments) for the store."""
    key, secret = where["credentials"]
    return {
        "endpoint_url": where["endpoint"], "aws_access_key_id": key,
        "aws_secret_access_key": secret, "region_name": where["region"],
    }  # fmt: skip


def arrow_s3(where: dict[str, Any]) -> Any:
    """pyarrow's S3 filesystem for the store (Grain's and HF datasets' way to it)."""
    from pyarrow import fs

    key, secret = where["credentials"]
    return fs.S3FileSystem(
        access_key=key, secret_key=secret, region=where["region"],
        endpoint_override=where["endpoint"].split("://", 1)[1], scheme="http",
    )  # fmt: skip


def fresh_cache() -> str:
    """A new folder for LitData's downloaded chunks, in this process's own (one per process)."""
    return tempfile.mkdtemp(dir=_caches())


@functools.cache
def _caches() -> str:
    """This process's folder of LitData's caches, removed as it exits."""
    path = tempfile.mkdtemp(prefix="aioloader-bench-litdata-cache-")
    atexit.register(shutil.rmtree, path, True)
    return path


@contextmanager
def serving(files: dict[str, list[str]], litdata: Path | None) -> Iterator[dict[str, Any]]:
    """SeaweedFS behind the 20 ms proxy, holding the corpus (and `litdata`'s chunks, a folder of
    one folder per source); yields what `STORE_ENV` carries."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here.parent / "tests"))
    from _delayproxy import Proxy
    from support.s3server import REGION, start_seaweed

    workdir = Path(tempfile.mkdtemp(prefix="aioloader-bench-tokens-s3-"))
    server = start_seaweed(workdir)
    proxy = None
    try:
        for paths in files.values():
            for path in paths:
                server.put(f"tokens/{Path(path).name}", Path(path).read_bytes())
        if litdata is not None:
            for path in sorted(litdata.rglob("*")):
                if path.is_file():
                    server.put(f"litdata/{path.relative_to(litdata).as_posix()}", path.read_bytes())
        proxy = Proxy(server.endpoint, DELAY_MS)
        yield {
            "endpoint": proxy.url, "bucket": server.bucket,
            "credentials": list(server.credentials), "region": REGION,
        }  # fmt: skip
    finally:
        if proxy is not None:
            proxy.stop()
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
