"""Real torchrun jobs for the distributed tests: `torchrun(script, ranks, *args, written=...)`."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def torchrun(
    script: str, ranks: int, *args: object, written: list[Path], timeout: float = 300
) -> None:
    """Run tests/scripts/`script` on `ranks` local processes (gloo, one thread each) with `args`.

    Its ranks write their records (`written`) after their last barrier, so the loader's work is
    done by then: a rank that aborts afterwards, inside torch's own gloo teardown (seen in CI:
    "terminate called without an active exception", no Python frame), is not the loader's failure
    (a warning says so); anything earlier fails the test, with torchrun's stderr.
    """
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", str(SCRIPTS / script)]
    done = subprocess.run(
        [*cmd, *map(str, args)], env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=timeout,
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        torn_down = all(p.exists() for p in written) and "exitcode: -6" in done.stderr
        assert torn_down, done.stderr[:3000] + "\n...\n" + done.stderr[-3000:]
        warnings.warn(
            f"torchrun's teardown aborted after every rank finished: {done.stderr[:200]}",
            stacklevel=2,
        )
