"""The C heap keeps what a thread executor's results free (`_util/heap.py`), in a fresh process each:
the thresholds it raises are the whole process's, once."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import sysconfig
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or sys.platform != "linux", reason="glibc's heap on Linux"
)

# A thread (a crew's, long-lived) allocates 32 results of 100 KB and writes them; the main thread
# frees them; ten times. Prints the page faults of each round in that thread.
ROUNDS = textwrap.dedent(
    """
    import ctypes, json, queue, sys, threading
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    if sys.argv[1] == "executor":
        from aioloader._executors.base import ThreadExecutor
        ThreadExecutor(2).close()

    def faults():
        return int(open("/proc/thread-self/stat").read().rsplit(")", 1)[1].split()[7])

    asks, made = queue.Queue(), queue.Queue()

    def serve():
        while asks.get():
            before = faults()
            blocks = []
            for _ in range(32):
                block = libc.malloc(100_000)
                libc.memset(block, 1, 100_000)
                blocks.append(block)
            made.put((blocks, faults() - before))

    thread = threading.Thread(target=serve)
    thread.start()
    counts = []
    for _ in range(10):
        asks.put(True)
        blocks, count = made.get()
        for block in blocks:
            libc.free(block)
        counts.append(count)
    asks.put(False)
    thread.join()
    print(json.dumps(counts))
    """
)


def _faults(mode: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", ROUNDS, mode], capture_output=True, text=True, check=True, timeout=60
    )
    counts: list[int] = json.loads(out.stdout.strip().splitlines()[-1])
    return counts


def test_a_thread_executor_has_the_heap_keep_what_its_results_free() -> None:
    pages = 32 * 100_000 // 4096  # a round's results, in pages
    plain, kept = _faults("plain"), _faults("executor")
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        # glibc's defaults hand the freed results back: every later round faults them in again.
        # (The GIL build's plain run here keeps them already: something in its start-up has raised
        # the thresholds before any test code runs. Only the kept run is checked there.)
        assert sum(plain[2:]) > 0.5 * pages * len(plain[2:]), plain
    # kept: after the first round (the arena grows once) the results reuse the same pages
    assert sum(kept[2:]) < 0.05 * pages * len(kept[2:]), kept


def test_keeping_freed_blocks_is_done_once_and_reported() -> None:
    code = (
        "from aioloader._util import heap; a = heap.kept(); b = heap.keep_freed_blocks(); "
        "c = heap.keep_freed_blocks(); print(a, b, c, heap.kept())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["False", "True", "True", "True"]
