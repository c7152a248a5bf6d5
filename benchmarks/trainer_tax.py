"""The trainer's tax: what each loader costs a launch-bound training step that runs beside it.

A GPU training step is Python that launches kernels, each launch needing the GIL of the training
process; a loader whose Python runs as threads of that process takes the GIL from the step. The
step here is that shape on the CPU: `STEP_OPS` small torch ops on the main thread (~20 ms of Python
and dispatch), reading batches of 64 objects of 128 KiB from an HTTP store on 127.0.0.1 that answers
each GET after 5 ms (`_objserver.py`, in a process of its own). Each contender runs in a fresh
interpreter (`--run NAME`):

  resident     the batches already in memory: the floor (no loader at all);
  torch-8      torch's `DataLoader(num_workers=8)`, one blocking urllib GET per `__getitem__`;
  frontdoor-8  the same user code through `aioloader.DataLoader(num_workers=8)`;
  native       `aioloader.Loader(sources.http(...), concurrency=64)`: the event loop and its
               callbacks in the training process.
  native-beside  the same `Loader(..., beside=True)`: the pipeline in a process of its own beside
               the trainer, each batch mapped out of shared memory (`_pipeline/beside.py`).

Figures per contender: the step's own compute time (timed inside the step: its median, and its
inflation over the resident floor's), the wait for each batch (`next()`), steps/s, and the CPU
seconds of the process tree per step. The step's inflation is the tax: a loader that delivers every
batch on time still slows training if the step itself runs slower beside it. Where the step's time
went (its thread's /proc schedstat, on average): "queued", waiting in a run queue for a core (other
processes' work: the cores are all busy); "GIL", the rest beyond its time on a CPU (waiting for
another thread of the training process). "trainer thr": the CPU of the training process's threads
other than the main one, per step (a loader's work in the trainer's process).

`--step model` makes the step a real training step instead: `MODEL_LAYERS` small linear layers
(forward, backward, an SGD step, then `loss.item()` as a loop that logs its loss does), many launches
each. With `--device cuda` it runs on the GPU, which is the figure that counts where one is lent: torch
and the front door pin their batches (`pin_memory=True`) and the step moves each one with
`.to("cuda", non_blocking=True)`, as their users write it; the native loaders are given
`device="cuda"` (pinned staging and a side-stream copy in the training process); the floor's batches
are on the GPU already. Without CUDA, `--device cuda` says so and exits 0.

Workaround, the same for every contender: the store runs on the trainer's cores, though it stands in
for a remote machine; it runs at nice 10 (`STORE_NICE`), so that it takes the CPU the contenders
leave rather than the trainer's.

Usage: python benchmarks/trainer_tax.py [--quick] [--rounds R] [--contenders a,b,...]
                                        [--step ops|model] [--device cpu|cuda (with --step model)]
(--quick: one round of fewer steps, under 60 s.) The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SIZE = 128 * 1024
DELAY_MS = 5.0
BATCH = 64
STEP_OPS = 2_500
MODEL_LAYERS, MODEL_WIDTH = 32, 256  # `--step model`: small layers, many launches
OBJECTS = 4_096
CONTENDERS = ("resident", "torch-8", "frontdoor-8", "native", "native-beside")
STEPS = {"full": (8, 60), "quick": (4, 20)}  # (warm-up, measured)
# The store stands in for a remote machine, yet runs on the trainer's cores: at nice 10 it takes the
# CPU the contenders leave, as a remote store would take none of the trainer's (same for each).
STORE_NICE = 10


# -- the user's code ----------------------------------------------------------------------------------


def train_step(batch: Any, state: Any) -> tuple[Any, float]:
    """A launch-bound step: `STEP_OPS` small ops (a GPU step's kernel launches, on the CPU here);
    returns the new state and the step's own compute time."""
    t0 = time.perf_counter()
    x = state + batch[:, :16].float().mean(0)
    for _ in range(STEP_OPS // 2):
        x = x * 1.0001 + 0.0001
    return x, time.perf_counter() - t0


class ModelStep:
    """`--step model`: a real training step on `device`, the batch moved there first (a no-op for a
    batch on it already), ending in `loss.item()`, so that the GPU's work is in the step's time."""

    def __init__(self, device: str) -> None:
        import torch

        torch.manual_seed(0)
        if device == "cpu":  # one thread, as a GPU step's host side: the loaders' cores stay theirs
            torch.set_num_threads(1)
        layers: list[Any] = []
        for _ in range(MODEL_LAYERS):
            layers += [torch.nn.Linear(MODEL_WIDTH, MODEL_WIDTH), torch.nn.ReLU()]
        self.device = device
        self.model = torch.nn.Sequential(*layers).to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def __call__(self, batch: Any, state: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        x = batch.to(self.device, non_blocking=True)[:, :MODEL_WIDTH].float() * (1 / 255)
        loss = self.model(x).square().mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return state + loss.item(), time.perf_counter() - t0


class HttpObjects:
    """Map-style dataset: one blocking urllib GET per item, as a torch user writes it."""

    def __init__(self, base: str, n: int) -> None:
        self.base, self.n = base, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        import torch

        with urllib.request.urlopen(f"{self.base}/obj/{index}", timeout=30) as resp:
            return torch.frombuffer(bytearray(resp.read()), dtype=torch.uint8)


def to_tensor(raw: Any) -> Any:
    import torch

    return torch.frombuffer(raw, dtype=torch.uint8)


def make_loader(name: str, base: str, device: str = "cpu") -> Any:
    pin = device != "cpu"  # the users of torch's loader pin where they copy to a GPU
    if name == "resident":
        import torch

        return [torch.randint(0, 255, (BATCH, SIZE), dtype=torch.uint8, device=device)
                for _ in range(8)]  # fmt: skip
    if name == "torch-8":
        from torch.utils.data import DataLoader

        return DataLoader(HttpObjects(base, OBJECTS), batch_size=BATCH, shuffle=True,
                          num_workers=8, persistent_workers=True, pin_memory=pin)  # fmt: skip
    if name == "frontdoor-8":
        from aioloader import DataLoader as FrontDoor

        return FrontDoor(HttpObjects(base, OBJECTS), batch_size=BATCH, shuffle=True,
                         num_workers=8, persistent_workers=True, pin_memory=pin)  # fmt: skip
    from aioloader import Loader, sources

    source = sources.http(f"{base}/obj/", keys=[str(i) for i in range(OBJECTS)], concurrency=64)
    return Loader(source, decode=to_tensor, executor="inline", batch_size=BATCH, shuffle=True,
                  concurrency=64, beside=name == "native-beside",
                  device=None if device == "cpu" else device)  # fmt: skip


# -- one contender, in its own interpreter --------------------------------------------------------


def tree_cpu() -> float:
    import psutil

    me, total = psutil.Process(), 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def schedstat() -> tuple[float, float]:
    """(seconds this thread ran on a CPU, seconds it waited in a run queue for one)."""
    with open("/proc/thread-self/schedstat") as f:
        ran, queued, _ = map(int, f.read().split())
    return ran / 1e9, queued / 1e9


def other_threads_cpu() -> float:
    """CPU seconds of this process's threads other than the main one (a loader's, in-process)."""
    import threading

    import psutil

    main = threading.main_thread().native_id
    return sum(t.user_time + t.system_time for t in psutil.Process().threads() if t.id != main)


def run_one(
    name: str, base: str, warmup: int, measured: int, step: str = "ops", device: str = "cpu"
) -> dict[str, Any]:
    import torch

    loader = make_loader(name, base, device)
    train = train_step if step == "ops" else ModelStep(device)
    state = torch.zeros(16) if step == "ops" else 0.0
    computes: list[float] = []
    waits: list[float] = []
    ran = queued = 0.0
    steps = 0
    t0 = cpu0 = others0 = 0.0
    while steps < warmup + measured:
        it = iter(loader)
        while steps < warmup + measured:
            began = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            came = time.perf_counter()
            ran0, queued0 = schedstat()
            state, compute = train(batch, state)
            ran1, queued1 = schedstat()
            del batch
            steps += 1
            if steps == warmup:
                t0, cpu0, others0 = time.perf_counter(), tree_cpu(), other_threads_cpu()
            elif steps > warmup:
                computes.append(compute)
                waits.append(came - began)
                ran, queued = ran + ran1 - ran0, queued + queued1 - queued0
        close = getattr(it, "close", None)
        if close is not None:
            close()
    wall, cpu = time.perf_counter() - t0, tree_cpu() - cpu0
    others = other_threads_cpu() - others0
    if hasattr(loader, "close"):
        loader.close()
    return {
        "step_compute_s": statistics.median(computes),
        "wait_s": statistics.mean(waits),
        "steps_per_s": measured / wall,
        "cpu_s_per_step": cpu / measured,
        # where the step's time went, on average: on a CPU, waiting for one (the cores busy with
        # other processes), and the rest: waiting for the GIL (another thread of this process)
        "step_mean_s": statistics.mean(computes),
        "step_queued_s": queued / measured,
        "step_gil_s": max(0.0, statistics.mean(computes) - (ran + queued) / measured),
        "trainer_threads_cpu_s": others / measured,
    }


# -- the orchestrator ---------------------------------------------------------------------------------


def measure(
    name: str, base: str, warmup: int, measured: int, step: str, device: str
) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--run", name, base, str(warmup), str(measured),
           "--step", step, "--device", device]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--step", choices=("ops", "model"), default="ops")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--run", nargs=4, metavar=("NAME", "BASE", "WARMUP", "MEASURED"))
    args = parser.parse_args()
    if args.device == "cuda" and args.step != "model":  # the ops step's state lives on the CPU
        parser.error("--device cuda times a real model step: give --step model with it")
    if args.run:
        name, base, warmup, measured = args.run
        result = run_one(name, base, int(warmup), int(measured), args.step, args.device)
        print(json.dumps(result), flush=True)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device here: nothing to measure with --device cuda")
            print(json.dumps({"workload": "trainer_tax", "device": "cuda", "skipped": "no CUDA"}))
            return
    import psutil
    from _objserver import start_server

    rounds = args.rounds or (1 if args.quick else 2)
    warmup, measured = STEPS["quick" if args.quick else "full"]
    names = args.contenders.split(",")
    server, base = start_server(SIZE, DELAY_MS)
    psutil.Process(server.pid).nice(STORE_NICE)  # a remote store's CPU is not the trainer's
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        for _ in range(rounds):
            for name in names:
                results[name].append(measure(name, base, warmup, measured, args.step, args.device))
    finally:
        server.kill()
        server.wait()
    floor = min((r["step_compute_s"] for r in results.get("resident", [])), default=None)
    print(f"{'contender':<15}{'step compute ms':>17}{'x floor':>9}{'queued ms':>11}{'GIL ms':>8}"
          f"{'wait ms':>9}{'steps/s':>9}{'CPU s/step':>12}{'trainer thr ms':>16}")  # fmt: skip
    summary: dict[str, Any] = {"workload": "trainer_tax", "date": time.strftime("%Y-%m-%d"),
                               "step": args.step, "device": args.device,
                               "step_ops": STEP_OPS, "rounds": rounds}  # fmt: skip
    for name, runs in results.items():
        for r in runs:
            inflation = r["step_compute_s"] / floor if floor else None
            shown = "-" if inflation is None else f"{inflation:.2f}"
            print(f"{name:<15}{r['step_compute_s'] * 1e3:>17.1f}{shown:>9}"
                  f"{r['step_queued_s'] * 1e3:>11.2f}{r['step_gil_s'] * 1e3:>8.2f}"
                  f"{r['wait_s'] * 1e3:>9.1f}{r['steps_per_s']:>9.1f}"
                  f"{r['cpu_s_per_step']:>12.3f}{r['trainer_threads_cpu_s'] * 1e3:>16.2f}")  # fmt: skip
        best = max(runs, key=lambda r: r["steps_per_s"])
        summary[name] = {
            "step_compute_ms": [round(r["step_compute_s"] * 1e3, 2) for r in runs],
            "inflation": [round(r["step_compute_s"] / floor, 3) if floor else None for r in runs],
            "wait_ms": [round(r["wait_s"] * 1e3, 2) for r in runs],
            "step_queued_ms": [round(r["step_queued_s"] * 1e3, 2) for r in runs],
            "step_gil_ms": [round(r["step_gil_s"] * 1e3, 2) for r in runs],
            "trainer_threads_cpu_ms": [round(r["trainer_threads_cpu_s"] * 1e3, 2) for r in runs],
            "steps_per_s": [round(r["steps_per_s"], 2) for r in runs],
            "best_steps_per_s": round(best["steps_per_s"], 2),
        }
    torch_best = summary.get("torch-8", {}).get("best_steps_per_s")
    for name in ("frontdoor-8", "native", "native-beside"):
        if torch_best and name in summary:
            summary[f"{name}/torch-8 steps/s"] = round(
                summary[name]["best_steps_per_s"] / torch_best, 3
            )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
