"""The package's imports follow the flow of data: no circle between modules, no import against the table.

Every module of `aioloader/` is read (not imported) and each of its imports resolved to a module. A
module belongs to a *layer*: its folder (`_pipeline`, `_executors/process`, `sources/stores`, `_mix`,
...), or, for the files directly in `aioloader/`, the errors (`_exceptions`), the loader (`LOADER`:
`Loader`, its parts, arguments and epochs) or else the front door (`aioloader`: the package's face,
`DataLoader`, the CLI); the protocol (`_protocol.py`: what a source is, and the hooks the loader looks
for) is a layer of its own, just above `_util`. `LAYERS` lists them from the ground up; a module may
import its own layer and any layer below it, never one above.
Imports under `if TYPE_CHECKING:` name types only and never run, so they are left out.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aioloader"

# From the ground up: a layer may import itself and those before it.
LAYERS = (
    "_exceptions",  # the errors everything raises
    "_util",  # thread pools, bytearrays, seeds, ranges, checks, event loops
    # what a source is, and the optional hooks (of sources, executors, a mix's inputs) the loader
    # looks for: contracts only, which every layer above may check
    "_protocol",
    "_observe",  # stats, traces, diagnosis, progress: read by every stage, reading none
    "_executors.process",  # worker processes and their arena: know nothing of the pipeline
    "_executors",  # the executor contract, inline and threads, the choice among them
    "_tuning",  # bounds and the controllers that move them (they build executors)
    # where samples come from (they share the tuning's AIMD controller), room by room:
    "sources.cache",  # the disk cache of remote objects and shards: files, index, eviction
    "sources.transport",  # GETs with retries, the fast engine, signing, redaction; `Remote`
    "sources.stores",  # where objects live: files, fsspec, http, S3, GCS, Azure
    "sources.formats",  # samples inside files from any store: tar shards, Parquet row groups
    "sources",  # the public face: `aioloader.sources` and its public modules
    "_pipeline",  # the stages, in the order data flows
    "_resume",  # exact resume: reads the order stage's plan
    "_torch",  # the DataLoader's parts: whole-batch workers, samplers as plans
    "_pack",  # token documents packed into fixed-length rows, around a built loader
    "loader",  # `Loader`: its parts, its arguments, its epochs (the files named in `LOADER`)
    "_mix",  # sources, or built loaders, mixed in proportion
    "aioloader",  # the front door: the package's face, DataLoader (its parts in `_torch`), the CLI
)
# The files directly in `aioloader/` that make the loader's layer.
LOADER = {"_arguments", "_parts", "_epochs", "_loader"}


def module_name(path: Path, root: Path) -> str:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer of a module: the longest entry of `LAYERS` its folder path starts with."""
    parts = module.split(".")[1:]
    if len(parts) == 1 and parts[0] in LOADER:
        return "loader"
    for depth in range(len(parts), 0, -1):
        candidate = ".".join(parts[:depth])
        if candidate in LAYERS:
            return candidate
    return "aioloader"


def runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, except those under `if TYPE_CHECKING:`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that `module` (read from `path`) imports at run time."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            if sub in modules:
                found.add(sub)
            elif target in modules:
                found.add(target)
    found.discard(module)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(paths)
    return {m: imports_of(p, m, modules) for m, p in paths.items()}


def against_the_flow(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        rank = LAYERS.index(layer_of(module))
        for target in sorted(targets):
            if LAYERS.index(layer_of(target)) > rank:
                bad.append(f"{module} ({layer_of(module)}) imports {target} ({layer_of(target)})")
    return bad


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circle_between_modules() -> None:
    assert circles(import_graph(PACKAGE)) == []


def test_no_import_against_the_flow() -> None:
    assert against_the_flow(import_graph(PACKAGE)) == []


def test_every_folder_has_a_layer() -> None:
    folders = {
        ".".join(p.parent.relative_to(PACKAGE).parts)
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    }
    assert folders <= set(LAYERS)


def test_the_loader_mix_and_torch_parts_are_layers_below_the_front_door() -> None:
    assert layer_of("aioloader._loader") == layer_of("aioloader._epochs") == "loader"
    assert layer_of("aioloader._mix.source") == "_mix"
    assert layer_of("aioloader._torch.workers") == "_torch"
    assert layer_of("aioloader.dataloader") == layer_of("aioloader.__main__") == "aioloader"
    graph = import_graph(PACKAGE)
    assert {m for m in graph if layer_of(m) == "loader"} == {f"aioloader.{n}" for n in LOADER}
    front = LAYERS.index("aioloader")
    assert LAYERS.index("_torch") < LAYERS.index("loader") < LAYERS.index("_mix") < front


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "aioloader" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "aioloader"


@pytest.mark.parametrize(
    ("files", "complaint"),
    [
        (
            {"_util/__init__.py": "", "_util/a.py": "from .._pipeline import b\n",
             "_pipeline/__init__.py": "", "_pipeline/b.py": ""},
            "against",
        ),
        (
            {"sources/__init__.py": "", "sources/transport/__init__.py": "",
             "sources/transport/a.py": "from ..stores import b\n",
             "sources/stores/__init__.py": "", "sources/stores/b.py": ""},
            "against",
        ),
        (
            {"sources/__init__.py": "", "sources/formats/__init__.py": "",
             "sources/formats/a.py": "from ..stores.b import c\nfrom ..cache import d\n",
             "sources/stores/__init__.py": "", "sources/stores/b.py": "",
             "sources/cache/__init__.py": "", "sources/cache/d.py": ""},
            None,
        ),
        (
            {"_loader.py": "from ._mix import a\n", "_mix/__init__.py": "", "_mix/a.py": ""},
            "against",
        ),
        (
            {"_mix/__init__.py": "", "_mix/a.py": "from .._loader import L\nfrom .. import _parts\n",
             "_loader.py": "", "_parts.py": "", "dataloader.py": "from ._mix import a\n"},
            None,
        ),
        (
            {"_util/__init__.py": "", "_util/a.py": "from . import b\n",
             "_util/b.py": "def f():\n    from .a import x\n"},
            "circle",
        ),
        (
            {"_util/__init__.py": "", "_util/a.py": "if TYPE_CHECKING:\n    from .._loader import L\n",
             "_loader.py": "from ._util import a\n"},
            None,
        ),
    ],
)  # fmt: skip
def test_the_checks_catch_what_they_name(
    tmp_path: Path, files: dict[str, str], complaint: str | None
) -> None:
    graph = import_graph(write(tmp_path, {"__init__.py": "", **files}))
    assert bool(against_the_flow(graph)) == (complaint == "against")
    assert bool(circles(graph)) == (complaint == "circle")
