#!/usr/bin/env bash
# Build the package's wheel (abi3: one file for CPython >= 3.10) into OUT_DIR, for a
# machine that has Python but no Rust toolchain (the GPU machine: install it there
# with `pip install --no-index --no-deps --target DIR OUT_DIR/dsa_indexer-*.whl`).
#
#   bash python/build_wheel.sh OUT_DIR                   # CPU backend only (the default)
#   bash python/build_wheel.sh .whl-cuda --features cuda # with the CUDA entries
#
# The wheel carries the CPU reference, dumps and the judge. Extra arguments go to
# maturin through pip (MATURIN_PEP517_ARGS), e.g. `--features cuda` for the library's
# CUDA backend and dsa_indexer.decode / index on torch tensors (libcuda and NVRTC are
# loaded at run time, so neither build needs a CUDA toolkit, and the CUDA wheel
# imports on a machine without a GPU). Its target directory is python/target, so a
# second build is incremental.
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash python/build_wheel.sh OUT_DIR [MATURIN_ARGS...]" >&2
  exit 2
fi
out="$1"; shift
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/target}"
MATURIN_PEP517_ARGS="${*:-}" python3 -m pip wheel --no-deps --disable-pip-version-check -w "$out" "$here"
ls -l "$out"/dsa_indexer-*.whl
