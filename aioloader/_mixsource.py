"""The mix as a source: its keys (`MixKey`s, one epoch per iteration of `keys()`) and its fetch.

See `_mix.py` for the rule a mix follows; `_mixparts.py` for how each input gives its keys.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from ._exceptions import FetchError, InvalidKeyError
from ._mixchoice import Choices
from ._mixparts import END, Indexed, Part, Pass, make_part
from ._util.threads import LazyThreadPool
from ._util.validate import check_int
from .sources.protocol import HasStats

__all__ = ["Mix", "MixEpochs", "MixKey", "label"]

_FETCH_THREADS = 64  # the most threads for sync fetches (a map-style dataset's __getitem__)


class MixKey:
    """The key of one mixed sample: which source (`source`, its index; `name`, its mapping key or
    None), that source's own `epoch`, its `index` in that epoch, and the source's own `key`.

    A decode given the key (`Loader(..., decode_with_key=True)`) can tell the sources apart by it.
    (A plain class with slots: one is made per sample, so it must be cheap; it pickles.)
    """

    __slots__ = ("epoch", "index", "key", "name", "source")

    def __init__(self, source: int, name: str | None, epoch: int, index: int, key: Any) -> None:
        self.source, self.name, self.epoch, self.index, self.key = source, name, epoch, index, key

    def _fields(self) -> tuple[Any, ...]:
        return self.source, self.name, self.epoch, self.index, self.key

    def __eq__(self, other: object) -> bool:
        return type(other) is MixKey and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        which = self.source if self.name is None else repr(self.name)
        return f"<mix source {which} epoch {self.epoch} #{self.index}: {self.key!r}>"


class MixEpochs:
    """`Mix.keys()`: an async iterable whose every iteration streams one more epoch of `MixKey`s."""

    def __init__(self, mix: Mix) -> None:
        self._mix = mix

    def __aiter__(self) -> AsyncIterator[MixKey]:
        return self._mix.stream(self._mix.next_epoch())

    def start_at(self, epoch: int, position: int) -> bool:
        """Make the next iteration of `epoch` begin at `position` (a loader resuming it): the
        sources are moved there by counting the draws before it, not by making their keys."""
        self._mix.starts[epoch] = position
        return True

    def digest(self) -> str:
        """What a saved loader state checks: the mix's configuration (not its progress)."""
        return self._mix.digest()


