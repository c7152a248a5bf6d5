"""scripts/chart.py: the README's chart, a PNG drawn from benchmark JSON lines with the stdlib only."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "chart.py"
RESULTS = ROOT / "docs" / "bench-results.jsonl"
CHART = ROOT / "docs" / "chart.png"


def chart(*args: str) -> str:
    """Run the script as `make chart` does; its stdout, once it exited 0."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of an 8-bit RGB PNG, after checking its chunks and its pixel data."""
    width, height, _ = png_pixels(data)
    return width, height


def png_pixels(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, scanlines) of an 8-bit RGB PNG, after checking its chunks."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length : at + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        chunks[kind] = body
        at += 12 + length
    assert list(chunks) == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, color_type) == (8, 2)
    pixels = zlib.decompress(chunks[b"IDAT"])
    assert len(pixels) == height * (1 + 3 * width)
    return width, height, pixels


def test_one_bar_per_claim_from_claims_and_benchmark_summaries(tmp_path: Path) -> None:
    lines = [
        json.dumps({"label": "W2 remote HTTP", "ratio": 16.7, "better": "higher"}),
        json.dumps({"label": "W1 serialization, best", "ratio": 0.39, "better": "lower"}),
        "a benchmark's table line, skipped",
        json.dumps({"workload": "parquet", "s3_ratio": 3.2, "local_ratio": 1.1}),  # a summary
    ]
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text("\n".join(lines[:2]) + "\n")
    large.write_text("\n".join(lines) + "\n")
    out = tmp_path / "chart.png"
    assert "(2 bars," in chart(str(small), "-o", str(out))
    width, two_bars = png_size(out.read_bytes())
    assert width > 200
    assert "(3 bars," in chart(str(large), "-o", str(out))
    assert png_size(out.read_bytes())[1] > two_bars  # a row more


def test_every_stored_claim_says_when_and_how_it_was_measured() -> None:
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    assert rows
    for row in rows:
        assert {"label", "ratio", "better", "peer", "date", "command"} <= row.keys(), row
        assert row["command"].startswith(
            (".venv/bin/python benchmarks/", "python3 benchmarks/", "make ")
        ), row


def test_the_committed_chart_is_what_make_chart_draws(tmp_path: Path) -> None:
    out = tmp_path / "chart.png"
    chart(str(RESULTS), "-o", str(out))
    drawn, committed = png_pixels(out.read_bytes()), png_pixels(CHART.read_bytes())
    assert drawn == committed, "run `make chart` after editing docs/bench-results.jsonl"
