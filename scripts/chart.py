"""Draw aioloader's headline ratios against its peers as a PNG bar chart, from JSON lines.

Usage: python scripts/chart.py [FILE ...] [-o docs/chart.png]

Each FILE holds JSON lines (other lines are skipped, so a benchmark's whole output can be given).
A line is either a claim as `docs/bench-results.jsonl` writes it:

    {"label": "W2 remote HTTP", "ratio": 16.7, "better": "higher", "peer": "torch DataLoader(8)",
     "date": "2026-11-24", "command": ".venv/bin/python benchmarks/remote.py"}

("ratio" may be [low, high], a range over several runs; "better": "lower" for a time ratio such as
s/batch), or the JSON summary a benchmark prints as its last line (`make bench`), from which the
ratios against torch's DataLoader are taken. A label given again replaces the earlier bar. Every bar
is aioloader's throughput as a multiple of the peer's in the same run: a time ratio r is drawn as
1 / r. With no FILE, docs/bench-results.jsonl is read.

Standard library only: the PNG is written with zlib and struct, its text in a small built-in font.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = ROOT / "docs" / "bench-results.jsonl"
DEFAULT_OUTPUT = ROOT / "docs" / "chart.png"

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
TEXT: Color = (30, 30, 30)
GRID: Color = (225, 225, 225)
BAR: Color = (31, 119, 180)
RANGE: Color = (158, 202, 225)
PARITY: Color = (200, 60, 60)

# A 5-pixel-wide font: rows top to bottom, "#" set. Capitals and digits take rows 0-6; a letter that
# descends takes rows 7-8 too.
GLYPHS: dict[str, str] = {
    " ": "...../...../...../...../...../...../.....",
    "0": ".###./#...#/#..##/#.#.#/##..#/#...#/.###.",
    "1": "..#../.##../..#../..#../..#../..#../.###.",
    "2": ".###./#...#/....#/...#./..#../.#.../#####",
    "3": "#####/...#./..#../...#./....#/#...#/.###.",
    "4": "...#./..##./.#.#./#..#./#####/...#./...#.",
    "5": "#####/#..../####./....#/....#/#...#/.###.",
    "6": "..##./.#.../#..../####./#...#/#...#/.###.",
    "7": "#####/....#/...#./..#../.#.../.#.../.#...",
    "8": ".###./#...#/#...#/.###./#...#/#...#/.###.",
    "9": ".###./#...#/#...#/.####/....#/...#./.##..",
    "A": ".###./#...#/#...#/#####/#...#/#...#/#...#",
    "B": "####./#...#/#...#/####./#...#/#...#/####.",
    "C": ".###./#...#/#..../#..../#..../#...#/.###.",
    "D": "####./#...#/#...#/#...#/#...#/#...#/####.",
    "E": "#####/#..../#..../####./#..../#..../#####",
    "F": "#####/#..../#..../####./#..../#..../#....",
    "G": ".###./#...#/#..../#.###/#...#/#...#/.####",
    "H": "#...#/#...#/#...#/#####/#...#/#...#/#...#",
    "I": ".###./..#../..#../..#../..#../..#../.###.",
    "J": "..###/...#./...#./...#./...#./#..#./.##..",
    "K": "#...#/#..#./#.#../##.../#.#../#..#./#...#",
    "L": "#..../#..../#..../#..../#..../#..../#####",
    "M": "#...#/##.##/#.#.#/#.#.#/#...#/#...#/#...#",
    "N": "#...#/#...#/##..#/#.#.#/#..##/#...#/#...#",
    "O": ".###./#...#/#...#/#...#/#...#/#...#/.###.",
    "P": "####./#...#/#...#/####./#..../#..../#....",
    "Q": ".###./#...#/#...#/#...#/#.#.#/#..#./.##.#",
    "R": "####./#...#/#...#/####./#.#../#..#./#...#",
    "S": ".####/#..../#..../.###./....#/....#/####.",
    "T": "#####/..#../..#../..#../..#../..#../..#..",
    "U": "#...#/#...#/#...#/#...#/#...#/#...#/.###.",
    "V": "#...#/#...#/#...#/#...#/#...#/.#.#./..#..",
    "W": "#...#/#...#/#...#/#.#.#/#.#.#/#.#.#/.#.#.",
    "X": "#...#/#...#/.#.#./..#../.#.#./#...#/#...#",
    "Y": "#...#/#...#/.#.#./..#../..#../..#../..#..",
    "Z": "#####/....#/...#./..#../.#.../#..../#####",
    "a": "...../...../.###./....#/.####/#...#/.####",
    "b": "#..../#..../####./#...#/#...#/#...#/####.",
    "c": "...../...../.###./#..../#..../#...#/.###.",
    "d": "....#/....#/.####/#...#/#...#/#...#/.####",
    "e": "...../...../.###./#...#/#####/#..../.###.",
    "f": "..##./.#..#/.#.../###../.#.../.#.../.#...",
    "g": "...../...../.####/#...#/#...#/#...#/.####/....#/.###.",
    "h": "#..../#..../#.##./##..#/#...#/#...#/#...#",
    "i": "..#../...../.##../..#../..#../..#../.###.",
    "j": "...#./...../..##./...#./...#./...#./...#./#..#./.##..",
    "k": "#..../#..../#..#./#.#../##.../#.#../#..#.",
    "l": ".##../..#../..#../..#../..#../..#../.###.",
    "m": "...../...../##.#./#.#.#/#.#.#/#.#.#/#.#.#",
    "n": "...../...../#.##./##..#/#...#/#...#/#...#",
    "o": "...../...../.###./#...#/#...#/#...#/.###.",
    "p": "...../...../####./#...#/#...#/#...#/####./#..../#....",
    "q": "...../...../.####/#...#/#...#/#...#/.####/....#/....#",
    "r": "...../...../#.##./##..#/#..../#..../#....",
    "s": "...../...../.###./#..../.###./....#/####.",
    "t": ".#.../.#.../###../.#.../.#.../.#..#/..##.",
    "u": "...../...../#...#/#...#/#...#/#..##/.##.#",
    "v": "...../...../#...#/#...#/#...#/.#.#./..#..",
    "w": "...../...../#...#/#...#/#.#.#/#.#.#/.#.#.",
    "x": "...../...../#...#/.#.#./..#../.#.#./#...#",
    "y": "...../...../#...#/#...#/#...#/#...#/.####/....#/.###.",
    "z": "...../...../#####/...#./..#../.#.../#####",
    ".": "...../...../...../...../...../.##../.##..",
    ",": "...../...../...../...../...../.##../..#../.#...",
    ":": "...../.##../.##../...../.##../.##../.....",
    "-": "...../...../...../.###./...../...../.....",
    "+": "...../..#../..#../#####/..#../..#../.....",
    "=": "...../...../#####/...../#####/...../.....",
    "/": "....#/....#/...#./..#../.#.../#..../#....",
    "(": "...#./..#../.#.../.#.../.#.../..#../...#.",
    ")": ".#.../..#../...#./...#./...#./..#../.#...",
    "%": "##..#/##..#/...#./..#../.#.../#..##/#..##",
    "<": "...#./..#../.#.../#..../.#.../..#../...#.",
    ">": ".#.../..#../...#./....#/...#./..#../.#...",
    "_": "...../...../...../...../...../...../#####",
    "'": "..#../..#../.#.../...../...../...../.....",
    "!": "..#../..#../..#../..#../..#../...../..#..",
    "?": ".###./#...#/....#/...#./..#../...../..#..",
    "\u00d7": "...../#...#/.#.#./..#../.#.#./#...#/.....",  # a multiplication sign
}
GLYPHS["\u2013"] = GLYPHS["-"]  # an en dash
SCALE = 2  # screen pixels per font pixel
ADVANCE = 6 * SCALE  # a glyph and the column after it
LINE = 11 * SCALE  # rows 0-8 and two rows of leading


@dataclass(frozen=True)
class Bar:
    """One claim: aioloader's throughput as a multiple of the peer's (low and high end of a range)."""

    label: str
    low: float
    high: float
    note: str  # the figure as measured, when it is not already the multiple (a time ratio)


def bars_from_lines(lines: Iterable[str]) -> Iterator[Bar]:
    """The bars of the JSON lines among `lines`: claims as written, or benchmark summaries."""
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            yield from bars_from_row(row)


def bars_from_row(row: dict[str, Any]) -> Iterator[Bar]:
    """A claim's bar, or the bars of a benchmark's summary line (none for a summary not known)."""
    if "label" in row and "ratio" in row:
        yield claim_bar(row["label"], row["ratio"], row.get("better", "higher"))
        return
    for label, ratio, better in summary_ratios(row):
        yield claim_bar(label, ratio, better)


def summary_ratios(row: dict[str, Any]) -> Iterator[tuple[str, Any, str]]:
    """(label, ratio, better) for each ratio against torch's DataLoader in a benchmark's summary."""
    workload = row.get("workload")
    simple = {
        "remote": ("W2 remote HTTP", "ratio"),
        "cloud_gcs": ("W7 GCS", "ratio"),
        "cloud_azure": ("W7 Azure", "ratio"),
        "parquet": ("W8 Parquet from S3", "s3_ratio"),
        "cache": ("cache: cached epoch", "ratio_vs_torch"),
    }
    if workload in simple:
        label, key = simple[workload]
        if row.get(key) is not None:
            yield label, row[key], "higher"
    elif workload == "serialization_tax":
        yield "W1 serialization, best", row["ratio_vs_torch"], "lower"
        if "process_ratio_vs_torch" in row:
            yield "W1 serialization, processes", row["process_ratio_vs_torch"], "lower"
    elif workload is None and "throughput_ratio" in row and "memory_ratio" in row:
        yield "W3 decode, processes", row["throughput_ratio"], "higher"  # benchmarks/decode.py
    elif workload is None and "date" in row:  # benchmarks/dropin.py: one entry per user code
        a, b, c = (row.get(code) or {} for code in "abc")
        if "2" in a.get("ratio_per_workers", {}):
            yield "drop-in (a) map-style, N=2", a["ratio_per_workers"]["2"], "lower"
        if "best_vs_best" in b:
            yield "drop-in (b) IterableDataset, best", b["best_vs_best"], "lower"
        if "throughput_ratio_n2" in c:
            yield "drop-in (c) JPEG folder, N=2", c["throughput_ratio_n2"], "higher"


def claim_bar(label: str, ratio: Any, better: str) -> Bar:
    """A ratio (or [low, high]) as the multiple a bar shows; a time ratio r is the multiple 1 / r."""
    values = [float(v) for v in (ratio if isinstance(ratio, list) else [ratio])]
    if not values or min(values) <= 0 or better not in ("higher", "lower"):
        raise ValueError(f"{label}: ratio {ratio!r} (better {better!r}) is not a positive ratio")
    if better == "higher":
        return Bar(label, min(values), max(values), "")
    shown = "-".join(f"{v:.2f}" if round(v, 2) == v else f"{v:g}" for v in sorted(values))
    return Bar(label, 1 / max(values), 1 / min(values), f"time ratio {shown}")


def read_bars(paths: Iterable[Path]) -> list[Bar]:
    """The bars of every file, in order; a label given again replaces the earlier bar in its place."""
    bars: dict[str, Bar] = {}
    for path in paths:
        for bar in bars_from_lines(path.read_text().splitlines()):
            bars[bar.label] = bar
    return list(bars.values())


class Canvas:
    """An RGB image held as rows of bytes, with the few drawing operations the chart needs."""

    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(bytes(WHITE) * width) for _ in range(height)]

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        x0, x1 = max(0, x0), min(self.width, x1)
        if x1 <= x0:
            return
        run = bytes(color) * (x1 - x0)
        for y in range(max(0, y0), min(self.height, y1)):
            self.rows[y][x0 * 3 : x1 * 3] = run

    def text(self, x: int, y: int, text: str, color: Color = TEXT) -> None:
        for i, char in enumerate(text):
            glyph = GLYPHS.get(char, GLYPHS["?"])
            for gy, row in enumerate(glyph.split("/")):
                for gx, pixel in enumerate(row):
                    if pixel == "#":
                        left, top = x + i * ADVANCE + gx * SCALE, y + gy * SCALE
                        self.rect(left, top, left + SCALE, top + SCALE, color)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)  # filter 0 on every scanline
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"\x89PNG\r\n\x1a\n" + b"".join(
            chunk(kind, data)
            for kind, data in ((b"IHDR", header), (b"IDAT", zlib.compress(raw, 9)), (b"IEND", b""))
        )


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def text_width(text: str) -> int:
    return len(text) * ADVANCE


def tick_step(top: float) -> int:
    """A round step that puts at most about eight ticks between 0 and `top`."""
    return next(s for s in (1, 2, 5, 10, 20, 50, 100, 200, 500) if top / s <= 8)


def value_text(bar: Bar) -> str:
    shown = f"{bar.low:.3g}x" if bar.low == bar.high else f"{bar.low:.3g}-{bar.high:.3g}x"
    return f"{shown} ({bar.note})" if bar.note else shown


TITLE = "aioloader's throughput as a multiple of the peer's, same run (higher is better)"
FOOTER = "red line: 1x, level with the peer. light end of a bar: the top of a range of runs"
MARGIN, ROW, BAR_HEIGHT, MIN_PLOT_WIDTH = 16, 30, 18, 480


def draw(bars: list[Bar]) -> bytes:
    """The PNG of one horizontal bar per claim, with a line at 1x (level with the peer)."""
    if not bars:
        raise ValueError("no ratios to draw")
    label_width = max(text_width(b.label) for b in bars)
    top = max(b.high for b in bars) * 1.05
    step = tick_step(top)
    plot_x = MARGIN + label_width + MARGIN

    def room(bar: Bar) -> int:  # what a bar's value text needs to the right of the bar's end
        return 8 + text_width(value_text(bar)) + MARGIN

    width = max(text_width(TITLE), text_width(FOOTER)) + 2 * MARGIN
    width = max([width] + [plot_x + round(b.high / top * MIN_PLOT_WIDTH) + room(b) for b in bars])
    plot_width = min(int((width - room(b) - plot_x) * top / b.high) for b in bars)
    plot_y = MARGIN + LINE + 8
    height = plot_y + ROW * len(bars) + 6 + 2 * LINE + MARGIN
    canvas = Canvas(width, height)

    def x_of(value: float) -> int:
        return plot_x + round(value / top * plot_width)

    canvas.text(MARGIN, MARGIN, TITLE)
    bottom = plot_y + ROW * len(bars)
    for tick in range(0, int(top) + 1, step):
        canvas.rect(x_of(tick), plot_y, x_of(tick) + 1, bottom, GRID)
        label = f"{tick}x"
        canvas.text(x_of(tick) - text_width(label) // 2, bottom + 6, label)
    for i, bar in enumerate(bars):
        y = plot_y + i * ROW + (ROW - BAR_HEIGHT) // 2
        canvas.text(MARGIN + label_width - text_width(bar.label), y, bar.label)
        canvas.rect(plot_x, y, x_of(bar.high), y + BAR_HEIGHT, RANGE)
        canvas.rect(plot_x, y, x_of(bar.low), y + BAR_HEIGHT, BAR)
        canvas.text(x_of(bar.high) + 8, y, value_text(bar))
    canvas.rect(x_of(1), plot_y - 4, x_of(1) + 2, bottom, PARITY)
    canvas.rect(plot_x, bottom, plot_x + plot_width, bottom + 1, TEXT)
    canvas.text(MARGIN, bottom + 6 + LINE, FOOTER)
    return canvas.png()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Draw the benchmark ratios as a PNG bar chart.")
    parser.add_argument("files", nargs="*", type=Path, help=f"JSON lines (default {DEFAULT_INPUT})")
    parser.add_argument(
        "-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="the PNG to write"
    )
    args = parser.parse_args(argv)
    bars = read_bars(args.files or [DEFAULT_INPUT])
    if not bars:
        print("no ratios found in the files given", file=sys.stderr)
        return 1
    png = draw(bars)
    args.output.write_bytes(png)
    width, height = struct.unpack(">II", png[16:24])
    print(f"wrote {args.output} ({len(bars)} bars, {width}x{height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
