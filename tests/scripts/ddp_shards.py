"""Run under `torchrun --nproc_per_node=4`: a tiny DDP model steps with an all-reduce per batch over
uneven tar shards, then over a mix of them with a key list. A rank with one step more than another
would hang in its all-reduce.

Writes <out>/rank<r>.json: per run, the samples this rank took and its steps; and how many shards
this rank counted (the ranks count the shards' samples together, each shard once per job).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import aioloader
from aioloader import sources


def names(batch: list[Any]) -> list[str]:
    return [s["txt"].decode() if isinstance(s, dict) else s for s in batch]


def train(loader: aioloader.Loader[Any], model: Any, opt: Any) -> dict[str, Any]:
    taken: list[str] = []
    steps = 0
    with loader:
        for batch in loader:
            x = torch.full((len(batch), 4), float(len(batch)))
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()  # the all-reduce: every rank must take this step
            opt.step()
            taken += batch
            steps += 1
    return {"samples": taken, "steps": steps}


def main(out: Path, shards: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    tar = sources.tar_shards(shards, shuffle_buffer=8, seed=1)
    record = {"tar": train(aioloader.Loader(tar, batch_size=3, collate=names), model, opt)}
    again = sources.tar_shards(shards, seed=2)
    both = aioloader.mix([again, [f"k{i}" for i in range(50)]], [3, 1], seed=3,
                         stop="all_exhausted")  # fmt: skip
    record["mix"] = train(aioloader.Loader(both, batch_size=3, collate=names), model, opt)
    record["counted"] = [tar.counted, again.counted]  # shards this rank counted, per source
    dist.barrier()
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
