"""The samples of `streams.py`, as every contender's writer makes them (its own and its peers' in
`_streampeers.py`): random bytes of 100-120 KB each, the same for a given count."""

from __future__ import annotations

SIZES = (100_000, 120_000)  # each sample's bytes, drawn uniformly


def make_samples(n: int) -> tuple[list[int], bytes]:
    """The byte length of each sample, and a pool of random bytes the samples are cut from."""
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = rng.integers(SIZES[0], SIZES[1], n).tolist()
    return sizes, rng.bytes(4 * SIZES[1])


def sample_bytes(i: int, sizes: list[int], pool: bytes) -> bytes:
    start = (i * 7919) % (len(pool) - sizes[i])
    return pool[start : start + sizes[i]]
