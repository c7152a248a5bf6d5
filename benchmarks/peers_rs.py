"""Peers: torch's DataLoader, aioloader's and dataloader-rs's (Rust core, worker threads) on the
same torch-style user code (`_user_datasets.py`).

Workloads (each `__getitem__` as a torch user writes it; shuffle on, default collate):

  int   returns its index; batch 64; num_workers 0 and 2: the loader's own cost per sample; at 0
        also aioloader's native `Loader(samples, batch_size=64)` over the same ints in a list,
        labelled `Loader(list)`, in the list's order as that call reads it (shuffled, it reads a
        1,048,576-int list at random places: 1.5 M samples/s here against 4.2 M in order, the
        memory's cost, not the loader's).
  seed  sleeps 3.125 ms, returns np.random.random((1000, 150)); batch 128; num_workers 2, 4, 8.
  io    sleeps 20 ms, returns a 4 KiB object's bytes as a uint8 array; batch 64; num_workers 4, and
        dataloader-rs again at its best setting for I/O, `items_in_parallel=16` (64 requests in
        flight), labelled `dataloader-rs ip16`.
  gil   a pure-Python arithmetic loop (about 0.4 ms, the GIL held); batch 64; num_workers 2.

Each contender runs in a fresh interpreter (`--run WORKLOAD LIBRARY N`): torch and aioloader in
this interpreter (the project's .venv, CPython 3.11), dataloader-rs in .venv-rs (CPython 3.13, which
it needs, and a CPU with AVX2; `make rs-env` builds it). After a warm-up (at least one batch from
every worker) the child times at least `window` seconds of batches. Figures: samples/s; the CPU
seconds of the child's whole process tree (its worker processes included) per sample over that
window (psutil's, in 10 ms ticks: coarse in --quick's one-second windows); the peak PSS of the tree
over its life, sampled by this process (the dataloader-rs child imports no torch, which alone is
~250 MB of the others'). Without .venv-rs (or where dataloader_rs does not import) its rows are
skipped, saying why, and the JSON says so.

What dataloader-rs needs to run the same code fairly (its `PyDataloader`):
  - it takes only instances of its `PyDataset`: the user's class gets it as a mixin, *after* the
    user's class (`class X(UserDataset, PyDataset)`); first, PyDataset's stub `__len__` shadows the
    user's and raises NotImplementedError.
  - without `collate_fn` a batch is a Python list: it gets `collate_fn=np.stack`, the counterpart of
    torch's default collate (ints -> one int64 array, arrays -> one stacked array).
  - `prefetch_depth=N`: at most 2N batches in flight or waiting, as torch's `prefetch_factor=2` per
    worker (torch and aioloader get `persistent_workers=True` where N > 0).
  - its workers are threads in one process, so `__getitem__` runs on up to
    `num_workers * items_in_parallel` threads at once *on the one dataset object* (the datasets
    here are read-only; in `seed`, np.random's one global generator fills its arrays under its
    lock, one thread at a time, where each of torch's and aioloader's worker processes has its own).
  - its process ends with `os._exit(0)` once its figures are printed: on CPython 3.13, when the
    interpreter exits while its worker threads still load the batches ahead (as they do after a
    `break` out of the loop), the process aborts ("FATAL: exception not rethrown", SIGABRT), with
    or without `del loader` first; waiting until those batches are done avoids it too.
  - it suggests glibc malloc thresholds for array samples (GLIBC_TUNABLES); `--glibc-tunables` sets
    them for every contender alike (off by default: the figures are those of a default setup).
  - the `gil` loop runs on CPython 3.13 there, 3.11 for the others: each child reports the loop's
    single-thread cost per item (`item_ms`) to compare by.

Usage: python benchmarks/peers_rs.py [--quick] [--workloads int,seed,io,gil] [--glibc-tunables]
(--quick: one worker count per workload, one-second windows; under 60 s)
The last line printed is a JSON summary: per case and contender samples/s, CPU us/sample and peak PSS,
and the ratios aioloader/torch and aioloader/dataloader-rs (samples/s; CPU per sample).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RS_PYTHON = HERE.parent / ".venv-rs" / "bin" / "python"
BATCH = {"int": 64, "seed": 128, "io": 64, "gil": 64}
WORKERS = {"int": (0, 2), "seed": (2, 4, 8), "io": (4,), "gil": (2,)}
QUICK_WORKERS = {"int": (2,), "seed": (2,), "io": (4,), "gil": (2,)}
WINDOW_S = {"int": 4.0, "seed": 8.0, "io": 6.0, "gil": 5.0}
QUICK_WINDOW_S = 1.0
MIN_BATCHES = 3  # measured, however long they take
RS_IO_ITEMS_IN_PARALLEL = 16
GLIBC_TUNABLES = "glibc.malloc.trim_threshold=67108864:glibc.malloc.mmap_threshold=33554432"
LIBRARIES = ("torch", "aioloader", "dataloader-rs")
RS_BEST = "dataloader-rs ip16"
NATIVE = "Loader(list)"  # int at num_workers 0: `aioloader.Loader` over the indices in a list


# -- one contender, in its own interpreter (stdlib, numpy and psutil only at the top) ----------------


def make_loader(library: str, workload: str, workers: int) -> Any:
    """The user's DataLoader call, with what each library needs (see the module docstring)."""
    from _user_datasets import DATASETS

    user_class = DATASETS[workload]
    if library.startswith("dataloader-rs"):
        import numpy as np
        from dataloader_rs import PyDataloader, PyDataset  # type: ignore[import-not-found]

        dataset = type(user_class.__name__, (user_class, PyDataset), {})()
        parallel = RS_IO_ITEMS_IN_PARALLEL if library == RS_BEST else 1
        return PyDataloader(
            dataset, batch_size=BATCH[workload], shuffle=True, num_workers=workers,
            collate_fn=np.stack, prefetch_depth=workers or 2, items_in_parallel=parallel,
        )  # fmt: skip
    if library == NATIVE:  # aioloader's own front door over the same samples, kept in a list
        from aioloader import Loader

        return Loader(list(range(len(user_class()))), batch_size=BATCH[workload])
    if library == "torch":
        from torch.utils.data import DataLoader
    else:
        from aioloader import DataLoader  # type: ignore[assignment]
    extra: dict[str, Any] = {"persistent_workers": True} if workers else {}
    return DataLoader(
        user_class(), batch_size=BATCH[workload], shuffle=True, num_workers=workers, **extra
    )


