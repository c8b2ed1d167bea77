#!/usr/bin/env bash
# Build the package's wheel (abi3: one file for CPython >= 3.10) into OUT_DIR, for a
# machine that has Python but no Rust toolchain (the GPU machine: install it there
# with `pip install --no-index --no-deps --target DIR OUT_DIR/dsa_indexer-*.whl`).
#
#   bash python/build_wheel.sh OUT_DIR            # CPU backend only (the default)
#
# The wheel carries the CPU reference, dumps and the judge. Extra arguments go to
# maturin through pip (MATURIN_PEP517_ARGS), e.g. `--features cuda` for the library's
# CUDA backend; the default build has none, so it needs no CUDA toolkit. Its target
# directory is python/target, so a second build is incremental.
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
