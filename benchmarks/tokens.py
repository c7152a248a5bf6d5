"""Language-model data: Parquet tokens mixed 0.7 / 0.3, packed into [8, 2048] rows with EOS, resumed.

The workload (issue 33): 90,000 tokenized documents (~53 M tokens) in Parquet files (local, or
with `--store` on SeaweedFS behind a proxy that holds each request 20 ms, as the issue measured
it: see `_tokens_store.py`), a `tokens` list<int32> column and three columns not to be read
(`id`, `url`, `raw`: ~1 KB a row); two sources ("web", 70% of the documents, and "code", 30%)
mixed 0.7 / 0.3; greedy packing into rows of 2,048 tokens with EOS after each document; batches
of [8, 2048]. Each contender runs in a fresh interpreter and reports:

- M tokens/s over the epoch (or `--batches`), from making the loader to the last batch;
- CPU s per M tokens (this process and its threads, user + system; worker processes included
  where a contender has them), and CPU µs per document (documents counted by their EOS);
- first batch (s): from making the loader to the first batch;
- restore (s): a fresh loader, `load_state_dict` of the state saved after batch `--resume-at`,
  to its first batch;
- exact resume: the 20 batches after the resume equal those of the uninterrupted run.

Contenders:
- "aioloader": a `Loader` of `sources.parquet(..., rows_per_sample=256)` per source (RecordBatches
  of 256 documents: the columnar fast path), mixed row by row (`aioloader.mix(loaders, weights,
  rows_per_item=256)`: the mix's rule per document), then `aioloader.pack`;
- "aioloader-batches": the same sources in one `Loader` over `aioloader.mix(sources, ...)`, which
  draws per record batch (the proportions hold per 256 documents, not per document);
- every aioloader contender packs into int32 rows (`pack(..., dtype=torch.int32)`), the dtype the
  peers' rows come in (LitData's and Grain's tokens as stored), so each contender hands over the
  same bytes; `pack`'s default is int64, what a loss takes as targets;
- "aioloader-per-doc": one document per sample (the mix draws per document);
- "aioloader-schedule": "aioloader" with the weights under `aioloader.schedule`, moving linearly
  from 0.7 / 0.3 to 0.4 / 0.6 over the first 40,000 documents (what a schedule costs; not in the
  default contenders: `--contenders aioloader,aioloader-schedule`);
- "aioloader-text": "aioloader-batches" over a copy of the corpus whose `text` column holds each document
  as words ("w123 w45 ..." for token ids 123, 45, ...; `id`, `url`, `raw` as they were), tokenized
  on the fly by `aioloader.tokenize` (a word-level `tokenizers.Tokenizer`, made before the clock
  starts) in the loader's decode threads, then mixed and packed alike: its batches are those of
  "aioloader-batches" (`same_batches`, checked on the first 20 after the run); needs `tokenizers`.
  `tokenizer_cpu_s_per_m_tokens` is what the tokenizer alone costs (one `encode_batch_fast` of a
  record batch's text, in this process): the rest of its CPU per M tokens is the loader's;
- peers, only when installed (`pip install 'aioloader[bench]'`), else skipped with the reason:
  see `_tokens_peers.py` (LitData, Grain, HF datasets + torchdata's StatefulDataLoader).

Every contender runs in this interpreter. Install aioloader in it as `make setup` installs it for
the project, with its `uvloop` extra (`pip install -e '.[parquet,uvloop,bench]'`): the loaders'
event loops are uvloop's where it is installed, and without it aioloader's contenders ran 4-10%
more CPU per token (three of four fresh-process pairs, 60% in the fourth; 2026-12-03). The peers
use no event loop. Each of aioloader's results says which loop it ran on (`event_loop`).

The corpus is written once into `--folder` (default: a folder in the temp directory, kept for the
next run; its text copy beside it, when "aioloader-text" runs), then flushed and read once, so
every contender finds it in the page cache (with `--store`, it is put into the bucket, and
LitData's chunks, made on disk first, beside it). Figures are the machine's of the moment: compare
contenders of the same run. With `--rounds R` (3 by default, 1 with `--quick`) every contender
runs R times, in alternating order, and each figure is its best round's.

Usage: python benchmarks/tokens.py [--quick] [--store] [--docs N] [--batches N] [--rounds R]
           [--contenders a,b,...]
The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from _tokens_store import DELAY_MS, RUNS_ON_STORE, STORE_ENV, in_bucket, s3_options, serving, store

SEQ_LEN, BATCH, EOS = 2048, 8, 0
WEIGHTS = {"web": 0.7, "code": 0.3}
ROWS_PER_FILE, ROW_GROUP = 10_000, 1_000
CHECKED = 20  # batches compared after the resume
OURS = (
    "aioloader",
    "aioloader-batches",
    "aioloader-per-doc",
    "aioloader-text",
    "aioloader-schedule",
)
IMPORTS = {
    "litdata": ["litdata"], "grain": ["grain", "grain.experimental"],
    "hf": ["datasets", "torchdata.stateful_dataloader"], "aioloader-text": ["aioloader", "tokenizers"],
}  # fmt: skip
VOCAB = 50_000  # token ids of the corpus are 1 .. VOCAB - 1; the text's unknown word is VOCAB


# -- the corpus -------------------------------------------------------------------------------------


def write_corpus(folder: Path, docs: int) -> dict[str, list[str]]:
    """The two sources' files (written once; a folder that has them is used as it is)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    done = folder / "done.json"
    if done.exists():
        return {k: [str(folder / p) for p in v] for k, v in json.loads(done.read_text()).items()}
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(33)
    names: dict[str, list[str]] = {}
    first = 0
    for source, share in WEIGHTS.items():
        n = round(docs * share)
        names[source] = []
        for part, start in enumerate(range(0, n, ROWS_PER_FILE)):
            rows = min(ROWS_PER_FILE, n - start)
            lengths = rng.integers(20, 1160, rows)  # 590 tokens a document on average
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            values = rng.integers(1, 50_000, int(offsets[-1]), dtype=np.int32)
            ids = np.arange(first, first + rows)
            table = pa.table({
                "id": ids,
                "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
                "url": pa.array([f"https://example.org/{source}/{i}" for i in ids]),
                "raw": pa.array([rng.bytes(int(k)) for k in rng.integers(600, 1400, rows)]),
            })  # fmt: skip
            name = f"{source}-{part:03d}.parquet"
            pq.write_table(table, folder / name, row_group_size=ROW_GROUP)
            names[source].append(name)
            first += rows
    done.write_text(json.dumps(names))
    return {k: [str(folder / p) for p in v] for k, v in names.items()}