def item_ms(workload: str) -> float | None:
    """The `gil` loop's cost per item on this interpreter, single-threaded (None elsewhere)."""
    if workload != "gil":
        return None
    from _user_datasets import PythonWork

    dataset, start = PythonWork(), time.perf_counter()
    for index in range(100):
        dataset[index]
    return (time.perf_counter() - start) * 10


def run_one(
    library: str, workload: str, workers: int, warmup: int, window: float
) -> dict[str, Any]:
    import psutil
    from _pss import tree_cpu

    me, per_item = psutil.Process(), item_ms(workload)
    loader = make_loader(library, workload, workers)
    start = time.perf_counter()
    seen, t0, cpu0, ttfb = 0, 0.0, 0.0, None
    while True:
        for batch in loader:
            now = time.perf_counter()
            ttfb = now - start if ttfb is None else ttfb
            seen += 1
            del batch
            if seen == warmup:
                t0, cpu0 = now, tree_cpu(me)
            elif seen > warmup + MIN_BATCHES and now - t0 >= window:
                break
        else:
            continue  # the epoch ended: the next one
        break
    cpu, samples = tree_cpu(me) - cpu0, (seen - warmup) * BATCH[workload]
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    return {
        "samples_per_s": samples / (now - t0),
        "cpu_us_per_sample": cpu / samples * 1e6,
        "ttfb_s": ttfb,
        "item_ms": per_item,
        "python": "{}.{}".format(*sys.version_info),
    }


# -- the orchestrator ---------------------------------------------------------------------------------


