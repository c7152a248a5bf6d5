"""Where users run it: a container's 64 MB /dev/shm and its memory limit (a real mount namespace and
a real memory cgroup, made by the test; skipped, saying why, where that cannot be done)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import pytest
import torch

from aioloader import Loader
from aioloader._tuning.memory import DEFAULT_CAP, MemoryBudget, Room, default_budget, memory_room

# the seed workload as a torch user writes it (1.2 MB samples, batch 128: 153 MB batches), run by
# the containers benchmark's own runner: `--run aioloader WORKERS BATCHES`
SEED = Path(__file__).resolve().parents[2] / "benchmarks" / "containers.py"


def _run_seed(
    prefix: list[str], workers: int, batches: int, cgroup: Path | None = None
) -> dict[str, object]:
    done = subprocess.run(
        [*prefix, sys.executable, str(SEED), "--run", "aioloader", str(workers), str(batches)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:] + _memory_of(cgroup)
    out: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return out


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
        capture_output=True, text=True,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"cannot make a private mount namespace here (root needed): {probe.stderr.strip()}"
    return None


def test_the_seed_workload_runs_with_dockers_64_mb_dev_shm() -> None:
    # 153 MB batches in 2 workers, where /dev/shm is a 64 MB tmpfs (Docker's and a pod's default):
    # torch's DataLoader fails there ("No space left on device"); every batch arrives here
    why = _can_unshare()
    if why:
        pytest.skip(why)
    mount = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$@"'
    got = _run_seed(["unshare", "-m", "sh", "-c", mount, "sh"], workers=2, batches=6)
    assert got["batches"] == 6


def _memory_cgroup() -> Path | None:
    """A folder where this process may make a v1 or v2 memory cgroup, or None."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (base / "memory.limit_in_bytes").exists() and os.access(base, os.W_OK):
                return base
        if hierarchy == "0" and controllers == "":
            root = Path("/sys/fs/cgroup")
            base = root / path.lstrip("/")
            writable = (root / "cgroup.controllers").exists() and os.access(base, os.W_OK)
            if writable and "memory" in (base / "cgroup.subtree_control").read_text().split():
                return base
    return None


