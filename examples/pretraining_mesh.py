"""Pretraining on a device mesh: a two-phase mixture schedule, DCP checkpoints, a restart elsewhere.

Four processes (`torchrun --nproc_per_node 4`, gloo, on the CPU) form a 2 (data-parallel) x 2
(tensor-parallel) mesh. Each reads two corpora mixed by `aioloader.mix` under a schedule (mostly
"web" for the first documents, then more "code"), packed by `aioloader.pack` into rows with
boundaries and flash-attention's varlen offsets, through `Loader(..., mesh=world_mesh["dp"])`: the
two ranks of a tensor-parallel pair read the same batches, the two pairs different ones. A tiny
model trains (its gradients averaged over the job). Half-way, model and data state are saved with
`torch.distributed.checkpoint` (`aioloader.DataCheckpoint` beside the model's state dict).

Then the job is "killed" and restarted from the checkpoint twice: on the same mesh, where the
batches after the restart must be those of the uninterrupted run; and on a 1 x 2 mesh (another
data-parallel size), where no document read before the checkpoint may come again.

Usage: python examples/pretraining_mesh.py [--steps 16] [--folder DIR]
(It launches torchrun itself; `--worker` is the torchrun side.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import aioloader
from aioloader import DataCheckpoint, Loader, mix, pack, schedule

VOCAB, EOS, SEQ_LEN, BATCH, IDS = 4096, 0, 64, 4, 1000  # a document's first token: its id (< IDS)


def corpus(name: str, first_id: int) -> list[np.ndarray]:
    """300 documents: an id token, then tokens of the corpus's own kind."""
    rng = np.random.default_rng(first_id)
    docs = []
    for i in range(300):
        n = int(rng.integers(10, 90))
        body = rng.integers(IDS, VOCAB // 2, n) if name == "web" else np.resize(
            rng.integers(VOCAB // 2, VOCAB, 4), n)  # fmt: skip
        docs.append(np.concatenate([[first_id + i], body]).astype(np.int64))
    return docs


def make_packed(mesh: Any) -> aioloader.Packed:
    web, code = corpus("web", 1), corpus("code", 400)
    weights = schedule([(0, {"web": 0.9, "code": 0.1}), (120, {"web": 0.4, "code": 0.6})])
    mixed = mix({"web": web, "code": code}, weights, seed=1, stop="cycle")  # train by steps
    loader = Loader(mixed, batch_size=None, collate=None, mesh=mesh)
    return pack(loader, SEQ_LEN, batch_size=BATCH, eos=EOS, boundaries=True, varlen=True)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(tokens))
        return out


def worker(dp: int, tp: int, steps: int, save_at: int | None, load: str | None, out: Path) -> None:
    dist.init_process_group("gloo")
    world_mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    packed = make_packed(world_mesh["dp"])
    start = 0
    if load is not None:  # the model's and the data's state, from the checkpoint
        state = {"model": model.state_dict(), "data": DataCheckpoint(packed)}
        dcp.load(state, checkpoint_id=load)
        model.load_state_dict(state["model"])
        start = json.loads(Path(load, "step.json").read_text())["step"]
    rows: list[list[list[int]]] = []
    batches = iter(packed)
    for n in range(start, steps):
        if n == save_at:
            dcp.save({"model": model.state_dict(), "data": DataCheckpoint(packed)},
                     checkpoint_id=out / "checkpoint")  # fmt: skip
            if dist.get_rank() == 0:
                (out / "checkpoint" / "step.json").write_text(json.dumps({"step": n}))
        batch = next(batches)
        tokens = batch["tokens"]
        assert int(batch["cu_seqlens"][-1]) == tokens.numel()  # the varlen offsets, whole
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # gradients averaged over the job
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        optimizer.step()
        rows.append(tokens.tolist())
    packed.close()
    record = {"coordinate": world_mesh.get_coordinate(), "start": start, "rows": rows}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def run(folder: Path, dp: int, tp: int, steps: int, *extra: str) -> list[dict[str, Any]]:
    """The job on a dp x tp mesh (torchrun, one process per rank); each rank's record."""
    folder.mkdir(parents=True, exist_ok=True)
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={dp * tp}", __file__, "--worker",
           "--dp", str(dp), "--tp", str(tp), "--steps", str(steps), "--out", str(folder), *extra]  # fmt: skip
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    records = [folder / f"rank{r}.json" for r in range(dp * tp)]
    if not all(p.exists() for p in records):
        raise SystemExit(f"torchrun failed:\n{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in records]


def documents(records: list[dict[str, Any]], upto: int | None = None) -> set[int]:
    """The ids of the documents whose first token the records' rows hold (first `upto` steps)."""
    return {t for r in records for batch in r["rows"][:upto] for row in batch for t in row
            if 0 < t < IDS}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--save-at", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.dp, args.tp, args.steps, args.save_at, args.load, args.out)
        return
    half = args.steps // 2
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp)
        first = run(folder / "uninterrupted", 2, 2, args.steps, "--save-at", str(half))
        checkpoint = str(folder / "uninterrupted" / "checkpoint")
        by_dp: dict[int, list[dict[str, Any]]] = {}
        for r in first:
            by_dp.setdefault(r["coordinate"][0], []).append(r)
        pairs = all(a["rows"] == b["rows"] for a, b in by_dp.values())
        apart = by_dp[0][0]["rows"] != by_dp[1][0]["rows"]
        print(f"2 x 2 mesh, {args.steps} steps, checkpoint at step {half}: each tensor-parallel "
              f"pair read the same batches: {'yes' if pairs else 'no'}; the two data-parallel "
              f"pairs different ones: {'yes' if apart else 'no'}")  # fmt: skip
        again = run(folder / "same", 2, 2, args.steps, "--load", checkpoint)
        same = all(a["rows"] == u["rows"][half:] for a, u in zip(again, first, strict=True))
        print(f"restarted on the 2 x 2 mesh: the batches after the restart are the uninterrupted "
              f"run's: {'yes' if same else 'no'}")  # fmt: skip
        other = run(folder / "smaller", 1, 2, args.steps, "--load", checkpoint)
        before, after = documents(first, half), documents(other)
        print(f"restarted on a 1 x 2 mesh (data-parallel size 2 -> 1): {len(after)} documents "
              f"begun after the restart, none of the {len(before)} begun before it: "
              f"{'yes' if not before & after else 'no'}")  # fmt: skip


if __name__ == "__main__":
    main()
