#!/usr/bin/env bash
# One device call on the H200: every GPU test, the CLI checks, the issue-7 benchmark and
# its A/B variants, each writing its log under $OUT (default ./gpu-out).
#
#   ../shared/gpu/stage            # here: build and stage .gpu/
#   run: bash benches/gpu.sh [tests] [bench] [ab] [torch]    # there, carry .gpu
#
# With no arguments it runs all four parts. Variants are compiled per process from
# $DSA_CUDA_DEFINES (kernels/*.cu knobs: SCALE_FOLD, TK_SAMPLED, LG_ROWS, LG_MIN_BLOCKS).
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
B=.gpu/bin
parts="${*:-tests bench ab torch}"
has() { [[ " $parts " == *" $1 "* ]]; }
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1

if has tests; then
  log "GPU tests"
  DSA_REQUIRE_GPU=1 timeout 300 $B/cuda --test-threads=1 > "$OUT/tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/tests.txt"
  grep -E "test result|FAILED|panicked" "$OUT/tests.txt" | tee -a "$OUT/summary.txt"
  DSA_REQUIRE_NVRTC=1 timeout 120 $B/nvrtc_compile > "$OUT/nvrtc.txt" 2>&1
  grep -E "test result" "$OUT/nvrtc.txt" | tee -a "$OUT/summary.txt"
  for d in cpu cuda; do
    timeout 120 $B/dsa-indexer run --device $d --json > "$OUT/run_$d.json" 2>&1
    grep -o '"checksum":"[0-9a-f]*"' "$OUT/run_$d.json" | sed "s/^/run --device $d: /" | tee -a "$OUT/summary.txt"
  done
fi

W="v32-16k v41-chunk v41-chunk-source v32-64k v41-1m v41-1m-256m"
if has bench; then
  log "bench (median of 5)"
  timeout 300 $B/dsa-cuda-bench $W --reps 5 > "$OUT/bench.jsonl" 2> "$OUT/bench.err"
  cat "$OUT/bench.jsonl" >> "$OUT/summary.txt"
  timeout 60 $B/dsa-indexer bench --workload v41-chunk --device cuda --reps 3 > "$OUT/cli_bench.txt" 2>&1
fi

if has ab; then
  for defs in "SCALE_FOLD=0" "TK_SAMPLED=0" "LG_ROWS=4 LG_MIN_BLOCKS=3"; do
    log "A/B: $defs"
    DSA_CUDA_DEFINES="$defs" timeout 120 $B/dsa-cuda-bench v32-16k v41-chunk --reps 5 \
      > "$OUT/ab_${defs// /_}.jsonl" 2>&1
    cat "$OUT/ab_${defs// /_}.jsonl" >> "$OUT/summary.txt"
  done
fi

if has torch; then
  log "torch.topk"
  timeout 120 python3 benches/torch_topk.py > "$OUT/torch_topk.txt" 2>&1
  tail -5 "$OUT/torch_topk.txt" >> "$OUT/summary.txt"
fi
log "done"
