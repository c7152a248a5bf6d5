# One entry point. Every target sets itself up (a .venv, torch only if missing) and skips what is done.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
AZURITE := .azurite/.installed
TORCH   ?= torch==2.13.0

BENCHES := dropin serialization_tax remote decode autotune stats_overhead per_batch h2d_overlap ft_threads ranks
BENCHES += mix parquet cache cloud_gcs cloud_azure containers streams token_lists trainer_tax peers_rs

.PHONY: setup test test-stress test-containers test-slow test-beside test-torchdata lint demo bench bench-quick chart soak clean

setup: $(STAMP) $(AZURITE)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[dev,uvloop]"
	touch $(STAMP)

# Azurite (Azure Blob's emulator, for the Azure tests and benchmark) from npm into .azurite/, once;
# without npm the Azure tests skip, saying so.
$(AZURITE):
	@if command -v npm >/dev/null; then \
		npm install --prefix .azurite --no-audit --no-fund --silent azurite@3 && touch $(AZURITE); \
	else echo "npm not found: the Azure tests will skip"; fi

lint: setup
	$(VPY) -m ruff format --check aioloader tests benchmarks examples
	$(VPY) -m ruff check aioloader tests benchmarks examples
	$(VPY) -m mypy

test: setup lint
	$(VPY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# The suite beside two processes that each keep a core busy (a machine that runs other work):
# tests take their time from events, not wall clocks, and pass here too.
test-stress: setup lint
	$(VPY) scripts/with_hogs.py 2 $(VPY) -m pytest -q

# Every test of the native loader again, each Loader run beside the trainer (AIOLOADER_BESIDE=1: the
# pipeline in a process of its own); the tests that look inside the test's own process (its threads,
# what its callables change, private parts) are marked in_process and skip there.
BESIDE_TESTS := tests/test_loader.py tests/test_epochs.py tests/test_lifecycle.py tests/test_faults.py
BESIDE_TESTS += tests/test_badinput.py tests/test_fuzz.py tests/test_soak.py tests/test_beside.py
BESIDE_TESTS += tests/resume tests/observe tests/pipeline tests/tuning tests/sources tests/mix tests/pack
test-beside: setup
	AIOLOADER_BESIDE=1 $(VPY) -m pytest -q $(BESIDE_TESTS)

# torchdata's own StatefulDataLoader tests (pytorch/data's test_state_dict.py, test_sampler.py,
# test_hugging_face.py at the commit scripts/torchdata_contract.sh names) with the class swapped for
# aioloader.StatefulDataLoader, in a venv of their own (.venv-sdl: torch as TORCH says, the
# torchdata-contract extra's pins); not in `make test`. The tests are fetched from github.com, or
# taken from a checkout: TORCHDATA_SRC=/path/to/pytorch-data make test-torchdata
SDLVENV := .venv-sdl
SDLPY   := $(SDLVENV)/bin/python

$(SDLVENV)/.installed: pyproject.toml
	test -x $(SDLPY) || $(PY) -m venv $(SDLVENV)
	$(SDLPY) -c "import torch" 2>/dev/null || $(SDLPY) -m pip install -q "$(TORCH)"
	$(SDLPY) -m pip install -q -e ".[torchdata-contract]"
	touch $@

test-torchdata: $(SDLVENV)/.installed
	scripts/torchdata_contract.sh

# The container tests alone (also in `make test`): a 64 MB /dev/shm, a 1.5 GiB memory cgroup (root).
test-containers: setup
	$(VPY) -m pytest -q tests/tuning/test_containers.py

demo: setup
	$(VPY) examples/demo.py

# Every benchmark prints a table and, as its last line, JSON with its ratios against the peers.
bench-quick: setup
	for b in $(BENCHES); do $(VPY) benchmarks/$$b.py --quick || exit 1; done

bench: setup
	for b in $(BENCHES); do $(VPY) benchmarks/$$b.py || exit 1; done

# The README's chart, docs/chart.png, from docs/bench-results.jsonl or RESULTS=FILES (JSON lines, such
# as a saved `make bench` output); the standard library only, so no setup.
RESULTS ?= docs/bench-results.jsonl
chart:
	$(PY) scripts/chart.py $(RESULTS) -o docs/chart.png

# The tests marked slow (over 30 s each), which the default run deselects (pyproject's addopts).
test-slow: setup
	$(VPY) -m pytest -q -m slow

# The soak tests: the full 50-epoch soak (marked slow) and the 10-epoch one `make test` runs too.
soak: setup
	$(VPY) -m pytest -q -m "slow or not slow" tests/test_soak.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# Free-threaded CPython (optional, not in the default CI): 3.14t where its sources can be fetched, else
# 3.13t, built from source into build/ft/<version>/, with its own venv .venv-ft (torch 2.14.1 cp314t or
# 2.12.0 cp313t). `make ft-env` takes minutes the first time.
FTVENV  := .venv-ft
FTPY    := $(FTVENV)/bin/python
FTCHECK := import sys, importlib.util as u; [__import__(m) for m in ("numpy", "torch", "aiohttp", \
	"PIL.Image", "aioloader", "uvloop") if m != "uvloop" or u.find_spec(m)]; \
	assert not sys._is_gil_enabled(), "the GIL is enabled"; print("free-threaded: GIL off")

.PHONY: ft-env test-ft bench-ft

ft-env:
	scripts/ft-env.sh

test-ft: ft-env
	$(FTPY) -W error -c '$(FTCHECK)'
	$(FTPY) -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests collected"; exit 0; fi; exit $$rc

# W5: a decode that holds the GIL, in threads on the free-threaded venv, against processes and torch's
# DataLoader(num_workers=2) on the GIL build (.venv).
# Its peers (the bench-ft extra's pins: SPDL's pipeline, Grain) go into .venv-ft, binary wheels only.
FTPEERS := import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"] \
	["optional-dependencies"]["bench-ft"]))

bench-ft: ft-env
	$(FTPY) -W error -c '$(FTCHECK)'
	$(FTPY) -c '$(FTPEERS)' >$(FTVENV)/bench-ft.txt
	$(FTPY) -m pip install -q --only-binary=:all: -c $(FTVENV)/constraints.txt -r $(FTVENV)/bench-ft.txt
	$(FTPY) benchmarks/ft_threads.py

# dataloader-rs, the peer of benchmarks/peers_rs.py (its rows are skipped without it), in a venv of
# its own: .venv-rs, CPython 3.13 (pyenv's 3.13.0 where there is one, else python3.13 on PATH;
# PY313=... picks another), with the bench-rs extra's pins, binary wheels only. No torch:
# dataloader-rs does not need it. Its x86-64 wheels need a CPU with AVX2.
RSVENV  := .venv-rs
RSPY    := $(RSVENV)/bin/python
PYENV313 := $(shell pyenv root 2>/dev/null)/versions/3.13.0/bin/python
PY313   ?= $(if $(wildcard $(PYENV313)),$(PYENV313),python3.13)
RSPEERS := import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"] \
	["optional-dependencies"]["bench-rs"]))

.PHONY: rs-env

rs-env: $(RSVENV)/.installed

$(RSVENV)/.installed: pyproject.toml
	test -x $(RSPY) || $(PY313) -m venv $(RSVENV)
	$(RSPY) -c '$(RSPEERS)' >$(RSVENV)/bench-rs.txt
	$(RSPY) -m pip install -q --only-binary=:all: -r $(RSVENV)/bench-rs.txt
	$(RSPY) -c "import dataloader_rs, numpy, psutil"
	touch $@