def text_of(files: dict[str, list[str]]) -> dict[str, list[str]]:
    """The text copy's files: beside each file of tokens, the same rows in the same row groups
    with `tokens` rendered as a `text` column (written once, by pyarrow's compute functions)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    out: dict[str, list[str]] = {}
    for source, paths in files.items():
        out[source] = []
        for path in paths:
            text_path = path.removesuffix(".parquet") + ".text.parquet"
            out[source].append(text_path)
            if os.path.exists(text_path):
                continue
            table = pq.read_table(path)
            tokens = table.column("tokens").combine_chunks()
            words = pc.binary_join_element_wise("w", pc.cast(tokens.values, "string"), "")
            text = pc.binary_join(type(tokens).from_arrays(tokens.offsets, words), " ")
            table = table.set_column(table.column_names.index("tokens"), "text", text)
            pq.write_table(table, text_path + ".part", row_group_size=ROW_GROUP)
            os.replace(text_path + ".part", text_path)
    return out


def warm(files: dict[str, list[str]]) -> int:
    """Flush the files to disk and read each once, so that every contender finds them in the
    page cache (the first one after writing them waited seconds on the writeback); their bytes."""
    os.sync()
    size = 0
    for paths in files.values():
        for path in paths:
            with open(path, "rb") as f:
                while chunk := f.read(1 << 24):
                    size += len(chunk)
    return size


# -- aioloader --------------------------------------------------------------------------------------


def aioloader_packed(
    files: dict[str, list[str]],
    rows_per_sample: int | None,
    tokenizer: Any = None,
    rows_per_item: int | None = None,
    options: dict[str, Any] | None = None,
    scheduled: bool = False,
) -> Any:
    """The mix packed; with a `tokenizer`, over the text copy, tokenized in the decode threads;
    `options`: the sources' own (`s3_options` for the store); `scheduled`: the weights move from
    0.7 / 0.3 to 0.4 / 0.6 over the first 40,000 documents (the mix by rows only)."""
    import torch

    from aioloader import Loader, mix, pack, schedule, sources, tokenize

    column = "tokens" if tokenizer is None else "text"
    options = options or {}
    if rows_per_item:  # a loader per source, mixed row by row
        loaders = [
            Loader(
                sources.parquet(
                    paths, [column], rows_per_sample=rows_per_sample, seed=i, **options
                ),
                batch_size=None,
                collate=None,
            )
            for i, paths in enumerate(files.values())
        ]
        weights: Any = WEIGHTS
        if scheduled:
            later = {"web": 0.4, "code": 0.6}
            weights = schedule([(0, WEIGHTS), (40_000, later)], interpolate="linear")
        rows = mix(dict(zip(files, loaders, strict=True)), weights, seed=1,
                   rows_per_item=rows_per_item)  # fmt: skip
        return pack(rows, SEQ_LEN, batch_size=BATCH, eos=EOS, key="tokens", dtype=torch.int32)
    parts = {
        name: sources.parquet(paths, [column], rows_per_sample=rows_per_sample, seed=i, **options)
        for i, (name, paths) in enumerate(files.items())
    }
    if tokenizer is None:
        loader = Loader(mix(parts, WEIGHTS, seed=1), batch_size=None, collate=None)
    else:
        loader = Loader(mix(parts, WEIGHTS, seed=1), batch_size=None, collate=None,
                        decode=tokenize(tokenizer), executor="thread")  # fmt: skip
    return pack(loader, SEQ_LEN, batch_size=BATCH, eos=EOS, key="tokens", dtype=torch.int32)


def word_level() -> Any:
    """The text copy's tokenizer: a word-level `tokenizers.Tokenizer`, "w<i>" -> i (no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": VOCAB, **{f"w{i}": i for i in range(1, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


