"""The public surface is exactly what `__all__` says."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest

import aioloader

PACKAGES = ["aioloader", "aioloader.sources"]


def isort_key(name: str) -> tuple[int, str]:
    """The order ruff's RUF022 keeps `__all__` in: CONSTANTS, then Classes, then the rest."""
    if name.isupper() and len(name) > 1:
        return 0, name
    if name[:1].isupper():
        return 1, name
    return 2, name


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_sorted_and_unique(package: str) -> None:
    names = importlib.import_module(package).__all__
    assert list(names) == sorted(names, key=isort_key)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_all_exists(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def is_own_submodule(module: types.ModuleType, value: object) -> bool:
    return isinstance(value, types.ModuleType) and value.__name__.startswith(module.__name__ + ".")


@pytest.mark.parametrize("package", PACKAGES)
def test_nothing_public_is_left_out_of_all(package: str) -> None:
    module = importlib.import_module(package)
    public = {
        name
        for name in dir(module)
        if not name.startswith("_") and not is_own_submodule(module, getattr(module, name))
    }
    subpackages = {
        name for name in module.__all__ if is_own_submodule(module, getattr(module, name))
    }
    assert public == set(module.__all__) - subpackages


def test_public_names_come_from_the_package() -> None:
    for name in aioloader.__all__:
        value = getattr(aioloader, name)
        owner = getattr(value, "__module__", None) or getattr(value, "__name__", "")
        if isinstance(value, type | types.FunctionType | types.ModuleType):
            assert owner.startswith("aioloader"), f"{name} comes from {owner}"


def test_errors_share_one_base() -> None:
    errors = [getattr(aioloader, n) for n in aioloader.__all__ if n.endswith(("Error", "Timeout"))]
    assert errors
    for error in errors:
        assert issubclass(error, aioloader.AioloaderError), error


def test_package_is_typed() -> None:
    assert (Path(aioloader.__file__).parent / "py.typed").is_file()


def test_version_is_a_string() -> None:
    assert isinstance(aioloader.__version__, str)
    assert aioloader.__version__.count(".") >= 1
