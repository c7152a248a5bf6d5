"""A Loader is made of parts, not of bases: what one batch goes through is read in one class at a time.

`DataLoader` hands a `Loader` its parts (`_parts.py`) and overrides none of its private methods; the
loader's classes have at most one of the package's classes above them (a `DataLoader` is a `Loader`),
not a chain of bases each overriding the one before.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from aioloader import DataLoader, Loader

PACKAGE = Path(__file__).resolve().parent.parent / "aioloader"

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

# the modules whose classes make up a loader
MODULES = ("_loader.py", "_epochs.py", "_parts.py", "dataloader.py", "_resume", "_torch")


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
    names = []
    for entry in MODULES:
        path = PACKAGE / entry
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        for file in files:
            parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


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


@pytest.mark.parametrize("module", module_names())
def test_a_loaders_classes_have_one_package_base_at_most(module: str) -> None:
    deep = {c.__qualname__: package_bases(c) for c in classes_of(module)}
    assert {name: bases for name, bases in deep.items() if len(bases) > 1} == {}


def test_the_modules_are_found() -> None:
    names = module_names()
    assert {"aioloader._loader", "aioloader.dataloader", "aioloader._resume.resume"} <= set(names)
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