def rs_unavailable(python: Path) -> str | None:
    """Why dataloader-rs cannot run here, or None."""
    if not python.exists():
        return f"{python} not found (`make rs-env` builds it)"
    probe = subprocess.run(
        [str(python), "-c", "import dataloader_rs, numpy, psutil"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if probe.returncode != 0:
        lines = probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"]
        return f"dataloader_rs does not import in {python}: {lines[-1]}"
    return None


def cases(workloads: list[str], quick: bool, rs: bool) -> list[tuple[str, int, str]]:
    """(workload, num_workers, contender) in the order they run."""
    out = []
    for workload in workloads:
        for workers in (QUICK_WORKERS if quick else WORKERS)[workload]:
            libraries = [lib for lib in LIBRARIES if rs or lib != "dataloader-rs"]
            if workload == "io" and rs:
                libraries.append(RS_BEST)
            if workload == "int" and workers == 0:
                libraries.append(NATIVE)
            out += [(workload, workers, lib) for lib in libraries]
    return out


def measure(workload: str, workers: int, library: str, args: argparse.Namespace) -> dict[str, Any]:
    from _pss import run_measured

    python = str(args.rs_python) if library.startswith("dataloader-rs") else sys.executable
    warmup = 20 if workload == "int" else max(2, workers) if args.quick else max(4, 2 * workers)
    window = QUICK_WINDOW_S if args.quick else WINDOW_S[workload]
    cmd = [python, __file__, "--run", workload, library, str(workers)]
    cmd += ["--warmup", str(warmup), "--window", str(window)]
    env = dict(os.environ, GLIBC_TUNABLES=GLIBC_TUNABLES) if args.glibc_tunables else None
    return run_measured(cmd, f"{library} {workload} N={workers}", env=env)


def ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None, key: str) -> float | None:
    if ours is None or theirs is None or not float(theirs[key]):
        return None  # (a CPU time under psutil's 10 ms tick reads 0 in --quick's short windows)
    return round(float(ours[key]) / float(theirs[key]), 3)


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workloads", default="int,seed,io,gil")
    parser.add_argument("--glibc-tunables", action="store_true")
    parser.add_argument("--rs-python", type=Path, default=RS_PYTHON)
    parser.add_argument("--run", nargs=3, metavar=("WORKLOAD", "LIBRARY", "N"))
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--window", type=float, default=QUICK_WINDOW_S)
    args = parser.parse_args()
    if args.run:
        workload, library, workers = args.run
        result = run_one(library, workload, int(workers), args.warmup, args.window)
        print(json.dumps(result), flush=True)
        if library.startswith("dataloader-rs"):
            os._exit(0)  # not through the interpreter's exit: see the module docstring
        return
    skipped = rs_unavailable(args.rs_python)
    if skipped:
        print(f"dataloader-rs: skipped: {skipped}", flush=True)
    print(
        f"{'case':<10}{'contender':<19}{'py':>5}{'samples/s':>11}{'CPU us/sample':>15}"
        f"{'peak PSS MB':>13}{'ttfb s':>8}{'aio/torch':>10}{'aio/rs':>8}",
        flush=True,
    )
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, workers, library in cases(args.workloads.split(","), args.quick, not skipped):
        case = f"{workload}-N{workers}"
        r = results.setdefault(case, {})[library] = measure(workload, workers, library, args)
        ours = results[case].get("aioloader")
        vs_torch = ratio(r, results[case].get("torch"), "samples_per_s")
        vs_rs = ratio(ours, r, "samples_per_s")
        if library == NATIVE:  # its own ratios on its row
            vs_rs = ratio(r, results[case].get("dataloader-rs"), "samples_per_s")
        print(
            f"{case:<10}{library:<19}{r['python']:>5}{r['samples_per_s']:>11,.0f}"
            f"{r['cpu_us_per_sample']:>15.1f}{r['peak_pss_mb']:>13.0f}{r['ttfb_s']:>8.2f}"
            f"{fmt(vs_torch if library in ('aioloader', NATIVE) else None, '.2f'):>10}"
            f"{fmt(vs_rs if library.startswith('dataloader-rs') or library == NATIVE else None, '.2f'):>8}",
            flush=True,
        )
    print(json.dumps(summary(results, skipped, args.glibc_tunables)))


def summary(
    results: dict[str, dict[str, dict[str, Any]]], skipped: str | None, tunables: bool
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "workload": "peers_rs",
        "date": time.strftime("%Y-%m-%d"),
        "dataloader_rs": {"skipped": skipped} if skipped else "ran",
        "glibc_tunables": tunables,
    }
    for case, by_lib in results.items():
        entry: dict[str, Any] = {
            lib: {
                "samples_per_s": round(r["samples_per_s"], 1),
                "cpu_us_per_sample": round(r["cpu_us_per_sample"], 2),
                "peak_pss_mb": round(r["peak_pss_mb"], 1),
                **({"item_ms": round(r["item_ms"], 3)} if r["item_ms"] is not None else {}),
            }
            for lib, r in by_lib.items()
        }
        for mine in ("aioloader", NATIVE):
            for peer in ("torch", "dataloader-rs", RS_BEST):
                if mine in by_lib and peer in by_lib:
                    entry[f"{mine}/{peer}"] = {
                        "samples_per_s": ratio(by_lib[mine], by_lib[peer], "samples_per_s"),
                        "cpu_per_sample": ratio(by_lib[mine], by_lib[peer], "cpu_us_per_sample"),
                    }
        out[case] = entry
    return out


if __name__ == "__main__":
    main()
