"""Tar shards written for the tests: `write_shards` (uneven sizes, for sharing an epoch among
ranks; the standard library's tarfile), `write_mixed_shards` (webdataset's own TarWriter: mixed
extensions, a folder key, a long name) and `write_bin_shards` (webdataset's TarWriter: a random
"bin" and a "cls" per sample, of a size given)."""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import webdataset as wds

SIZES = [7, 13, 5, 11, 9, 3, 17, 8, 1, 14]  # uneven: 88 samples in 10 shards


def write_shards(folder: Path, sizes: list[int]) -> list[str]:
    """Shards of `sizes` samples, each of two members (a pax long name in one of them)."""
    paths = []
    for s, n in enumerate(sizes):
        path = folder / f"part-{s:03d}.tar"
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for i in range(n):
                stem = f"s{s}/{'long' * 40 if i == 2 else 'x'}{i:04d}"
                for ext, data in (("txt", f"{s}-{i}".encode()), ("cls", str(i).encode())):
                    info = tarfile.TarInfo(f"{stem}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def write_mixed_shards(folder: Path, shards: int, per_shard: int) -> list[str]:
    """Shards written by webdataset's own TarWriter: mixed extensions, a folder key, a long name."""
    rng = random.Random(11)
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:03d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(per_shard):
                key = f"s{s}/{'x' * 120 if i == 3 else 'sample'}{i:04d}"
                sink.write({"__key__": key, "jpg": rng.randbytes(rng.randrange(1, 3000)),
                            "cls": str(i).encode(), "seg.PNG": rng.randbytes(40)})  # fmt: skip
        paths.append(str(path))
    return paths


def write_bin_shards(folder: Path, shards: int, per_shard: int, size: int = 100) -> list[str]:
    """`shards` shards of `per_shard` samples ("bin" of `size` random bytes, "cls")."""
    rng = random.Random(7)
    paths = []
    for s in range(shards):
        path = folder / f"shard-{s:03d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(per_shard):
                sink.write({"__key__": f"s{s:03d}-{i:04d}", "bin": rng.randbytes(size),
                            "cls": str(i % 10).encode()})  # fmt: skip
        paths.append(str(path))
    return paths
