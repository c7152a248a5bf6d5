"""Parquet lists of token ids: aioloader's own decoder (`parquet_lists`) against pyarrow's reader.

Files of 4,000 documents (20 to 1,160 ids, ~2.4 M ids) in row groups of 1,000, as `pq.write_table`
writes them (dictionary-encoded, snappy), for three vocabularies: 30,000 ids (15-bit dictionary
indices), 50,000 (16-bit, the tokens benchmark's corpus) and 120,000 (17-bit). Each decoder reads
every row group of the `tokens` column, one thread, into the decode pool, the pages warm in the page
cache; CPU ns per id (thread time), best of `--rounds` passes, alternating. Both give the same
table (checked on every row group of the last pass).

This is the decode alone: in a loader its thread also waits for the GIL each time it comes back
from numpy or pyarrow (see `parquet_lists`' docstring and benchmarks/tokens.py for the whole
pipeline).

Usage: python benchmarks/token_lists.py [--quick] [--rounds R]
The last line printed is a JSON summary: ns per id for each and their ratio (pyarrow / ours).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

VOCABS = {"15-bit": 30_000, "16-bit": 50_000, "17-bit": 120_000}


def write(folder: Path, vocab: int, docs: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = folder / f"tokens-{vocab}-{docs}.parquet"
    if not path.exists():
        rng = np.random.default_rng(vocab)
        lengths = rng.integers(20, 1160, docs)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = rng.integers(1, vocab, int(offsets[-1]), dtype=np.int32)
        tokens = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        pq.write_table(pa.table({"tokens": tokens}), path, row_group_size=1_000)
    return path


def passes(path: Path, rounds: int) -> dict[str, Any]:
    import pyarrow.parquet as pq

    from aioloader.sources.formats import parquet_lists
    from aioloader.sources.formats.parquet_bytes import FileMeta, decode_pool, decode_row_group

    meta = FileMeta(str(path), path.name, pq.read_metadata(path), path.stat().st_size, b"")
    groups = meta.metadata.num_row_groups
    pool = decode_pool()

    def ours(rg: int) -> Any:
        table = parquet_lists.decode(meta, rg, ["tokens"], None, path, pool)
        if table is None:
            raise SystemExit(f"{path.name}: row group {rg} was left to pyarrow")
        return table

    def theirs(rg: int) -> Any:  # pyarrow's reader, into the same pool (the loader's own path)
        return decode_row_group(meta, rg, ["tokens"], None, path)

    best = {"aioloader": float("inf"), "pyarrow": float("inf")}
    ids = 0
    for r in range(rounds):
        for name, decode in (("aioloader", ours), ("pyarrow", theirs))[:: 1 if r % 2 == 0 else -1]:
            t0, ids = time.thread_time(), 0
            for rg in range(groups):
                ids += len(decode(rg).column("tokens").chunk(0).values)
            best[name] = min(best[name], (time.thread_time() - t0) / ids * 1e9)
    same = all(ours(rg).equals(theirs(rg)) for rg in range(groups))
    return {
        "ids": ids, "aioloader_ns_per_id": round(best["aioloader"], 2),
        "pyarrow_ns_per_id": round(best["pyarrow"], 2),
        "pyarrow_over_ours": round(best["pyarrow"] / best["aioloader"], 2), "same_table": same,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 documents a file, 3 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="passes each (default 7, 3 quick)")
    args = parser.parse_args()
    docs, rounds = (1_000, args.rounds or 3) if args.quick else (4_000, args.rounds or 7)
    folder = Path(tempfile.gettempdir()) / "aioloader-bench-token-lists"
    folder.mkdir(exist_ok=True)
    summary: dict[str, Any] = {"workload": "token_lists", "docs": docs, "rounds": rounds}
    print(f"{'indices':<8} {'ids':>10} {'aioloader ns/id':>16} {'pyarrow ns/id':>14} {'ratio':>6}")
    for label, vocab in VOCABS.items():
        result = passes(write(folder, vocab, docs), rounds)
        if not result["same_table"]:
            raise SystemExit(f"{label}: the tables differ")
        summary[label] = result
        print(f"{label:<8} {result['ids']:>10} {result['aioloader_ns_per_id']:>16.2f} "
              f"{result['pyarrow_ns_per_id']:>14.2f} {result['pyarrow_over_ours']:>5.2f}x")  # fmt: skip
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
