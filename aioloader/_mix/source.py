"""The mix as a source: its keys (`MixKey`s, one epoch per iteration of `keys()`) and its fetch.

See `mix.py` for the rule a mix follows; `parts.py` for how each input gives its keys.

Across ranks, every rank draws the same sources at the same positions and each source gives every
rank as many keys (its share, padded), so every rank's epoch ends at the same position: equal steps.
For a resume on another world size, the positions of the mix are the sources' own, laid end to end:
pass `k` of source `i` (its epoch `e + k`) holds positions `k * T + base_i + j` for the `j`-th of its
N_i positions (T: all sources' N together, base_i: those before `i`); a saved state's delivered
samples are counted there (`positions`), and so are the positions the uninterrupted epoch would never
have reached (`left_out`: with stop "first_exhausted" the rest of every source but the first to run
out; with "all_exhausted", beyond the passes it reached). The resumed epoch draws on from the
furthest draw an old rank had made (`based`, which its states record: a schedule goes on from
there), each source giving the new rank its share of what is left, under the elastic rule: a source
whose share is spent is passed over when drawn (it goes on to its next pass only where that pass
holds positions left), and the epoch ends once every source's is spent. So every sample of the
uninterrupted epoch comes once, before the save or after the restore (the new shares' padding
aside), whatever the world sizes. ("cycle" never ends: what was delivered is all that is taken out.)

Weights changed at a load (`load_draws`) draw from the saved reader's furthest draw on (on another
world size, from where the new draws begin); the draws before are made again under the weights that
made them (`changes`, which the states record), so the sources are placed where they stood.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._exceptions import FetchError, InvalidKeyError, StateError
from .._protocol import HasAclose, HasStats
from .._util.ranges import Ranges, ranges_of
from .._util.threads import LazyThreadPool
from .._util.validate import check_int
from .choices import Choices, Schedule, check_weights, own_weights, weights_config, weights_of
from .parts import END, Indexed, Part, Pass, make_part

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
        self, sources: Sequence[Any], names: Sequence[str | None],
        weights: Sequence[float] | Schedule, *,
        seed: int, stop: str, shuffle: bool,
    ) -> None:  # fmt: skip
        self._threads = LazyThreadPool(_FETCH_THREADS, "aioloader-mix")
        self.weights, self.seed, self.stop, self.shuffle = own_weights(weights), seed, stop, shuffle
        self.names = list(names)
        self._sources = list(sources)
        self.parts: list[Part] = [
            make_part(label(i, name), i, obj, self._threads, shuffle=shuffle, seed=seed)
            for i, (obj, name) in enumerate(zip(sources, names, strict=True))
        ]
        self._epoch = 0
        self.starts: dict[int, int] = {}  # epoch -> the position its next stream begins at
        self.changes: list[dict[str, Any]] = []  # where loads changed the weights (`load_draws`)
        # (epoch, draw): where the draws of an epoch resumed on another world size begin
        self.based: tuple[int, int] | None = None
        self._walked: list[float] | Schedule | None = None  # (an elastic load) the old weights
        self._pending: Any = None  # (an elastic load) the old weights' record, to change from
        self.rank, self.world_size = 0, 1

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
        self.rank, self.world_size = rank, world_size

    def rank_and_world(self) -> tuple[int, int]:
        """This rank's place: what a loader's state records."""
        return self.rank, self.world_size

    def share_keys(self, epoch: int, consumed: Ranges, drop_last: bool) -> AsyncIterator[MixKey]:
        """This rank's `MixKey`s of `epoch`, once the positions in `consumed` are taken out."""
        return self.stream(epoch, consumed)

    def positions(
        self, epoch: int, consumed: Ranges, drop_last: bool, rank: int, world_size: int,
        stop: int | None,
    ) -> list[int]:  # fmt: skip
        """The positions (see the module's docstring) of the first `stop` keys of `epoch` that
        `rank` of `world_size` streamed, found from the draws and the sources' shares alone;
        StateError when a source cannot say (a stream without a known size)."""
        layout = _Layout(self, consumed, world_size)
        walk = self._walk(epoch, layout, rank, elastic=bool(consumed) and self.stop != "cycle")
        return [layout.position(i, k, local) for i, k, local in itertools.islice(walk, stop)]

    def left_out(self, epoch: int, consumed: Ranges, world_size: int) -> Ranges:
        """The positions of `epoch` (see the module's docstring) that `world_size` readers going
        on from `consumed` would not reach before the epoch ends; none for stop "cycle" (an epoch
        without an end). A resume on another world size counts them as consumed, so that the
        resumed epoch ends with the uninterrupted one (the elastic rule of `stream`)."""
        if self.stop == "cycle":
            return Ranges()
        layout = _Layout(self, consumed, world_size)
        taken: dict[tuple[int, int], int] = {}  # (source, pass) -> the keys each reader takes
        for i, k, _ in self._walk(epoch, layout, 0, elastic=bool(consumed)):
            taken[i, k] = taken.get((i, k), 0) + 1
        out = [np.zeros(0, np.int64)]
        for i in range(len(self.parts)):  # up to the pass after its last reached: its end
            last = max((k for j, k in taken if j == i), default=-1)
            for k in range(last + 2):
                reached = np.zeros(layout.size(i), dtype=bool)
                for rank in range(world_size) if (i, k) in taken else ():
                    share = np.asarray(layout.share(i, k, epoch, rank), dtype=np.int64)
                    reached[share[: taken[i, k]]] = True  # every reader as many (shares padded)
                out.append(layout.position(i, k, 0) + np.flatnonzero(~reached))
        return ranges_of(np.concatenate(out))

    def _walk(
        self, epoch: int, layout: _Layout, rank: int, *, elastic: bool
    ) -> Iterator[tuple[int, int, int]]:
        """(source, pass, its position in that pass) of each key `rank` streams in `epoch`, in
        order, as `stream` gives them (`elastic`: under the elastic rule)."""
        choices = self.choices(epoch)
        live = choices.live
        at = dict.fromkeys(live, 0)  # each source: its pass, and its place in it
        k = dict.fromkeys(live, 0)
        shares: dict[tuple[int, int], Any] = {}
        ran_out: set[int] = set()  # (`elastic`: spent)
        for i in choices.iter_from(self._base(epoch, layout.resumed)):
            if elastic and i in ran_out:
                continue
            share = shares.get((i, k[i]))
            if share is None:
                share = shares[i, k[i]] = layout.share(i, k[i], epoch, rank)
            if at[i] >= len(share):
                if elastic and layout.wholly(i, k[i] + 1):
                    ran_out.add(i)
                    if ran_out >= live:
                        return
                    continue
                if not elastic:
                    ran_out.add(i)
                    if self.stop == "first_exhausted" or (
                        self.stop == "all_exhausted" and ran_out >= live
                    ):
                        return
                k[i], at[i] = k[i] + 1, 0
                share = shares[i, k[i]] = layout.share(i, k[i], epoch, rank)
                if not len(share):
                    raise ValueError(self._empty(i, epoch + k[i]))
            yield i, k[i], int(share[at[i]])
            at[i] += 1

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
            await part.aclose()
        for source in self._sources:
            if isinstance(source, HasAclose):
                await source.aclose()
        self._threads.close()

    # -- the mix -----------------------------------------------------------------------------------

    def draws(self, epoch: int, n: int) -> list[int]:
        """The sources drawn by the first `n` positions of `epoch` (indices into the sources)."""
        choices = self.choices(epoch)
        return [choices.at(p) for p in range(n)]

    def choices(self, epoch: int, weights: Sequence[float] | Schedule | None = None) -> Choices:
        """The draws of `epoch`: under the weights in force before each of its changes (`changes`),
        then under `weights` (None: the mix's; while an elastic load counts what the old ranks
        delivered, the weights they drew with)."""
        earlier = [
            (c["position"], self._checked(c["was"])) for c in self.changes if c["epoch"] == epoch
        ]
        if weights is None:
            weights = self.weights if self._walked is None else self._walked
        return Choices(weights, self.seed, epoch, earlier)

    def _base(self, epoch: int, resumed: bool) -> int:
        """The draw the streams of `epoch` begin at: 0, or for an epoch `resumed` on another world
        size (positions consumed), the furthest its old ranks had drawn (`resume_draws`)."""
        return self.based[1] if resumed and self.based and self.based[0] == epoch else 0

    def digest(self) -> str:
        """The mix's configuration, less its weights (`draws_state`: a state saved under other
        weights loads, and they draw from its position on)."""
        parts = ", ".join(part.digest() for part in self.parts)
        return f"mix(seed={self.seed}, stop={self.stop}, shuffle={self.shuffle}, sources=[{parts}])"

    def draws_state(self) -> dict[str, Any]:
        """What a loader's state records of the draws: the weights in force; each change a load
        made (`"weights_changed"`: the epoch, the position from which the weights changed, and
        the weights before it, `"was"`); where an epoch resumed on another world size began its
        draws (`"draws_from"`: [epoch, position])."""
        changed = {"weights_changed": [dict(c) for c in self.changes]} if self.changes else {}
        based = {"draws_from": list(self.based)} if self.based else {}
        return {"weights": weights_config(self.weights), **changed, **based}

    def load_draws(
        self, saved: Mapping[str, Any], epoch: int, reached: int | None, consumed: Ranges
    ) -> None:
        """Take a loader state's record of the draws (`draws_state`) before it resumes `epoch`.
        Where the state was saved under other weights than the mix's, these draw from the
        position after the `reached` keys its reader's stream had given (less `consumed`) on, as
        in a run whose weights changed there; the change is recorded. `reached` None: the state is
        another reader's (a resume on another world size): the old ranks' draws are counted under
        the weights they drew with, and the new ones begin where they had drawn to
        (`resume_draws`)."""
        changes = saved.get("weights_changed", [])
        based = saved.get("draws_from")
        self._walked = self._pending = None
        try:
            self.changes = [
                {"epoch": int(c["epoch"]), "position": int(c["position"]), "was": c["was"]}
                for c in changes
            ]
            for c in self.changes:
                self._checked(c["was"])
        except (KeyError, TypeError, ValueError) as e:
            self.changes = []
            raise StateError(
                "weights_changed: expected [{'epoch': int, 'position': int, 'was': weights}, ...] "
                f"with weights for these {len(self.parts)} sources, got {changes!r} ({e})",
                field="weights_changed",
            ) from e
        try:
            self.based = None if based is None else (int(based[0]), int(based[1]))
        except (IndexError, TypeError, ValueError) as e:
            raise StateError(
                f"draws_from: expected [epoch, position], got {based!r}", field="draws_from"
            ) from e
        was = saved.get("weights")
        if was == weights_config(self.weights):
            return
        try:
            old = self._checked(was)
        except (TypeError, ValueError) as e:
            raise StateError(
                f"weights: not weights of these sources: {was!r} ({e})", field="weights"
            ) from e
        if reached is None:
            self._walked, self._pending = old, was
            return
        rank, world_size = self.rank_and_world()
        self._walked = old
        draw = self.draw_reached(epoch, consumed, rank, world_size, reached)
        self._walked = None
        self._change(epoch, draw, was)

    def draw_reached(
        self, epoch: int, consumed: Ranges, rank: int, world_size: int, keys: int
    ) -> int:  # fmt: skip
        """The draw after the first `keys` keys of reader `rank` of `world_size` in `epoch`, less
        `consumed` (where its stream passes spent sources over, further than `keys`)."""
        base = self._base(epoch, bool(consumed))
        if not consumed or self.stop == "cycle":
            return base + keys
        layout = _Layout(self, consumed, world_size)
        return self._elastic_start(epoch, keys, layout, self.choices(epoch), rank)[0]

    def resume_draws(self, epoch: int, draw: int) -> None:
        """An elastic load's last step: the new ranks' draws of `epoch` begin at `draw` (the
        furthest the old ranks had drawn), under the mix's weights from there on."""
        self.based, self._walked = (epoch, draw), None
        pending, self._pending = self._pending, None
        if pending is not None:
            self._change(epoch, draw, pending)

    def _change(self, epoch: int, draw: int, was: Any) -> None:
        change = {"epoch": epoch, "position": draw, "was": was}
        if not self.changes or self.changes[-1] != change:  # (a state loaded, saved, loaded)
            self.changes.append(change)

    def _checked(self, config: Any) -> list[float] | Schedule:
        """Saved weights (`weights_config`) checked against the sources."""
        return check_weights(weights_of(config), self.names)

    async def stream(self, epoch: int, consumed: Ranges | None = None) -> AsyncIterator[MixKey]:
        """The `MixKey`s of `epoch`, in the mix's order (see the module docstring for the rule),
        once the positions in `consumed` are taken out."""
        layout = _Layout(self, consumed, self.world_size) if consumed else None
        elastic = layout is not None and self.stop != "cycle"  # see the module docstring

        def opened(i: int, part_epoch: int) -> Pass:
            if layout is None:
                return self.parts[i].open(part_epoch)
            return self.parts[i].open(part_epoch, layout.consumed(i, part_epoch - epoch))

        choices = self.choices(epoch)
        live = choices.live
        start = self.starts.pop(epoch, 0)
        self.starts.clear()  # a start left for another epoch is stale once this one streams
        spent: set[int] = set()  # (elastic) the sources whose share is spent
        if elastic:
            assert layout is not None
            draw, drawn, spent = self._elastic_start(epoch, start, layout, choices, self.rank)
        else:
            base = self._base(epoch, layout is not None)
            draw, drawn = base + start, choices.counts(base + start, base)
        passes: dict[int, Pass] = {}
        ran_out: set[int] = set()
        try:
            for i in sorted(live - spent):  # all read ahead at once
                await self._advance(i, epoch, passes, drawn[i], ran_out, layout)
            if spent >= live:
                return
            for i in choices.iter_from(draw):
                if i in spent:
                    continue
                current = passes[i]
                key = current.take() if current.at_hand else await current.next()
                if key is END:
                    if elastic:
                        assert layout is not None
                        if layout.wholly(i, current.epoch - epoch + 1):
                            spent.add(i)
                            if spent >= live:
                                return
                            continue
                    else:
                        ran_out.add(i)
                        if self.stop == "first_exhausted" or (
                            self.stop == "all_exhausted" and ran_out >= live
                        ):
                            return
                    await current.aclose()
                    current = passes[i] = opened(i, current.epoch + 1)
                    key = await current.next()
                    if key is END:
                        raise ValueError(self._empty(i, current.epoch))
                yield MixKey(i, self.names[i], current.epoch, current.index - 1, key)
        finally:
            for open_pass in passes.values():
                await open_pass.aclose()

    def _elastic_start(
        self, epoch: int, start: int, layout: _Layout, choices: Choices, rank: int
    ) -> tuple[int, list[int], set[int]]:
        """(the draw, the keys each source gave, the sources spent) where the elastic rule has
        given `start` keys of reader `rank`'s epoch, drawn by `choices` from the epoch's base: a
        spent source's draws give none."""
        live = choices.live
        left = {}
        for i in live:  # the reader's keys of each source, over the passes that hold any
            k, n = 0, len(layout.share(i, 0, epoch, rank))
            while not layout.wholly(i, k + 1):
                k += 1
                n += len(layout.share(i, k, epoch, rank))
            left[i] = n
        draw = self._base(epoch, True)
        drawn, given = [0] * len(self.parts), 0
        spent: set[int] = set()
        draws = choices.iter_from(draw)
        while given < start and spent < live:
            i, draw = next(draws), draw + 1
            if i in spent:
                continue
            if drawn[i] == left[i]:
                spent.add(i)
                continue
            drawn[i], given = drawn[i] + 1, given + 1
        return draw, drawn, spent

    async def _advance(
        self, i: int, epoch: int, passes: dict[int, Pass], drawn: int, ran_out: set[int],
        layout: _Layout | None,
    ) -> None:  # fmt: skip
        """Open source `i`'s pass in `passes` where `drawn` draws have left it: for a source with
        a length, by arithmetic; for a stream, by reading (and dropping) that many keys."""
        part = self.parts[i]

        def left(k: int) -> Ranges | None:  # what the resume consumed of its pass `k`
            return None if layout is None else layout.consumed(i, k)

        if isinstance(part, Indexed) and drawn:
            k = 0  # passes done: a draw found the pass empty and started the next epoch
            while drawn > (length := part.length(left(k))):
                drawn, k = drawn - length, k + 1
            if k:
                ran_out.add(i)
            passes[i] = part.open(epoch + k, left(k), drawn)
            return
        current = passes[i] = part.open(epoch, left(0))
        for _ in range(drawn):
            if await current.next() is END:
                ran_out.add(i)
                await current.aclose()
                current = passes[i] = part.open(current.epoch + 1, left(current.epoch + 1 - epoch))
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


