"""WebDataset tar shards: samples streamed out of .tar files on disk, over HTTP(S), in S3 or in GCS.

Members are grouped into samples the way the `webdataset` package does: consecutive members that share
a key (the path up to the first "." of the file name) make one dict `{"__key__": key, "__url__": shard,
"jpg": bytes, "cls": bytes, ...}` (extensions lower-cased; `__*__` metadata members skipped).

Per epoch, the shard list is shuffled with (seed, epoch) (by default: `shuffle=False` keeps the given
order, for validation and evaluation) and its samples shared out across `world_size * num_workers`
readers without overlap, every reader the same number (`tar_share.py`: from the shards' sample
counts, given as `sample_counts` or counted by a first pass); `parallel` shards are read at once and
their samples interleaved round-robin (a fixed order, whatever the timing), then mixed by a bounded
shuffle buffer. The next `read_ahead` shards of each of the `parallel` are requested before the
current ones end (within the loader's read-ahead share of its memory budget), so one shard's
first-byte wait overlaps another's reading. A shard on this machine (a local file, or a remote
shard's copy in `cache_dir`) is read by position in a thread (`tar_file.py`): the loop receives its
members whole, a batch at a time. From the members to the merge and the shuffle buffer, samples move
in chunks (the samples of one batch of members), so each step of that chain is taken once a chunk;
the order does not depend on the chunks. A loader takes each streamed sample in place
(`fetch_now`), with no task of its own for it.

Since samples exist only once a shard is read, the keys of this source are produced while streaming:
`keys()` is an async iterable of `SampleRef`s (each full iteration is one epoch) that carry their sample,
and `fetch(ref)` hands the sample over. Iterating the source itself (`async for sample in shards`)
gives the samples directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import re
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

from ..._exceptions import FetchError
from ..._util.aiters import flattened
from ..._util.loops import run_to_end
from ..._util.ranges import Ranges
from ..._util.validate import check_int
from ..cache.disk import Cache, check_cache_args
from ..stores.manifest import job_store
from ..transport.redact import redact_url
from .options import ShardOptions
from .shards import SCHEMES, ReadMeter, cached_name, initial_fill, interleave, open_shard, shuffled
from .tar_counts import count_all, count_local, count_members
from .tar_file import Run, file_members
from .tar_members import Members, member_batches, tar_members
from .tar_share import Segment, check_counts, given, kept, segments, shard_order

__all__ = ["SampleRef", "TarShards", "count_samples", "tar_shards"]

log = logging.getLogger("aioloader")

_META = re.compile(r"__[^/]*__($|/)")


def split_name(name: str) -> tuple[str | None, str]:
    """(key, extension) of a member name: "a/b.seg.jpg" -> ("a/b", "seg.jpg"); (None, "") if none."""
    folder, slash, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None, ""
    return folder + slash + stem, ext


def sample_key(name: str) -> str | None:
    """The key of the sample a member belongs to (None: metadata, or a name without a key)."""
    if _META.match(name) or name.rpartition("/")[2].startswith("__"):
        return None
    return split_name(name)[0]


class SampleRef:
    """The key of one streamed sample: where it came from, and the sample until `fetch` takes it."""

    __slots__ = ("index", "name", "sample", "shard")

    def __init__(self, shard: str, index: int, sample: dict[str, Any]) -> None:
        self.shard = shard
        self.index = index
        self.name = sample["__key__"]
        self.sample: dict[str, Any] | None = sample

    def __repr__(self) -> str:
        return f"<sample {self.name!r} #{self.index} of {redact_url(self.shard)}>"


class _Epochs:
    """An async iterable whose every iteration streams one more epoch of `SampleRef`s."""

    def __init__(self, shards: TarShards) -> None:
        self._shards = shards

    def __aiter__(self) -> AsyncIterator[SampleRef]:
        return self._shards._refs(self._shards._next_epoch())

    def digest(self) -> str:
        """What a saved loader state checks: the shards and what orders their samples."""
        src = self._shards
        h = hashlib.blake2b("\n".join(src.shards).encode(), digest_size=8).hexdigest()
        return (f"tar_shards({len(src.shards)}:{h}, shuffle={src.shuffle}, seed={src.seed}, "
                f"shuffle_buffer={src.shuffle_buffer}, parallel={src.parallel})")  # fmt: skip


class TarShards:
    """Samples from WebDataset-style tar shards, as a source. See `tar_shards()` for the arguments.

    The shard order is shuffled every epoch unless `shuffle=False`. The source shuffles itself: a
    `Loader` over it keeps its own `shuffle=False`.

    Example:
        >>> shards = tar_shards(["/data/train-000.tar", "/data/train-001.tar"], shuffle_buffer=1000)
        >>> async def first_keys():
        ...     async for sample in shards:
        ...         print(sample["__key__"], sorted(sample))  # doctest: +SKIP
    """

    def __init__(
        self,
        shards: str | Sequence[str],
        *,
        parallel: int = 2,
        read_ahead: int = 1,
        shuffle_initial: int | None = None,
        suffixes: Sequence[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | None = None,
        sample_counts: Sequence[int] | Mapping[str, int] | None = None,
        options: ShardOptions | None = None,
        **shared: Any,
    ) -> None:
        """`shared`: the arguments `tar_shards()` shares with `parquet()` (`ShardOptions`: order,
        share, stores' options), one by one or together as `options`."""
        self.options = ShardOptions.of(options, shared, "TarShards.__init__")
        self.shards = [shards] if isinstance(shards, str) else list(shards)
        if not self.shards:
            raise ValueError("shards: no shards given")
        self.options.check("samples")
        check_int("parallel", parallel, minimum=1)
        check_int("read_ahead", read_ahead, minimum=0)
        if shuffle_initial is not None:
            check_int("shuffle_initial", shuffle_initial, minimum=1)
        self.shuffle = self.options.shuffle
        self.shuffle_buffer, self.seed = self.options.shuffle_buffer, self.options.seed
        self.slot, self.slots = self.options.place()
        self.parallel = parallel
        self.read_ahead = read_ahead
        self.shuffle_initial = (
            initial_fill(self.shuffle_buffer) if shuffle_initial is None else shuffle_initial
        )
        # what the shards read ahead may hold together (None: no byte bound); a loader sets it
        # to its budget's share for reading ahead (`MemoryBudget.read_ahead_bytes`)
        self.max_bytes_ahead: int | None = None
        self.suffixes = None if suffixes is None else frozenset(s.lower() for s in suffixes)
        self._store_options = self.options.stores()
        self._remotes: dict[str, Any] = {}
        self._epoch = 0
        self._reads = ReadMeter(parallel)
        check_cache_args(cache_dir, cache_limit)
        self._cache = None if cache_dir is None else Cache(cache_dir, cache_limit)
        self.sample_counts = check_counts(sample_counts, self.shards)  # None: counted when needed
        self.counted = 0  # shards whose samples this process counted (a first pass)

    def __repr__(self) -> str:
        mixing = f", shuffle_buffer={self.shuffle_buffer}" if self.shuffle_buffer else ""
        return (
            f"tar_shards([{len(self.shards)} shards], shuffle={self.shuffle}{mixing}, "
            f"slot {self.slot} of {self.slots})"
        )

    def bind(self, *, rank: int, world_size: int) -> None:
        """Take the loader's rank and world size, unless this source was given its own share.

        The loader calls this at construction; it then leaves the sharding to this source.
        """
        if self.slots == self.options.num_workers:  # built for rank 0 of 1: use the loader's
            self.slot, self.slots = self.options.place(rank, world_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration stream `epoch` (which decides the shard order and the mixing)."""
        self._epoch = check_int("epoch", epoch, minimum=0)

    def _next_epoch(self) -> int:
        epoch, self._epoch = self._epoch, self._epoch + 1
        return epoch

    def shards_for(self, epoch: int) -> list[str]:
        """The shards this rank and worker read (all or part of) in `epoch`, in reading order."""
        order = shard_order(len(self.shards), self.shuffle, self.seed, epoch)
        if self.slots > 1:
            counts = self._counts_now()
            cut = segments(counts, order, Ranges(), self.slot, self.slots, False)
            order = [seg.shard for seg in cut]
        return [self.shards[i] for i in order]

    def samples(
        self, epoch: int, keep_going: bool = False, consumed: Ranges | None = None,
        drop_last: bool = False,
    ) -> AsyncGenerator[dict[str, Any], None]:  # fmt: skip
        """The samples of `epoch` for this rank and worker, streamed: its share of the epoch's
        samples once those in `consumed` (positions, `tar_share.py`) are taken out, as many as
        every other reader's (padded by wrapping, or cut with `drop_last`). A shard that cannot be
        read (missing, truncated, corrupt) raises FetchError naming it and the offset; with
        `keep_going` it yields `{"__error__": that error, ...}` in its place and the others go on
        (how a Loader skips it under `on_error="skip"`)."""
        return flattened(self._chunks(epoch, keep_going, consumed or Ranges(), drop_last))

    async def _chunks(
        self, epoch: int, keep_going: bool, consumed: Ranges, drop_last: bool
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """`samples`, in chunks (lists of samples: those that came without a wait)."""
        order = shard_order(len(self.shards), self.shuffle, self.seed, epoch)
        if self.sample_counts is None and self.slots == 1 and not len(consumed):
            mine = [Segment(i, None, None) for i in order]  # all of every shard: no count needed
        else:
            counts = await self._counted()
            mine = segments(counts, order, consumed, self.slot, self.slots, drop_last)
        if not mine:
            log.warning("tar shards: reader %d of %d has no samples", self.slot, self.slots)
        streams = [self._segment(seg, keep_going) for seg in mine]
        merged = self._merged(streams, epoch, self.slot, self._reads)
        async with contextlib.aclosing(merged):
            async for chunk in merged:
                yield chunk

    def _merged(
        self, streams: list[AsyncGenerator[list[Any], None]], epoch: int, slot: int,
        meter: ReadMeter | None = None,
    ) -> AsyncGenerator[list[Any], None]:  # fmt: skip
        """Reader `slot`'s streams of `epoch` (in chunks) as one: interleaved, then through the
        shuffle buffer (the same for samples and for the positions they stand for: `positions`)."""
        merged = interleave(
            streams, self.parallel, meter, ahead=self.parallel * self.read_ahead,
            max_bytes_ahead=self.max_bytes_ahead,
        )  # fmt: skip
        if self.shuffle_buffer <= 1:
            return merged
        rng = random.Random(f"{self.seed}/{epoch}/{slot}")
        return shuffled(merged, self.shuffle_buffer, rng, self.shuffle_initial)

    def _segment(
        self, seg: Segment, keep_going: bool
    ) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The samples of one shard this reader keeps (`seg.members`; None: all of them), in
        chunks."""
        shard = self.shards[seg.shard]
        read = self._shard_or_its_rest if keep_going else self._shard_samples
        expected = None if self.sample_counts is None else self.sample_counts[seg.shard]
        return kept(read(shard), seg.members, expected, shard, keep_going)

    # -- sample counts: equal shares and the positions a state names ----------------------------------

    async def _counted(self) -> list[int]:
        """Every shard's sample count: as given, else counted once (a first pass)."""
        if self.sample_counts is None:
            remote = sum(s.partition("://")[0] in SCHEMES for s in self.shards)
            shared = job_store() is not None
            log.log(logging.INFO if shared or not remote else logging.WARNING,  # all read here
                    "tar shards: counting the samples of %d shards (%d remote) %s, a first pass; "
                    "pass sample_counts= (sources.tar.count_samples) to skip it",
                    len(self.shards), remote, "with the job" if shared else "on this rank",
                    )  # fmt: skip
            self.sample_counts = await self._count_all(self._cache)
        return self.sample_counts

    def _counts_now(self) -> list[int]:
        """`_counted()` from sync code (on a loop of its own, whose connections it then closes)."""
        if self.sample_counts is None:

            async def count() -> list[int]:
                try:
                    return await self._count_all(None)
                finally:
                    for remote in self._remotes.values():  # made on this loop: closed with it
                        await remote.aclose()

            self.sample_counts = run_to_end(count(), "aioloader-tar-count")
        return self.sample_counts

    async def _count_all(self, cache: Cache | None) -> list[int]:
        """Every shard's count: with the job's other ranks when a process group is up (each shard
        counted once per job), else all of them here (`tar_counts.count_all`)."""

        async def one(shard: str) -> int:
            scheme, sep, _ = shard.partition("://")
            if not sep or scheme not in SCHEMES:  # a local file: its headers only
                return await asyncio.to_thread(count_local, shard, sample_key)
            stream = open_shard(shard, self._remotes, self._options_of, cache)
            members = tar_members(stream, redact_url(shard))
            async with contextlib.aclosing(members):
                return await count_members(members, sample_key)

        counts, self.counted = await count_all(self.shards, one, max(self.parallel, 8))
        return counts

    def rank_and_world(self) -> tuple[int, int]:
        """This reader's place (rank, or rank and worker) among all: what a state records."""
        return self.slot, self.slots

    def epoch_size(self) -> int:
        """The samples of one epoch, over all readers."""
        return sum(self._counts_now())

    def share_keys(self, epoch: int, consumed: Ranges, drop_last: bool) -> AsyncIterator[SampleRef]:
        """This reader's `SampleRef`s of `epoch` once `consumed` is taken out (a loader's plan)."""
        return self._refs(epoch, consumed, drop_last)

    def positions(
        self, epoch: int, consumed: Ranges, drop_last: bool, rank: int, world_size: int,
        stop: int | None,
    ) -> list[int]:  # fmt: skip
        """The epoch positions (`tar_share.py`) of the first `stop` samples (None: all) that
        reader `rank` of `world_size` streams, found without reading a shard: its segments'
        positions, through the same interleave and shuffle buffer as its samples."""
        order = shard_order(len(self.shards), self.shuffle, self.seed, epoch)
        cut = segments(self._counts_now(), order, consumed, rank, world_size, drop_last)

        async def first() -> list[int]:
            streams = [given(seg.positions) for seg in cut if seg.positions is not None]
            out: list[int] = []
            async with contextlib.aclosing(self._merged(streams, epoch, rank)) as merged:
                async for chunk in merged:
                    out += chunk
                    if stop is not None and len(out) >= stop:
                        return out[:stop]
            return out

        return run_to_end(first(), "aioloader-tar-positions")

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self.samples(self._next_epoch())

    async def _shard_or_its_rest(self, shard: str) -> AsyncGenerator[list[dict[str, Any]], None]:
        """`_shard_samples`, then, if the shard breaks, one `{"__error__": ...}` for its rest."""
        done = 0
        try:
            async with contextlib.aclosing(self._shard_samples(shard)) as samples:
                async for chunk in samples:
                    yield chunk
                    done += len(chunk)
        except Exception as exc:  # the rest of this shard is lost; the other shards go on
            error = exc if isinstance(exc, FetchError) else FetchError(
                f"tar shard {redact_url(shard)}: {type(exc).__name__}: {exc}",
                key=redact_url(shard),
            )  # fmt: skip
            error.add_note(f"aioloader: after {done} whole samples of the shard")
            yield [{
                "__error__": error,
                "__url__": shard,
                "__key__": f"<rest of {redact_url(shard)}>",
            }]  # fmt: skip

    async def _shard_samples(self, shard: str) -> AsyncGenerator[list[dict[str, Any]], None]:
        samples = self._parsed(shard)
        try:
            async with contextlib.aclosing(samples):
                async for chunk in samples:
                    yield chunk
        except FetchError:
            if self._cache is not None:  # a cached copy that does not parse is fetched again
                name = cached_name(shard, self._remotes, self._options_of)
                if name is not None:
                    await self._cache.forget(name)
            raise

    async def _parsed(self, shard: str) -> AsyncGenerator[list[dict[str, Any]], None]:
        """The samples of `shard`, in chunks: those whose members came in one batch of members (a
        sample is handed on once its last member is in: when the next sample's first one is, or
        the shard ends)."""
        label = redact_url(shard)
        current: dict[str, Any] | None = None
        suffixes = self.suffixes

        def read_file(run: Run, fd: int, size: int) -> AsyncGenerator[Members, None]:
            return file_members(run, fd, size, label)

        members = member_batches(
            open_shard(shard, self._remotes, self._options_of, self._cache, read_file), label
        )
        async with contextlib.aclosing(members):
            async for batch in members:
                done: list[dict[str, Any]] = []
                for name, data in batch:
                    if _META.match(name) or name.rpartition("/")[2].startswith("__"):
                        continue
                    key, ext = split_name(name)
                    if key is None:
                        continue
                    ext = ext.lower()
                    if current is None or key != current["__key__"]:
                        if current is not None:
                            done.append(current)
                        current = {"__key__": key, "__url__": shard}
                    if ext in current:
                        if done:  # the samples before it come out first
                            yield done
                        raise FetchError(
                            f"tar shard {label}: {name!r} twice in one sample",
                            key=redact_url(shard),
                        )
                    if suffixes is None or ext in suffixes:
                        current[ext] = data
                if done:
                    yield done
        if current is not None:
            yield [current]

    def _options_of(self, kind: str) -> dict[str, Any]:
        stores = self._store_options
        return stores[kind] if kind in stores else stores["http"]

    async def _refs(
        self, epoch: int, consumed: Ranges | None = None, drop_last: bool = False
    ) -> AsyncIterator[SampleRef]:
        index = 0
        # closed here, in this task: left to the garbage collector, it and the generators it reads
        # would be closed at once by tasks of their own, each finding the next one still running
        chunks = self._chunks(epoch, True, consumed or Ranges(), drop_last)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                for sample in chunk:  # a broken shard's rest: its fetch raises
                    yield SampleRef(sample["__url__"], index, sample)
                    index += 1

    def keys(self) -> _Epochs:
        """An async iterable of the `SampleRef`s of one epoch per iteration (streamed, no length)."""
        return _Epochs(self)

    async def fetch(self, ref: SampleRef) -> dict[str, Any]:
        """The sample `ref` carries (handed over once)."""
        return self.fetch_now(ref)

    def fetch_now(self, ref: SampleRef) -> dict[str, Any]:
        """`fetch`, as a plain call: the sample is here already (`HandsOver`)."""
        sample, ref.sample = ref.sample, None
        if sample is None:
            raise FetchError(f"{ref!r} was already fetched", key=ref, stage="fetch")
        error = sample.get("__error__")
        if error is not None:  # the rest of a shard that could not be read
            raise error
        return sample

    def stats(self) -> dict[str, float | None]:
        """What the shard readers did: samples and bytes read, seconds spent reading (summed over
        readers; `shard_all_reading_s`: every one of the `shard_readers` reading at once), read
        time percentiles per sample, the retries of the remote shards' sources, and the cache's
        hits, misses, waits, evictions and bytes read (with `cache_dir`).

        A loader reading this source counts these as its fetch stage (`loader.stats()`)."""
        counts: dict[str, float | None] = dict(self._reads.stats())
        counts["retries"] = sum(r.transport.counts["retries"] for r in self._remotes.values())
        if self._cache is not None:
            counts.update(self._cache.counts)
        return counts

    async def aclose(self) -> None:
        """Close the connection pools of the remote shards (and the cache's index). Idempotent."""
        remotes, self._remotes = self._remotes, {}
        for remote in remotes.values():
            await remote.aclose()
        if self._cache is not None:
            await self._cache.aclose()


def tar_shards(
    shards: str | Sequence[str],
    *,
    shuffle: bool = True,
    shuffle_buffer: int = 0,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    worker: int = 0,
    num_workers: int = 1,
    parallel: int = 2,
    read_ahead: int = 1,
    shuffle_initial: int | None = None,
    suffixes: Sequence[str] | None = None,
    http_options: dict[str, Any] | None = None,
    s3_options: dict[str, Any] | None = None,
    gcs_options: dict[str, Any] | None = None,
    azure_options: dict[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | None = None,
    sample_counts: Sequence[int] | Mapping[str, int] | None = None,
) -> TarShards:
    """A source of the samples in WebDataset tar shards.

    Shuffled by default: every epoch reads the shards in a new order (seeded by `seed` and the
    epoch), as training wants. For a validation or test set pass `shuffle=False`: the shards are
    read in the order given and their samples come in the order stored (with `parallel=1`, one
    shard after the other; with more, interleaved round-robin, the same every epoch). The source
    shuffles itself, so a `Loader` over it takes no `shuffle=True`.

    Args:
        shards: paths, http(s) URLs, s3://, gs:// or az:// URLs of .tar files.
        shuffle: shuffle the shard order per epoch (True, the default) or keep it (False).
        shuffle_buffer: samples held to mix the stream (0: no sample shuffle); needs `shuffle`.
        shuffle_initial: samples the shuffle buffer holds before the first one goes out (default:
            100, at most `shuffle_buffer`); it then grows by one sample per sample out (two read
            per one out) until it holds `shuffle_buffer`, so the first batch does not wait for
            the whole buffer. Which sample goes out when follows from (seed, epoch) alone.
        seed: what every epoch's shard order and mixing derive from (with the epoch).
        rank, world_size, worker, num_workers: read only this reader's share of the shards.
        parallel: shards read at once (their samples interleaved round-robin).
        read_ahead: shards requested ahead per each of the `parallel` (0: none), before the
            current ones end, so that their first bytes are on their way while those are read.
            Each holds a few samples until its turn comes, and under a Loader all of them
            together at most its budget's read-ahead share (half of `max_bytes_in_flight`)
            beyond their first samples. The order is the same whatever `read_ahead` is.
        suffixes: keep only these extensions (others are dropped from the samples).
        http_options: passed to `http()` for http(s) shards (timeouts, retries, headers, ssl).
        s3_options: passed to `s3()` for s3:// shards (endpoint_url, credentials, region, ...).
        gcs_options: passed to `gcs()` for gs:// shards (endpoint_url, credentials_file, ...).
        azure_options: passed to `azure()` for az://container/blob shards (endpoint_url,
            account_name, account_key, sas_token, connection_string, ...).
        cache_dir: keep each remote shard whole in this directory as it is first read, and read
            it from there afterwards (no request): shared safely by the processes of one machine.
        cache_limit: the most bytes kept in `cache_dir` (None: no limit); the least recently
            used shards are deleted to stay under it.
        sample_counts: the samples in each shard (one int per shard, or {shard: count}), from
            which every reader gets the same number per epoch (the last padded by wrapping around,
            or cut by a Loader's `drop_last`) and a saved state resumes on another world size.
            None: with more than one reader, counted by a first pass before the first epoch (a
            local shard from its headers; a remote one read once, into `cache_dir` if given).
            `count_samples(shards)` gives them, to save and pass at scale.

    Example:
        >>> train = tar_shards([f"s3://bucket/train-{i:04d}.tar" for i in range(64)],
        ...                    shuffle_buffer=1000)
        >>> val = tar_shards(["s3://bucket/val-0000.tar"], shuffle=False)
    """
    shared = ShardOptions(
        shuffle=shuffle, shuffle_buffer=shuffle_buffer, seed=seed, rank=rank,
        world_size=world_size, worker=worker, num_workers=num_workers, http_options=http_options,
        s3_options=s3_options, gcs_options=gcs_options, azure_options=azure_options,
    )  # fmt: skip
    return TarShards(
        shards, parallel=parallel, read_ahead=read_ahead, shuffle_initial=shuffle_initial,
        suffixes=suffixes, cache_dir=cache_dir, cache_limit=cache_limit,
        sample_counts=sample_counts, options=shared,
    )  # fmt: skip


def count_samples(shards: str | Sequence[str], **options: Any) -> list[int]:
    """The samples in each of `shards`, one int per shard: `tar_shards(..., sample_counts=)`.

    A first pass: a local shard is counted from its headers, a remote one read once. `options`
    are `tar_shards()`'s (the stores' options, `parallel` for how many at once). Blocks; save the
    result (e.g. as JSON) and pass it to every rank rather than counting on each.

    Example:
        >>> counts = count_samples(["/data/train-000.tar", "/data/train-001.tar"])  # doctest: +SKIP
    """
    return tar_shards(shards, **options)._counts_now()
