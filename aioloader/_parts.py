"""A Loader's variable parts, declared together: what a front door (`Loader`, `DataLoader`) hands it.

A `Loader` is wired from `Parts`: the plan of keys (`Plan`), the read (`Read`: fetch, then decode),
the pipeline's settings, and three objects it asks at set points, whatever made it:

- `EpochHooks`: told when an epoch starts, before each batch is handed over, and when the next epoch
  is set (`NoHooks` by default; a DataLoader forks, renews and seeds its worker processes at the
  start, counts its batches for torch's IterableDataset length warning, and passes `set_epoch` on to
  its sampler);
- `Describer`: what the loader says of itself: its repr, where decode runs and the argument that
  sets its workers (for `diagnose()`), the timeout message, `len()` and an epoch's samples
  (`LoaderDescriber` by default);
- `StateCodec`: what a saved state must match to load here, written into `state_dict()` and checked
  by `load_state_dict()` (`KeyPlanState` by default).

One object may play several of them (the DataLoader's does). None of them holds the loader (the
DataLoader's reads its attributes through a weak proxy): a loader that is dropped is closed by its
`__del__`, which a reference back to it would delay until the garbage collector runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ._arguments import _name
from ._executors.base import Executor, workers_of, writes_rows
from ._executors.fetch_in_workers import FetchDecode
from ._pipeline.feed import BatchStage
from ._pipeline.order import KeyPlan, Plan
from ._pipeline.stages import Stages
from ._resume.state import keys_digest
from ._tuning.bounds import ErrorPolicy
from ._tuning.memory import MemoryBudget
from .sources import Source

__all__ = [
    "Describer",
    "EpochHooks",
    "KeyPlanState",
    "LoaderDescriber",
    "NoHooks",
    "Parts",
    "Read",
    "StateCodec",
    "executor_kind",
]


@dataclass(frozen=True)
class Read:
    """How a key becomes a sample: `fetch(key)`, then `decode(raw)` run by `executor`."""

    fetch: Callable[[Any], Any]
    decode: Callable[[Any], Any] | None = None
    # a name of `EXECUTORS`, "auto" or an `Executor`; None: "inline" without a decode, else "auto"
    executor: str | Executor | None = None
    workers: int | str | None = None  # decode threads or processes, for an executor by name
    fetch_initializer: Callable[[], None] | None = None  # run once in each fetch thread
    fetch_threads: int = 1  # fetch threads that start as calls wait, whatever the calls do
    own_executor: bool = False  # an `Executor` object that is closed with the loader all the same


class EpochHooks(Protocol):
    """What happens at an epoch's set points, besides the loader's own work."""

    def started(self) -> None:
        """An epoch starts: in the consumer's thread, once the plan drew the epoch's groups and the
        source was told the epoch; before any of its keys is fetched."""

    def handing_over(self) -> None:
        """A batch (one that failed too) is about to be handed to the consumer, in its thread."""

    def passed(self, index: int) -> None:
        """Batch `index` of the epoch was handed over, or skipped (its samples all skipped), in the
        consumer's thread: a state saved from now on counts it delivered."""

    def finished(self) -> None:
        """The epoch's last batch was handed over (in the consumer's thread)."""

    def set_epoch(self, epoch: int) -> None:
        """`set_epoch(epoch)` was called (after the loader took it as its next epoch)."""


class NoHooks:
    """A `Loader`'s epoch hooks: nothing besides the loader's own work."""

    def started(self) -> None:
        pass

    def handing_over(self) -> None:
        pass

    def passed(self, index: int) -> None:
        pass

    def finished(self) -> None:
        pass

    def set_epoch(self, epoch: int) -> None:
        pass


class Describer(Protocol):
    """What a loader says of itself."""

    workers_argument: str  # the argument that sets decode's workers, for diagnose()

    def config(self) -> list[str]:
        """What `repr` shows, as "name=value" parts."""
        ...

    def executor_kind(self) -> str:
        """Where decode runs: "inline", "thread" or "process"."""
        ...

    def timeout_message(self) -> str:
        """What `LoaderTimeout` says first, when no batch came within the timeout."""
        ...

    def length(self) -> int:
        """`len(loader)`: batches per epoch (samples when unbatched); TypeError without a length."""
        ...

    def epoch_samples(self) -> int | None:
        """The samples of an epoch, when known (progress lines show its share done)."""
        ...


class StateCodec(Protocol):
    """What a saved state must match to load into a loader."""

    def state_config(self) -> dict[str, Any]:
        """The fields written as a state's "config" and compared on load (JSON-ready)."""
        ...

    def own_state(self) -> dict[str, Any]:
        """Fields a state carries beside the loader's own (a DataLoader: its dataset's and
        sampler's own states, `_torch/stateful.py`); {} for none."""
        ...

    def load_own_state(
        self, state: Mapping[str, Any] | None, elastic: list[Mapping[str, Any]]
    ) -> None:
        """A state is being loaded: this rank's own fields, or on another world size None and
        every old rank's (`elastic`); StateError where they cannot be kept here (before the loader
        takes anything of the state)."""
        ...


