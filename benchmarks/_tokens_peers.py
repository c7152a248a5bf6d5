"""The peers of `benchmarks/tokens.py`, each optional (the `bench` extra pins them): `missing(name)`
says why one cannot run, `peer(name, ...)` makes it. Each does the workload its own way:

- "litdata": LitData's `optimize` writes each source's documents (EOS appended) into its own token
  chunks first, an offline step timed apart ("offline_s", not in the figures); then a
  `StreamingDataset` per source with `TokensLoader(block_size=2048)`, a `CombinedStreamingDataset`
  with weights 0.7 / 0.3 (it mixes 2,048-token blocks, not documents) and a `StreamingDataLoader`
  (batch 8, no worker processes), whose `state_dict()` resumes it;
- "grain": `ParquetIterDataset` per source (it reads every column), EOS appended by `map`,
  `IterDataset.mix` 0.7 / 0.3 per document, `ConcatThenSplitIterDataset` into 2,048 tokens,
  `batch(8)`; its iterator's `get_state()` / `set_state()` resume it;
- "hf": HF datasets' streaming `load_dataset("parquet", columns=["tokens"])` per source,
  `interleave_datasets` 0.7 / 0.3 per document, packing in a batched `map` over 1,000 documents
  (its recipe: the tokens left over at the end of each 1,000 are dropped), torchdata's
  `StatefulDataLoader` (batch 8, no worker processes), whose `state_dict()` resumes it.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from _tokens_store import arrow_s3, boto3_options, fresh_cache, in_bucket, store

NEEDS = {"litdata": ["litdata"], "grain": ["grain"], "hf": ["datasets", "torchdata"]}


def missing(name: str) -> str | None:
    """Why contender `name` cannot run here (None: it can)."""
    if name not in NEEDS:
        known = ", ".join(NEEDS)
        return f"unknown contender {name!r} (known: aioloader, aioloader-per-doc, {known})"
    absent = [m for m in NEEDS[name] if importlib.util.find_spec(m) is None]
    if absent:
        return f"{', '.join(absent)} not installed (pip install 'aioloader[bench]')"
    return None


def peer(
    name: str, files: dict[str, list[str]], folder: Path, seq_len: int, batch: int, eos: int,
    weights: dict[str, float],
) -> Any:  # fmt: skip
    kinds = {"litdata": LitData, "grain": Grain, "hf": HF}
    return kinds[name](files, folder, seq_len, batch, eos, weights)


class Peer:
    """What `tokens.py` asks of a contender: make, batches (numpy [batch, seq_len]), state, load,
    close; `extra` holds figures of its own (an offline step)."""

    def __init__(
        self, files: dict[str, list[str]], folder: Path, seq_len: int, batch: int, eos: int,
        weights: dict[str, float],
    ) -> None:  # fmt: skip
        self.files, self.folder, self.seq_len, self.batch, self.eos = (
            files,
            folder,
            seq_len,
            batch,
            eos,
        )
        self.weights = [weights[name] for name in files]
        self.extra: dict[str, Any] = {}

    def state(self, made: Any) -> Any:
        return copy.deepcopy(made.state_dict())

    def load(self, made: Any, state: Any) -> None:
        made.load_state_dict(state)

    def close(self, made: Any) -> None:
        pass


# -- LitData -----------------------------------------------------------------------------------------


def _documents(path: str) -> Iterator[Any]:
    """One source file's documents, EOS appended (LitData's optimize calls this per file)."""
    import pyarrow.parquet as pq
    import torch

    file = pq.ParquetFile(path)
    for rg in range(file.num_row_groups):
        column = file.read_row_group(rg, columns=["tokens"]).column("tokens").combine_chunks()
        offsets, values = column.offsets.to_numpy(), column.values.to_numpy()
        for a, b in itertools.pairwise(offsets):
            yield torch.from_numpy(np.append(values[a:b], _EOS[0]).astype(np.int32))


_EOS = [0]  # set before optimize runs (its workers fork from here)


class LitData(Peer):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.dirs = [self.folder / "litdata" / name for name in self.files]
        self.caches: list[str] = []  # on the store: a chunk cache per source, this process's
        if not all((d / "index.json").exists() for d in self.dirs):
            self.extra["offline_s"] = self._optimize()

    def _optimize(self) -> float:
        from litdata import TokensLoader, optimize

        _EOS[0] = self.eos
        t0 = time.perf_counter()
        for paths, out in zip(self.files.values(), self.dirs, strict=True):
            optimize(fn=_documents, inputs=paths, output_dir=str(out), chunk_size=(self.seq_len * 2048),
                     item_loader=TokensLoader(), num_workers=2, verbose=False)  # fmt: skip
        return time.perf_counter() - t0

    def make(self) -> Any:
        from litdata import (
            CombinedStreamingDataset,
            StreamingDataLoader,
            StreamingDataset,
            TokensLoader,
        )

        where = store()
        inputs = [str(d) for d in self.dirs]
        if where is not None:  # its chunks in the bucket, behind the 20 ms proxy
            inputs = [f"s3://{where['bucket']}/litdata/{d.name}" for d in self.dirs]
            if not self.caches:  # empty for the first loader; the restore's finds its chunks
                self.caches = [fresh_cache() for _ in self.dirs]  # (its state names them)
            caches = self.caches
            # the workaround it needs here: its chunk downloads go through obstore, which takes
            # only https endpoints unless told `allow_http` (the store here speaks plain http)
            from litdata.streaming import downloader

            downloader._OBSTORE_CLIENT_OPTIONS = {  # type: ignore[attr-defined]
                **downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True,  # type: ignore[attr-defined]
            }  # fmt: skip
        parts = [
            StreamingDataset(
                inputs[i],
                item_loader=TokensLoader(block_size=self.seq_len),
                shuffle=True,
                seed=i,
                **(
                    {}
                    if where is None
                    else {"cache_dir": caches[i], "storage_options": boto3_options(where)}
                ),
            )
            for i in range(len(self.dirs))
        ]
        mixed = CombinedStreamingDataset(
            parts, seed=1, weights=self.weights, iterate_over_all=False
        )
        return StreamingDataLoader(mixed, batch_size=self.batch, num_workers=0)

    def batches(self, made: Any) -> Iterator[np.ndarray]:
        for batch in made:
            yield batch.numpy()

    def state(self, made: Any) -> Any:
        # a copy, as a checkpoint keeps it (`torch.save`): through JSON its int keys would turn
        # into strings, and the resumed batches were then other batches
        return copy.deepcopy(made.state_dict())


# -- Grain -------------------------------------------------------------------------------------------


class Grain(Peer):
    def make(self) -> Any:
        import grain

        eos = self.eos

        def with_eos(row: dict[str, Any]) -> dict[str, Any]:
            return {"tokens": np.append(row["tokens"], np.int32(eos))}

        files, options = self.files, {}
        where = store()
        if where is not None:  # the files in the bucket, through pyarrow's S3 filesystem
            files, options["filesystem"] = in_bucket(files, where, ""), arrow_s3(where)
        parts = [
            grain.experimental.ParquetIterDataset(paths, **options).map(with_eos)
            for paths in files.values()
        ]
        mixed = grain.IterDataset.mix(parts, weights=self.weights)
        packed = grain.experimental.ConcatThenSplitIterDataset(
            mixed, length_struct={"tokens": self.seq_len}
        )
        return iter(packed.batch(self.batch))

    def batches(self, made: Any) -> Iterator[np.ndarray]:
        for batch in made:
            yield batch["tokens"]

    def state(self, made: Any) -> Any:
        return copy.deepcopy(made.get_state())

    def load(self, made: Any, state: Any) -> None:
        made.set_state(state)


# -- HF datasets + torchdata's StatefulDataLoader -----------------------------------------------------


class HF(Peer):
    def make(self) -> Any:
        from datasets import interleave_datasets, load_dataset
        from torchdata.stateful_dataloader import StatefulDataLoader

        seq_len, eos = self.seq_len, self.eos

        def packed(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
            flat = np.concatenate(
                [np.append(np.asarray(t, np.int32), np.int32(eos)) for t in rows["tokens"]]
            )
            n = len(flat) // seq_len
            return {"tokens": list(flat[: n * seq_len].reshape(n, seq_len))}

        files = self.files
        where = store()
        if where is not None:  # the files in the bucket, through fsspec (see `_arrow_s3`)
            _arrow_s3(where)
            files = in_bucket(files, where, f"{_ARROW_S3}://")
        parts = [
            load_dataset(
                "parquet", data_files=paths, split="train", streaming=True, columns=["tokens"]
            )
            for paths in files.values()
        ]
        mixed = interleave_datasets(parts, probabilities=self.weights, seed=1)
        rows = mixed.map(packed, batched=True, batch_size=1000).with_format("numpy")
        return StatefulDataLoader(rows, batch_size=self.batch, num_workers=0)

    def batches(self, made: Any) -> Iterator[np.ndarray]:
        for batch in made:
            yield batch["tokens"].numpy()


_ARROW_S3 = "arrows3"


def _arrow_s3(where: dict[str, Any]) -> None:
    """The workaround HF datasets needs here: it reads remote files through fsspec, whose S3
    filesystem (`s3fs`, with `aiobotocore`) pins a botocore other than the one LitData's boto3
    needs in the same environment. So pyarrow's S3 filesystem, through fsspec's wrapper of it,
    is registered as the protocol `arrows3://` for the store."""
    import fsspec
    from fsspec.implementations.arrow import ArrowFSWrapper

    class ArrowS3(ArrowFSWrapper):  # type: ignore[misc]
        protocol = _ARROW_S3

        @classmethod
        def _strip_protocol(cls, path: Any) -> Any:  # "arrows3://bucket/key" -> "bucket/key"
            if isinstance(path, list):
                return [cls._strip_protocol(p) for p in path]
            return str(path).split("://", 1)[-1].lstrip("/").rstrip("/")

        def __init__(self, **_: Any) -> None:
            super().__init__(arrow_s3(where))

    fsspec.register_implementation(_ARROW_S3, ArrowS3, clobber=True)
