"""W5, free-threaded decode: a decode that holds the GIL, in threads with the GIL off, against processes.

What free-threading is for: per-sample work that holds the GIL (Python-level parsing, small numpy
steps), where a user of a GIL build pays for worker processes, their memory and the copies between
them. The decode here parses a record of 2,000 integers in pure Python, folds them in a Python loop, and
fills a 100x256 float32 array (100 KB) two small numpy steps per row: about 1 ms per sample, all of it
with the GIL held on a GIL build. Batches of 32; the consumer only touches each batch.

Contenders, each in its own fresh interpreter (`--run MODE`), on the same records:

  GIL build (`.venv`):           torch DataLoader(num_workers=2, persistent workers);
                                 the same script with `from aioloader import DataLoader` (its
                                 default, worker_mode="auto": worker processes here, threads on
                                 the free-threaded build);
                                 aioloader executor="process", 2 workers;
                                 aioloader executor="thread", 1 and 2 threads
  free-threaded build (`.venv-ft`, `make ft-env`): aioloader executor="thread", 1 and 2 threads;
                                 aioloader executor="process", 2 workers (the same torch as the
                                 threads: PyPI's free-threaded torch is a CUDA build, whose
                                 libraries make each interpreter ~550 MB larger); SPDL's thread
                                 pipeline (spdl-core), 2 threads; Grain (grain-free-threading),
                                 2 threads. Both peers are in the
                                 `bench-ft` extra (`make bench-ft` installs them into .venv-ft)

How each peer is run, as its documentation has a user run it on threads:
  SPDL   PipelineBuilder: source range(n) -> pipe(read and decode, concurrency=T) -> aggregate(32)
         -> pipe(stack into one tensor) -> sink(3), built with num_threads=T (the thread pool the
         pipe runs its sync op in); iterated under auto_stop(). Its I/O package (spdl-io) has no
         free-threaded wheel and is not needed here: only the pipeline (spdl-core) is installed.
  Grain  MapDataset.range(n).map(read and decode).to_iter_dataset(ReadOptions(num_threads=T,
         prefetch_buffer_size=64)).batch(32) (Grain's own np.stack), the batch made a tensor
         with torch.from_numpy (no copy); a new iterator per epoch, as its users write it.

A contender whose interpreter is missing is reported as skipped. Throughput is measured over the epochs
after the first (workers started); CPU seconds are the contender's process and its workers' over those
epochs; this process samples the PSS of each contender and its descendants every `PSS_PERIOD_S` and
keeps the peak. With several rounds (contenders alternate order) each figure is the best round's.

Usage: python benchmarks/ft_threads.py [--quick] [--samples N] [--epochs E] [--rounds R]
           [--gil-python PATH] [--ft-python PATH] [--modes torch2,process2,...]
The last line printed is a JSON summary: per mode samples/s, CPU s and peak PSS; `ft_scaling` (FT 2
threads / FT 1 thread; `scaling` is the same), `gil_scaling`, `ft2_vs_process` and `ft2_vs_torch`
(FT 2 threads against the GIL build's process executor and torch DataLoader(2)), `front_vs_torch`
and `front_ft_vs_torch` (torch's script through aioloader's front door, on each build, against
torch's DataLoader), `ft2_vs_spdl` and
`ft2_vs_grain` (against the peers' pipelines on the same free-threaded build), `ft2_pss_vs_process_ft`
(peak PSS against the process executor on the free-threaded build), `ft2_pss_vs_process`
and `ft2_added_pss_vs_process` (peak PSS less each interpreter's own once torch is imported: the
free-threaded venv's torch is a CUDA build, whose libraries alone hold ~400 MB more); null where a
contender was skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from _pss import run_measured, tree_cpu

REPO = Path(__file__).resolve().parent.parent
BATCH = 32
ROWS, COLS = 100, 256  # the decoded sample: 100 KB of float32
FIELDS = 2000  # integers per record
RECORDS = 64  # distinct records; sample i reads record i % RECORDS
# mode -> (build, label)
MODES = {
    "torch2": ("gil", "torch DataLoader(num_workers=2)"),
    "front2": ("gil", "aioloader DataLoader(num_workers=2)"),
    "front2-ft": ("ft", "aioloader DataLoader(num_workers=2)"),
    "process2": ("gil", 'aioloader "process", 2 workers'),
    "thread1-gil": ("gil", 'aioloader "thread", 1 thread'),
    "thread2-gil": ("gil", 'aioloader "thread", 2 threads'),
    "thread1-ft": ("ft", 'aioloader "thread", 1 thread'),
    "thread2-ft": ("ft", 'aioloader "thread", 2 threads'),
    "process2-ft": ("ft", 'aioloader "process", 2 workers'),
    "spdl2-ft": ("ft", "SPDL pipeline, 2 threads"),
    "grain2-ft": ("ft", "Grain, 2 threads"),
}
PEERS = {"spdl2-ft": "spdl.pipeline", "grain2-ft": "grain"}  # mode -> the module it needs
# at least; the peers' own free-threaded pipelines: aioloader ahead of each
BARS = {"ft_scaling": 1.7, "ft2_vs_process": 1.2, "ft2_vs_torch": 1.2}
BARS |= {"ft2_vs_spdl": 1.0, "ft2_vs_grain": 1.0}
PSS_BAR = 0.7  # ft2_pss_vs_process, at most


# -- the sample pipeline (module level: worker processes unpickle it) ---------------------------------


def _record(i: int) -> bytes:
    rng = np.random.default_rng(i)
    return ",".join(map(str, rng.integers(0, 1000, FIELDS).tolist())).encode()


RAW = [_record(i) for i in range(RECORDS)]


def read(i: int) -> bytes:
    return RAW[i % RECORDS]


async def fetch(i: int) -> bytes:
    return RAW[i % RECORDS]


def read_decode(i: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    return decode(read(i))


def decode(raw: bytes) -> np.ndarray[Any, np.dtype[np.float32]]:
    """A record -> 100x256 float32, the GIL held throughout on a GIL build (~1 ms)."""
    values = [int(field) for field in raw.decode("ascii").split(",")]  # Python-level parsing
    acc = 0
    for v in values:  # a Python loop over the fields
        acc = (acc * 31 + v) & 0xFFFF
    row = np.asarray(values[:COLS], dtype=np.float32)
    out = np.empty((ROWS, COLS), np.float32)
    scale = 1.0 / (acc % 97 + 1)
    for r in range(ROWS):  # small numpy steps: each too short to be worth releasing the GIL
        np.multiply(row, scale * (r + 1), out=out[r])
        np.add(out[r], r, out=out[r])
    return out


class Records:
    """The records as torch's map-style dataset."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray[Any, np.dtype[np.float32]]:
        return decode(read(i))


