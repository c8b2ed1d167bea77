#!/usr/bin/env bash
# CI, no GPU: compile every CUDA kernel variant for sm_90a with NVRTC 13.0.88.
# Installs the NVRTC wheel into a local folder (cached in ~/.cache/nvrtc), then runs
# the compile test with it on LD_LIBRARY_PATH; DSA_REQUIRE_NVRTC=1 makes a missing
# libnvrtc a failure instead of a skip. Also builds (but cannot run) the GPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
NVRTC_DIR="${NVRTC_DIR:-$HOME/.cache/nvrtc}"
if [ ! -e "$NVRTC_DIR/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  python3 -m pip install --quiet --target "$NVRTC_DIR" nvidia-cuda-nvrtc==13.0.88
fi
export LD_LIBRARY_PATH="$NVRTC_DIR/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
DSA_REQUIRE_NVRTC=1 cargo test --features cuda --test nvrtc_compile
# The backend's host-only unit tests (kernel choice, footprint, validation constants),
# with and without the `tuning` feature (which reads $DSA_CUDA_DEFINES).
cargo test --features cuda --lib cuda::
cargo test --features cuda,tuning --lib cuda::
# The GPU tests compile and skip here (no libcuda): they print "no CUDA device, skipping".
cargo test --features cuda --test cuda
# The CUDA fuzz target and its oracle's tests compile (they run only on a GPU machine).
cargo check --manifest-path fuzz/Cargo.toml --features cuda --all-targets
