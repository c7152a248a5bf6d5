"""Argument checks shared by the constructors: each error names the argument."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["check_callable", "check_int", "check_timeout"]


def check_int(name: str, value: Any, *, minimum: int) -> int:
    """`value` must be an int (not a bool) of at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_callable(name: str, value: Any, *, optional: bool = False) -> None:
    """`value` must be callable (or None when `optional`)."""
    if value is None and optional:
        return
    if not callable(value):
        raise TypeError(f"{name} must be callable, got {type(value).__name__} {value!r}")


def check_timeout(name: str, value: Any) -> float | None:
    """None, or a positive finite number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number of seconds or None, got {value!r}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be > 0 seconds, got {value}")
    return float(value)
