"""The inputs of a mix as parts: each gives its keys one pass (one epoch of its own) at a time.

A part is one of the mix's inputs, made uniform:

- `Indexed`: keys with a length (a `Source` such as `sources.files`/`sources.s3`, a map-style
  dataset, a list of samples). Its order in its own epoch `e` is a permutation seeded from (the
  mix's seed, the part's index, `e`) when the mix shuffles, else the stored order; across ranks each
  takes every world_size-th entry of the positions not consumed, padded by wrapping as the order
  stage pads.
- `Streamed`: keys that only come by iterating (`sources.tar_shards`, a streamed listing, an
  IterableDataset or any iterable or async iterable of samples; the indices of a torch `Sampler`
  paired with its map-style dataset, `(dataset, sampler)`). Each pass iterates it afresh,
  after `set_epoch(e)` where it has one; a task reads up to `READ_AHEAD` keys ahead of the mix, so
  every streamed part reads at once.

`Pass.next()` gives the pass's next key or `END`; nothing here depends on timing. A part that knows
its epoch's size (`epoch_size()`: keys with a length; tar shards) also says which positions of its
epoch a rank's pass stands for (`positions`), so the mix can resume on another world size.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from .._arguments import is_map_style
from .._exceptions import FetchError
from .._pipeline.own_order import OrdersItself
from .._protocol import (
    Bindable,
    HasAclose,
    HasSetEpoch,
    HasSize,
    SharesItsStream,
    Source,
)
from .._resume.state import keys_digest
from .._util.loops import is_async_callable
from .._util.ranges import Ranges
from .._util.threads import LazyThreadPool
from ..sources.formats.parquet_order import remaining

__all__ = ["END", "READ_AHEAD", "Indexed", "Part", "Pass", "Streamed", "make_part"]

READ_AHEAD = 64  # keys a streamed part reads ahead of the mix
_SYNC_CHUNK = 16  # items a sync iterable gives per call in a thread
_PERM_SALT = 0x6D697870  # keeps the parts' permutations apart from the choice draws
END: Any = type("_End", (), {"__repr__": lambda self: "END"})()


class Pass:
    """One pass of a part over its keys, in its own epoch `epoch`; `index` keys given so far.

    `at_hand`: `take()` gives the next key without waiting (keys with a length), so the mix need
    not await `next()`.
    """

    at_hand = False

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch
        self.index = 0

    async def next(self) -> Any:
        """The next key, or `END` after the last."""
        return self.take()

    def take(self) -> Any:
        """`next()` without waiting, where `at_hand`."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop reading (idempotent)."""