# -- one contender (in its own interpreter) -----------------------------------------------------------


def gil_enabled() -> bool:
    probe = getattr(sys, "_is_gil_enabled", None)
    return True if probe is None else bool(probe())


class SpdlEpochs:
    """SPDL's thread pipeline, one per epoch (as its examples build one per epoch)."""

    def __init__(self, n: int, threads: int) -> None:
        self.n, self.threads = n, threads

    def __iter__(self) -> Any:
        import torch
        from spdl.pipeline import PipelineBuilder

        def stack(items: list[np.ndarray[Any, Any]]) -> Any:
            return torch.from_numpy(np.stack(items))

        pipeline = (
            PipelineBuilder()
            .add_source(range(self.n))
            .pipe(read_decode, concurrency=self.threads)
            .aggregate(BATCH)
            .pipe(stack)
            .add_sink(3)
            .build(num_threads=self.threads)
        )
        with pipeline.auto_stop():
            yield from pipeline


class GrainEpochs:
    """Grain's MapDataset -> IterDataset with reading threads, a new iterator per epoch."""

    def __init__(self, n: int, threads: int) -> None:
        import grain

        options = grain.ReadOptions(num_threads=threads, prefetch_buffer_size=64)
        ds = grain.MapDataset.range(n).map(read_decode)
        self.dataset = ds.to_iter_dataset(options).batch(BATCH)

    def __iter__(self) -> Any:
        import torch

        for batch in self.dataset:
            yield torch.from_numpy(batch)


