"""When to try a remote read again, and how long to wait first: capped exponential backoff, full jitter.

`Retry.delay(attempt)` is a uniform draw from [0, min(max_backoff, backoff * 2**(attempt-1))] ("full
jitter"), so that many clients failing together do not retry together. A server's `Retry-After` is a
floor on the wait (capped at `max_retry_after`). `attempts` bounds the failures that are not
throttling; a throttled answer is retried until the read's deadline (`Transport`), its backoff
counted by the throttles so far but its ceiling held at `max_throttle_backoff` (1 s): a throttle
that lasts seconds must not leave reads asleep for seconds more after the store has recovered, so
each throttled read asks again within a second, and the AIMD limit (`_tuning/aimd.py`), not the
wait, is what lowers the rate the store sees.
"""

from __future__ import annotations

import email.utils
import math
import random
import time
from dataclasses import dataclass, field

from ..._util.validate import check_int, check_timeout

__all__ = [
    "ATTEMPTS",
    "BACKOFF",
    "CONNECT_TIMEOUT",
    "DEADLINE",
    "MAX_BACKOFF",
    "MAX_THROTTLE_BACKOFF",
    "READ_TIMEOUT",
    "RETRY_STATUSES",
    "Retry",
    "Timeouts",
    "parse_retry_after",
]

# The defaults of every remote source (http, s3, tar shards), held here only; README's figures are
# checked against them by tests/test_readme.py.
CONNECT_TIMEOUT = 10.0  # seconds to open one connection, per attempt
READ_TIMEOUT = 30.0  # seconds without a byte arriving, per attempt
DEADLINE = 120.0  # seconds for one sample, retries and backoff included
ATTEMPTS = 5  # attempts in all
BACKOFF = 0.1  # the first backoff ceiling, seconds
MAX_BACKOFF = 10.0  # the largest backoff ceiling, seconds
MAX_THROTTLE_BACKOFF = 1.0  # the largest backoff ceiling of a throttled read, seconds

# Statuses that say "not now" rather than "never": timeouts, throttling and transient server errors.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def _check_seconds(name: str, value: float | None, *, optional: bool = True) -> None:
    if value is None and not optional:
        raise TypeError(f"{name} must be a number of seconds, got None")
    check_timeout(name, value)


@dataclass(frozen=True)
class Timeouts:
    """Time limits of a remote read.

    Attributes:
        connect: seconds to open one connection (per attempt).
        read: seconds without a byte arriving before an attempt is abandoned (per attempt).
        deadline: seconds for the whole sample, retries and backoff included (None: no limit).
    """

    connect: float | None = CONNECT_TIMEOUT
    read: float | None = READ_TIMEOUT
    deadline: float | None = DEADLINE

    def __post_init__(self) -> None:
        _check_seconds("connect_timeout", self.connect)
        _check_seconds("read_timeout", self.read)
        _check_seconds("deadline", self.deadline)


@dataclass(frozen=True)
class Retry:
    """How often, and after how long, a failed read is tried again.

    Attributes:
        attempts: attempts in all for failures other than throttling (1: never retry, not even a
            throttled answer, which is otherwise retried until the deadline).
        backoff: the first backoff ceiling in seconds; doubles with each attempt.
        max_backoff: the largest backoff ceiling.
        max_throttle_backoff: the largest backoff ceiling after a throttled answer (at most
            `max_backoff`): how long past a throttle's end a read may still wait.
        max_retry_after: the longest `Retry-After` honoured; a longer one is cut to this.
        statuses: HTTP statuses that are retried.
    """

    attempts: int = ATTEMPTS
    backoff: float = BACKOFF
    max_backoff: float = MAX_BACKOFF
    max_retry_after: float = 60.0
    max_throttle_backoff: float = MAX_THROTTLE_BACKOFF
    statuses: frozenset[int] = RETRY_STATUSES
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_int("attempts", self.attempts, minimum=1)
        _check_seconds("backoff", self.backoff, optional=False)
        _check_seconds("max_backoff", self.max_backoff, optional=False)
        _check_seconds("max_retry_after", self.max_retry_after, optional=False)
        _check_seconds("max_throttle_backoff", self.max_throttle_backoff, optional=False)

    def delay(
        self, attempt: int, retry_after: float | None = None, throttled: bool = False
    ) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based; of a throttled read
        (`throttled`): its throttle number `attempt`)."""
        largest = min(self.max_backoff, self.max_throttle_backoff if throttled else math.inf)
        ceiling = min(largest, self.backoff * 2.0 ** min(attempt - 1, 60))
        wait = self.rng.uniform(0.0, ceiling)
        if retry_after is not None:
            wait = max(wait, min(retry_after, self.max_retry_after))
        return wait


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a `Retry-After` header (delta-seconds or an HTTP date); None if absent or bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