def executor_kind(executor: str | Executor) -> str:
    """Where decode runs with `executor` (a name or an `Executor`): "inline", "thread" or "process"."""
    if isinstance(executor, str):
        return executor
    return "process" if writes_rows(executor) else "thread"


class LoaderDescriber:
    """A `Loader`'s describer: its arguments as given, its plan and its stages."""

    workers_argument = "workers"

    def __init__(
        self,
        origin: str,
        plan: Plan,
        stages: Stages,
        concurrency: int | str,
        executor: str | Executor,
        timeout: float | None,
    ) -> None:
        self._origin, self._plan, self._stages = origin, plan, stages
        self._concurrency, self._executor, self._timeout = concurrency, executor, timeout

    def config(self) -> list[str]:
        parts = [self._origin]
        decode = self._stages.decode
        if isinstance(decode, FetchDecode):  # fetch_in_workers: the user's decode is inside
            parts.append("fetch_in_workers=True")
            decode = decode.decode
        if decode is not None:
            parts.append(f"decode={_name(decode)}")
        plan = self._plan
        parts.append(f"batch_size={getattr(plan, 'batch_size', plan.group_size)}")
        order = getattr(plan, "order", None)
        if order is not None:
            parts.append(f"shuffle={order.shuffle}")
        parts.append(f"concurrency={self._concurrency!r}")
        executor = self._executor
        parts.append(
            f"executor={executor if isinstance(executor, str) else type(executor).__name__!r}"
        )
        workers = workers_of(self._stages.decoder, None)
        if workers is not None and executor != "inline":
            parts.append(f"workers={workers}")
        return parts

    def executor_kind(self) -> str:
        return executor_kind(self._executor)

    def timeout_message(self) -> str:
        return f"no batch within timeout={self._timeout} s"

    def length(self) -> int:
        return len(self._plan)

    def epoch_samples(self) -> int | None:
        try:
            return self.length() * self._stages.group_size
        except TypeError:
            return None


class KeyPlanState:
    """A `Loader`'s state codec: its keys (a digest), batching and shuffle."""

    def __init__(self, plan: Plan) -> None:
        self._plan = plan
        self._digest: tuple[Any, int, str] | None = None  # (keys, their length, their digest)

    def _keys_digest(self, keys: Any) -> str:
        """`keys_digest(keys)`, worked out again only for other keys or another length (a state
        is asked for often: a mix by rows asks at every item, and a digest reads 64 keys)."""
        n = len(keys) if isinstance(keys, Sequence) else -1
        if self._digest is None or self._digest[0] is not keys or self._digest[1] != n:
            self._digest = (keys, n, keys_digest(keys))
        return self._digest[2]

    def state_config(self) -> dict[str, Any]:
        plan = self._plan
        assert isinstance(plan, KeyPlan)
        order = plan.order
        return {
            "keys": self._keys_digest(order.keys), "batch_size": plan.batch_size,
            "drop_last": plan.drop_last, "shuffle": order.shuffle, "seed": order.seed,
        }  # fmt: skip

    def own_state(self) -> dict[str, Any]:
        return {}

    def load_own_state(
        self, state: Mapping[str, Any] | None, elastic: list[Mapping[str, Any]]
    ) -> None:
        pass


@dataclass
class Parts:
    """Everything a Loader is wired from (see `Loader` for what the settings mean)."""

    plan: Plan
    read: Read
    collate: Callable[[list[Any]], Any] | None
    concurrency: int | str
    prefetch: int
    in_order: bool
    timeout: float | None
    use_caller_loop: bool = False
    source: Source | None = None  # closed with the loader; told each epoch (`set_epoch`)
    seed: int = 0
    device: BatchStage | None = None
    errors: ErrorPolicy | None = None  # None: raise at the first error
    budget: MemoryBudget | None = None  # None: the default byte budget
    stats: bool = True
    batch_errors: bool = False  # an error ends its batch only (torch's DataLoader), not the epoch
    # `for` makes each batch in the consumer's thread, without the pipeline (`_pipeline/inline.py`):
    # for reads that do not wait, or must not overlap; not with a decode or a device stage
    inline: bool = False
    # `iter(loader)` begins the epoch (draws its order, starts its workers), as torch's DataLoader
    # does; else the first `next()` does
    begin_at_iter: bool = False
    origin: str = ""  # where the samples come from, for the default describer's repr
    hooks: EpochHooks = field(default_factory=NoHooks)
    describer: Describer | None = None  # None: a `LoaderDescriber`, once the stages are made
    state: StateCodec | None = None  # None: a `KeyPlanState` of `plan`
