"""Mixing already-built loaders: their items (batches, or samples when unbatched) interleaved whole.

`mix([loader_a, loader_b], weights)` gives a `MixedLoaders`. Its epoch `e` follows the rule of
`mix.py`: position `p` draws loader `i` from (seed, e, p); every loader starts its epoch `e` with
the mix's and keeps its own; one that runs out ends the epoch (`"first_exhausted"`) or starts its
next epoch (`"all_exhausted"`, `"cycle"`). Every loader runs its own pipeline on its own thread, so
all of them prefetch at once (with `for` or `async for`). `state_dict()` holds the mix's epoch and
position and every loader's own state, and `load_state_dict()` continues the exact sequence.

On another world size (every old rank's state, a list), each loader resumes from what all the old
ranks delivered of it (`elastic.py`): each of its documents comes once, before the save or after
the restore, and the new ranks' draws go on from the furthest old rank's position.

All of this but how items are handed over is `Mixing`: a `MixedLoaders` holds one, and so does a
mix by rows (`rows.py`, `MixedRows`). Each starts its epochs, follows its draws and its loaders'
epochs, and saves and loads its state through `Mixing`'s methods; what a mix by rows holds of its
loaders' items beyond their states (the rows not used yet) it declares to it as `Holds`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from .._exceptions import StateError
from .._loader import Loader
from .._resume.state import STATE_VERSION, check_config
from .._util.ranges import Ranges
from .._util.validate import check_int
from .choices import (
    Choices,
    Schedule,
    check_weights,
    drawable,
    own_weights,
    weights_config,
    weights_of,
)
from .elastic import Resumed, Seen, resume_loader

__all__ = ["NO_ITEM", "Holds", "MixFace", "MixedLoaders", "Mixing", "Progress"]

NO_ITEM: Any = object()  # what a mix's drivers take from a loader's iteration that has ended


@dataclass
class Progress:
    """Where an epoch of the mix stands: the next position, who ran out, each loader's own epoch."""

    epoch: int
    position: int
    epochs: list[int]
    ran_out: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Holds:
    """What a mix holds of its loaders' current items beyond their states (a mix by rows: the
    rows of each item not used yet), declared to its `Mixing`, which calls these as it starts an
    epoch and loads a state. (The mix's own `state_dict()` adds what it holds to each loader's
    entry of `Mixing.state_dict()`.)"""

    # hold nothing: an epoch starts afresh, or a load on another world size (every loader then
    # starts at a fresh item)
    clear: Callable[[], None]
    # this rank's own saved entries (`state["sources"]`), checked and taken before any loader
    # loads its state: what each held then
    load: Callable[[Sequence[Mapping[str, Any]]], None]
    # loader `i`'s partly used item in an old rank's entry: (group, rows used, rows), or None
    part: Callable[[int, Mapping[str, Any]], tuple[int, int, int] | None]


# loaders mixed whole hold nothing of their items: each is handed over whole
WHOLE = Holds(clear=lambda: None, load=lambda saved: None, part=lambda i, own: None)


