"""How long a benchmark's child process lives: no longer than its parent.

A benchmark killed mid-run (a test's timeout, a Ctrl-C that reaches only the parent) would leave its
object server, its delay proxy or its children running, and a forgotten process skews every timing
that follows. `exit_with_parent()`, called first thing in a child, ends it once its parent is gone.
"""

from __future__ import annotations

import os
import threading
import time

ORPHAN_POLL_S = 0.5  # how often a child looks whether its parent is still there


def exit_with_parent() -> None:
    """End this process (exit status 1) once its parent is gone. A thread that polls: the parent's
    death is another process's event, which nothing here is told of (PR_SET_PDEATHSIG would fire
    when the parent's *thread* that started this one ends, which need not be the parent's end)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
