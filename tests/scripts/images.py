"""Small JPEGs that carry their index, and a Pillow decode for them (importable by decode workers)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image


def jpeg(index: int) -> bytes:
    """An 8x8 JPEG; its last two bytes, after the image (Pillow ignores them), hold `index`."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), ((index * 8) % 256, 0, 0)).save(buf, "JPEG")
    return buf.getvalue() + index.to_bytes(2, "little")


def decode_jpeg(raw: bytes) -> dict[str, Any]:
    """bytes -> {"image": uint8 tensor (8, 8, 3), "index": the index the bytes carry}."""
    with Image.open(io.BytesIO(raw)) as image:
        pixels = np.asarray(image.convert("RGB"))
    return {"image": torch.from_numpy(pixels.copy()), "index": int.from_bytes(raw[-2:], "little")}
