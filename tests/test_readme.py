"""The guide's knob tables (docs/guide.md) state the signatures' defaults: the two cannot drift apart."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader import sources

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "guide.md"

_NOT_A_LITERAL = object()


def knob_table(heading: str) -> list[tuple[list[str], list[str]]]:
    """(argument names, default cells) of each row of the table under `heading` in the guide."""
    lines = GUIDE.read_text().splitlines()
    start = lines.index(heading)
    rows: list[tuple[list[str], list[str]]] = []
    for line in lines[start + 1 :]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("argument", "---"):
            continue
        names = [n.strip().strip("`") for n in cells[0].split(",")]
        rows.append((names, [d.strip() for d in cells[1].split(", ")]))
    return rows


def literal(cell: str) -> Any:
    """The Python value a default cell spells, or _NOT_A_LITERAL for a description ("detected")."""
    try:
        return ast.literal_eval(cell)
    except (ValueError, SyntaxError):
        return _NOT_A_LITERAL


def stated_defaults(heading: str) -> dict[str, Any]:
    """{argument: default} for the table's rows whose defaults are Python literals, one per name."""
    found: dict[str, Any] = {}
    for names, cells in knob_table(heading):
        if len(names) != len(cells):
            continue  # one descriptive cell for several arguments
        for name, cell in zip(names, cells, strict=True):
            value = literal(cell)
            if value is not _NOT_A_LITERAL and name.isidentifier():
                found[name] = value
    return found


def signature_defaults(*functions: Callable[..., Any]) -> dict[str, dict[str, Any]]:
    """{function name: {argument: default}} of the arguments that have a default."""
    return {
        f.__qualname__: {
            p.name: p.default
            for p in inspect.signature(f).parameters.values()
            if p.default is not inspect.Parameter.empty
        }
        for f in functions
    }


def test_loader_table_matches_the_signature() -> None:
    stated = stated_defaults("### Knobs and defaults (`aioloader.Loader`)")
    actual = signature_defaults(aioloader.Loader.__init__)["Loader.__init__"]
    assert len(stated) >= 15, stated  # the table was found and read
    wrong = {
        k: (v, actual.get(k, "no such argument")) for k, v in stated.items() if actual.get(k) != v
    }
    assert not wrong, f"the guide says (stated, actual): {wrong}"


def remote_defaults(source: type) -> dict[str, Any]:
    """A remote source's own arguments and the ones every remote source takes (`RemoteOptions`)."""
    shared = {f.name: f.default for f in dataclasses.fields(sources.RemoteOptions)}
    return shared | signature_defaults(source.__init__)[f"{source.__name__}.__init__"]


@pytest.mark.parametrize("source", [sources.Http, sources.S3], ids=["http", "s3"])
def test_remote_table_matches_the_signatures(source: type) -> None:
    stated = stated_defaults("### Knobs and defaults (`sources.http`, `sources.s3`)")
    actual = remote_defaults(source)
    assert {"attempts", "deadline", "connect_timeout", "read_timeout"} <= stated.keys()
    wrong = {k: (v, actual[k]) for k, v in stated.items() if k in actual and actual[k] != v}
    assert not wrong, f"the guide says (stated, actual) for {source.__name__}: {wrong}"


def test_remote_table_names_only_real_arguments() -> None:
    stated = stated_defaults("### Knobs and defaults (`sources.http`, `sources.s3`)")
    known = set(remote_defaults(sources.Http)) | set(remote_defaults(sources.S3))
    known |= set(inspect.signature(sources.S3).parameters)
    assert not stated.keys() - known, f"the guide lists arguments no remote source has: {stated}"


def test_parquet_table_matches_the_signature() -> None:
    stated = stated_defaults("### Parquet")
    actual = signature_defaults(sources.parquet)["parquet"]
    assert {"columns", "rows_per_sample", "shuffle", "row_groups_in_flight"} <= stated.keys()
    wrong = {
        k: (v, actual.get(k, "no such argument")) for k, v in stated.items() if actual.get(k) != v
    }
    assert not wrong, f"the guide says (stated, actual): {wrong}"


def test_pack_table_matches_the_signature() -> None:
    stated = stated_defaults("### Packing token documents")
    actual = signature_defaults(aioloader.pack)["pack"]
    assert {"key", "targets", "boundaries", "drop_last"} <= stated.keys()
    wrong = {
        k: (v, actual.get(k, "no such argument")) for k, v in stated.items() if actual.get(k) != v
    }
    assert not wrong, f"the guide says (stated, actual): {wrong}"
