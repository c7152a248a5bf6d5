"""Mixing already-built loaders: their items (batches, or samples when unbatched) interleaved whole.

`mix([loader_a, loader_b], weights)` gives a `MixedLoaders`. Its epoch `e` follows the rule of
`mix.py`: position `p` draws loader `i` from (seed, e, p); every loader starts its epoch `e` with
the mix's and keeps its own; one that runs out ends the epoch (`"first_exhausted"`) or starts its
next epoch (`"all_exhausted"`, `"cycle"`). Every loader runs its own pipeline on its own thread, so
all of them prefetch at once (with `for` or `async for`). `state_dict()` holds the mix's epoch and
position and every loader's own state, and `load_state_dict()` continues the exact sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from .._exceptions import StateError
from .._loader import Loader
from .._resume.state import STATE_VERSION, check_config
from .._util.validate import check_int
from .choices import Choices

__all__ = ["MixedLoaders"]

_END: Any = object()


@dataclass
class _Progress:
    """Where an epoch of the mix stands: the next position, who ran out, each loader's own epoch."""

    epoch: int
    position: int
    epochs: list[int]
    ran_out: set[int] = field(default_factory=set)


class MixedLoaders:
    """Loaders' items interleaved in set proportions; iterate with `for` (one epoch per iteration).

    Closing it (`close()`, or the end of a `with` block) closes the loaders.

    Example:
        >>> both = mix([Loader(a, batch_size=8), Loader(b, batch_size=8)], [3, 1])  # doctest: +SKIP
        >>> for batch in both: ...  # doctest: +SKIP
    """

    def __init__(
        self, loaders: Sequence[Loader[Any]], names: Sequence[str | None], weights: Sequence[float],
        *, seed: int, stop: str,
    ) -> None:  # fmt: skip
        self.loaders, self.names, self.weights = list(loaders), list(names), list(weights)
        self.seed, self.stop = seed, stop
        self._epoch = 0
        self._progress: _Progress | None = None  # the epoch being iterated
        self._resume: _Progress | None = None  # where the next iteration starts, after a load

    def __repr__(self) -> str:
        return (
            f"mix([{len(self.loaders)} loaders], weights={self.weights}, seed={self.seed}, "
            f"stop={self.stop!r})"
        )

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration run `epoch`."""
        self._epoch = check_int("epoch", epoch, minimum=0)

    def __iter__(self) -> Iterator[Any]:
        return self._resumed(self._start())

    def __aiter__(self) -> AsyncIterator[Any]:
        """`async for item in mixed`: the same items, from the loaders' `async for`."""
        return self._aresumed(self._start())

    def _resumed(self, progress: _Progress) -> Iterator[Any]:
        """The epoch's items; a resume saved after the last of them (found when the epoch ends
        before a first item) goes on with the next epoch, as the run it was saved from would."""
        resumed, out = progress.position > 0, 0
        for item in self._items(progress):
            out += 1
            yield item
        if resumed and not out:
            yield from self._items(self._start())

    async def _aresumed(self, progress: _Progress) -> AsyncIterator[Any]:
        resumed, out = progress.position > 0, 0
        async with contextlib.aclosing(self._aitems(progress)) as items:
            async for item in items:
                out += 1
                yield item
        if resumed and not out:
            async with contextlib.aclosing(self._aitems(self._start())) as items:
                async for item in items:
                    yield item

    def _start(self) -> _Progress:
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
            progress = _Progress(epoch, 0, [epoch] * len(self.loaders))
            for loader in self.loaders:
                loader._start_epoch_afresh(epoch)
        self._progress = progress
        return progress

    def _items(self, progress: _Progress) -> Iterator[Any]:
        choices = Choices(self.weights, self.seed, progress.epoch)
        running: dict[int, Iterator[Any]] = {}
        try:
            while True:
                i = choices.at(progress.position)
                it = running.get(i) or running.setdefault(i, iter(self.loaders[i]))
                box = [next(it, _END)]
                if box[0] is _END:
                    if self._ends(i, progress):
                        return
                    running[i] = it = iter(self.loaders[i])
                    box = [self._first(i, progress, next(it, _END))]
                progress.position += 1
                yield box.pop()  # not held here while the consumer has it
        finally:
            for it in running.values():
                it.close()  # type: ignore[attr-defined]

    async def _aitems(self, progress: _Progress) -> AsyncGenerator[Any, None]:
        choices = Choices(self.weights, self.seed, progress.epoch)
        running: dict[int, AsyncIterator[Any]] = {}
        try:
            while True:
                i = choices.at(progress.position)
                it = running.get(i) or running.setdefault(i, aiter(self.loaders[i]))
                box = [await anext(it, _END)]
                if box[0] is _END:
                    if self._ends(i, progress):
                        return
                    running[i] = it = aiter(self.loaders[i])
                    box = [self._first(i, progress, await anext(it, _END))]
                progress.position += 1
                yield box.pop()  # not held here while the consumer has it
        finally:
            for it in running.values():
                await it.aclose()  # type: ignore[attr-defined]

    def _ends(self, i: int, progress: _Progress) -> bool:
        """Loader `i` ran out: True if the mix's epoch ends there; else it starts its next epoch."""
        progress.ran_out.add(i)
        live = {j for j, w in enumerate(self.weights) if w > 0}
        if self.stop == "first_exhausted" or (
            self.stop == "all_exhausted" and progress.ran_out >= live
        ):
            self._progress = None
            return True
        progress.epochs[i] += 1
        self.loaders[i].set_epoch(progress.epochs[i])
        return False

    def _first(self, i: int, progress: _Progress, item: Any) -> Any:
        """The first item of loader `i`'s next epoch (an epoch with none cannot start again)."""
        if item is _END:
            raise ValueError(
                f"mix: loader {self._label(i)} gave nothing in its epoch {progress.epochs[i]}, so "
                f"it cannot start again (stop={self.stop!r})"
            )
        return item

    def _label(self, i: int) -> str:
        return f"sources[{i}]" if self.names[i] is None else f"sources[{self.names[i]!r}]"

    # -- state ---------------------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "weights": self.weights, "seed": self.seed, "stop": self.stop,
            "names": [str(n) if n is not None else i for i, n in enumerate(self.names)],
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """The mix's epoch and next position, which loaders ran out, and every loader's own epoch
        and `state_dict()` (JSON-ready). Safe between any two items."""
        progress = self._progress or self._resume or _Progress(
            self._epoch, 0, [self._epoch] * len(self.loaders)
        )  # fmt: skip
        return {
            "version": STATE_VERSION, "kind": type(self).__name__, "config": self._config(),
            "epoch": progress.epoch, "position": progress.position,
            "ran_out": sorted(progress.ran_out),
            "sources": [
                {"epoch": e, "state": loader.state_dict()}
                for e, loader in zip(progress.epochs, self.loaders, strict=True)
            ],
        }  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state`: the next iteration goes on with the item after the saved one.

        Raises StateError naming the field when `state` does not fit this mix.
        """
        check_config(state, type(self).__name__, self._config())
        saved = state.get("sources")
        if not isinstance(saved, list) or len(saved) != len(self.loaders):
            raise StateError(f"sources: expected {len(self.loaders)} states", field="sources")
        for loader, own in zip(self.loaders, saved, strict=True):
            loader.load_state_dict(own["state"])
        epoch = int(state["epoch"])
        self._resume = _Progress(
            epoch, int(state["position"]), [int(s["epoch"]) for s in saved],
            set(int(i) for i in state.get("ran_out", [])),
        )  # fmt: skip
        self._epoch, self._progress = epoch, None

    # -- lifecycle -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close every loader (idempotent)."""
        for loader in self.loaders:
            loader.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
