"""The optional peers of `streams.py`: LitData and Mosaic Streaming, each writing the samples in its own
format with its own writer and reading them back from the bucket (the `bench` extra pins them).

`missing(kind)` says why a peer cannot run here (None: it can); `write(kind, ...)` writes its format
under `folder / "out"`; `run_<kind>(spec)` makes its loader in a contender's process.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MODULES = {"litdata": "litdata", "mosaic": "streaming"}


def missing(kind: str) -> str | None:
    """Why `kind` cannot run here (None: it can)."""
    module = MODULES[kind]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e '.[bench]')"
    return None


def write(kind: str, folder: Path, sizes: list[int], pool: bytes, shards: int) -> dict[str, Any]:
    raise NotImplementedError(kind)


def run_litdata(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    raise NotImplementedError


def run_mosaic(spec: dict[str, Any]) -> tuple[Iterable[Any], Callable[[], None]]:
    raise NotImplementedError
