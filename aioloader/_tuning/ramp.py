"""How a rank of a large job starts on a store the job shares: a start jitter and a concurrency ramp.

A torchrun job of 1,000 ranks starts its loaders within a second of each other. Were each to open at
its full `concurrency`, the store would see ranks x concurrency requests in one instant, throttle
them, and every rank would halve its limit at once. So a rank of a job with `world` ranks:

- waits a uniform draw from [0, `JITTER_S_PER_DOUBLING` x log2(world)] seconds before its first
  request (10 ms per doubling: 30 ms at 8 ranks, 100 ms at 1,000), so that ranks started together
  reach the store spread out; and
- starts with `BURST // world` requests in flight (at least `LEAST_START`, at most its
  concurrency), growing by one per answer (doubling per round trip, as TCP's slow start does) until
  it reaches its concurrency or is first throttled (then AIMD, `aimd.py`, takes over). The job's
  opening burst is then about `BURST` requests, whatever its size; up to 16 ranks of concurrency 64
  start at full speed.

A process alone (world 1) starts at once, at full concurrency. The draw is deterministic: seeded
by the job's seed and the rank.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from .._util.ranks import resolve_rank

__all__ = ["BURST", "JITTER_S_PER_DOUBLING", "LEAST_START", "Ramp", "job_position"]

BURST = 1024  # requests in flight the whole job opens with, about
LEAST_START = 2  # the fewest requests in flight a rank starts with
JITTER_S_PER_DOUBLING = 0.010  # the start jitter's span, per doubling of the world size


@dataclass(frozen=True)
class Ramp:
    """A rank's start: `start` requests in flight at first, after `delay_s` seconds.

    Example:
        >>> Ramp.for_job(64, world=1000, rank=3).start
        2
        >>> Ramp.for_job(64, world=8, rank=3).start
        64
    """

    start: int
    delay_s: float

    @classmethod
    def for_job(
        cls, concurrency: int, world: int | None = None, rank: int | None = None, seed: int = 0
    ) -> Ramp:
        """The start of rank `rank` of `world` (None: the job's, see `job_position`)."""
        if world is None or rank is None:
            rank, world = job_position()
        if world <= 1:
            return cls(concurrency, 0.0)
        rng = random.Random(f"aioloader-ramp:{seed}:{rank}")
        span = JITTER_S_PER_DOUBLING * math.log2(world)
        start = max(min(LEAST_START, concurrency), min(concurrency, BURST // world))
        return cls(start, rng.uniform(0.0, span))


def job_position() -> tuple[int, int]:
    """(rank, world size) as the loader finds them (`resolve_rank`: torch.distributed's group, else
    torchrun's RANK and WORLD_SIZE), else (0, 1): a malformed pair only costs the ramp, not the
    run (the loader that needs the pair says what is wrong with it)."""
    try:
        return resolve_rank(None, None)
    except (TypeError, ValueError):
        return 0, 1
