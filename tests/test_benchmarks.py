"""The benchmarks run: each is a script, so nothing else would notice one that stopped working."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_stats_overhead_runs_both_workloads_and_ends_with_its_json() -> None:
    # Quick and small: it starts the benchmarks' object server, as remote.py and autotune.py do.
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "stats_overhead.py"), "--quick", "--repeats", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["workload"] == "stats_overhead"
    for workload in ("small", "w2"):
        assert summary[workload]["on_items_per_s"] > 0
        assert summary[workload]["off_items_per_s"] > 0