class Part:
    """One input of a mix. `name` says which in errors; `fetch_fn` turns a key into a sample (the
    mix calls it: on the loop when `fetches_async`, else in its threads; None: the key is it)."""

    sized = False

    def __init__(self, name: str, fetch: Callable[[Any], Any] | None, threads: LazyThreadPool):
        self.name = name
        self.fetch_fn = fetch  # None: the key is the sample
        self.fetches_async = fetch is not None and is_async_callable(fetch)
        self._threads = threads
        self.rank, self.world_size = 0, 1
        self.sizer: Callable[[Any], int | None] | None = None  # a source's `size`

    def open(self, epoch: int, consumed: Ranges | None = None) -> Pass:
        """A pass over this rank's share of `epoch`, once the positions in `consumed` are out."""
        raise NotImplementedError

    def digest(self) -> str:
        raise NotImplementedError

    def epoch_size(self) -> int | None:
        """The positions of one epoch over all ranks (None: not known: no elastic resume)."""
        return None

    def positions(
        self, epoch: int, consumed: Ranges, rank: int, world_size: int
    ) -> Sequence[int] | np.ndarray[Any, Any]:
        """The positions of `epoch` that the pass of `rank` of `world_size` gives, in order."""
        raise NotImplementedError

    def bind(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def size(self, key: Any) -> int | None:
        """The bytes `fetch(key)` will give, where the part's source knows them (else None)."""
        return None if self.sizer is None else self.sizer(key)

    async def aclose(self) -> None:
        """Stop the passes that read ahead, if any (idempotent)."""


class _IndexedPass(Pass):
    def __init__(
        self, epoch: int, keys: Sequence[Any], order: np.ndarray[Any, Any], index: int
    ) -> None:
        super().__init__(epoch)
        self._keys, self._order, self.index = keys, order, index

    at_hand = True

    def take(self) -> Any:
        if self.index >= len(self._order):
            return END
        self.index += 1
        return self._keys[int(self._order[self.index - 1])]


class Indexed(Part):
    """Keys with a length, in a seeded permutation per epoch (or the stored order)."""

    sized = True

    def __init__(
        self, name: str, index: int, keys: Sequence[Any], fetch: Callable[[Any], Any] | None,
        threads: LazyThreadPool, *, shuffle: bool, seed: int,
    ) -> None:  # fmt: skip
        super().__init__(name, fetch, threads)
        if len(keys) == 0:
            raise ValueError(f"{name}: it has no samples")
        self.keys, self.index, self.shuffle, self.seed = keys, index, shuffle, seed

    def order(
        self, epoch: int, consumed: Ranges | None = None
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Key positions this rank takes in `epoch`, in order (8 bytes a key, not a list's 36)."""
        n = len(self.keys)
        perm = (
            np.random.default_rng([self.seed, self.index, epoch, _PERM_SALT]).permutation(n)
            if self.shuffle
            else np.arange(n, dtype=np.int64)
        )
        if self.world_size > 1 or consumed:
            perm = perm[self.positions(epoch, consumed or Ranges(), self.rank, self.world_size)]
        return perm

    def positions(
        self, epoch: int, consumed: Ranges, rank: int, world_size: int
    ) -> np.ndarray[Any, np.dtype[np.int64]]:
        """As `shard` deals them: every world_size-th position left from `rank`, wrapping around."""
        left = remaining(consumed, len(self.keys))
        if not len(left):
            return left
        return left[np.arange(rank, self.length(consumed, world_size) * world_size, world_size)
                    % len(left)]  # fmt: skip

    def open(self, epoch: int, consumed: Ranges | None = None, index: int = 0) -> Pass:
        """A pass over `epoch`'s keys (less `consumed`) that has given `index` of them already."""
        return _IndexedPass(epoch, self.keys, self.order(epoch, consumed), index)

    def length(self, consumed: Ranges | None = None, world_size: int | None = None) -> int:
        """Keys this rank takes per epoch (less `consumed`)."""
        left = len(self.keys) - (len(consumed) if consumed else 0)
        return -(-left // (world_size or self.world_size))  # as `shard` counts them, padded

    def epoch_size(self) -> int:
        return len(self.keys)

    def digest(self) -> str:
        return keys_digest(self.keys)


class _StreamedPass(Pass):
    """Reads a pass's keys on a task, up to `READ_AHEAD` ahead; an error is raised in its place."""

    def __init__(self, epoch: int, part: Streamed, consumed: Ranges | None) -> None:
        super().__init__(epoch)
        self._part, self._consumed = part, consumed
        self._queue: asyncio.Queue[Any] = asyncio.Queue(READ_AHEAD)
        self._task = asyncio.get_running_loop().create_task(self._read(), name="aioloader-mix-read")
        part.passes.add(self)

    async def _read(self) -> None:
        try:
            async for chunk in self._part.chunks(self.epoch, self._consumed):
                for key in chunk:
                    await self._queue.put(key)
        except Exception as exc:
            await self._queue.put(_Raised(exc))
            return
        await self._queue.put(END)

    async def next(self) -> Any:
        key = await self._queue.get()
        if type(key) is _Raised:
            self._queue.put_nowait(key)  # raised again by a later call, never skipped
            raise FetchError(
                f"mix: {self._part.name} failed while giving its keys in its epoch "
                f"{self.epoch}, after {self.index}: {type(key.error).__name__}: {key.error}",
                key=self._part.name, stage="fetch",
            ) from key.error  # fmt: skip
        if key is not END:
            self.index += 1
        return key

    async def aclose(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._part.passes.discard(self)


class _Raised:
    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


class Streamed(Part):
    """Keys that come by iterating: one iteration per pass, `set_epoch(e)` first where it exists."""

    def __init__(
        self, name: str, keys: Callable[[], Iterable[Any] | AsyncIterable[Any]],
        fetch: Callable[[Any], Any] | None, threads: LazyThreadPool, owner: object,
    ) -> None:  # fmt: skip
        super().__init__(name, fetch, threads)
        self._keys, self._owner = keys, owner
        self.passes: set[_StreamedPass] = set()

    def open(self, epoch: int, consumed: Ranges | None = None) -> Pass:
        return _StreamedPass(epoch, self, consumed)

    def digest(self) -> str:
        return f"stream:{type(self._owner).__name__}"

    async def aclose(self) -> None:
        for open_pass in list(self.passes):
            await open_pass.aclose()

    def epoch_size(self) -> int | None:
        owner = self._owner
        return owner.epoch_size() if isinstance(owner, SharesItsStream) else None

    def positions(self, epoch: int, consumed: Ranges, rank: int, world_size: int) -> list[int]:
        assert isinstance(self._owner, SharesItsStream)
        return self._owner.positions(epoch, consumed, False, rank, world_size, None)

    def bind(self, rank: int, world_size: int) -> None:
        replicas = getattr(self._owner, "num_replicas", None)  # a DistributedSampler: its share
        if isinstance(self._owner, Bindable):
            self._owner.bind(rank=rank, world_size=world_size)
        elif replicas is not None and replicas != world_size:
            raise ValueError(
                f"{self.name}: its sampler shares the data among num_replicas={replicas}, the "
                f"loader runs {world_size} ranks"
            )
        elif world_size > 1 and replicas is None:
            raise ValueError(
                f"{self.name}: a {type(self._owner).__name__} cannot be shared among "
                f"{world_size} ranks (it has no length and no bind()); give each rank its own share"
            )
        super().bind(rank, world_size)

    async def chunks(self, epoch: int, consumed: Ranges | None = None) -> AsyncIterator[list[Any]]:
        """The keys of one pass in `epoch` (less `consumed`, for a source that shares its stream
        itself), in lists (a sync iterable is read in the threads)."""
        owner = self._owner
        keys: Iterable[Any] | AsyncIterable[Any]
        if isinstance(owner, SharesItsStream):  # tar shards: this rank's equal share
            keys = owner.share_keys(epoch, consumed or Ranges(), False)
        else:
            if isinstance(owner, HasSetEpoch) and callable(owner.set_epoch):
                owner.set_epoch(epoch)
            keys = self._keys()
        if isinstance(keys, AsyncIterable):
            stream = aiter(keys)
            try:
                async for key in stream:
                    yield [key]
            finally:
                if isinstance(stream, HasAclose):
                    await stream.aclose()
            return
        it = iter(keys)
        while True:
            chunk, error = await self._threads.run(_take, it)
            if chunk:
                yield chunk
            if error is not None:
                raise error
            if not chunk:
                return


def _take(it: Iterable[Any]) -> tuple[list[Any], Exception | None]:
    """Up to `_SYNC_CHUNK` items of `it`, and the error that cut them short (if one did)."""
    out: list[Any] = []
    try:
        for item in itertools.islice(it, _SYNC_CHUNK):
            out.append(item)
    except Exception as exc:
        return out, exc
    return out, None


def make_part(
    name: str, index: int, obj: Any, threads: LazyThreadPool, *, shuffle: bool, seed: int
) -> Part:
    """The part for one input: a Source, a map-style dataset, a sequence or an iterable of samples."""
    if isinstance(obj, str | bytes) or obj is None:
        raise TypeError(f"{name}: expected a source, a dataset or samples, got {obj!r}")
    if isinstance(obj, OrdersItself) and isinstance(obj, AsyncIterable):
        # sources.parquet: its own order, its rows read by row group; each pass one epoch of it
        stream: AsyncIterable[Any] = obj
        return Streamed(name, lambda: stream, None, threads, obj)
    if isinstance(obj, Source):
        keys = obj.keys()
        part: Part
        if isinstance(keys, Sequence):
            part = Indexed(name, index, keys, obj.fetch, threads, shuffle=shuffle, seed=seed)
        else:
            part = Streamed(name, obj.keys, obj.fetch, threads, obj)
        part.sizer = obj.size if isinstance(obj, HasSize) else None
        return part
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], Sampler):
        dataset, sampler = obj
        if not is_map_style(dataset):
            raise TypeError(
                f"{name}: (dataset, sampler) needs a map-style dataset, got {dataset!r}"
            )
        return Streamed(name, lambda: sampler, dataset.__getitem__, threads, sampler)
    if is_map_style(obj):
        return Indexed(name, index, range(len(obj)), obj.__getitem__, threads,
                       shuffle=shuffle, seed=seed)  # fmt: skip
    if isinstance(obj, Sequence):
        return Indexed(name, index, obj, None, threads, shuffle=shuffle, seed=seed)
    if isinstance(obj, Iterable | AsyncIterable):
        return Streamed(name, lambda: obj, None, threads, obj)
    raise TypeError(
        f"{name}: expected a Source, a map-style dataset, a (dataset, sampler) pair, a sequence "
        f"or an iterable of samples (or only Loaders), got {type(obj).__name__}"
    )
