"""Demo: train a small CNN on images behind a slow HTTP store, with torch's DataLoader, then aioloader.

1. Generates 2,000 small JPEGs into data/demo/images (once; kept for later runs). The class of an image
   (0-9) is in its file name and decides the colour of the disc drawn on it, so the model can learn it.
2. Serves them with examples/http_server.py on 127.0.0.1, adding 20 ms per request like a remote store.
3. Trains the same CNN for the same number of steps twice: torch DataLoader (urllib in `__getitem__`,
   2 worker processes: one per core) and aioloader (aiohttp, 64 requests in flight, Pillow decoding in
   threads), and prints samples/s and the share of the time the model waited for data.

Usage: python examples/demo.py [--steps 200] [--torch-workers 2]   (or: make demo)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import nn
from torch.utils.data import DataLoader, Dataset

from aioloader import Loader

REPO = Path(__file__).resolve().parent.parent
IMAGES = REPO / "data" / "demo" / "images"
N_IMAGES = 2000
SIZE = 64
CLASSES = 10
BATCH = 16
DELAY_MS = 20
PALETTE = [
    (230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48),
    (145, 30, 180), (70, 240, 240), (240, 50, 230), (250, 250, 250), (128, 128, 0),
]  # fmt: skip


# -- the data set -------------------------------------------------------------------------------------


def label_of(name: str) -> int:
    """The class encoded in a file name such as "00042_7.jpg"."""
    return int(Path(name).stem.split("_")[1])


def draw_image(index: int, rng: np.random.Generator) -> tuple[str, bytes]:
    label = index % CLASSES
    noise = rng.integers(0, 96, size=(SIZE, SIZE, 3), dtype=np.uint8)
    image = Image.fromarray(noise)
    r = int(rng.integers(10, 20))
    x, y = (int(v) for v in rng.integers(r, SIZE - r, size=2))
    ImageDraw.Draw(image).ellipse((x - r, y - r, x + r, y + r), fill=PALETTE[label])
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return f"{index:05d}_{label}.jpg", out.getvalue()


def ensure_dataset(root: Path = IMAGES) -> list[str]:
    """The names of the demo images, generating them first if they are not all there."""
    names = sorted(p.name for p in root.glob("*.jpg")) if root.is_dir() else []
    if len(names) == N_IMAGES:
        print(f"dataset: {N_IMAGES} images in {root} (cached)")
        return names
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(N_IMAGES):
        name, data = draw_image(index, rng)
        (root / name).write_bytes(data)
    print(f"dataset: generated {N_IMAGES} {SIZE}x{SIZE} JPEGs in {root} "
          f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    return sorted(p.name for p in root.glob("*.jpg"))


def decode(raw: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
    """JPEG bytes -> (uint8 CHW tensor, label)."""
    data, label = raw
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.array(image.convert("RGB"))
    return torch.from_numpy(pixels).permute(2, 0, 1), label


# -- the store ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def http_store(root: Path, ready_timeout_s: float = 30.0) -> Iterator[str]:
    """Run examples/http_server.py serving `root`; yields its base URL; always stops it."""
    cmd = [sys.executable, str(Path(__file__).with_name("http_server.py")), "--root", str(root),
           "--delay-ms", str(DELAY_MS)]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(ready_timeout_s, server.kill)  # a server that never says READY
    try:
        assert server.stdout is not None
        watchdog.start()
        line = server.stdout.readline()
        watchdog.cancel()
        if not line.startswith("READY "):
            raise RuntimeError(f"the HTTP server did not start (exit code {server.poll()})")
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        watchdog.cancel()
        server.terminate()
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


# -- torch DataLoader: one blocking request per item, in worker processes ---------------------------


class HttpImageDataset(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, base_url: str, names: list[str]) -> None:
        self.base_url = base_url
        self.names = names

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        name = self.names[index]
        with urllib.request.urlopen(f"{self.base_url}/{name}", timeout=30) as response:
            data = response.read()
        return decode((data, label_of(name)))


# -- aioloader: a source with one aiohttp session on the loader's event loop ------------------------


class HttpImages:
    """An aioloader source (keys, fetch, aclose) reading images over HTTP.

    The session is created by the first fetch, so it belongs to the loop the fetches run on; the loader
    calls `aclose` on that same loop when it closes.
    """

    def __init__(self, base_url: str, names: list[str], connections: int) -> None:
        self.base_url = base_url
        self.names = names
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None

    def keys(self) -> list[str]:
        return self.names

    async def fetch(self, name: str) -> tuple[bytes, int]:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.connections)
            self._session = aiohttp.ClientSession(self.base_url, connector=connector)
        async with self._session.get(f"/{name}") as response:
            response.raise_for_status()
            return await response.read(), label_of(name)

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()


# -- training -----------------------------------------------------------------------------------------


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, CLASSES),
    )  # fmt: skip


@dataclass
class Run:
    name: str
    samples: int
    seconds: float
    waited: float  # seconds blocked in next(), waiting for a batch
    accuracy: float  # on the last 20 training batches

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


def batches_forever(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        yield from loader  # one epoch per pass


def train(name: str, loader: Iterable[Any], steps: int) -> Run:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = batches_forever(loader)
    waited, correct, seen = 0.0, 0, 0
    start = time.perf_counter()
    try:
        for step in range(steps):
            asked = time.perf_counter()
            images, labels = next(batches)
            waited += time.perf_counter() - asked
            logits = model(images.float().div_(255))
            loss = nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step >= steps - 20:
                correct += int((logits.argmax(1) == labels).sum())
                seen += len(labels)
    finally:
        batches.close()  # ends the epoch in flight (and torch's worker processes)
    seconds = time.perf_counter() - start
    run = Run(name, steps * BATCH, seconds, waited, correct / max(seen, 1))
    print(f"  {name}: {steps} steps in {seconds:.1f} s, loss {loss.item():.3f}", flush=True)
    return run


def run_torch(base_url: str, names: list[str], steps: int, workers: int) -> Run:
    dataset = HttpImageDataset(base_url, names)
    loader = DataLoader(
        dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=workers
    )
    return train(f"torch DataLoader ({workers} workers)", loader, steps)


def run_aioloader(base_url: str, names: list[str], steps: int, in_flight: int) -> Run:
    source = HttpImages(base_url, names, connections=in_flight)
    with Loader(
        source, decode=decode, executor="thread", batch_size=BATCH, shuffle=True, drop_last=True,
        concurrency=in_flight,
    ) as loader:  # fmt: skip
        return train(f"aioloader ({in_flight} in flight)", loader, steps)


def report(runs: list[Run]) -> None:
    print(f"\n{'':28} {'samples/s':>10} {'time s':>7} {'waited for data':>16} {'accuracy':>9}")
    for r in runs:
        print(f"{r.name:28} {r.samples_per_s:>10.0f} {r.seconds:>7.1f} "
              f"{r.waited / r.seconds:>16.0%} {r.accuracy:>9.0%}")  # fmt: skip
    print(f"speed-up: {runs[-1].samples_per_s / runs[0].samples_per_s:.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per loader")
    parser.add_argument("--torch-workers", type=int, default=2, help="DataLoader num_workers")
    parser.add_argument("--in-flight", type=int, default=64, help="aioloader concurrency")
    args = parser.parse_args()
    start = time.perf_counter()
    # One intra-op thread for the model: the loader (worker processes or threads) needs a core too, and
    # an OpenMP team sharing its cores with busy threads stalls at every barrier.
    torch.set_num_threads(1)
    names = ensure_dataset()
    try:
        with http_store(IMAGES) as base_url:
            print(f"store: {base_url} (+{DELAY_MS} ms per request); {args.steps} steps of {BATCH}")
            runs = [
                run_torch(base_url, names, args.steps, args.torch_workers),
                run_aioloader(base_url, names, args.steps, args.in_flight),
            ]
    except KeyboardInterrupt:
        print("interrupted; the HTTP server was stopped")
        sys.exit(130)
    report(runs)
    print(f"demo took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
