"""What a source is: something that lists keys and fetches the raw bytes of one key."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

__all__ = ["Source"]


@runtime_checkable
class Source(Protocol):
    """A place samples come from.

    `keys()` lists the keys (a Sequence when their number is known). `fetch(key)` is a coroutine that
    returns the raw sample and is safe to cancel. `aclose()` releases connections and is idempotent.
    """

    def keys(self) -> Sequence[Any] | Iterable[Any]: ...

    async def fetch(self, key: Any) -> Any: ...

    async def aclose(self) -> None: ...
