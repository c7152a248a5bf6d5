"""Tar shards of uneven sizes, for the tests of sharing an epoch among ranks."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

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
