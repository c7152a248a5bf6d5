"""The peers of `benchmarks/tokens.py`, each optional: `missing(name)` says why one cannot run."""

from __future__ import annotations

import importlib.util
from typing import Any

NEEDS = {"litdata": ["litdata"], "grain": ["grain"], "hf": ["datasets", "torchdata"]}


def missing(name: str) -> str | None:
    """Why contender `name` cannot run here (None: it can)."""
    if name not in NEEDS:
        return (
            f"unknown contender {name!r} (known: aioloader, aioloader-per-doc, {', '.join(NEEDS)})"
        )
    absent = [m for m in NEEDS[name] if importlib.util.find_spec(m) is None]
    if absent:
        return f"{', '.join(absent)} not installed (pip install 'aioloader[bench]')"
    return None


def peer(name: str, *args: Any) -> Any:
    raise SystemExit(f"{name}: not written yet")
