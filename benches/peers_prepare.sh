#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what benches/peers.py needs on the GPU machine, which
# has no registry: the DeepGEMM and tvm-ffi wheels for its Python 3.12, and FlashInfer's
# top-k built for sm_90a (benches/flashinfer_topk/build.sh) from the flashinfer-python
# wheel with a pinned CUDA 13.0 toolkit from pip. Run here, then carry .whl beside .gpu:
#
#   bash benches/peers_prepare.sh          # a few minutes (downloads, then nvcc)
#
# The versions are the ones peers.py was written against: sgl-deep-gemm 0.1.4.post1
# (0.2.5 links libtorch symbols that torch 2.11 lacks) with its pin apache-tvm-ffi
# 0.1.11, flashinfer-python 0.7.2.post1. The toolkit goes to $CUDA_DIR (default
# ~/.cache/cu13-toolkit), the flashinfer wheel to $FI_DIR (default ~/.cache/flashinfer):
# neither travels.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
whl="$root/.whl"
cuda_dir="${CUDA_DIR:-$HOME/.cache/cu13-toolkit}"
fi_dir="${FI_DIR:-$HOME/.cache/flashinfer}"
mkdir -p "$whl" "$fi_dir"
pip_get() {  # pip_get DIR SPEC...: wheels for the GPU machine's CPython 3.12, no deps
  local dir="$1"; shift
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$dir" "$@"
}
pip_get "$whl" sgl-deep-gemm==0.1.4.post1 apache-tvm-ffi==0.1.11
pip_get "$fi_dir" flashinfer-python==0.7.2.post1
if [ ! -x "$cuda_dir/nvidia/cu13/bin/nvcc" ]; then
  python3 -m pip install -q --disable-pip-version-check --target "$cuda_dir" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.96
fi
CUDA_HOME="$cuda_dir/nvidia/cu13" bash "$root/benches/flashinfer_topk/build.sh" \
  "$fi_dir"/flashinfer_python-0.7.2.post1-*.whl "$whl/flashinfer_topk"
ls -l "$whl" "$whl/flashinfer_topk"
