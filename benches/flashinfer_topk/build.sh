#!/usr/bin/env bash
# Builds benches/peers.py's FlashInfer top-k peer: libdsa_fi_topk.so, our C ABI
# (binding.cu, loaded with ctypes) over the top-k page-table transform of a flashinfer-python
# wheel's bundled sources, compiled to sm_90a SASS only (no PTX, so no driver JIT).
#
#   bash benches/flashinfer_topk/build.sh WHEEL [OUT_DIR]
#
# WHEEL    flashinfer_python-*.whl (peers.py was written against 0.7.2.post1), e.g. from
#          pip download --no-deps --only-binary=:all: --python-version 3.12 \
#              flashinfer-python==0.7.2.post1 -d DIR
# OUT_DIR  default .whl/flashinfer_topk (git-ignored; peers.py looks there)
# CUDA_HOME  a CUDA 13.0 toolkit whose nvcc, cicc and ptxas agree, with include/ and
#          lib/libcudart_static.a; e.g. the pip wheels, pinned together (an unpinned
#          nvidia-cuda-nvcc pulls a newer cicc whose PTX the 13.0 ptxas rejects):
#              pip install --target DIR nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 \
#                  nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96
#          then CUDA_HOME=DIR/nvidia/cu13. The H200's driver runs CUDA 13.0.
#
# Fetches nothing. The wheel's csrc/include/CCCL are unpacked into a temporary folder and
# removed; nothing of FlashInfer is written into the repository. The flags are FlashInfer's
# JIT flags for this module (flashinfer/jit/core.py, cpp_ext.py), its CCCL first on the
# include path. nvcc takes about 6 minutes on 2 cores.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
wheel=${1:?usage: build.sh WHEEL [OUT_DIR]}
out=${2:-$root/.whl/flashinfer_topk}
cuda=${CUDA_HOME:?set CUDA_HOME to a CUDA 13.0 toolkit (see the header of this script)}
nvcc=$cuda/bin/nvcc
[ -f "$wheel" ] || { echo "build.sh: no wheel at $wheel" >&2; exit 2; }
[ -x "$nvcc" ] || { echo "build.sh: no nvcc at $nvcc" >&2; exit 2; }
[ -f "$cuda/lib/libcudart_static.a" ] || { echo "build.sh: no $cuda/lib/libcudart_static.a" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 - "$wheel" "$tmp" <<'PY'
import sys, zipfile
wheel, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist()
             if n.startswith(("flashinfer/data/include/", "flashinfer/data/cccl/"))]
    if "flashinfer/data/include/flashinfer/topk.cuh" not in names:
        sys.exit(f"build.sh: {wheel} has no flashinfer/data/include/flashinfer/topk.cuh")
    z.extractall(dst, names)
PY
data=$tmp/flashinfer/data

mkdir -p "$out"
flags=(
  -std=c++17 -O3 -DNDEBUG -use_fast_math -lineinfo
  -gencode=arch=compute_90a,code=sm_90a
  -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
  -DFLASHINFER_ENABLE_F16 -DFLASHINFER_ENABLE_BF16
  -DFLASHINFER_ENABLE_FP8_E4M3 -DFLASHINFER_ENABLE_FP8_E5M2
  -DFLASHINFER_ENABLE_FP8_E8M0 -DFLASHINFER_ENABLE_FP4_E2M1
  --expt-relaxed-constexpr -static-global-template-stub=false
  -Xfatbin=-compress-all
  -I"$data/cccl/cub" -I"$data/cccl/libcudacxx/include" -I"$data/cccl/thrust"
  -I"$data/include" -isystem "$cuda/include"
  --compiler-options=-fPIC -shared -cudart static -L"$cuda/lib"
)
"$nvcc" "${flags[@]}" "$here/binding.cu" -o "$out/libdsa_fi_topk.so.tmp"
mv "$out/libdsa_fi_topk.so.tmp" "$out/libdsa_fi_topk.so"
{
  echo "wheel: $(basename "$wheel") sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
  echo "binding: sha256 $(sha256sum "$here/binding.cu" | cut -d' ' -f1)"
  "$nvcc" --version | tail -1
  echo "flags: ${flags[*]}" | sed "s#$tmp#<wheel>#g"
} >"$out/BUILD-INFO.txt"
echo "built $out/libdsa_fi_topk.so"
