"""Comparing batches: `assert_same(ours, theirs)` for two nested structures of tensors, arrays and
plain values (what a collate makes), naming the path to the first difference."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["assert_same"]


def assert_same(ours: Any, theirs: Any, path: str = "batch") -> None:
    """Same structure, container types, dtypes, shapes and values (NaN equal to NaN)."""
    assert type(ours) is type(theirs), f"{path}: {type(ours)} != {type(theirs)}"
    if ours is theirs:
        return
    if isinstance(theirs, np.ndarray | torch.Tensor):
        assert ours.dtype == theirs.dtype, f"{path}: {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape, f"{path}: {ours.shape} != {theirs.shape}"
        if isinstance(theirs, np.ndarray):
            same = np.array_equal(ours, theirs, equal_nan=theirs.dtype.kind in "fc")
        else:
            same = torch.equal(ours, theirs) or torch.allclose(ours, theirs, 0, 0, equal_nan=True)
        assert same, f"{path}: {ours} != {theirs}"
    elif isinstance(theirs, Mapping):
        assert list(ours) == list(theirs), f"{path}: keys {list(ours)} != {list(theirs)}"
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs), f"{path}: len {len(ours)} != {len(theirs)}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float) and math.isnan(theirs):
        assert math.isnan(ours), f"{path}: {ours!r} is not NaN"
    else:
        assert ours == theirs, f"{path}: {ours!r} != {theirs!r}"
