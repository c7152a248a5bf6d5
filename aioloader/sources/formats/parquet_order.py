"""The parquet source's epoch order: row groups shuffled, rows mixed in a bounded window, shares cut whole.

For one epoch of N rows in R row groups:

1. the row groups in an order drawn from (seed, epoch) (or as stored, without shuffle), their rows
   concatenated: the epoch's rows in row-group order;
2. with a shuffle buffer of B rows, each row i is sorted by i + u_i * B (u_i uniform in [0, 1) from
   the same generator): a row moves fewer than B places, so rows that are close in the epoch come
   from few row groups and a reader holds only those; B rows of look-ahead suffice to emit in order;
3. the indices into that order not yet consumed are cut into one contiguous share per reader (rank,
   or rank and worker), all of one length: ceil(left / readers), the last share padded by wrapping
   around to the start (as the order stage pads), or floor with `drop_last`. Contiguous shares keep a
   row group on one reader, except the ones cut at a share's ends.

Everything is computed from the footers, before any row is read, so a resumed epoch knows which row
groups it still needs without reading the ones it skips.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..._util.ranges import Ranges

__all__ = ["epoch_rows", "remaining", "share"]


def epoch_rows(
    row_counts: Sequence[int], shuffle: bool, shuffle_buffer: int, seed: int, epoch: int
) -> np.ndarray:
    """The global row numbers of every row, in the epoch's order (steps 1 and 2 above)."""
    counts = np.asarray(row_counts, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    n = int(starts[-1])
    order = np.arange(len(counts))
    rng = np.random.default_rng([seed, epoch])
    if shuffle:
        rng.shuffle(order)
    rows = np.concatenate(
        [np.arange(starts[g], starts[g + 1], dtype=np.int64) for g in order]
        or [np.zeros(0, np.int64)]
    )
    if shuffle and shuffle_buffer > 1 and n:
        keys = np.arange(n, dtype=np.float64) + rng.random(n) * shuffle_buffer
        rows = rows[np.argsort(keys, kind="stable")]
    return rows


def remaining(consumed: Ranges, n: int) -> np.ndarray:
    """The indices in [0, n) not in `consumed`, ascending."""
    if not len(consumed):
        return np.arange(n, dtype=np.int64)
    return np.asarray(consumed.complement(n), dtype=np.int64)


def share(left: np.ndarray, slot: int, slots: int, drop_last: bool) -> np.ndarray:
    """Reader `slot`'s contiguous share of `left` among `slots` readers (step 3 above)."""
    m = len(left)
    if m == 0:
        return left
    per = m // slots if drop_last else -(-m // slots)
    if (slot + 1) * per <= m:  # no wrapping around: a view
        return left[slot * per : (slot + 1) * per]
    return left[np.arange(slot * per, (slot + 1) * per) % m]