class Ours:
    """A contender's three steps, for aioloader: make, iterate, save and load state."""

    def __init__(
        self, files: dict[str, list[str]], rows_per_sample: int | None, tokenizer: Any = None,
        rows_per_item: int | None = None, scheduled: bool = False,
    ) -> None:  # fmt: skip
        self.files, self.rows_per_sample, self.tokenizer = files, rows_per_sample, tokenizer
        self.rows_per_item, self.scheduled = rows_per_item, scheduled
        self.options: dict[str, Any] = {}
        where = store()
        if where is not None:  # the files' copies in the bucket, behind the 20 ms proxy
            self.files, self.options = in_bucket(files, where), {"s3_options": s3_options(where)}

    def make(self) -> Any:
        return aioloader_packed(self.files, self.rows_per_sample, self.tokenizer,
                                self.rows_per_item, self.options, self.scheduled)  # fmt: skip

    def batches(self, packed: Any) -> Iterator[np.ndarray]:
        for batch in packed:
            yield batch.numpy()

    def state(self, packed: Any) -> Any:
        return json.loads(json.dumps(packed.state_dict()))

    def load(self, packed: Any, state: Any) -> None:
        packed.load_state_dict(state)

    def close(self, packed: Any) -> None:
        packed.close()


# -- one contender, in this process ------------------------------------------------------------------


def cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def digest(batch: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(batch).tobytes(), digest_size=8).hexdigest()


