"""Run a command beside N processes that each keep a core busy (a machine where other work runs).

Usage: python scripts/with_hogs.py N COMMAND [ARG ...]  -> the command's exit status (5, pytest's
"no tests collected", counts as success). The hogs are stopped however the command ends.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys


def _spin() -> None:
    n = 0
    while True:
        n += 1


def main() -> int:
    count, command = int(sys.argv[1]), sys.argv[2:]
    hogs = [mp.get_context("spawn").Process(target=_spin, daemon=True) for _ in range(count)]
    for hog in hogs:
        hog.start()
    try:
        code = subprocess.call(command)
    finally:
        for hog in hogs:
            hog.kill()
            hog.join()
    return 0 if code == 5 else code


if __name__ == "__main__":
    sys.exit(main())
