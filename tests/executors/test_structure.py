"""The process pool is made of parts that it owns, not of layers of subclasses.

Every class of a package (its modules walked with pkgutil and imported) may build on one class of
aioloader at most: no class inherits from an aioloader class that itself inherits from another. A
chain of subclasses, each reaching the state of all below it, splits code by file rather than by
responsibility. Exceptions and Protocols are left out (their hierarchies are what they name).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Iterator

import pytest

# The process executor's package only, for now: the loader's classes are being reworked on another
# branch; the whole package (`aioloader`) joins this list once that lands.
PACKAGES = ("aioloader._executors.process",)


def classes(package: str) -> Iterator[type]:
    """Every class defined at the top level of `package`'s modules."""
    root = importlib.import_module(package)
    names = [package, *(m.name for m in pkgutil.walk_packages(root.__path__, f"{package}."))]
    for name in names:
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name:
                yield cls


def ours(cls: type, root: str = "aioloader") -> list[type]:
    """The classes of package `root` that `cls` builds on (its MRO but itself)."""
    return [c for c in cls.__mro__[1:] if c.__module__.partition(".")[0] == root]


def too_deep(cls: type, root: str = "aioloader") -> bool:
    """Whether `cls` (not an exception, not a Protocol) builds on more than one class of `root`."""
    if issubclass(cls, BaseException) or getattr(cls, "_is_protocol", False):
        return False
    return len(ours(cls, root)) > 1


@pytest.mark.parametrize("package", PACKAGES)
def test_no_class_builds_on_a_chain_of_aioloader_classes(package: str) -> None:
    found = list(classes(package))
    assert len(found) > 10  # the walk found the package's classes
    deep = {
        f"{c.__module__}.{c.__qualname__}": [b.__name__ for b in ours(c)]
        for c in found
        if too_deep(c)
    }
    assert deep == {}  # each: the aioloader classes it builds on


class _Base:
    pass


class _One(_Base):
    pass


class _Two(_One):
    pass


class _Mixed(_One, Exception):
    pass


def test_the_check_catches_a_chain() -> None:
    here = __name__.partition(".")[0]  # this module's classes stand for aioloader's
    assert not too_deep(_Base, here)
    assert not too_deep(_One, here)  # one class of the package below it: allowed
    assert too_deep(_Two, here)
    assert not too_deep(_Mixed, here)  # an exception
    assert not too_deep(_Two)  # none of aioloader's
