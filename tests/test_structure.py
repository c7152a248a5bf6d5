"""Parts, not bases: what one batch goes through is read in one class at a time.

`DataLoader` hands a `Loader` its parts (`_parts.py`) and overrides none of its private methods; the
process pool owns its parts (`_executors/process/dispatcher.py`). Every class of the package (its
modules walked with pkgutil and imported) has at most one of the package's classes above it (a
`DataLoader` is a `Loader`), not a chain of bases each reaching the state of all below it. Exceptions
and Protocols are left out: their hierarchies are what they name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

from aioloader import DataLoader, Loader

# what Python (or `Generic`) puts in a class's namespace, and the constructor
STRUCTURAL = {
    "__init__", "__doc__", "__module__", "__qualname__", "__annotations__", "__dict__",
    "__weakref__", "__slots__", "__parameters__", "__orig_bases__", "__firstlineno__",
    "__static_attributes__", "__annotate__", "__classdictcell__",
}  # fmt: skip
# the dunders a DataLoader defines because torch's DataLoader does, with the reason
TORCH_DUNDERS = {
    "__setattr__": "torch raises ValueError when a fixed attribute (batch_size, sampler, ...) is "
    "set after init",
}

# Chains that are known, with the reason: the test fails when one is undone (drop it here) or a new
# one appears.
KNOWN_CHAINS: dict[str, list[str]] = {
    # torchdata's class name, for trainers that import or subclass it (a class, not a factory:
    # they subclass it); it adds an argument and sets two class-level choices, nothing more
    "aioloader.dataloader.StatefulDataLoader": ["DataLoader", "Loader"],
    # the stores that list a bucket: `Bucket` holds no state, only the methods that ask the
    # store's `listing` part, written once for the three
    "aioloader.sources.stores.s3.S3": ["Bucket", "Remote"],
    "aioloader.sources.stores.gcs.GCS": ["Bucket", "Remote"],
    "aioloader.sources.stores.azure.Azure": ["Bucket", "Remote"],
}


def private_overrides(cls: type, base: type) -> list[str]:
    """The names starting with "_" that `cls` defines and `base` (or a class above it) has too,
    other than the structural ones and torch's dunders."""
    return sorted(
        name
        for name in vars(cls)
        if name.startswith("_")
        and name not in STRUCTURAL
        and name not in TORCH_DUNDERS
        and name in dir(base)
    )


def package_bases(cls: type) -> list[str]:
    """The package's classes above `cls` (not `Generic`, `Protocol` nor any other outside class)."""
    return [c.__name__ for c in cls.__mro__[1:] if c.__module__.split(".")[0] == "aioloader"]


def module_names() -> list[str]:
    """Every module of the package."""
    root = importlib.import_module("aioloader")
    return ["aioloader", *(m.name for m in pkgutil.walk_packages(root.__path__, "aioloader."))]


def classes_of(module: str) -> list[type]:
    """The classes `module` defines, less exceptions and Protocols."""
    found = vars(importlib.import_module(module)).values()
    return [
        c
        for c in found
        if inspect.isclass(c)
        and c.__module__ == module
        and not issubclass(c, BaseException)
        and not getattr(c, "_is_protocol", False)
    ]


def test_the_dataloader_overrides_no_private_method_of_a_loader() -> None:
    assert private_overrides(DataLoader, Loader) == []


def test_the_torch_dunders_are_the_dataloaders_own() -> None:
    defined = set(vars(DataLoader))
    assert set(TORCH_DUNDERS) <= defined  # else drop the exception from the list


def test_no_class_builds_on_a_chain_of_the_packages_classes() -> None:
    deep = {
        f"{c.__module__}.{c.__qualname__}": package_bases(c)
        for module in module_names()
        for c in classes_of(module)
        if len(package_bases(c)) > 1
    }
    assert deep == KNOWN_CHAINS


def test_the_modules_are_found() -> None:
    names = module_names()
    assert {"aioloader._loader", "aioloader.dataloader", "aioloader._resume.resume"} <= set(names)
    assert {"aioloader._executors.process.dispatcher", "aioloader.sources.stores.s3"} <= set(names)
    assert any(name.startswith("aioloader._torch.") for name in names)


def test_the_checks_catch_what_they_name() -> None:
    class Base:
        __module__ = "aioloader._chain"  # as if the package's

        def _config(self) -> list[str]:
            return []

    class Middle(Base):
        __module__ = "aioloader._chain"

    class Overrides(Middle):
        _workers_argument = "n"

        def _config(self) -> list[str]:
            return ["x"]

        def _own(self) -> None:
            pass

        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, value)

    assert private_overrides(Overrides, Middle) == ["_config"]  # not `_own`, nor torch's dunder
    assert private_overrides(Overrides, object) == []
    assert package_bases(Overrides) == ["Middle", "Base"]  # a chain: one too many
    assert package_bases(Middle) == ["Base"]
    assert package_bases(DataLoader) == ["Loader"]


# -- no module calls a private attribute of another module's class -------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "aioloader"
# Python's own names with a leading underscore that are public (a namedtuple's methods, `os._exit`)
PUBLIC_UNDERSCORED = {"_replace", "_fields", "_asdict", "_make", "_exit"}
# where the private names of dependencies live, each behind a function (`_util/deps.py`)
DEPENDENCIES_HOME = "_util/deps.py"
# Private calls across modules that are known and not yet undone: the test fails when one is undone
# (drop it here) or a new one appears.
KNOWN_PRIVATE_CALLS: set[tuple[str, str]] = set()


def private_calls(path: Path) -> set[str]:
    """The private attributes `path` reaches on objects not its own: `x._name` where `x` is not
    `self` or `cls` and `_name` is defined by none of the module's own classes or functions."""
    tree = ast.parse(path.read_text())
    own = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }
    own |= {
        target.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
    }  # attributes the module's classes set on themselves (`self._x = ...`)
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        name = node.attr
        if not name.startswith("_") or name.startswith("__") or name in PUBLIC_UNDERSCORED:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        if name in own and not ast.unparse(base).startswith("super()"):
            continue  # the module's own (another instance of its class, a helper of its own)
        found.add(ast.unparse(node))
    return found


def test_no_module_calls_a_private_attribute_of_another_modules_class() -> None:
    calls = {
        (path.relative_to(PACKAGE).as_posix(), call)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).as_posix() != DEPENDENCIES_HOME
        for call in private_calls(path)
    }
    assert calls == KNOWN_PRIVATE_CALLS


def test_private_calls_are_found(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "class A:\n    def _mine(self):\n        return self._x\n"
        "    def other(self, b):\n        return b._theirs(), self._mine(), A()._mine()\n"
        "def f(loader):\n    return loader._resume_at(1)\n"
    )
    assert private_calls(module) == {"b._theirs", "loader._resume_at"}
