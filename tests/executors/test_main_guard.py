"""A script's top-level code never runs again in a worker: a pool made from it unguarded is refused.

With threads running, the process pool cannot fork its workers and starts them in fresh interpreters
("forkserver"), which run the main script again as `__mp_main__`. The scripts here are real ones,
run in a subprocess: each appends "<pid> <__name__>" to the file `$MARKER` whenever its top-level
code runs, so a test can count where it ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from aioloader._executors.process import main_guard
from aioloader._executors.process.main_guard import check_main_guard, guarded, unguarded_call

RUN_S = 60  # bound on one script run (imports torch in the parent and in each worker)

HEAD = """\
import os
import threading

import aioloader

with open(os.environ["MARKER"], "a") as marker:
    marker.write(f"{os.getpid()} {__name__}\\n")


def fetch(key):
    return key


def decode(raw):
    return raw * 10

"""

# Top-level code that makes a process pool while a thread runs (as a loader left open would).
BODY = """\
threading.Thread(target=threading.Event().wait, daemon=True).start()
loader = aioloader.Loader(
    list(range(8)), fetch, decode=decode, batch_size=4, executor="process", workers=2,
    collate=list,
)
for batch in loader:
    print(batch)
loader.close()
"""


def run_script(tmp_path: Path, text: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Run `text` as the script `tmp_path/train.py`; (the run, the marker's lines)."""
    script = tmp_path / "train.py"
    script.write_text(text)
    marker = tmp_path / "marker.txt"
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env={**os.environ, "MARKER": str(marker)},
        capture_output=True, text=True, timeout=RUN_S, check=False,
    )  # fmt: skip
    return done, marker.read_text().splitlines() if marker.exists() else []


def test_unguarded_script_is_refused_and_runs_once(tmp_path: Path) -> None:
    done, ran = run_script(tmp_path, HEAD + BODY)
    assert done.returncode != 0
    line = (HEAD + BODY).splitlines().index("loader = aioloader.Loader(") + 1
    assert f"RuntimeError: {tmp_path / 'train.py'}, line {line}:" in done.stderr
    assert "start_method='forkserver', chosen because this process runs 2 threads" in done.stderr
    assert 'if __name__ == "__main__":' in done.stderr
    assert 'start_method="zygote"' in done.stderr
    assert len(ran) == 1  # once, in the parent alone: no worker ran it again
    assert ran[0].endswith(" __main__")


def test_guarded_script_runs_and_workers_find_its_functions(tmp_path: Path) -> None:
    guarded_body = 'if __name__ == "__main__":\n' + textwrap.indent(BODY, "    ")
    done, ran = run_script(tmp_path, HEAD + guarded_body)
    assert done.returncode == 0, done.stderr
    # Every batch, decoded by `decode` from the script: workers found it in `__main__`.
    assert done.stdout.splitlines() == ["[0, 10, 20, 30]", "[40, 50, 60, 70]"]
    # The parent ran the top level as `__main__`; the fresh interpreters ran it again as
    # `__mp_main__` (this is how they find `decode`), where the guarded loader code does not run.
    names = [entry.split()[1] for entry in ran]
    assert names[0] == "__main__"
    assert names.count("__main__") == 1
    assert names.count("__mp_main__") >= 1  # the pool did start fresh interpreters


def test_refusal_names_the_cause_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(main_guard, "unguarded_call", lambda: ("/data/train.py", 7))
    with pytest.raises(RuntimeError, match=r"/data/train\.py, line 7: .*'forkserver', chosen") as e:
        check_main_guard("forkserver", "this process runs 3 threads")
    assert 'start_method="zygote"' in str(e.value)  # threads are what kept it from forking
    with pytest.raises(RuntimeError, match=r"\(start_method='spawn', as given\)") as e:
        check_main_guard("spawn", None)
    assert "zygote" not in str(e.value)
    with pytest.raises(RuntimeError, match="CUDA") as e:
        check_main_guard("forkserver", "CUDA is initialised in this process")
    assert "zygote" not in str(e.value)
    for forked in ("fork", "zygote"):  # workers that inherit this process never run the script
        check_main_guard(forked, None)


def test_no_script_frame_on_another_thread() -> None:
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(unguarded_call()))
    thread.start()
    thread.join()
    assert found == [None]


SCRIPT = """\
import aioloader


def main():
    make_pool("called")


if __name__ == "__main__":
    main()
    if True:
        make_pool("nested")
elif True:
    make_pool("elif")
else:
    make_pool("else")
if "__main__" == __name__:
    make_pool("reversed")
if __name__ == "__main__" and not quiet:
    make_pool("and")
if __name__ != "__main__":
    make_pool("not equal")
if name == "__main__":
    make_pool("other name")
make_pool(
    "top level",
)
try:
    make_pool("in try")
finally:
    pass
# the end
"""


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("    main()", True),  # calls a function of the script from the guard
        ('        make_pool("nested")', True),
        ("def main():", False),  # the def runs in the workers too (only defines)
        ('if __name__ == "__main__":', False),  # the test is evaluated in the workers
        ("elif True:", False),  # the guard's else branch runs in the workers
        ('    make_pool("elif")', False),
        ('    make_pool("else")', False),
        ('    make_pool("reversed")', True),
        ('    make_pool("and")', True),
        ('    make_pool("not equal")', False),
        ('    make_pool("other name")', False),
        ("make_pool(", False),
        ('    "top level",', False),  # within a statement of several lines
        ('    make_pool("in try")', False),
        ("# the end", False),
    ],
)
def test_guarded_lines(text: str, expected: bool) -> None:
    line = SCRIPT.splitlines().index(text) + 1
    assert guarded(SCRIPT, line) is expected
