"""Refuse a pool whose workers would run the user's script again.

Workers started by "forkserver" or "spawn" are fresh interpreters: to find the functions the script
defines, multiprocessing runs the script again in them as `__mp_main__`. Top-level code outside
`if __name__ == "__main__":` then runs once more in every worker: it opens its files and connections
again, and a loader it creates there would start a pool of its own. Rather than let that happen, the
pool refuses to start from such code and says how to fix the script (`check_main_guard`).

Only the script's top-level code is looked at: a pool made from a thread, an interactive session or
`python -c` has no script frame on its stack and is let through, as is one whose script cannot be
read back; a guarded script is let through, and its workers still find what it defines.
"""

from __future__ import annotations

import ast
import os
import sys
import tokenize
from types import FrameType

from ..._util.deps import caller_frame

__all__ = ["check_main_guard", "guarded", "unguarded_call"]

_FRESH = ("forkserver", "spawn")  # start methods whose workers run the main script again


def check_main_guard(method: str, no_fork: str | None) -> None:
    """Raise if workers started with `method` would run the script's unguarded top-level code again.

    Args:
        method: the start method resolved ("forkserver" and "spawn" are checked; others pass).
        no_fork: why the pool could not fork (the zygote's refusal, e.g. "this process runs 3
            threads"); None where `method` was given.

    Raises:
        RuntimeError: this call comes from the script's top-level code outside
            `if __name__ == "__main__":`; the message names the script, the line and the fix.
    """
    if method not in _FRESH:
        return
    where = unguarded_call()
    if where is None:
        return
    path, line = where
    why = "as given" if no_fork is None else f"chosen because {no_fork}"
    fix = 'put that code under `if __name__ == "__main__":`'
    if no_fork is not None and "thread" in no_fork:  # threads are the one cause the user can end
        fix += (
            ", or end the threads still running (a loader left open keeps some) before this "
            'pool is made, so that it can fork (start_method="zygote")'
        )
    raise RuntimeError(
        f"{path}, line {line}: this process pool's workers (start_method={method!r}, {why}) "
        "would run the script's top-level code again: multiprocessing imports the main script "
        f"in each new interpreter, and this code is not under the main guard. To fix it, {fix}"
    )


def unguarded_call() -> tuple[str, int] | None:
    """(script path, line) when this call comes from the main script's top-level code outside
    `if __name__ == "__main__":`; None where there is no script, it is not on this thread's
    stack, or its source cannot be read back as the one running."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or not isinstance(path, str):
        return None  # interactive, `python -c`
    spec = getattr(main, "__spec__", None)
    if getattr(spec, "name", "").rpartition(".")[2] == "__main__":
        return None  # `python -m package`: multiprocessing does not run a package's __main__ again
    frame = _script_frame(vars(main))
    if frame is None or not _same_file(frame.f_code.co_filename, path):
        return None
    line = frame.f_lineno
    try:
        with tokenize.open(path) as file:  # honours the script's encoding declaration
            source = file.read()
        is_guarded = guarded(source, line)
    except (OSError, SyntaxError, ValueError):
        return None  # the file changed or went away since it started: nothing to judge by
    return None if is_guarded else (path, line)


def guarded(source: str, line: int) -> bool:
    """Whether `line` of the module `source` runs only in the main process: it lies in the body
    of a top-level `if __name__ == "__main__":` (either operand order, or that comparison joined
    by `and`). A line in any other top-level statement, that If's `else` included, is not.

    Raises:
        SyntaxError: `source` does not parse.
    """
    for statement in ast.parse(source).body:
        end = statement.end_lineno or statement.lineno
        if statement.lineno <= line <= end:
            if not isinstance(statement, ast.If) or not _is_main_test(statement.test):
                return False
            return any(s.lineno <= line <= (s.end_lineno or s.lineno) for s in statement.body)
    return False  # between statements (a comment): not code that runs


def _is_main_test(test: ast.expr) -> bool:
    """`__name__ == "__main__"`, `"__main__" == __name__`, or one of them joined by `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_is_main_test(value) for value in test.values)
    if not isinstance(test, ast.Compare) or len(test.ops) != 1:
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    operands = [test.left, test.comparators[0]]
    names = [o for o in operands if isinstance(o, ast.Name) and o.id == "__name__"]
    mains = [o for o in operands if isinstance(o, ast.Constant) and o.value == "__main__"]
    return len(names) == 1 and len(mains) == 1


def _script_frame(main_globals: dict[str, object]) -> FrameType | None:
    """The frame on this thread's stack running the main module's top-level code, if any."""
    frame = caller_frame(1)
    while frame is not None:
        if frame.f_globals is main_globals and frame.f_code.co_name == "<module>":
            return frame
        frame = frame.f_back
    return None


def _same_file(a: str, b: str) -> bool:
    """Whether both paths name one file (False where either is gone: the frame is not the script)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