def measure(contender: Any, limit: int | None, resume_at: int) -> dict[str, Any]:
    """Throughput over the epoch (or `limit` batches), then the resume at `resume_at`."""
    cpu0, t0 = cpu_s(), time.perf_counter()
    packed = contender.make()
    first = None
    tokens = count = docs = 0
    expected: list[str] = []
    state: Any = None
    try:
        for batch in contender.batches(packed):
            if first is None:
                first = time.perf_counter() - t0
                if batch.shape[1] != SEQ_LEN:
                    raise SystemExit(f"rows of {batch.shape[1]} tokens, not {SEQ_LEN}")
            count += 1
            tokens += batch.size
            docs += int(np.count_nonzero(batch == EOS))  # every document's end
            if resume_at <= count - 1 < resume_at + CHECKED:
                expected.append(digest(batch))
            if count == resume_at:
                state = contender.state(packed)
            if limit is not None and count >= limit:
                break
        wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
    finally:
        contender.close(packed)
    restore, exact = resume(contender, state, expected)
    return {
        "m_tokens_per_s": round(tokens / wall / 1e6, 2), "cpu_s_per_m_tokens": round(cpu / tokens * 1e6, 4),
        "cpu_us_per_doc": round(cpu / max(docs, 1) * 1e6, 1),
        "first_batch_s": round(first or 0.0, 3), "restore_s": round(restore, 3), "exact_resume": exact,
        "batches": count, "m_tokens": round(tokens / 1e6, 2), "wall_s": round(wall, 2),
    }  # fmt: skip


def resume(contender: Any, state: Any, expected: list[str]) -> tuple[float, bool | None]:
    """(seconds from a fresh loader to its first batch after loading `state`, whether the batches
    then are the uninterrupted run's)."""
    if state is None:
        return 0.0, None
    t0 = time.perf_counter()
    packed = contender.make()
    contender.load(packed, state)
    got: list[str] = []
    restore = 0.0
    try:
        for batch in contender.batches(packed):
            if not got:
                restore = time.perf_counter() - t0
            got.append(digest(batch))
            if len(got) == len(expected):
                break
    finally:
        contender.close(packed)
    return restore, got == expected


def child(
    name: str, folder: Path, docs: int, limit: int | None, resume_at: int, prepare: bool = False
) -> None:  # fmt: skip
    files = write_corpus(folder, docs)
    # imported before the clock starts: what a process imports once (pyarrow's Parquet reader
    # too, which aioloader and Grain import when a source is made)
    for module in ["pyarrow.parquet", *IMPORTS.get(name, ["aioloader"])]:
        importlib.import_module(module)
    if name == "aioloader-text":
        contender: Any = Ours(text_of(files), 256, word_level())
    elif name == "aioloader":
        contender = Ours(files, 256, rows_per_item=256)
    elif name == "aioloader-schedule":
        contender = Ours(files, 256, rows_per_item=256, scheduled=True)
    elif name in OURS:
        contender = Ours(files, 256 if name == "aioloader-batches" else None)
    else:
        from _tokens_peers import peer  # benchmarks/ is on sys.path: this script's folder

        contender = peer(name, files, folder, SEQ_LEN, BATCH, EOS, WEIGHTS)
    if prepare:  # its offline step only (done as the contender was made)
        print(json.dumps({}))
        return
    result = measure(contender, limit, resume_at)
    if name == "aioloader-text":
        result["same_batches"] = same_batches(contender, Ours(files, 256))
        result["tokenizer_cpu_s_per_m_tokens"] = tokenizer_cost(contender)
    if name in OURS:
        result["event_loop"] = event_loop()
        result["read_from"] = "s3" if contender.files != files else "local"
    print(json.dumps({**result, **getattr(contender, "extra", {})}))


def event_loop() -> str:
    """The kind of event loop aioloader's loaders run on in this interpreter ("uvloop", "asyncio")."""
    from aioloader._util.loops import new_event_loop

    loop = new_event_loop()
    loop.close()
    return type(loop).__module__.split(".")[0]


def tokenizer_cost(text: Ours) -> float:
    """CPU s per M tokens of the tokenizer alone, on the text of the first 1,000-row row group."""
    import pyarrow.parquet as pq

    first = next(iter(text.files.values()))[0]
    texts = pq.ParquetFile(first).read_row_group(0, ["text"]).column("text").to_pylist()
    cpu0 = cpu_s()
    tokens = sum(len(e.ids) for e in text.tokenizer.encode_batch_fast(texts))
    return round((cpu_s() - cpu0) / tokens * 1e6, 4)


