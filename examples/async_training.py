"""Training inside `async def main()`, with `async for batch in loader`.

The fetch is a coroutine standing in for a remote read (5 ms of latency each; 32 in flight), and the
sample is made from the key, so the example needs no data on disk. The pipeline runs on the loader's own
event loop thread (the default), so the model step below, which does not await, never stalls fetching.

Usage: python examples/async_training.py
"""

from __future__ import annotations

import asyncio
import time

import torch
from torch import nn

from aioloader import Loader

N_SAMPLES = 2048
FEATURES = 16
CLASSES = 4
PROTOTYPES = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(1))


async def fetch(key: int) -> tuple[torch.Tensor, int]:
    """A sample of class key % CLASSES: its class's prototype plus noise, after a 5 ms "request"."""
    await asyncio.sleep(0.005)
    noise = torch.randn(FEATURES, generator=torch.Generator().manual_seed(key))
    label = key % CLASSES
    return PROTOTYPES[label] + 0.5 * noise, label


async def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    async with Loader(
        range(N_SAMPLES), fetch, batch_size=128, shuffle=True, concurrency=32
    ) as loader:
        for epoch in range(3):
            start, correct = time.perf_counter(), 0
            async for x, y in loader:
                logits = model(x)
                loss = nn.functional.cross_entropy(logits, y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                correct += int((logits.argmax(1) == y).sum())
            seconds = time.perf_counter() - start
            print(f"epoch {epoch}: accuracy {correct / N_SAMPLES:.0%}, {seconds:.2f} s")


if __name__ == "__main__":
    asyncio.run(main())
