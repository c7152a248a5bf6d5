"""Ordinary `for batch in loader` training, reading samples from local files.

Writes 1,024 small .npz files (a 2-class problem: the sign of the features' sum) into a temporary
directory, reads them with `aioloader.sources.files` (async file reads on the loader's own event loop
thread), decodes them in a thread pool and trains a tiny model for a few epochs.

Usage: python examples/sync_training.py
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aioloader import Loader
from aioloader.sources import files

N_SAMPLES = 1024
FEATURES = 32


def write_samples(root: Path) -> None:
    """One .npz file per sample, holding its features `x` and its label `y`."""
    rng = np.random.default_rng(0)
    for i in range(N_SAMPLES):
        x = rng.standard_normal(FEATURES, dtype=np.float32)
        np.savez(root / f"{i:04d}.npz", x=x, y=int(x.sum() > 0))


def decode(raw: bytes) -> tuple[torch.Tensor, int]:
    """.npz bytes -> (features, label); the default collate stacks them into (x, y) batches."""
    with np.load(io.BytesIO(raw)) as sample:
        return torch.from_numpy(sample["x"]), int(sample["y"])


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        write_samples(Path(tmp))
        source = files(tmp, "*.npz")
        with Loader(
            source, decode=decode, executor="thread", batch_size=64, shuffle=True, concurrency=32
        ) as loader:
            for epoch in range(3):  # each pass over the loader is one epoch, reshuffled
                start, correct = time.perf_counter(), 0
                for x, y in loader:
                    logits = model(x)
                    loss = nn.functional.cross_entropy(logits, y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    correct += int((logits.argmax(1) == y).sum())
                seconds = time.perf_counter() - start
                print(f"epoch {epoch}: accuracy {correct / N_SAMPLES:.0%}, {seconds:.2f} s")


if __name__ == "__main__":
    main()