@pytest.fixture
def cgroup_of(request: pytest.FixtureRequest) -> object:
    """Make a memory cgroup with a limit; yields a function that runs a command in it."""
    base = _memory_cgroup()
    if base is None:
        pytest.skip("no memory cgroup this process may make one under (root, cgroup v1 or v2)")
    made: list[Path] = []

    def make(limit: int) -> tuple[list[str], Path]:
        folder = base / f"aioloader-test-{uuid.uuid4().hex[:8]}"
        folder.mkdir()
        made.append(folder)
        v1 = (folder / "memory.limit_in_bytes").exists()
        (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(str(limit))
        swap = folder / ("memory.memsw.limit_in_bytes" if v1 else "memory.swap.max")
        if swap.exists():  # no swapping out of the limit either (where swap is accounted)
            with contextlib.suppress(OSError):
                swap.write_text(str(limit) if v1 else "0")
        enter = f'echo $$ > {folder}/cgroup.procs && exec "$@"'
        return ["sh", "-c", enter, "sh"], folder

    yield make
    for folder in made:
        for _ in range(50):
            try:
                folder.rmdir()
                break
            except OSError:  # its last process is still exiting
                time.sleep(0.1)


def _memory_of(cgroup: Path | None) -> str:
    """What a cgroup's memory went to (its peak, and the shared memory / anonymous split), for the
    message of a run that failed in it (an OOM kill: which memory the limit ran out on)."""
    if cgroup is None:
        return ""
    lines = []
    for name in ("memory.max_usage_in_bytes", "memory.peak"):
        if (cgroup / name).exists():
            lines.append(f"{name} {(cgroup / name).read_text().strip()}")
    if (cgroup / "memory.stat").exists():
        keep = ("shmem", "anon", "rss", "total_shmem", "total_rss", "file")
        stat = (cgroup / "memory.stat").read_text().splitlines()
        lines += [line for line in stat if line.split(" ")[0] in keep]
    return "\n" + "\n".join(lines)


def _oom_kills(folder: Path) -> int:
    for name in ("memory.oom_control", "memory.events"):
        path = folder / name
        if path.exists():
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    return 0


@pytest.mark.xfail(
    bool(sysconfig.get_config_var("Py_GIL_DISABLED")) and torch.version.cuda is not None,
    reason="a free-threaded venv whose torch is the CUDA build (PyPI's only cp314t/cp313t torch): "
    "its interpreter is ~800 MB resident before a batch is made (~250 MB on the GIL venv), and the "
    "8-worker run was OOM-killed in 1.5 GiB in one of two runs on 3.14.7t",
    strict=False,
)
def test_eight_workers_of_153_mb_batches_fit_a_1_5_gib_container(cgroup_of: object) -> None:
    # the default budget follows the cgroup's limit: whole batches in flight, and the worker slabs
    # they are made in, are admitted against it; none is made in a worker's own memory meanwhile
    enter, folder = cgroup_of(3 << 29)  # type: ignore[operator]
    got = _run_seed(enter, workers=8, batches=12, cgroup=folder)
    assert got["batches"] == 12
    assert _oom_kills(folder) == 0, got  # with how many batches were pickled in worker memory
    assert "cgroup" in str(got["budget_origin"])
    assert int(got["budget"]) < 3 << 29  # type: ignore[call-overload]


# -- the default budget, read from a cgroup tree written here -----------------------------------------


def _tree(tmp_path: Path, v1: bool, limit: str, usage: int, cache: int) -> tuple[str, str]:
    root = tmp_path / "cgroup"
    if v1:
        leaf = root / "memory" / "docker" / "abc"
        leaf.mkdir(parents=True)
        (leaf / "memory.limit_in_bytes").write_text(limit)
        (leaf / "memory.usage_in_bytes").write_text(str(usage))
        (leaf / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {cache}\n")
        (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
        proc = "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n"
    else:
        leaf = root / "user.slice" / "job"
        leaf.mkdir(parents=True)
        (root / "cgroup.controllers").write_text("memory cpu\n")
        (leaf / "memory.max").write_text(limit)
        (leaf / "memory.current").write_text(str(usage))
        (leaf / "memory.stat").write_text(f"anon 1\ninactive_file {cache}\n")
        (root / "user.slice" / "memory.max").write_text("max")
        proc = "0::/user.slice/job\n"
    (tmp_path / "self-cgroup").write_text(proc)
    return str(tmp_path / "self-cgroup"), str(root)


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
def test_the_default_budget_is_half_of_what_the_cgroup_leaves_free(
    tmp_path: Path, v1: bool
) -> None:
    proc, root = _tree(tmp_path, v1, str(1 << 30), usage=300 << 20, cache=100 << 20)
    room = memory_room(proc, root)
    assert (room.limit, room.used) == (1 << 30, 200 << 20)  # page cache it may reclaim is free
    assert f"cgroup v{1 if v1 else 2}" in room.origin
    budget, origin = default_budget(room)
    assert budget == (1024 - 200) // 2 << 20
    assert "1024 MiB" in origin


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
def test_no_limit_or_one_above_ram_leaves_the_ram_default(tmp_path: Path, v1: bool) -> None:
    proc, root = _tree(tmp_path, v1, "max" if not v1 else "9223372036854771712", 1, 0)
    assert memory_room(proc, root).origin == "RAM"
    proc, root = _tree(tmp_path / "b", v1, str(1 << 50), 1, 0)
    room = memory_room(proc, root)
    assert room.origin == "RAM"
    assert default_budget(room)[0] == min(DEFAULT_CAP, room.limit // 4)


def test_a_tighter_limit_above_the_process_cgroup_counts(tmp_path: Path) -> None:
    proc, root = _tree(tmp_path, True, str(4 << 30), usage=0, cache=0)
    (Path(root) / "memory" / "docker" / "memory.limit_in_bytes").write_text(str(1 << 30))
    assert memory_room(proc, root).limit == 1 << 30


def test_a_cgroup_path_not_visible_under_the_mount_reads_its_root(tmp_path: Path) -> None:
    # inside a container, /proc/self/cgroup names the host's path; the mount is the container's own
    proc, root = _tree(tmp_path, False, str(1 << 30), 0, 0)
    (tmp_path / "self-cgroup").write_text("0::/elsewhere/on/the/host\n")
    (Path(root) / "memory.max").write_text(str(512 << 20))
    assert memory_room(proc, root).limit == 512 << 20


def test_stats_and_diagnose_say_the_budget_and_where_it_came_from() -> None:
    with Loader(range(8), abs, batch_size=4) as loader:
        list(loader)
        stats = loader.stats()
        assert stats.budget_origin == MemoryBudget.of("auto").origin
        assert stats.budget_origin in stats.table()
        assert "max_bytes_in_flight" in str(loader.diagnose())
    with Loader(range(8), abs, batch_size=4, max_bytes_in_flight=1 << 20) as loader:
        list(loader)
        assert loader.stats().budget_origin == "given"
    with pytest.raises(ValueError, match="max_bytes_in_flight must be an int, None or 'auto'"):
        Loader(range(8), abs, max_bytes_in_flight="lots")


def test_a_full_room_still_leaves_a_budget() -> None:
    assert default_budget(Room(1 << 30, 2 << 30, "cgroup v2 x"))[0] == 1 << 20
