"""Labels from paths: a folder per class (`cat/001.png`), the label taken from the key in decode.

With `decode_with_key=True` the loader calls `decode(key, raw)`, so a decode that runs in worker
processes still sees the path the bytes came from. Without a ROOT this writes a small set itself
(3 classes, 16 images each, one colour per class) into a temporary folder; then it reads it with
`aioloader.sources.files`, decodes in worker processes, checks that every label agrees with its
image's colour and trains a tiny classifier for a few epochs.

Usage: python examples/labels_from_paths.py [ROOT] [--executor inline|thread|process]
"""

from __future__ import annotations

import argparse
import functools
import io
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from aioloader import Loader
from aioloader.sources import files

COLOURS = {"bird": (40, 90, 230), "cat": (230, 60, 40), "dog": (60, 200, 70)}
PER_CLASS = 16
SIDE = 16


def write_images(root: Path) -> None:
    """`root/<class>/<nnn>.png`: each image its class's colour plus a little noise."""
    rng = np.random.default_rng(0)
    for name, colour in COLOURS.items():
        (root / name).mkdir()
        for i in range(PER_CLASS):
            noise = rng.integers(-20, 20, (SIDE, SIDE, 3))
            pixels = np.clip(np.array(colour) + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.png")


def decode(classes: list[str], key: str, raw: bytes) -> tuple[torch.Tensor, int]:
    """PNG bytes -> (3xHxW float image, class index); the class is the key's first folder."""
    label = classes.index(key.split("/")[0])
    with Image.open(io.BytesIO(raw)) as image:
        pixels = np.asarray(image.convert("RGB").resize((SIDE, SIDE)), dtype=np.float32) / 255
    return torch.from_numpy(pixels).permute(2, 0, 1), label


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", help="a folder with one sub-folder per class")
    parser.add_argument("--executor", default="process", choices=["inline", "thread", "process"])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(args.root) if args.root else Path(scratch)
        if not args.root:
            write_images(root)
        return train(root, args.executor, args.epochs, check=not args.root)


def train(root: Path, executor: str, epochs: int, check: bool) -> int:
    """Train on the images under `root`; `check`: our own set, whose colours tell the labels."""
    source = files(root, "*/*.png")
    paths = source.keys()  # "cat/001.png", ...: relative to root, sorted
    classes = sorted({path.split("/")[0] for path in paths})
    model = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, len(classes)))
    optimiser = torch.optim.SGD(model.parameters(), lr=2.0)
    # decode is a module-level function (bound to the class list with a partial), so it pickles
    # and can run in worker processes; it is called as decode(key, raw).
    with Loader(source, decode=functools.partial(decode, classes), decode_with_key=True,
                batch_size=8, shuffle=True, executor=executor, workers=2) as loader:  # fmt: skip
        print(loader)
        for epoch in range(epochs):
            correct = total = 0
            for images, labels in loader:
                if check:
                    means = images.mean(dim=(2, 3)) * 255
                    expected = torch.tensor([COLOURS[classes[i]] for i in labels.tolist()])
                    if (means - expected).abs().max() > 25:
                        print("a label does not match its image", file=sys.stderr)
                        return 1
                logits = model(images)
                loss = nn.functional.cross_entropy(logits, labels)
                optimiser.zero_grad()
                loss.backward()
                optimiser.step()
                correct += int((logits.argmax(1) == labels).sum())
                total += len(labels)
            print(f"epoch {epoch}: {total} images, accuracy {correct / total:.2f}")
    print(f"labels from paths: {len(classes)} classes {classes}, every label matched its image")
    return 0


if __name__ == "__main__":
    sys.exit(main())
