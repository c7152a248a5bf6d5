"""`python -m aioloader profile`, `loader.iter(progress=True)` and the stats sampler and plot."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.profile_factory import make

from aioloader import Loader
from aioloader._observe.profile import SAMPLE_INTERVAL_S, Sampler, draw, figure, plot, series
from aioloader._observe.progress import live_line

TESTS = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path = TESTS) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioloader", *args], cwd=cwd, capture_output=True, text=True,
        timeout=90, check=False,
    )  # fmt: skip


def test_profile_prints_the_table_and_the_verdict_and_saves_a_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    png, trace = tmp_path / "p.png", tmp_path / "t.json"
    done = cli("profile", "support.profile_factory:make", "--batches", "15", "--interval", "0.05",
               "--png", str(png), "--trace", str(trace))  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("15 batches")  # 10 a epoch: the second epoch gave the last 5
    assert "stage" in out
    assert "fetch" in out
    assert "consumer:" in out
    assert "Fetch is the bottleneck" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert trace.exists()
    assert "batch/s" in done.stderr  # tqdm's bar


def test_profile_takes_a_file_path_and_says_when_matplotlib_is_missing(tmp_path: Path) -> None:
    stub = tmp_path / "stub"
    (stub / "matplotlib").mkdir(parents=True)
    (stub / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    done = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(stub)!r}); "
         "from aioloader.__main__ import main; sys.exit(main())",
         "profile", str(TESTS / "support" / "profile_factory.py") + ":make", "--batches", "3",
         "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "matplotlib is not installed" in done.stdout
    assert not (tmp_path / "aioloader-profile.png").exists()


def test_profile_refuses_what_is_not_a_loader() -> None:
    done = cli("profile", "support.profile_factory:not_a_loader", "--no-png", "--no-progress")
    assert done.returncode == 2
    assert "not a Loader" in done.stdout
    assert cli("profile", "support.profile_factory").returncode != 0


def test_iter_with_progress_yields_the_same_batches(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    with make() as loader:
        plain = list(loader)
        shown = list(loader.iter(progress=True))
    assert shown == plain
    assert "10/10" in capsys.readouterr().err


def test_progress_without_tqdm_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with make() as loader, pytest.raises(ImportError, match=r"aioloader\[profile\]"):
        loader.iter(progress=True)


@pytest.mark.in_process
def test_breaking_out_of_a_progress_loop_stops_the_epoch() -> None:
    pytest.importorskip("tqdm")
    with make() as loader:
        for _ in loader.iter(progress=True):
            break
        assert not loader._epochs.live


def test_live_line_reads_the_interval_between_two_snapshots() -> None:
    with make() as loader:
        before = loader.stats()
        list(loader)
        after = loader.stats()
    line = live_line(before, after)
    assert "batches/s" in line
    assert "samples/s" in line
    assert "MB/s" in line
    assert "wait" in line


def test_sampler_series_and_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    with make() as loader:
        with Sampler(loader, interval=0.01) as sampler:
            assert sum(1 for _ in draw(loader, 12, progress=False)) == 12
        data = series(sampler.samples)
    assert len(sampler.samples) >= 2
    assert len(data["t"]) == len(data["fetch items/s"]) == len(data["held samples"])
    assert sum(data["consumer samples/s"]) > 0
    assert plot(sampler.samples, tmp_path / "p.png") == tmp_path / "p.png"


def test_the_stub_of_an_interval_that_the_end_cut_short_is_not_drawn() -> None:
    with make() as loader:
        snapshots = [loader.stats()]
        for batch in draw(loader, 6, progress=False):
            del batch
            time.sleep(0.02)
            snapshots.append(loader.stats())
        snapshots.append(loader.stats())  # at once: an interval of microseconds
    data = series(snapshots)
    # the stub's "rate" (a batch over microseconds) would dwarf every real one
    assert len(data["t"]) == len(snapshots) - 2
    assert max(data["consumer batches/s"]) < 1000


def test_draw_stops_at_an_empty_epoch() -> None:
    async def fetch(key: int) -> int:
        await asyncio.sleep(0)
        return key

    loader: Loader[Any] = Loader([], fetch, batch_size=2)
    with loader:
        assert list(draw(loader, 5, progress=False)) == []


def test_a_ten_second_run_is_drawn_with_20_points_a_series_on_its_own_panels(
    tmp_path: Path,
) -> None:
    """A 1-second run sampled 10 times as often stands for a 10-second run at the default."""
    pytest.importorskip("matplotlib")

    async def fetch(key: int) -> bytes:
        await asyncio.sleep(0.002)
        return bytes(256)

    def decode(raw: bytes) -> int:
        time.sleep(0.005)
        return len(raw)

    scale = 10
    loader = Loader(range(100_000), fetch, decode=decode, executor="thread", workers=2,
                    batch_size=4, concurrency=8)  # fmt: skip
    with loader, Sampler(loader, interval=SAMPLE_INTERVAL_S / scale) as sampler:
        end = time.monotonic() + 10.0 / scale
        for _ in draw(loader, 1_000_000, progress=False):
            if time.monotonic() >= end:
                break
    fig = figure(sampler.samples)
    panels = {line.get_label(): ax for ax in fig.axes for line in ax.get_lines()}
    points = {line.get_label(): len(line.get_xdata()) for ax in fig.axes for line in ax.get_lines()}
    wanted = {"consumer samples/s", "consumer batches/s", "data wait %", "fetch in flight",
              "fetch limit (concurrency)", "decode running", "decode queued", "decode workers"}  # fmt: skip
    assert wanted <= points.keys()
    assert min(points.values()) >= 20, points
    assert panels["consumer samples/s"] is not panels["consumer batches/s"]  # axes of their own
    assert panels["decode running"] is panels["decode queued"] is panels["decode workers"]
    assert panels["data wait %"] is not panels["consumer samples/s"]
    assert plot(sampler.samples, tmp_path / "p.png") == tmp_path / "p.png"