def same_batches(text: Ours, tokens: Ours) -> bool:
    """Whether the first `CHECKED` batches of the text tokenized on the fly are those of the
    corpus tokenized beforehand (after the measured run: this costs it nothing)."""
    heads = []
    for contender in (text, tokens):
        packed = contender.make()
        try:
            heads.append([digest(b) for b in islice(contender.batches(packed), CHECKED)])
        finally:
            contender.close(packed)
    return heads[0] == heads[1] and len(heads[0]) > 0


# -- the run -----------------------------------------------------------------------------------------


def run_child(
    name: str, args: argparse.Namespace, folder: Path, where: dict[str, Any] | None = None,
    prepare: bool = False,
) -> dict[str, Any] | str:  # fmt: skip
    """One contender in a fresh interpreter: its figures, or why it did not run (`where`: the
    store it reads from; `prepare`: only make it, for its offline step)."""
    if where is not None and name not in RUNS_ON_STORE:
        return "local files only (see _tokens_store.py)"
    if name == "aioloader-text" and importlib.util.find_spec("tokenizers") is None:
        return "tokenizers not installed (pip install 'aioloader[dev]', or tokenizers alone)"
    if name not in OURS:
        from _tokens_peers import missing

        reason = missing(name)
        if reason:
            return reason
    cmd = [sys.executable, __file__, "--child", name, "--folder", str(folder), "--docs",
           str(args.docs), "--resume-at", str(args.resume_at)]  # fmt: skip
    if args.batches:
        cmd += ["--batches", str(args.batches)]
    if prepare:
        cmd += ["--prepare"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # local files only
    env.pop(STORE_ENV, None)
    if where is not None:
        env[STORE_ENV] = json.dumps(where)
    done = subprocess.run(
        cmd, capture_output=True, text=True, check=False, timeout=args.timeout, env=env
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        said = next(
            (x for x in reversed(lines) if "Error" in x or "Exception" in x),
            lines[-1] if lines else "",
        )
        log = Path(tempfile.gettempdir()) / f"aioloader-bench-tokens-{name}.err"
        log.write_text(done.stderr)
        return f"failed (exit {done.returncode}): {said.strip()[:300]} (all of it: {log})"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="12,000 documents, 200 batches (< 60 s with aioloader's three; peers add their own)",
    )  # fmt: skip
    parser.add_argument("--docs", type=int, default=90_000)
    parser.add_argument("--batches", type=int, default=None, help="stop after N (default: epoch)")
    parser.add_argument("--resume-at", type=int, default=100)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument(
        "--contenders",
        default="aioloader,aioloader-batches,aioloader-per-doc,aioloader-text,litdata,grain,hf",
    )
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="runs of every contender, in alternating order; each figure is a contender's best "
        "round's (default 3, --quick 1): the machine's minute moves each run by tens of percent",
    )  # fmt: skip
    parser.add_argument(
        "--store", action="store_true",
        help="read the files from SeaweedFS (S3) on 127.0.0.1 behind a proxy that holds each "
        "request 20 ms, as issue 33 measured it (every contender but aioloader-text)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.docs, args.batches = 12_000, args.batches or 200
    args.rounds = args.rounds or (1 if args.quick else 3)
    folder = args.folder or Path(tempfile.gettempdir()) / f"aioloader-bench-tokens-{args.docs}"
    if args.child:
        child(args.child, folder, args.docs, args.batches, args.resume_at, args.prepare)
        return
    t0 = time.perf_counter()
    files = write_corpus(folder, args.docs)
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    size = warm(files)
    if "aioloader-text" in names and importlib.util.find_spec("tokenizers") is not None:
        size += warm(text_of(files))  # its text copy, beside it
    print(f"corpus: {args.docs} documents in {sum(map(len, files.values()))} files, "
          f"{size / 1e6:.0f} MB, in {folder} ({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    print(f"{'contender':<18} {'M tok/s':>8} {'CPU s/M':>8} {'CPU us/doc':>10} {'first s':>8} "
          f"{'restore s':>9} {'exact':>6} {'batches':>8}")  # fmt: skip
    summary: dict[str, Any] = {
        "workload": "tokens", "docs": args.docs, "batches": args.batches, "rounds": args.rounds,
    }  # fmt: skip
    rounds: dict[str, list[dict[str, Any] | str]] = {name: [] for name in names}
    with contextlib.ExitStack() as stack:
        where = None
        if args.store:
            summary["store"] = f"SeaweedFS behind a {DELAY_MS:.0f} ms proxy"
            litdata = None
            if "litdata" in names and run_child("litdata", args, folder, prepare=True) == {}:
                litdata = folder / "litdata"  # its offline step, done: its chunks go up too
            where = stack.enter_context(serving(files, litdata))
            print(f"store: {summary['store']}, the files put in its bucket")
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                rounds[name].append(run_child(name, args, folder, where))
    for name in names:
        result = best_of(rounds[name])
        summary[name] = result
        if isinstance(result, str):
            print(f"{name:<18} skipped: {result}")
            continue
        print(f"{name:<18} {result['m_tokens_per_s']:>8.2f} {result['cpu_s_per_m_tokens']:>8.4f} "
              f"{result['cpu_us_per_doc']:>10.1f} {result['first_batch_s']:>8.3f} "
              f"{result['restore_s']:>9.3f} {result['exact_resume']!s:>6} "
              f"{result['batches']:>8}")  # fmt: skip
    ours, per_doc = summary.get("aioloader"), summary.get("aioloader-per-doc")
    if isinstance(ours, dict) and isinstance(per_doc, dict):
        summary["columnar_speedup"] = round(ours["m_tokens_per_s"] / per_doc["m_tokens_per_s"], 2)
        print(f"columnar fast path / one document per sample: {summary['columnar_speedup']:.2f}x")
    if isinstance(ours, dict):
        summary["vs"] = versus(ours, summary)
    batches, text = summary.get("aioloader-batches"), summary.get("aioloader-text")
    if isinstance(batches, dict) and isinstance(text, dict):
        summary["text_over_tokens"] = round(text["m_tokens_per_s"] / batches["m_tokens_per_s"], 2)
        print(f"text tokenized on the fly / tokens read: {summary['text_over_tokens']:.2f}x "
              f"tokens/s (the tokenizer alone: {text['tokenizer_cpu_s_per_m_tokens']:.4f} CPU "
              f"s/M); the same batches: {text['same_batches']}")  # fmt: skip
    print(json.dumps(summary))


def best_of(results: list[dict[str, Any] | str]) -> dict[str, Any] | str:
    """A contender's figures over its rounds: each its best (most tokens/s; least CPU, first
    batch and restore), exact resume only if every round's was, and every round's tokens/s; why
    it did not run, if it never did."""
    ran = [r for r in results if isinstance(r, dict)]
    if not ran:
        return results[0]
    best = dict(max(ran, key=lambda r: r["m_tokens_per_s"]))
    for key in ("cpu_s_per_m_tokens", "cpu_us_per_doc", "first_batch_s", "restore_s"):
        best[key] = min(r[key] for r in ran)
    best["exact_resume"] = all(r["exact_resume"] for r in ran)
    best["rounds"] = len(ran)
    best["each_round_m_tokens_per_s"] = [r["m_tokens_per_s"] for r in ran]  # how far they spread
    return best


def versus(ours: dict[str, Any], summary: dict[str, Any]) -> dict[str, dict[str, float]]:
    """aioloader's figures over each peer's of this run (printed): tokens/s (higher is better),
    CPU per token, first batch and restore (lower is better)."""
    out: dict[str, dict[str, float]] = {}
    for name, theirs in summary.items():
        if (
            name in OURS
            or name in ("workload", "docs", "batches", "rounds")
            or not isinstance(theirs, dict)
        ):
            continue
        out[name] = {
            key: round(ours[key] / theirs[key], 2) if theirs[key] else float("inf")
            for key in ("m_tokens_per_s", "cpu_s_per_m_tokens", "first_batch_s", "restore_s")
        }
        r = out[name]
        print(f"aioloader / {name}: tokens/s {r['m_tokens_per_s']:.2f}x, CPU per token "
              f"{r['cpu_s_per_m_tokens']:.2f}x, first batch {r['first_batch_s']:.2f}x, restore "
              f"{r['restore_s']:.2f}x")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