def run_one(mode: str, n: int, epochs: int) -> dict[str, Any]:
    import torch

    if mode in PEERS:
        try:
            __import__(PEERS[mode])
        except ImportError as exc:
            return {"skipped": f"{PEERS[mode]} does not import here ({exc})"}
    if mode == "spdl2-ft":
        loader: Any = SpdlEpochs(n, threads=2)
    elif mode == "grain2-ft":
        loader = GrainEpochs(n, threads=2)
    elif mode == "torch2":
        from torch.utils.data import DataLoader

        loader = DataLoader(Records(n), batch_size=BATCH, num_workers=2, persistent_workers=True)
    elif mode.startswith("front2"):  # the same script with one import changed
        from aioloader import DataLoader as FrontDoor

        loader = FrontDoor(Records(n), batch_size=BATCH, num_workers=2, persistent_workers=True)
    else:
        import aioloader

        torch.set_num_threads(1)  # the collate thread stacks on busy cores, as torch's workers do
        process = mode.startswith("process")
        executor, workers = ("process", 2) if process else ("thread", int(mode[6]))
        loader = aioloader.Loader(
            range(n), fetch, decode=decode, batch_size=BATCH, executor=executor, workers=workers
        )
    me = psutil.Process()
    base_pss = me.memory_full_info().pss  # the interpreter with torch (and aioloader) imported
    seconds = cpu = 0.0
    samples = 0
    try:
        for epoch in range(epochs):
            start, cpu0 = time.perf_counter(), tree_cpu(me)
            count = 0
            for batch in loader:
                assert tuple(batch.shape[1:]) == (ROWS, COLS)
                count += len(batch)
                del batch
            if epoch > 0:
                seconds += time.perf_counter() - start
                cpu += tree_cpu(me) - cpu0
                samples += count
    finally:
        if hasattr(loader, "close"):
            loader.close()
    return {
        "samples_per_s": samples / seconds,
        "cpu_s": cpu,
        "cpu_ms_per_sample": 1e3 * cpu / samples,
        "base_pss_mb": base_pss / 2**20,
        "gil_enabled": gil_enabled(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


# -- the orchestrator ---------------------------------------------------------------------------------


def is_free_threaded() -> bool:
    return bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def interpreters(args: argparse.Namespace) -> dict[str, str | None]:
    """The interpreter of each build, None where it is missing."""
    here = sys.executable
    gil = args.gil_python or (here if not is_free_threaded() else str(REPO / ".venv/bin/python"))
    ft = args.ft_python or (here if is_free_threaded() else str(REPO / ".venv-ft/bin/python"))
    return {
        build: path if os.access(path, os.X_OK) else None
        for build, path in (("gil", gil), ("ft", ft))
    }


def measure(python: str, mode: str, n: int, epochs: int) -> dict[str, Any]:
    cmd = [python, __file__, "--run", mode, "--samples", str(n), "--epochs", str(epochs)]
    # this checkout's aioloader first (a venv's editable install may point at another one)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    result = run_measured(cmd, mode, env={**os.environ, "PYTHONPATH": path})
    if "skipped" in result:
        return result
    result["added_pss_mb"] = result["peak_pss_mb"] - result["base_pss_mb"]
    return result


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else round(a / b, 3)


def summarise(results: dict[str, dict[str, Any]], skipped: list[str], args: Any) -> dict[str, Any]:
    def get(mode: str, key: str) -> float | None:
        return results[mode][key] if mode in results else None

    rate = {mode: round(r["samples_per_s"], 1) for mode, r in results.items()}
    ft_scaling = ratio(get("thread2-ft", "samples_per_s"), get("thread1-ft", "samples_per_s"))
    return {
        "workload": "ft_threads",
        "samples_per_s": rate,
        "cpu_s": {mode: round(r["cpu_s"], 2) for mode, r in results.items()},
        "peak_pss_mb": {mode: round(r["peak_pss_mb"]) for mode, r in results.items()},
        "added_pss_mb": {mode: round(r["added_pss_mb"]) for mode, r in results.items()},
        "ft_scaling": ft_scaling,
        "scaling": ft_scaling,
        "gil_scaling": ratio(
            get("thread2-gil", "samples_per_s"), get("thread1-gil", "samples_per_s")
        ),
        "ft2_vs_process": ratio(
            get("thread2-ft", "samples_per_s"), get("process2", "samples_per_s")
        ),
        "ft2_vs_torch": ratio(get("thread2-ft", "samples_per_s"), get("torch2", "samples_per_s")),
        # torch's own script, with `from aioloader import DataLoader`, against torch's DataLoader
        "front_vs_torch": ratio(get("front2", "samples_per_s"), get("torch2", "samples_per_s")),
        "front_ft_vs_torch": ratio(
            get("front2-ft", "samples_per_s"), get("torch2", "samples_per_s")
        ),
        "ft2_vs_spdl": ratio(get("thread2-ft", "samples_per_s"), get("spdl2-ft", "samples_per_s")),
        "ft2_vs_grain": ratio(
            get("thread2-ft", "samples_per_s"), get("grain2-ft", "samples_per_s")
        ),
        "ft2_pss_vs_process": ratio(
            get("thread2-ft", "peak_pss_mb"), get("process2", "peak_pss_mb")
        ),
        # the same above each interpreter's own PSS once torch is imported: the free-threaded venv's
        # torch is a CUDA build (its libraries alone ~400 MB more than the GIL venv's CPU build)
        "ft2_added_pss_vs_process": ratio(
            get("thread2-ft", "added_pss_mb"), get("process2", "added_pss_mb")
        ),
        # and against the process executor on the free-threaded build itself (the same torch)
        "ft2_pss_vs_process_ft": ratio(
            get("thread2-ft", "peak_pss_mb"), get("process2-ft", "peak_pss_mb")
        ),
        "ft_gil_enabled": any(results[m]["gil_enabled"] for m in results if MODES[m][0] == "ft"),
        "skipped": skipped,
        "samples": args.samples,
        "epochs": args.epochs,
        "rounds": args.rounds,
    }


def verdicts(summary: dict[str, Any]) -> list[str]:
    lines = []
    for key, bar in BARS.items():
        value = summary[key]
        if value is not None:
            lines.append(
                f"{key}: {value:.2f}x (bar >= {bar}x: {'met' if value >= bar else 'not met'})"
            )
    pss = summary["ft2_pss_vs_process"]
    if pss is not None:
        met = "met" if pss <= PSS_BAR else "not met"
        added = summary["ft2_added_pss_vs_process"]
        lines.append(f"ft2_pss_vs_process: {pss:.2f} (bar <= {PSS_BAR}: {met}); above each "
                     f"interpreter's PSS with torch imported: {added:.2f}")  # fmt: skip
    same = summary["ft2_pss_vs_process_ft"]
    if same is not None:
        met = "met" if same <= PSS_BAR else "not met"
        lines.append(f"ft2_pss_vs_process_ft (the process executor on the free-threaded build, "
                     f"the same torch): {same:.2f} (bar <= {PSS_BAR}: {met})")  # fmt: skip
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1280 samples, 2 epochs, 1 round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--gil-python", default=None, help="default: this one, or .venv's")
    parser.add_argument("--ft-python", default=None, help="default: this one, or .venv-ft's")
    parser.add_argument("--modes", default=",".join(MODES), help="a comma-separated subset")
    parser.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.samples = args.samples or (1280 if args.quick else 3200)
    args.epochs = args.epochs or (2 if args.quick else 3)
    args.rounds = args.rounds or (1 if args.quick else 2)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first is warm-up)")
    if args.run:
        print(json.dumps(run_one(args.run, args.samples, args.epochs)), flush=True)
        return
    pythons = interpreters(args)
    skipped = [mode for mode, (build, _) in MODES.items() if pythons[build] is None]
    wanted = args.modes.split(",")
    if unknown := set(wanted) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {list(MODES)}")
    skipped = [mode for mode in skipped if mode in wanted]
    modes = [mode for mode in MODES if mode in wanted and mode not in skipped]
    print(f"W5 GIL-holding decode: {args.samples} records of {FIELDS} integers -> {ROWS}x{COLS} "
          f"float32 (100 KB), batch {BATCH}, {args.epochs} epochs (the first is warm-up), "
          f"{args.rounds} round(s), {len(os.sched_getaffinity(0))} cores")  # fmt: skip
    for build, path in pythons.items():
        print(f"  {build} build: {path or 'missing (its contenders are skipped)'}")
    print(f"{'build':<5} {'contender':<34} {'samples/s':>10} {'CPU s':>7} {'CPU ms/sample':>14} "
          f"{'peak PSS MB':>12} {'added MB':>9} {'GIL':>4}")  # fmt: skip
    results: dict[str, dict[str, Any]] = {}
    for round_ in range(args.rounds):
        for mode in modes if round_ % 2 == 0 else modes[::-1]:
            build, label = MODES[mode]
            python = pythons[build]
            assert python is not None
            r = measure(python, mode, args.samples, args.epochs)
            if "skipped" in r:
                if mode not in skipped:
                    print(f"{build:<5} {label:<34} skipped: {r['skipped']}", flush=True)
                    skipped.append(mode)
                continue
            print(f"{build:<5} {label:<34} {r['samples_per_s']:>10.1f} {r['cpu_s']:>7.2f} "
                  f"{r['cpu_ms_per_sample']:>14.2f} {r['peak_pss_mb']:>12.0f} "
                  f"{r['added_pss_mb']:>9.0f} "
                  f"{'on' if r['gil_enabled'] else 'off':>4}", flush=True)  # fmt: skip
            best = results.setdefault(mode, dict(r))
            best["samples_per_s"] = max(best["samples_per_s"], r["samples_per_s"])
            for key in ("cpu_s", "cpu_ms_per_sample", "peak_pss_mb", "added_pss_mb"):
                best[key] = min(best[key], r[key])
            best["gil_enabled"] = best["gil_enabled"] or r["gil_enabled"]
    for mode in skipped:
        build, label = MODES[mode]
        if pythons[build] is None:
            print(f"{build:<5} {label:<34} {'skipped: no ' + build + ' interpreter':>30}")
    summary = summarise(results, skipped, args)
    for build in ("gil", "ft"):
        scaling = summary["gil_scaling" if build == "gil" else "ft_scaling"]
        if scaling is not None:
            print(f"{build} build, 1 -> 2 threads: {scaling:.2f}x")
    for line in verdicts(summary):
        print(line)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