class Mixing:
    """A mix of built loaders, however it hands their items over: its epochs, where each stands
    (`Progress`), its loaders' own epochs, and its state, saved and loaded on the same ranks or on
    another world size. `MixedLoaders` and `MixedRows` each hold one (see the module's docstring)
    and hand its epochs' items over: `iterate(items)`, where `items` follows the draws and calls
    `ends()` and `first()` as a loader runs out."""

    def __init__(
        self, loaders: Sequence[Loader[Any]], names: Sequence[str | None],
        weights: Sequence[float] | Schedule,
        *, seed: int, stop: str, kind: str, config: Mapping[str, Any] | None = None,
        holds: Holds = WHOLE,
    ) -> None:  # fmt: skip
        self.loaders, self.names, self.weights = list(loaders), list(names), own_weights(weights)
        self.seed, self.stop, self.holds = seed, stop, holds
        self.kind = kind  # the state's "kind": the mix's class name
        self.settings = dict(config or {})  # the mix's own, in its state's config after the rest
        self._epoch = 0
        self._progress: Progress | None = None  # the epoch being iterated
        self._resume: Progress | None = None  # where the next iteration starts, after a load
        # per loader, the indices of its later epochs an elastic load found consumed (its epoch
        # -> them), taken when the loader starts that epoch within this epoch of the mix
        self._later: dict[int, dict[int, Ranges]] = {}
        # the weights a state was saved under, where a load found others given here: each
        # {"epoch", "position", "was"}, from which on these weights draw (kept in later states)
        self._changes: list[dict[str, Any]] = []

    def __repr__(self) -> str:
        return (
            f"mix([{len(self.loaders)} loaders], weights={self.weights}, seed={self.seed}, "
            f"stop={self.stop!r})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch`."""
        self._epoch = check_int("epoch", epoch, minimum=0)

    # -- iteration -----------------------------------------------------------------------------------

    def iterate(self, items: Callable[[Progress], Iterator[Any]]) -> Iterator[Any]:
        """Start the next epoch now (not at the first `next()`), and iterate `items(progress)`
        over it: the epoch's items, which advance `progress` (with `ends()` and `first()`). A
        resume saved after the last of them (found when the epoch ends before a first item) goes
        on with the next epoch, as the run it was saved from would."""
        return self._resumed(self._start(), items)

    def aiterate(
        self, items: Callable[[Progress], AsyncGenerator[Any, None]]
    ) -> AsyncIterator[Any]:
        """`iterate()` for `async for`."""
        return self._aresumed(self._start(), items)

    def _resumed(
        self, progress: Progress, items: Callable[[Progress], Iterator[Any]]
    ) -> Iterator[Any]:
        resumed, out = progress.position > 0, 0
        for item in items(progress):
            out += 1
            yield item
        if resumed and not out:
            yield from items(self._start())

    async def _aresumed(
        self, progress: Progress, items: Callable[[Progress], AsyncGenerator[Any, None]]
    ) -> AsyncIterator[Any]:
        resumed, out = progress.position > 0, 0
        async with contextlib.aclosing(items(progress)) as running:
            async for item in running:
                out += 1
                yield item
        if resumed and not out:
            async with contextlib.aclosing(items(self._start())) as running:
                async for item in running:
                    yield item

    def _start(self) -> Progress:
        """Take the next epoch: where a load left it, else from its start (every loader's too)."""
        epoch, self._epoch = self._epoch, self._epoch + 1
        progress, self._resume = self._resume, None
        # a resume at position 0 (saved between epochs) starts the epoch afresh: its loaders' own
        # states may be those of the epoch before, where one ended it and the others had not
        if (
            progress is None
            or progress.epoch != epoch
            or not (progress.position or progress.ran_out)
        ):
            progress = Progress(epoch, 0, [epoch] * len(self.loaders))
            self._later = {}
            for loader in self.loaders:
                loader.start_epoch_afresh(epoch)
            self.holds.clear()
        self._progress = progress
        return progress

    def ends(self, i: int, progress: Progress) -> bool:
        """Loader `i` ran out: True if the mix's epoch ends there; else it starts its next epoch."""
        progress.ran_out.add(i)
        live = drawable(self.weights)
        if self.stop == "first_exhausted" or (
            self.stop == "all_exhausted" and progress.ran_out >= live
        ):
            self._progress = None
            return True
        progress.epochs[i] += 1
        consumed = self._later.get(i, {}).pop(progress.epochs[i], None)
        if consumed is None:
            self.loaders[i].set_epoch(progress.epochs[i])
        else:  # what the old ranks of an elastic load delivered of it
            self.loaders[i].resume_at(progress.epochs[i], consumed)
        return False

    def first(self, i: int, progress: Progress, item: Any) -> Any:
        """The first item of loader `i`'s next epoch (an epoch with none cannot start again)."""
        if item is NO_ITEM:
            raise ValueError(
                f"mix: loader {self.label(i)} gave nothing in its epoch {progress.epochs[i]}, so "
                f"it cannot start again (stop={self.stop!r})"
            )
        return item

    def label(self, i: int) -> str:
        """Loader `i` as messages name it: `sources[i]`, or `sources['name']`."""
        return f"sources[{i}]" if self.names[i] is None else f"sources[{self.names[i]!r}]"

    # -- state ---------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "weights": weights_config(self.weights), "seed": self.seed, "stop": self.stop,
            "names": [str(n) if n is not None else i for i, n in enumerate(self.names)],
            **self.settings,
        }  # fmt: skip

    def _place(self) -> tuple[int, int] | None:
        """(rank, world size) of the loaders' shares: the mix's, where all of them agree."""
        places = {loader.place() for loader in self.loaders}
        return places.pop() if len(places) == 1 else None

    def state_dict(self) -> dict[str, Any]:
        """What `MixedLoaders.state_dict()` says (without what `holds` holds)."""
        progress = self._progress or self._resume or Progress(
            self._epoch, 0, [self._epoch] * len(self.loaders)
        )  # fmt: skip
        place = self._place()
        sources: list[dict[str, Any]] = []
        for i, (e, loader) in enumerate(zip(progress.epochs, self.loaders, strict=True)):
            own: dict[str, Any] = {"epoch": e, "state": loader.state_dict()}
            later = self._later.get(i)
            if later:
                own["later"] = [[k, r.pairs] for k, r in sorted(later.items())]
            sources.append(own)
        return {
            "version": STATE_VERSION, "kind": self.kind, "config": self._config(),
            "epoch": progress.epoch, "position": progress.position,
            "ran_out": sorted(progress.ran_out),
            **({} if place is None else {"rank": place[0], "world_size": place[1]}),
            "sources": sources,
            **({"weights_changed": [dict(c) for c in self._changes]} if self._changes else {}),
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """What `MixedLoaders.load_state_dict()` says (`holds` told what a state held)."""
        states = [state] if isinstance(state, Mapping) else list(state)
        if not states:
            raise StateError("state: no state given", field="state")
        config = self._config()
        weights = config.pop("weights")  # (other weights than the saved ones: from there on)
        for s in states:
            check_config(s, self.kind, config)
            saved = s.get("sources")
            if not isinstance(saved, list) or len(saved) != len(self.loaders):
                raise StateError(f"sources: expected {len(self.loaders)} states", field="sources")
        here = self._place()
        if here is None:  # (its loaders' own loads check their states)
            if len(states) > 1:
                raise StateError(
                    "states: this mix's loaders are on different ranks or world sizes "
                    f"({sorted({loader.place() for loader in self.loaders})}), so it resumes "
                    "from its own state only (not from a list of states)",
                    field="states",
                )
            self._load_own(states[0], weights)
            return
        places = [_place_of(s) for s in states]
        own = [s for s, place in zip(states, places, strict=True) if place == here]
        if len(own) == 1:
            self._load_own(own[0], weights)
            return
        worlds = {place[1] for place in places if place is not None}
        if own or None in places or len(worlds) != 1 or here[1] in worlds:
            raise StateError(
                f"states: {len(own)} of them are this rank's ({here[0]} of {here[1]}); pass "
                "this rank's own state, or every rank's to resume on another world size",
                field="states",
            )
        was = [s.get("config", {}).get("weights") for s in states]
        if any(w != was[0] for w in was):
            raise StateError(
                f"weights: the old ranks' states were saved under different weights ({was[0]!r}, "
                f"{next(w for w in was if w != was[0])!r}): pass states of one run",
                field="weights",
            )
        self._load_elastic(states, worlds.pop(), was[0], weights)

    def _load_own(self, state: Mapping[str, Any], weights: Any) -> None:
        """Continue from this rank's own state; where it was saved under other weights than
        `weights` (this mix's), these draw from its position on, and later states say so."""
        saved = state["sources"]
        self.holds.load(saved)
        self._changes = [dict(c) for c in state.get("weights_changed", [])]
        was = state.get("config", {}).get("weights")
        if was != weights:
            self._changes.append(
                {"epoch": int(state["epoch"]), "position": int(state["position"]), "was": was}
            )
        for loader, own in zip(self.loaders, saved, strict=True):
            loader.load_state_dict(own["state"])
        epoch = int(state["epoch"])
        self._resume = Progress(
            epoch, int(state["position"]), [int(s["epoch"]) for s in saved],
            set(int(i) for i in state.get("ran_out", [])),
        )  # fmt: skip
        self._epoch, self._progress = epoch, None
        self._later = {i: _later_of(own, self.label(i)) for i, own in enumerate(saved)}

    def _load_elastic(
        self, states: list[Mapping[str, Any]], world_size: int, was: Any, weights: Any
    ) -> None:
        """Continue from every old rank's state, saved on `world_size` ranks (`elastic.py`) under
        the weights `was`; where this mix's `weights` are others, they draw from the furthest old
        rank's position on, and later states say so."""
        if self.stop == "first_exhausted":
            place = self._place()
            new = "?" if place is None else place[1]
            raise StateError(
                f"world_size: a mix of loaders with stop='first_exhausted' saved on world size "
                f"{world_size} cannot resume on {new}: its epoch ends where the first loader runs "
                "out of a rank's share, which the world size moves, so the rest of the epoch as "
                f"it would have gone on cannot be told; resume on {world_size} ranks, or mix "
                "with stop='all_exhausted' or 'cycle' (a mix of sources in one Loader resumes "
                "either way)",
                field="world_size",
            )
        by_rank = sorted(states, key=lambda s: int(s["rank"]))
        ranks = [int(s["rank"]) for s in by_rank]
        if ranks != list(range(world_size)):
            raise StateError(
                f"states: resuming on another world size needs one state of each of the "
                f"{world_size} ranks that saved them, got ranks {ranks}",
                field="states",
            )
        epochs = sorted({int(s["epoch"]) for s in by_rank})
        if len(epochs) != 1:
            raise StateError(
                f"epoch: the old ranks' states are from different epochs of the mix {epochs} "
                "(one rank had ended its epoch): resume them on the saved world size",
                field="epoch",
            )
        epoch = epochs[0]
        # a rank that drew nothing of the epoch yet delivered nothing of it (whatever its
        # loaders' states say: they may be those of the epoch before)
        fresh = [not (int(s["position"]) or s.get("ran_out")) for s in by_rank]
        try:
            drawn = drawable(self.weights) | drawable(check_weights(weights_of(was), self.names))
        except (TypeError, ValueError) as e:
            raise StateError(
                f"weights: not weights of these loaders: {was!r} ({e})", field="weights"
            ) from e
        resumed: dict[int, Resumed] = {}
        self._changes = [dict(c) for c in by_rank[0].get("weights_changed", [])]
        if not all(fresh):  # (else the epoch from its start, afresh)
            for i, loader in enumerate(self.loaders):
                if i in drawn:  # (one of weight 0 is never drawn)
                    seen = [
                        Seen(rank, epoch, None) if skip else self._seen(i, rank, s, world_size)
                        for rank, (s, skip) in enumerate(zip(by_rank, fresh, strict=True))
                    ]
                    resumed[i] = resume_loader(loader, self.label(i), seen, world_size)
        self._epoch, self._progress, self._resume, self._later = epoch, None, None, {}
        self.holds.clear()
        if not resumed:
            return
        progress = Progress(
            epoch, max(int(s["position"]) for s in by_rank), [epoch] * len(self.loaders),
            set.intersection(*(set(map(int, s.get("ran_out", []))) for s in by_rank)),
        )  # fmt: skip
        for i, where in resumed.items():
            self.loaders[i].resume_at(where.epoch, where.consumed)
            progress.epochs[i] = where.epoch
            if where.later:
                self._later[i] = where.later
        self._resume = progress
        if was != weights:
            self._changes.append({"epoch": epoch, "position": progress.position, "was": was})

    def _seen(self, i: int, rank: int, state: Mapping[str, Any], world_size: int) -> Seen:
        """What old rank `rank`'s state says of loader `i`."""
        label, own = self.label(i), state["sources"][i]
        saved = own.get("state") if isinstance(own, Mapping) else None
        if not isinstance(saved, Mapping):
            raise StateError(f"sources: {label}: expected the loader's state", field="sources")
        self.loaders[i].check_state(saved)
        if (saved.get("rank"), saved.get("world_size")) != (rank, world_size):
            raise StateError(
                f"sources: {label}: the state of rank {rank} of {world_size} holds its loader's "
                f"of rank {saved.get('rank')} of {saved.get('world_size')}",
                field="rank",
            )
        epoch = int(own["epoch"])
        if saved.get("epoch") != epoch:
            raise StateError(
                f"sources: {label}: rank {rank}'s loader state is of its epoch "
                f"{saved.get('epoch')}, the mix's says {epoch}",
                field="epoch",
            )
        return Seen(rank, epoch, saved, self.holds.part(i, own), _later_of(own, label))

    def close(self) -> None:
        """Close every loader (idempotent)."""
        for loader in self.loaders:
            loader.close()


class MixFace:
    """What both mixes of built loaders (whole, `MixedLoaders`; by rows, `MixedRows`) answer alike,
    through the `Mixing` each holds: the epoch the next iteration runs, a load, closing."""

    _mixing: Mixing

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch`."""
        self._mixing.set_epoch(epoch)

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Continue from `state`: the next iteration goes on with the item after the saved one (a
        mix by rows skips the rows of each loader's item that the state says were used).

        Given every rank's state (a list), this rank's own is used; on another world size, each
        loader resumes from what every old rank delivered of it (`elastic.py`; a mix by rows
        starts every loader at a fresh item), and the draws go on from the furthest old rank's
        position.

        Raises StateError naming the field when a state does not fit this mix.
        """
        self._mixing.load_state_dict(state)

    def close(self) -> None:
        """Close every loader (idempotent)."""
        self._mixing.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class MixedLoaders(MixFace):
    """Loaders' items interleaved in set proportions; iterate with `for` (one epoch per iteration).

    Closing it (`close()`, or the end of a `with` block) closes the loaders.

    Example:
        >>> both = mix([Loader(a, batch_size=8), Loader(b, batch_size=8)], [3, 1])  # doctest: +SKIP
        >>> for batch in both: ...  # doctest: +SKIP
    """

    def __init__(
        self, loaders: Sequence[Loader[Any]], names: Sequence[str | None],
        weights: Sequence[float] | Schedule,
        *, seed: int, stop: str,
    ) -> None:  # fmt: skip
        self._mixing = mixing = Mixing(
            loaders, names, weights, seed=seed, stop=stop, kind=type(self).__name__
        )
        self.loaders, self.names, self.weights = mixing.loaders, mixing.names, mixing.weights
        self.seed, self.stop = seed, stop

    def __repr__(self) -> str:
        return repr(self._mixing)

    def __iter__(self) -> Iterator[Any]:
        return self._mixing.iterate(self._items)

    def __aiter__(self) -> AsyncIterator[Any]:
        """`async for item in mixed`: the same items, from the loaders' `async for`."""
        return self._mixing.aiterate(self._aitems)

    def _items(self, progress: Progress) -> Iterator[Any]:
        mixing = self._mixing
        choices = Choices(self.weights, self.seed, progress.epoch)
        running: dict[int, Iterator[Any]] = {}
        try:
            while True:
                i = choices.at(progress.position)
                it = running.get(i) or running.setdefault(i, iter(self.loaders[i]))
                box = [next(it, NO_ITEM)]
                if box[0] is NO_ITEM:
                    if mixing.ends(i, progress):
                        return
                    running[i] = it = iter(self.loaders[i])
                    box = [mixing.first(i, progress, next(it, NO_ITEM))]
                progress.position += 1
                yield box.pop()  # not held here while the consumer has it
        finally:
            for it in running.values():
                it.close()  # type: ignore[attr-defined]

    async def _aitems(self, progress: Progress) -> AsyncGenerator[Any, None]:
        mixing = self._mixing
        choices = Choices(self.weights, self.seed, progress.epoch)
        running: dict[int, AsyncIterator[Any]] = {}
        try:
            while True:
                i = choices.at(progress.position)
                it = running.get(i) or running.setdefault(i, aiter(self.loaders[i]))
                box = [await anext(it, NO_ITEM)]
                if box[0] is NO_ITEM:
                    if mixing.ends(i, progress):
                        return
                    running[i] = it = aiter(self.loaders[i])
                    box = [mixing.first(i, progress, await anext(it, NO_ITEM))]
                progress.position += 1
                yield box.pop()  # not held here while the consumer has it
        finally:
            for it in running.values():
                await it.aclose()  # type: ignore[attr-defined]

    # -- state and lifecycle -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The mix's epoch and next position, which loaders ran out, the rank and world size of
        the loaders (where they agree), and every loader's own epoch and `state_dict()` (and,
        after a load on another world size, its later epochs' consumed indices: `"later"`).
        JSON-ready. Safe between any two items."""
        return self._mixing.state_dict()


def _place_of(state: Mapping[str, Any]) -> tuple[int, int] | None:
    """(rank, world size) a mix's state was saved on: as it says, else as its loaders' states
    agree (None where they do not)."""
    if "rank" in state and "world_size" in state:
        return int(state["rank"]), int(state["world_size"])
    places = {
        (own["state"].get("rank", 0), own["state"].get("world_size", 1))
        for own in state["sources"]
        if isinstance(own, Mapping) and isinstance(own.get("state"), Mapping)
    }
    return places.pop() if len(places) == 1 else None


def _later_of(own: Mapping[str, Any], label: str) -> dict[int, Ranges]:
    """A saved entry's `"later"`: [[epoch, consumed pairs], ...] as {epoch: Ranges}."""
    later = own.get("later", [])
    try:
        return {int(k): Ranges(pairs) for k, pairs in later}
    except (TypeError, ValueError) as e:
        raise StateError(
            f"sources: {label}: 'later' must be [[epoch, [[start, stop], ...]], ...], got {later!r}",
            field="later",
        ) from e
