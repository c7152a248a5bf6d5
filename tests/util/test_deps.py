"""The private APIs of dependencies, gathered in `aioloader/_util/deps.py`: the versions installed are
those they were checked with, and each does what its callers count on."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from aioloader._util.deps import (
    CHECKED,
    arrow_take,
    c10d_default_store,
    forkserver_preloaded,
    parquet_reader,
    storage_uses,
    torch_collate,
)


def _installed() -> dict[str, str]:
    versions = {
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "torch": torch.__version__.split("+")[0],
    }
    try:
        import pyarrow
    except ImportError:
        return versions
    return {**versions, "pyarrow": pyarrow.__version__}


@pytest.mark.parametrize("name", sorted(CHECKED))
def test_the_versions_installed_are_those_the_private_apis_were_checked_with(name: str) -> None:
    version = _installed().get(name)
    if version is None:
        pytest.skip(f"{name} is not installed")
    assert version in CHECKED[name], (
        f"{name} {version} is not among the versions aioloader/_util/deps.py was checked with "
        f"({', '.join(sorted(CHECKED[name]))}): check each of its private APIs against {version}, "
        "then add it to CHECKED"
    )


def test_torch_collate_is_torchs_default_collate() -> None:
    collate, fn_map = torch_collate()
    batch = [{"x": torch.tensor([1.0]), "y": 2}, {"x": torch.tensor([3.0]), "y": 4}]
    got = collate(batch, collate_fn_map=fn_map)
    expected = torch.utils.data.default_collate(batch)
    assert torch.equal(got["x"], expected["x"])
    assert torch.equal(got["y"], expected["y"])


def test_storage_uses_counts_each_tensor_of_a_storage() -> None:
    t = torch.empty(4)
    storage = t.untyped_storage()
    before = storage_uses(storage)
    view = t[1:]
    assert storage_uses(storage) == before + 1
    del view
    assert storage_uses(storage) == before


def test_a_workers_seed_and_info_are_torchs() -> None:
    """In torch's own worker (a process of its own): the numpy seed torch drew is ours for the
    same base seed and id, and `get_worker_info()` answers what `publish_worker_info` set."""
    code = textwrap.dedent("""
        import numpy as np, torch
        from torch.utils.data import DataLoader, Dataset, get_worker_info
        from aioloader._util import deps

        class Seeds(Dataset):
            def __len__(self):
                return 2
            def __getitem__(self, i):
                info = get_worker_info()
                return info.seed - info.id, info.id, int(np.random.randint(2**31))

        for base, wid, drawn in DataLoader(Seeds(), batch_size=None, num_workers=2):
            np.random.seed(deps.worker_numpy_seed(int(base), int(wid)))
            assert int(np.random.randint(2**31)) == drawn, (base, wid)
        assert not deps.worker_info_published()
        deps.publish_worker_info(3, 4, 99, "ds")
        info = get_worker_info()
        assert (info.id, info.num_workers, info.seed, info.dataset) == (3, 4, 99, "ds")
        assert deps.worker_info_published()
        print("ok")
    """)  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


def test_forkserver_preloaded_names_modules() -> None:
    preloaded = forkserver_preloaded()
    assert preloaded
    assert all(isinstance(name, str) for name in preloaded)


def test_c10d_default_store_is_the_groups_store(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        store = c10d_default_store()
        store.set("aioloader-deps", "checked")
        assert store.get("aioloader-deps") == b"checked"
    finally:
        dist.destroy_process_group()


def test_parquet_reader_decodes_into_the_pool_given(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    table = pa.table({"a": list(range(1000))})
    pq.write_table(table, path)
    pool = pa.system_memory_pool()  # one for the process (a pool must outlive its buffers)
    assert pool.backend_name != pa.default_memory_pool().backend_name
    before = pool.bytes_allocated()
    reader = parquet_reader(pool)
    assert reader is not None
    reader.open(str(path), use_memory_map=False, pre_buffer=False)
    got = reader.read_all()
    assert got.equals(table)
    assert pool.bytes_allocated() > before  # it decoded into the pool given


def test_arrow_take_takes() -> None:
    pa = pytest.importorskip("pyarrow")
    function, options = arrow_take()
    got = function.call([pa.array([10, 20, 30]), pa.array([2, 0])], options)
    assert got.to_pylist() == [30, 10]


_FORKED_FORKSERVER = """
import multiprocessing as mp, os, sys
from aioloader._util.deps import forget_inherited_forkserver

def nothing():
    pass

if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    first = ctx.Process(target=nothing); first.start(); first.join()  # this process's fork server
    pid = os.fork()
    if pid == 0:  # a forked process that starts workers of its own by a fork server
        if sys.argv[1] == "forget":
            forget_inherited_forkserver()
        try:
            p = ctx.Process(target=nothing); p.start(); p.join()
            os._exit(p.exitcode)
        except ChildProcessError:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_process_starts_a_fork_server_of_its_own_once_it_forgets_its_parents(
    tmp_path: Path,
) -> None:
    script = tmp_path / "forked.py"
    script.write_text(_FORKED_FORKSERVER)
    codes = {
        how: subprocess.run([sys.executable, str(script), how], timeout=120, check=False).returncode
        for how in ("keep", "forget")
    }
    assert codes == {"keep": 3, "forget": 0}  # the inherited one is its parent's: ChildProcessError


def test_before_threads_joined_runs_before_the_threads_are_joined() -> None:
    """A process whose non-daemon thread waits for an event that the hook sets exits."""
    script = (
        "import threading\n"
        "from aioloader._util.deps import before_threads_joined\n"
        "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait).start()\n"
        "assert before_threads_joined(stop.set)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], timeout=60, check=False)
    assert done.returncode == 0