class Mix:
    """Sources mixed in set proportions, as a source of a `Loader`. Made by `aioloader.mix()`.

    `keys()` streams the epoch's `MixKey`s (each iteration is one epoch; `set_epoch(e)` picks it),
    `fetch(key)` fetches the sample from its source (errors as `FetchError` naming the source and
    key), `draws(epoch, n)` gives the first `n` choices of an epoch. `aclose()` closes every source
    (the loader calls it at its close). One loader at a time may iterate a mix.
    """

    shuffles_how = (
        "the choices from (seed, epoch, position); each source with a length in a permutation of "
        "its own per epoch unless mix(..., shuffle=False)"
    )  # what a Loader given shuffle=True says

    def __init__(
        self, sources: Sequence[Any], names: Sequence[str | None], weights: Sequence[float], *,
        seed: int, stop: str, shuffle: bool,
    ) -> None:  # fmt: skip
        self._threads = LazyThreadPool(_FETCH_THREADS, "aioloader-mix")
        self.weights, self.seed, self.stop, self.shuffle = list(weights), seed, stop, shuffle
        self.names = list(names)
        self._sources = list(sources)
        self.parts: list[Part] = [
            make_part(label(i, name), i, obj, self._threads, shuffle=shuffle, seed=seed)
            for i, (obj, name) in enumerate(zip(sources, names, strict=True))
        ]
        self._epoch = 0
        self.starts: dict[int, int] = {}  # epoch -> the position its next stream begins at

    def __repr__(self) -> str:
        shown = [_short(s) for s in self._sources]
        inner = (
            f"[{', '.join(shown)}]"
            if self.names == [None] * len(self.names)
            else "{"
            + ", ".join(f"{n!r}: {s}" for n, s in zip(self.names, shown, strict=True))
            + "}"
        )
        return (
            f"mix({inner}, weights={self.weights}, seed={self.seed}, stop={self.stop!r}, "
            f"shuffle={self.shuffle})"
        )

    # -- the source's side ---------------------------------------------------------------------------

    def keys(self) -> MixEpochs:
        """An async iterable of the `MixKey`s of one epoch per iteration (streamed, no length)."""
        return MixEpochs(self)

    async def fetch(self, key: MixKey) -> Any:
        """The sample `key` names, fetched from its source; a failure is a `FetchError` naming the
        source and its key (the source's own error is its `__cause__`)."""
        if type(key) is not MixKey:
            raise InvalidKeyError(f"key: a mix fetches MixKeys, got {key!r}")
        part = self.parts[key.source]
        try:
            if part.fetch_fn is None:  # the key is the sample
                return key.key
            if part.fetches_async:  # (no coroutine of the part's own in between: one per sample)
                return await part.fetch_fn(key.key)
            return await self._threads.run(part.fetch_fn, key.key)
        except Exception as exc:
            raise FetchError(
                f"mix: {self.parts[key.source].name} failed to fetch key {key.key!r} (its epoch "
                f"{key.epoch}, #{key.index}): {type(exc).__name__}: {exc}",
                key=key, stage="fetch",
            ) from exc  # fmt: skip

    def size(self, key: MixKey) -> int | None:
        """The bytes `fetch(key)` will give, where its source knows them without I/O."""
        return self.parts[key.source].size(key.key)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration of `keys()` stream `epoch`."""
        self._epoch = check_int("epoch", epoch, minimum=0)

    def next_epoch(self) -> int:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return epoch

    def bind(self, *, rank: int, world_size: int) -> None:
        """Share every source among the ranks (a loader calls this; it leaves the mix unsharded).

        A source with a length is dealt out as the order stage deals keys (equal counts, padded);
        one that shards itself (tar shards) is bound; any other stream cannot be shared.
        """
        for part in self.parts:
            part.bind(rank, world_size)

    def stats(self) -> dict[str, float]:
        """The retries and throttles of the remote sources in the mix, summed."""
        counts = {"retries": 0.0, "throttles": 0.0}
        for source in self._sources:
            if isinstance(source, HasStats) and callable(source.stats):
                theirs = source.stats()
                for name in counts:
                    counts[name] += float(theirs.get(name) or 0)
        return counts

    async def aclose(self) -> None:
        """Stop every read ahead, close the sources that can be closed and the fetch threads."""
        for part in self.parts:
            for open_pass in list(getattr(part, "passes", ())):
                await open_pass.aclose()
        for source in self._sources:
            close = getattr(source, "aclose", None)
            if close is not None:
                await close()
        self._threads.close()

    # -- the mix -----------------------------------------------------------------------------------

    def draws(self, epoch: int, n: int) -> list[int]:
        """The sources drawn by the first `n` positions of `epoch` (indices into the sources)."""
        choices = Choices(self.weights, self.seed, epoch)
        return [choices.at(p) for p in range(n)]

    def digest(self) -> str:
        parts = ", ".join(part.digest() for part in self.parts)
        return (
            f"mix(weights={self.weights}, seed={self.seed}, stop={self.stop}, "
            f"shuffle={self.shuffle}, sources=[{parts}])"
        )

    async def stream(self, epoch: int) -> AsyncIterator[MixKey]:
        """The `MixKey`s of `epoch`, in the mix's order (see the module docstring for the rule)."""
        choices = Choices(self.weights, self.seed, epoch)
        live = {i for i, w in enumerate(self.weights) if w > 0}
        start = self.starts.pop(epoch, 0)
        self.starts.clear()  # a start left for another epoch is stale once this one streams
        drawn = choices.counts(start)
        passes: dict[int, Pass] = {}
        ran_out: set[int] = set()
        try:
            for i in sorted(live):  # all read ahead at once
                await self._advance(i, epoch, passes, drawn[i], ran_out)
            for i in choices.iter_from(start):
                current = passes[i]
                key = current.take() if current.at_hand else await current.next()
                if key is END:
                    ran_out.add(i)
                    if self.stop == "first_exhausted" or (
                        self.stop == "all_exhausted" and ran_out >= live
                    ):
                        return
                    await current.aclose()
                    current = passes[i] = self.parts[i].open(current.epoch + 1)
                    key = await current.next()
                    if key is END:
                        raise ValueError(self._empty(i, current.epoch))
                yield MixKey(i, self.names[i], current.epoch, current.index - 1, key)
        finally:
            for open_pass in passes.values():
                await open_pass.aclose()

    async def _advance(
        self, i: int, epoch: int, passes: dict[int, Pass], drawn: int, ran_out: set[int]
    ) -> None:
        """Open source `i`'s pass in `passes` where `drawn` draws have left it: for a source with
        a length, by arithmetic; for a stream, by reading (and dropping) that many keys."""
        part = self.parts[i]
        if isinstance(part, Indexed) and drawn:
            passes_done, index = divmod(drawn - 1, part.length())
            if passes_done:
                ran_out.add(i)  # a draw found it empty and started its next epoch
            passes[i] = part.open(epoch + passes_done, index + 1)
            return
        current = passes[i] = part.open(epoch)
        for _ in range(drawn):
            if await current.next() is END:
                ran_out.add(i)
                await current.aclose()
                current = passes[i] = part.open(current.epoch + 1)
                if await current.next() is END:
                    raise ValueError(self._empty(i, current.epoch))

    def _empty(self, i: int, epoch: int) -> str:
        return (
            f"mix: {self.parts[i].name} gave no samples in its epoch {epoch}, so it cannot start "
            f"again (stop={self.stop!r}); a one-shot iterator (a generator) gives its samples once: "
            "pass a sequence or an iterable that starts again each time it is iterated"
        )


def _short(obj: object, most: int = 60) -> str:
    """`repr(obj)`, cut to `most` characters (a list of samples would fill the screen)."""
    text = repr(obj)
    return text if len(text) <= most else text[: most - 3] + "..."


def label(index: int, name: str | None) -> str:
    return f"sources[{index}]" if name is None else f"sources[{name!r}]"
