"""Three epochs of a loader whose decode draws random augmentations; prints one line per batch.

Modes:
  full            run all three epochs
  stop N STATE    after N batches of epoch 1 (the second), save the state to STATE, then wait
                  (the test SIGKILLs the process there)
  resume STATE    load STATE and run to the end of epoch 2
Each batch prints "epoch hash".
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import torch

import aioloader

EPOCHS = 3


def fetch(key: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + key


def augment(sample: torch.Tensor) -> torch.Tensor:
    gen = aioloader.sample_generator()  # seeded from (seed, epoch, key position)
    return sample + torch.rand(sample.shape, generator=gen)


def make() -> aioloader.Loader[torch.Tensor]:
    return aioloader.Loader(
        list(range(40)), fetch, decode=augment, batch_size=3, shuffle=True, seed=7,
        executor="thread", concurrency=4,
    )  # fmt: skip


def emit(epoch: int, batch: torch.Tensor) -> None:
    print(epoch, hashlib.sha1(batch.numpy().tobytes()).hexdigest(), flush=True)


def main(argv: list[str]) -> None:
    loader = make()
    first = 0
    if argv[0] == "resume":
        state = json.loads(Path(argv[1]).read_text())
        loader.load_state_dict(state)
        first = state["epoch"]
    for epoch in range(first, EPOCHS):
        for step, batch in enumerate(loader):
            emit(epoch, batch)
            if argv[0] == "stop" and epoch == 1 and step + 1 == int(argv[1]):
                Path(argv[2]).write_text(json.dumps(loader.state_dict()))
                print("saved", flush=True)
                time.sleep(600)
    loader.close()


if __name__ == "__main__":
    main(sys.argv[1:])
