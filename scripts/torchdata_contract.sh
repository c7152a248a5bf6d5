#!/usr/bin/env bash
# torchdata's StatefulDataLoader tests (pytorch/data at TORCHDATA_COMMIT: test_state_dict.py,
# test_sampler.py, test_hugging_face.py) run against aioloader.StatefulDataLoader, in the venv
# .venv-sdl (`make test-torchdata` makes it: torch, torchdata 0.11.0 and what the tests import,
# pinned in pyproject's torchdata-contract extra). The tests are torchdata's, unchanged; the
# class is swapped by the plugin torchdata_contract/swap.py, and the tests that only read
# torchdata's private state keys are deselected (torchdata_contract/private.txt says why).
#
#   scripts/torchdata_contract.sh                  # clones pytorch/data (needs github.com)
#   TORCHDATA_SRC=/path/to/pytorch-data scripts/torchdata_contract.sh   # a checkout you have
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${SDL_PYTHON:-$ROOT/.venv-sdl/bin/python}"
COMMIT="${TORCHDATA_COMMIT:-088e4347}"
WORK="$ROOT/build/torchdata-contract"
SRC="${TORCHDATA_SRC:-$ROOT/build/torchdata-src}"

is_git() { git -C "$1" rev-parse --git-dir >/dev/null 2>&1; }
if ! is_git "$SRC" && [ ! -d "$SRC/test" ]; then
    git clone -q https://github.com/pytorch/data "$SRC"
fi
rm -rf "$WORK" && mkdir -p "$WORK"
for name in test_state_dict test_sampler test_hugging_face; do
    if is_git "$SRC"; then  # (a bare repository too)
        git -C "$SRC" show "$COMMIT:test/stateful_dataloader/$name.py" >"$WORK/$name.py"
    else  # files as they are: say which commit they are of
        cp "$SRC/test/stateful_dataloader/$name.py" "$WORK/$name.py"
    fi
done

deselect=()
while read -r line; do
    case "$line" in ''|'#'*) continue ;; esac
    deselect+=(--deselect "$line")
done <"$ROOT/scripts/torchdata_contract/private.txt"

cd "$WORK"
# (no rootdir config of the project's: its filterwarnings=error is for its own tests)
PYTHONPATH="$ROOT/scripts/torchdata_contract" exec "$PY" -m pytest -q -c /dev/null -p swap \
    -p no:cacheprovider --timeout 300 "${deselect[@]}" "$@" \
    test_state_dict.py test_sampler.py test_hugging_face.py