class _Layout:
    """The positions of a mix's sources laid end to end (the module's docstring), and what of
    each source's pass a set of consumed positions holds."""

    def __init__(self, mix: Mix, consumed: Ranges | None, old_world: int) -> None:
        sizes = [part.epoch_size() for part in mix.parts]
        unknown = [part.name for part, n in zip(mix.parts, sizes, strict=True) if n is None]
        if unknown:
            raise StateError(
                f"world_size: a mix state saved on world size {old_world} cannot resume on "
                f"{mix.world_size}: {unknown[0]} does not know its epoch's size (a stream with "
                "neither a length nor sample counts); resume on the same world size",
                field="world_size",
            )
        self._parts = mix.parts
        self._sizes = [int(n or 0) for n in sizes]
        self._base = np.concatenate([[0], np.cumsum(self._sizes)]).tolist()
        self._total = self._base[-1]
        self._consumed = consumed or Ranges()
        self._world = old_world
        self.resumed = bool(consumed)  # (an epoch resumed on another world size)

    def position(self, i: int, k: int, local: int) -> int:
        return int(k * self._total + self._base[i] + local)

    def size(self, i: int) -> int:
        """Source `i`'s positions in one pass (all readers')."""
        return self._sizes[i]

    def wholly(self, i: int, k: int) -> bool:
        """Whether every position of source `i`'s pass `k` is consumed: where the elastic rule
        ends the source (`Mix.stream`)."""
        return len(self.consumed(i, k)) >= self._sizes[i]

    def consumed(self, i: int, k: int) -> Ranges:
        """The consumed positions of source `i`'s pass `k`, as its own (from 0)."""
        lo = self.position(i, k, 0)
        hi = lo + self._sizes[i]
        return Ranges(
            (max(a, lo) - lo, min(b, hi) - lo) for a, b in self._consumed.pairs if a < hi and b > lo
        )

    def share(self, i: int, k: int, epoch: int, rank: int) -> Any:
        """Source `i`'s positions in its pass `k` (its epoch `epoch + k`) for `rank`."""
        return self._parts[i].positions(epoch + k, self.consumed(i, k), rank, self._world)
