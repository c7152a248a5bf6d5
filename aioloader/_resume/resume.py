"""The loader's side of exact resume: begin each epoch from a pending resume, save and load state."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .._exceptions import StateError
from .._pipeline.order import Group, Plan
from .._util.ranges import Ranges
from .state import (
    STATE_VERSION,
    Progress,
    Resume,
    check_config,
    elastic_consumed,
    pick_own,
)

__all__ = ["Ledger"]


class Ledger:
    """A loader's epoch bookkeeping: the epoch the next iteration runs, what of the epoch being
    delivered was handed over, a resume pending after a load; and the state that says so
    (`state_dict()` / `load_state_dict()` of the loader that owns it)."""

    def __init__(self, plan: Plan, in_order: bool) -> None:
        self._plan = plan
        self._in_order = in_order
        self._lock = threading.Lock()
        self._epoch = 0
        self._progress: Progress | None = None  # the epoch being delivered, if any
        self._resume: Resume | None = None  # where the next iteration starts, after a load
        self._plan_state: dict[str, Any] = {}
        self._loaded: dict[str, Any] | None = None  # a state loaded, until the next epoch begins

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will run."""
        return self._epoch

    def set_epoch(self, epoch: int, afresh: bool = False) -> None:
        """The epoch the next iteration runs; `afresh`: from its start, whatever a load left, and
        with nothing of it delivered until then (not what an iteration stopped midway had: a state
        saved before the next iteration begins is of `epoch`, not of the epoch left)."""
        with self._lock:
            if afresh or epoch != self._epoch:
                self._loaded = None  # (a state saved now is of that epoch, not the one loaded)
            self._epoch = epoch
            if afresh:
                self._resume = None
                self._progress = None

    def begin(self) -> tuple[Progress, Iterable[Group] | AsyncIterable[Group]]:
        """Take the next epoch number and its groups (in the caller's thread: a plan may draw from
        a generator here)."""
        with self._lock:
            epoch, self._epoch = self._epoch, self._epoch + 1
            resume, self._resume = self._resume, None
            self._loaded = None
        if resume is None or resume.epoch != epoch:
            resume = Resume(epoch, Ranges(), set())
        self._plan_state = self._plan.snapshot()
        skip = resume.skip
        start_after = getattr(self._plan, "start_after", None)
        if skip and start_after is not None:  # keys that begin past the delivered groups (a mix)
            skip = start_after(epoch, skip)
        groups = self._plan.groups(epoch, resume.consumed)
        self._progress = progress = Progress(epoch, resume.consumed, Ranges.of(resume.skip))
        return progress, (_skip(groups, skip) if skip else groups)

    def finished(self, progress: Progress) -> None:
        if self._progress is progress:
            self._progress = None

    def state_dict(
        self, kind: str, config: Callable[[], dict[str, Any]], own: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Where the loader (of class `kind`, made as `config()` says) stands: the epoch and what
        of it was delivered (small, JSON-ready); `own`: the own states of its parts, under
        "own_states" (a DataLoader's dataset and sampler: not JSON-ready where theirs are not)."""
        if self._loaded is not None:  # loaded, not begun: what was loaded
            return dict(self._loaded)
        progress = self._progress
        # between epochs, a state is of the next one: the random state its order will be drawn
        # from is the one there is now, not the one the last epoch's was drawn from
        plan_state = self._plan_state if progress is not None else self._plan.snapshot()
        progress = progress or Progress(self._epoch)
        mine = {"own_states": dict(own)} if own else {}
        rank, world_size = self._plan.rank_and_world()
        return {
            "version": STATE_VERSION, "kind": kind,
            "config": config(), "epoch": progress.epoch, "rank": rank,
            "world_size": world_size, "in_order": self._in_order,
            "consumed": progress.consumed.pairs, "delivered": progress.delivered.pairs,
            **plan_state, **mine,
        }  # fmt: skip

    def load_state_dict(
        self,
        state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        kind: str,
        config: Callable[[], dict[str, Any]],
        take_own: Callable[[Mapping[str, Any] | None, list[Mapping[str, Any]]], None] | None = None,
    ) -> None:
        """Continue from a saved state (or from every rank's states, for another world size) of a
        loader of class `kind` made as `config()` says; StateError naming the field otherwise.
        `take_own` is given the own states of the state picked (None on another world size)
        before anything is taken: it may refuse them too."""
        states = [state] if isinstance(state, Mapping) else list(state)
        if not states:
            raise StateError("state: no state given", field="state")
        made = config()
        for s in states:
            check_config(s, kind, made)
        own = pick_own(states, *self._plan.rank_and_world())
        if take_own is not None:  # (on another world size: every old rank's, to refuse or drop)
            take_own(
                None if own is None else own.get("own_states"),
                [] if own is not None else [s.get("own_states") or {} for s in states],
            )
        before = {"epoch": self._epoch, **self._plan.snapshot()}  # (a refused load puts it back)
        self._plan.restore(own or states[0])  # before the plan recomputes the saved ranks' batches
        if own is not None:
            resume = Resume(
                int(own["epoch"]), Ranges(own.get("consumed", [])),
                set(Ranges(own.get("delivered", []))),
            )  # fmt: skip
        else:
            try:
                epoch, consumed = elastic_consumed(
                    states, self._plan.group_indices, getattr(self._plan, "left_out", None)
                )
                resumed_elsewhere = getattr(self._plan, "resumed_elsewhere", None)
                if resumed_elsewhere is not None:  # (a mix: its draws go on from the old ones')
                    resumed_elsewhere(states)
            except BaseException:  # refused: the plan's random state and draws as they were
                self._plan.restore(before)
                raise
            resume = Resume(epoch, consumed, set())
        with self._lock:
            self._resume, self._epoch = resume, resume.epoch
        self._progress = Progress(resume.epoch, resume.consumed, Ranges.of(resume.skip))
        self._plan_state = {}
        self._loaded = dict(own) if own is not None else None

    # -- a mix's side of resuming on another world size (`_mix/elastic.py`) ----------------------

    def indices(
        self, epoch: int, rank: int, world_size: int, consumed: Ranges,
        groups: Iterable[int] | None,
    ) -> np.ndarray:  # fmt: skip
        """The permutation indices of `epoch` (less `consumed`) that the plan of `rank` of
        `world_size` deals to its `groups`, in order; or, for None, to all of its groups.
        StateError (field "world_size") where the plan cannot say so."""
        self._plan.restore({"epoch": epoch})  # (a stream's positions are of the epoch restored)
        share = getattr(self._plan, "share_indices", None)
        if share is not None:  # the share worked out once, not once per group
            return np.asarray(share(rank, world_size, consumed, groups), dtype=np.int64)
        if groups is None:
            raise StateError(
                f"world_size: a {type(self._plan).__name__} cannot say a whole share of another "
                "world size (what an old rank that went past an epoch delivered of it)",
                field="world_size",
            )
        return np.asarray(
            [i for g in groups for i in self._plan.group_indices(rank, world_size, g, consumed)],
            dtype=np.int64,
        )

    def resume_at(self, epoch: int, consumed: Ranges) -> None:
        """Make the next iteration run `epoch` without the permutation indices in `consumed`,
        shared among this plan's ranks as an elastic load shares what is left."""
        resume = Resume(epoch, consumed, set())
        with self._lock:
            self._resume, self._epoch, self._loaded = resume, epoch, None
        self._progress = Progress(epoch, consumed)
        self._plan_state = {}


async def _askip(groups: AsyncIterable[Group], skip: set[int]) -> AsyncIterator[Group]:
    async for group in groups:
        if group.index not in skip:
            yield group


def _skip(
    groups: Iterable[Group] | AsyncIterable[Group], skip: set[int]
) -> Iterable[Group] | AsyncIterable[Group]:
    """The groups not in `skip` (those a resumed epoch had already delivered)."""
    if isinstance(groups, AsyncIterable):
        return _askip(groups, skip)
    return (group for group in groups if group.index not in skip)
