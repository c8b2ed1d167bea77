#!/usr/bin/env bash
# The GPU run on an H200: every GPU test, the CLI checks, the benchmark and its
# A/B variants, and the compute-sanitizer checks, each writing its log under $OUT
# (default ./gpu-out).
#
#   ../shared/gpu/stage --features tuning                                   # here
#   run: bash benches/gpu.sh [quick] [tests] [wgi8] [knobs] [bench] [decode] [ab] [alt] [altfast] [altfull] [select] [torch] [ncu] [ncutk] [sanitize]
#        [old] [replay] [peers] [accuracy] [pyengine] [clocks] [phases] [ktimes]
#        # there, carry .gpu (and .whl for bench, decode, peers, pyengine)
#
# The staged binaries must be built with --features cuda,tuning (stage's extra
# arguments go to every cargo call, which already passes --features cuda) for the
# parts that set $DSA_CUDA_DEFINES (the A/B runs) or give the
# benchmark hooks: without `tuning` the library never reads either variable.
#
# `bench` runs ours (bench.jsonl), the peers (benches/peers.py: DeepGEMM, FlashInfer's
# top-k, torch.topk; peers.jsonl) and prints one table per workload with the ratios
# (benches/table.py; table.md). It needs .whl/ (the DeepGEMM and tvm-ffi wheels, and
# flashinfer_topk/libdsa_fi_topk.so) carried beside .gpu/. The prefill workloads ($W)
# run first, then the decode workloads over paged keys ($DW: batches of requests, pages
# of 64), ours and the peers (DeepGEMM's paged logits + FlashInfer's top-k through the
# slot table, + torch.topk, on the E4M3 ones, $PDW), each a line of the same files; the
# decode tables add the KV cache's bytes per second at the floor against 4.3 TB/s.
# `decode` runs only the decode half of `bench` (ours, the peers with --check, the tables).
# `bench` and `peers` run peers.py's accuracy part too (--accuracy: DeepGEMM's |x - ref| / M
# on random v32 data against SPEC 4 in float64, its own table in table.md); `accuracy` runs
# it alone, writing its problem to $OUT/accuracy_problem.safetensors and measuring ours
# beside DeepGEMM's when $OURS names a file of our logits of that problem.
#
# `pyengine` installs the Python package's wheel (.whl/dsa_indexer-*.whl, built by
# python/build_wheel.sh, or the CUDA one in .whl-cuda/ when it is carried: then
# DSA_REQUIRE_GPU=1) with the DeepGEMM wheels, runs python/examples/deepgemm_check.py
# (one V3.2 layer through DeepGEMM and torch.topk, judged by dsa_indexer.check;
# deepgemm_check.txt, its JSON line in deepgemm_check.jsonl) and pytest python/tests
# (pytest.txt) against this machine's torch.
#
# `clocks` samples the SM clock, power and clock-event reasons during our long fast runs
# and DeepGEMM's logits kernel alone (benches/clock_probe.py; about 2 minutes).
#
# With no arguments it runs tests, bench, ab and torch (ncu, ncutk: hardware counters;
# ktimes: each kernel's device time; sanitize: memcheck, racecheck, initcheck and
# synccheck over the GPU tests and `run --device cuda`, each on request; alt: define
# sets of the exact class's kernel beside the default, below; altfast: the same for the
# fast kernel; altfull: for the default precision's E4M3 kernel and the selection). The
# golden files are read from tests/golden unless $DSA_GOLDEN_DIR says otherwise.
#
# Forced fallbacks are typed test hooks (cuda::Hooks), named in $DSA_CUDA_HOOKS
# (comma-separated): mma_sync_only (mma.sync where wgmma is the default), no_scale_fold
# (the exact class's two-multiply epilogue), no_short_rows (no shared-memory row),
# no_sampled_threshold (no sampled threshold), no_int8_exact (the exact class at H = 32 on
# mqa_logits_wgr's fp8 tile everywhere, where mqa_logits_wgi8 runs s8 wgmma on the tiles
# its guard admits),
# no_wide_topk (topk_ragged_f32 where tiles of few rows take topk_ragged_wide_f32),
# no_cluster_topk (topk_ragged_wide_f32 where tiles of at most sms / 8 rows take
# topk_cluster_f32). The GPU tests read it in any build (and
# one test runs every hook in-process); the benchmark only with `tuning`.
#
# With `tuning`, variants are compiled per process with $DSA_CUDA_DEFINES prepended as
# #defines, tuning numbers: LG_ROWS, LG_MIN_BLOCKS, WGR_MIN_BLOCKS, WGI8_MIN_BLOCKS, WGI8_R8_MIN_BLOCKS, W16_MIN_BLOCKS,
#   W8_MIN_BLOCKS, TK_SAMPLE_RATIO, TK_UNROLL, TK_SAMPLE_LOADS (sample chunks in flight per
#   warp in the narrow top-k's sample, 8), TK_RAGGED_MIN_BLOCKS, TK_BITMAP (0: sampled
#   rows sort their selected ids instead of scanning a bitmap), TK_SHORT_BITMAP (1: the
#   shared-memory row's ids in order from a bitmap, not the ordered pass), TK_COLLECT_MASK
#   (1: the sampled rows' collecting pass reserves candidate slots once per round of loads),
#   TK_SAMPLED_ORDERED (1:
#   sampled rows of at most 16 * K keys end with the ordered pass), TK_STOP (profiling:
#   sampled rows stop after phase N, outputs unwritten), TK_SEG_ALIGN (0: split rows'
#   segments of ceil(n / S) keys, most of them misaligned), W8_RING (2 or 3 key tiles),
#   W8_TMA (0: the fast kernel's keys in registers), W8_LPT and W16_LPT (0: a launch's
#   groups in launch order, not longest first), WGI8_PREDECODE (0: mqa_logits_wgi8_r8
#   decodes the fp4 keys in its blocks instead of reading the keys wgi8_decode_keys wrote
#   once per run; host and kernel), WGI8_R8_MIN_BLOCKS (the eight-row entry's blocks per SM; its launches' waves too), WGI8_RING
#   (3: the pre-decoded keys' ring of key tiles in shared memory has three, not two; host and kernel),
#   MBAR_WATCHDOG (N: an mbarrier wait traps after 2^N failed tries, a hang made a launch error); host side: TK_SPLIT_MIN_KEYS (rows shorter than this never split their top-k), LG_PER_BLOCK, LG_MIN_WAVES (the eight-row entry's fewest waves per launch, 4), WGI8_ROWS (4 or 8: that form of
#   mqa_logits_wgi8 in every launch, where each launch takes the one its row groups favour),
#   SELECT_STREAM (1 or 2: each tile's selection on a stream of its own, at the default or
#   the greatest priority, beside the next tile's logits in two slots of half the budget).
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
B=.gpu/bin
export DSA_GOLDEN_DIR="${DSA_GOLDEN_DIR:-$PWD/tests/golden}"
parts="${*:-tests bench ab torch}"
has() { [[ " $parts " == *" $1 "* ]]; }
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$OUT/gpu.txt" 2>&1

# Test filters under tuning defines (the `tuning` feature): knob_tests "DEFINES" FILTER...
knob_tests() {
  local defs="$1"; shift
  DSA_CUDA_DEFINES="$defs" DSA_REQUIRE_GPU=1 timeout 200 $B/cuda --test-threads=1 "$@" >> "$OUT/tests.txt" 2>&1
  grep -E "test result" "$OUT/tests.txt" | tail -1 | sed "s/^/$defs: /" | tee -a "$OUT/summary.txt"
}

# mqa_logits_wgi8's knobs on the exact class's tests (about 35 s each).
wgi8_knob_tests() {
  # Its two forms, each in every launch: four rows per block (decode's) and eight
  # (prefill's: two MMAs per key tile).
  knob_tests "WGI8_ROWS=4" int8_exact exact_class boundary special golden same_bits paged decode_step
  knob_tests "WGI8_ROWS=8" int8_exact exact_class boundary special golden same_bits paged decode_step
  # The eight-row form decoding its keys in its blocks (no pre-decoded keys).
  knob_tests "WGI8_PREDECODE=0" int8_exact exact_class boundary special golden same_bits engine
  # The pre-decoded keys' ring with a third tile.
  knob_tests "WGI8_RING=3" int8_exact exact_class boundary golden same_bits engine
}

# The whole GPU suite (about 3 to 4 minutes), then the library's CUDA unit tests,
# nvrtc_compile (every module for sm_90a) and `run` on both devices (one checksum).
gpu_suite() {
  log "GPU tests"
  DSA_REQUIRE_GPU=1 timeout 420 $B/cuda --test-threads=1 > "$OUT/tests.txt" 2>&1
  echo "rc=$?" >> "$OUT/tests.txt"
  grep -E "test result|FAILED|panicked" "$OUT/tests.txt" | tee -a "$OUT/summary.txt"
}
unit_nvrtc_run() {
  DSA_REQUIRE_GPU=1 timeout 120 $B/dsa_indexer.unit cuda >> "$OUT/tests.txt" 2>&1
  grep -E "test result" "$OUT/tests.txt" | tail -1 | sed 's/^/lib cuda unit tests: /' | tee -a "$OUT/summary.txt"
  DSA_REQUIRE_NVRTC=1 timeout 120 $B/nvrtc_compile >> "$OUT/tests.txt" 2>&1
  grep -E "test result" "$OUT/tests.txt" | tail -1 | sed 's/^/nvrtc_compile: /' | tee -a "$OUT/summary.txt"
  for d in cpu cuda; do
    timeout 120 $B/dsa-indexer run --device $d --json 2>&1 | grep checksum | sed "s/^/run --device $d: /" | tee -a "$OUT/summary.txt"
  done
}

# `quick`: the suite and the checks after it, without the hook and knob filters: with
# `bench`, one call of under 10 minutes that tests and measures a build.
if has quick; then
  gpu_suite
  unit_nvrtc_run
fi

if has tests; then
  # GPU_SUITE=0: the hook, knob and unit parts only, for binaries whose whole suite has
  # passed already.
  if [ "${GPU_SUITE:-1}" != 0 ]; then gpu_suite; fi
  # Test filters again on the other side of each forced fallback: the mma.sync kernel
  # where wgmma is the default, the exact class without scale folding, short rows
  # through the two-pass and general paths (the shared-memory row off), long rows
  # without the sampled threshold.
  hook_tests() {
    local hooks="$1"; shift
    DSA_CUDA_HOOKS="$hooks" DSA_REQUIRE_GPU=1 timeout 300 $B/cuda --test-threads=1 "$@" >> "$OUT/tests.txt" 2>&1
    grep -E "test result" "$OUT/tests.txt" | tail -1 | sed "s/^/hooks $hooks: /" | tee -a "$OUT/summary.txt"
  }
  hook_tests mma_sync_only exact_class boundary special golden paged decode_step
  hook_tests no_scale_fold exact_class boundary special golden same_bits
  hook_tests no_short_rows boundary topk_ special golden same_bits
  hook_tests no_sampled_threshold boundary topk_ golden same_bits decode_step
  hook_tests no_wide_topk boundary topk_ golden same_bits decode_step paged engine
  hook_tests no_cluster_topk boundary topk_ golden same_bits decode_step paged engine
  # The exact class at H = 32 on mqa_logits_wgr alone (no int8 tile), folded and not.
  hook_tests no_int8_exact int8_exact exact_class boundary special golden same_bits engine_api paged decode_step
  hook_tests no_int8_exact,no_scale_fold int8_exact exact_class special golden
  has wgi8 || wgi8_knob_tests
  # The accumulator cases' errors, |diff| / M per case, at both precisions (the fast mode
  # on fp8 wgmma, held to SPEC 4's fast-mode bound).
  DSA_REQUIRE_GPU=1 timeout 120 $B/cuda --test-threads=1 fp8_wgmma engine_like --nocapture 2>&1 | grep "/ M =\|panicked\|> bound" > "$OUT/acc_cases.txt"
  unit_nvrtc_run
fi

# `wgi8`: mqa_logits_wgi8's knob suites alone (part of `tests`).
if has wgi8; then
  log "mqa_logits_wgi8 knobs"
  wgi8_knob_tests
fi

if has knobs; then
  # The fast kernel's other forms at D = 128, on its tests (about 2 minutes each): the
  # other ring size of each layout (flat keys take 2 tiles, paged 3), the keys in
  # registers, the groups in launch order. KNOBS (space-separated define sets) names
  # others, or some of these.
  log "fast-kernel forms"
  for defs in ${KNOBS:-W8_RING=3 W8_RING=2 W8_TMA=0 W8_LPT=0}; do
    knob_tests "$defs" fp8_wgmma e4m3_h64 tolerance_class_overflow decode_step paged
  done
fi

W="v32-16k v41-chunk v41-chunk-source v41-chunk-wide v32-64k v41-1m v41-1m-256m"
# The peers' shapes (v41-chunk-source and v41-1m-256m have v41-chunk's and v41-1m's).
PW="v32-16k v41-chunk v41-chunk-wide v32-64k v41-1m"
# Decode over paged keys: ours on all three, the peers on the E4M3 two.
DW="v32-decode-b64-32k v32-decode-b128-128k-mtp2 v32-decode-b1-128k v41-decode-b64-64k"
PDW="v32-decode-b64-32k v32-decode-b128-128k-mtp2 v32-decode-b1-128k"
# The fast precision (E4M3 x E4M3 at H = 64 on fp8 wgmma): the V3.2 workloads, prefill
# and decode.
FW="v32-16k v32-64k $PDW"
# DeepGEMM's logits, FlashInfer's top-k (through .whl/flashinfer_topk/, built by
# benches/flashinfer_topk/build.sh) and torch.topk on the same shapes, with --check; the
# wheels travel in .whl/ (benches/peers.py says how). Its JSON lines go to peers.jsonl.
install_wheels() {
  if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  else
    echo "no .whl/ here: the peers need the wheels that bash benches/peers_prepare.sh puts there (carry .whl beside .gpu)" \
      | tee -a "$OUT/summary.txt"
  fi
  # The package's CUDA wheel (python/build_wheel.sh .whl-cuda --features cuda), when
  # carried: it serves the CPU entries too.
  if ls .whl-cuda/dsa_indexer-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl-cuda/dsa_indexer-*.whl && export PYTHONPATH=/tmp/site
  fi
}
peers_run() {  # peers_run WORKLOAD...
  log "peers"
  install_wheels
  # The harness's own tests first, the torch ones included (torch is here, not in CI).
  DSA_INDEXER_BIN="$PWD/$B/dsa-indexer" timeout 120 python3 benches/peers_test.py > "$OUT/peers_test.txt" 2>&1
  echo "peers_test rc=$? ($(tail -1 "$OUT/peers_test.txt"))" | tee -a "$OUT/summary.txt"
  PYTHONUNBUFFERED=1 timeout 480 python3 benches/peers.py --check "$@" > "$OUT/peers.txt" 2>&1
  echo "peers rc=$?" | tee -a "$OUT/summary.txt"
  grep '^{' "$OUT/peers.txt" > "$OUT/peers.jsonl"
  grep -E '^flashinfer: not available|FAILED|^peers.py: ' "$OUT/peers.txt" | tee -a "$OUT/summary.txt"
}

if has bench; then
  # Ours, then the peers in the same run, then one table per workload (table.md).
  log "bench (median of 5)"
  timeout 240 $B/dsa-indexer bench --device cuda --json $W --reps 5 > "$OUT/bench.jsonl" 2>> "$OUT/summary.txt"
  log "bench decode (median of 5)"
  timeout 240 $B/dsa-indexer bench --device cuda --json $DW --reps 5 >> "$OUT/bench.jsonl" 2>> "$OUT/summary.txt"
  log "bench, fast precision (median of 5)"
  timeout 240 $B/dsa-indexer bench --device cuda --json --precision fast $FW --reps 5 >> "$OUT/bench.jsonl" 2>> "$OUT/summary.txt"
  cat "$OUT/bench.jsonl" >> "$OUT/summary.txt"
  timeout 60 $B/dsa-indexer bench --workload v41-chunk --device cuda --reps 3 >> "$OUT/summary.txt" 2>&1
  peers_run --accuracy $PW $PDW
  python3 benches/table.py "$OUT" > "$OUT/table.md" 2>&1
  cat "$OUT/table.md" >> "$OUT/summary.txt"
fi

if has ab; then
  # workload:NAME=VALUE ..., where NAME=VALUE is a define, hooks=NAME[,NAME] or
  # precision=fast, each against the same run's default run above ($AB: a shorter
  # list). Needs the `tuning` build.
  AB="${AB:-v41-chunk:WGI8_PREDECODE=0;v41-1m:WGI8_PREDECODE=0;v41-1m-256m:WGI8_PREDECODE=0;v41-chunk-wide:WGI8_PREDECODE=0;v41-chunk:WGI8_RING=3;v41-1m:WGI8_RING=3;v41-chunk:hooks=no_int8_exact;v41-chunk-wide:hooks=no_int8_exact;v41-chunk:WGI8_ROWS=4;v41-chunk-wide:WGI8_ROWS=4;v41-1m:WGI8_ROWS=4;v41-1m-256m:WGI8_ROWS=4;v41-decode-b64-64k:WGI8_ROWS=8;v41-decode-b64-64k:hooks=no_int8_exact;v41-chunk:hooks=mma_sync_only;v41-chunk:hooks=no_scale_fold;v41-chunk:hooks=no_sampled_threshold;v32-16k:hooks=mma_sync_only;v32-64k:TK_SAMPLE_RATIO=16;v32-16k:hooks=no_short_rows;v32-64k:hooks=no_short_rows;v41-1m-256m:TK_SEG_ALIGN=0;v41-1m:TK_SEG_ALIGN=0;v32-decode-b1-128k:hooks=no_cluster_topk}"
  IFS=';' read -ra abs <<< "$AB"
  for ab in "${abs[@]}"; do
    wl="${ab%%:*}" defs="" hooks="" prec=full
    for tok in ${ab#*:}; do
      case $tok in
        hooks=*) hooks="${tok#hooks=}" ;;
        precision=*) prec="${tok#precision=}" ;;
        *) defs="${defs:+$defs }$tok" ;;
      esac
    done
    log "A/B $wl: ${hooks:+hooks $hooks }$defs (precision $prec)"
    DSA_CUDA_HOOKS="$hooks" DSA_CUDA_DEFINES="$defs" timeout 120 $B/dsa-indexer bench --device cuda --json --precision "$prec" "$wl" --reps 5 >> "$OUT/summary.txt" 2>&1
  done
fi

# Alternating A/B of define sets against the default (`alt`, `altfast`). A form that hangs
# (a ring whose protocol is new) is caught by one short run first, with MBAR_WATCHDOG (a
# wait that never ends traps: the launch fails) and a 60 s timeout, and left out of the
# rest, so that it cannot spend the tests' longer timeouts hanging.
# ab_forms LOG PRECISION FORMS PROBE TESTS FILTER...: ab_log, ab_prec and ab_ran (the
# forms of the ';'-separated FORMS whose one PROBE run passed), each form's tests under
# FILTER first unless TESTS is 0.
ab_forms() {
  ab_log="$1" ab_prec="$2"
  local list="$3" probe="$4" tests="$5" defs rc
  shift 5
  : > "$ab_log"  # this invocation's rounds only: ab_summary reads the whole log
  ab_ran=()
  local cand=()
  IFS=';' read -ra cand <<< "$list"
  for defs in ${cand[@]+"${cand[@]}"}; do
    DSA_CUDA_DEFINES="$defs MBAR_WATCHDOG=24" timeout -k 10 60 $B/dsa-indexer bench --device cuda \
      --precision "$ab_prec" "$probe" --reps 1 > /dev/null 2>> "$ab_log"
    rc=$?
    if [ $rc != 0 ]; then echo "$defs: one $probe run failed (rc=$rc), left out" | tee -a "$OUT/summary.txt"; continue; fi
    ab_ran+=("$defs")
    if [ "$tests" != 0 ]; then knob_tests "$defs" "$@"; fi
  done
}
# ab_round SECONDS WORKLOAD...: the default, then each form of ab_ran, into ab_log.
ab_round() {
  local secs="$1" defs
  shift
  for defs in "" ${ab_ran[@]+"${ab_ran[@]}"}; do
    DSA_CUDA_DEFINES="$defs" timeout "$secs" $B/dsa-indexer bench --device cuda --json \
      --precision "$ab_prec" "$@" --reps 5 2>&1 | sed "s/^/[${defs:-default}] /" >> "$ab_log"
  done
}
# ab_summary [LOG [FIELD]]: each run of LOG (default ab_log), a line of its form,
# workload and times (and FIELD's value, a JSON key of integers), into the summary.
ab_summary() {
  local fields='"(median|logits|select)_ms":[0-9.]+'
  [ -n "${2:-}" ] && fields="$fields|\"$2\":[0-9]+"
  grep -oE '^\[[^]]*\]|"name":"[^"]*"|'"$fields" "${1:-$ab_log}" \
    | paste -sd' ' | sed 's/ \[/\n[/g' | tee -a "$OUT/summary.txt"
}

# ab_rounds_v32: the V3.2 forms' rounds (altfast, altfull): two on v32-16k and on
# v32-64k, one on the paged decode at batch 128, then ab_summary.
ab_rounds_v32() {
  ab_round 60 v32-16k
  ab_round 120 v32-64k
  ab_round 60 v32-16k
  ab_round 120 v32-64k
  ab_round 60 v32-decode-b128-128k-mtp2
  ab_summary
}

if has alt; then
  # ALT_FORMS (';'-separated define sets of the exact class's kernel, each a candidate
  # form) beside the default in alternating processes: each form's tests of the exact
  # class's kernels first (int8, exact-class, boundary, golden, paged, decode and
  # special-value tests), then two rounds on v41-chunk and one on v41-chunk-wide, v41-1m
  # and v41-decode-b64-64k (alt.txt, and the summary).
  log "alternating A/B: ${ALT_FORMS:-no forms (ALT_FORMS is empty)}"
  ab_forms "$OUT/alt.txt" full "${ALT_FORMS:-}" v41-chunk 1 \
    int8_exact exact_class boundary golden paged decode special_values
  ab_round 60 v41-chunk
  ab_round 60 v41-chunk
  ab_round 120 v41-chunk-wide v41-1m v41-decode-b64-64k
  ab_summary
fi

if has altfast; then
  # FAST_FORMS (';'-separated define sets of the fast kernel, mqa_logits_w8) beside the
  # default in alternating processes, at the fast precision: each form's fast-kernel
  # tests first (FAST_TESTS=0 leaves them out, for a form only measured), then two
  # rounds on v32-16k and on v32-64k and one on the paged decode at batch 128
  # (altfast.txt, and the summary).
  log "alternating A/B, fast precision: ${FAST_FORMS:-no forms (FAST_FORMS is empty)}"
  ab_forms "$OUT/altfast.txt" fast "${FAST_FORMS:-}" v32-16k "${FAST_TESTS:-1}" \
    fp8_wgmma e4m3_h64 tolerance_class_overflow decode_step paged
  ab_rounds_v32
fi

if has altfull; then
  # FULL_FORMS (';'-separated define sets of the default precision's E4M3 x E4M3 kernel,
  # mqa_logits_w16, or of the selection) beside the default in alternating processes, at
  # the default precision: each form's tests of those kernels first (FULL_TESTS=0 leaves
  # them out), then two rounds on v32-16k and on v32-64k and one on the paged decode at
  # batch 128 (altfull.txt, and the summary).
  log "alternating A/B, default precision: ${FULL_FORMS:-no forms (FULL_FORMS is empty)}"
  ab_forms "$OUT/altfull.txt" full "${FULL_FORMS:-}" v32-16k "${FULL_TESTS:-1}" \
    e4m3_h64 tolerance_class boundary topk_ golden decode_step paged
  ab_rounds_v32
fi

if has select; then
  # SEL_FORMS (';'-separated define sets of the selection) beside the default in
  # alternating processes (ab_forms, ab_round): by default each tile's selection on a
  # stream of its own beside the next tile's logits, two logits slots of half the budget
  # (SELECT_STREAM=1: the stream at the default priority, 2: at the device's greatest;
  # host side, docs/cuda.md "The selection beside the next tile's logits"). Each form's
  # one v41-chunk probe, then its tests (SEL_FILTER: by default the runs of many tiles:
  # every budget, the plan's peak, random batches of both classes, the golden vectors,
  # paged keys, the engine entry, decode), then the rounds of SEL_ROUNDS (';'-separated
  # "SECONDS PRECISION WORKLOAD..."; by default the workloads of several tiles) into
  # select.txt, and the summary.
  # SEL_TESTS=0: the rounds alone, the forms' tests left to another run.
  sel_forms="${SEL_FORMS:-SELECT_STREAM=1;SELECT_STREAM=2}"
  log "selection A/B: $sel_forms"
  # shellcheck disable=SC2086
  ab_forms "$OUT/select.txt" full "$sel_forms" v41-chunk "${SEL_TESTS:-1}" \
    ${SEL_FILTER:-same_bits selection_stream plan_and_measured_peak random_batches golden paged engine_api decode}
  IFS=';' read -ra sel_rounds <<< "${SEL_ROUNDS:-60 full v41-chunk v41-chunk-source;60 full v41-chunk;120 fast v32-64k v32-16k;120 full v32-64k v41-1m v41-1m-256m}"
  for r in "${sel_rounds[@]}"; do
    read -r secs ab_prec wls <<< "$r"  # ab_round runs at ab_prec
    # shellcheck disable=SC2086
    ab_round "$secs" $wls
  done
  ab_summary "$OUT/select.txt" logits_slots
fi

if has ncu; then
  # Hardware counters of the first logits launch of each workload. NCU_W names the
  # workloads (v32-16k v41-chunk), NCU_ARGS further bench arguments (e.g. --precision
  # fast); NCU_SET=full takes ncu's full set, the source counters (stall reasons per SASS
  # instruction, ncu-src-WORKLOAD.csv, summarised by benches/ncu_source.py) among them.
  ncu_first() {  # ncu_first SECONDS NCU_ARGS...: the first logits launch of a process
    local secs="$1"; shift
    timeout "$secs" ncu --clock-control none -k regex:mqa_logits -c 1 "$@"
  }
  for wl in ${NCU_W:-v32-16k v41-chunk}; do
    log "ncu $wl ${NCU_ARGS:-}"
    run_wl=($B/dsa-indexer bench --device cuda --json "$wl" ${NCU_ARGS:-} --reps 1)
    if [[ "${NCU_SET:-}" == full ]]; then
      ncu_first 300 --set full -o "$OUT/ncu-$wl" "${run_wl[@]}" > "$OUT/ncu-$wl.log" 2>&1
      ncu --import "$OUT/ncu-$wl.ncu-rep" --page details > "$OUT/ncu-$wl.txt" 2>&1
      ncu --import "$OUT/ncu-$wl.ncu-rep" --page source --print-source sass --csv \
        > "$OUT/ncu-src-$wl.csv" 2>&1
      python3 benches/ncu_source.py "$OUT/ncu-src-$wl.csv" | tee -a "$OUT/summary.txt"
    else
      ncu_first 180 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy "${run_wl[@]}" > "$OUT/ncu-$wl.txt" 2>&1
    fi
  done
fi

if has ktimes; then
  # Each kernel's device time, launch by launch, in one benchmark process per workload
  # (ncu's gpu__time_duration; benches/kernel_times.py sums them per kernel): where a
  # run's time goes, for an A/B of a form that adds or moves launches. KT_W names the
  # workloads (v41-chunk), KT_ARGS further bench arguments (e.g. --precision fast);
  # $DSA_CUDA_HOOKS and $DSA_CUDA_DEFINES apply as to the benchmark.
  for wl in ${KT_W:-v41-chunk}; do
    log "kernel times $wl ${KT_ARGS:-}"
    timeout 180 ncu --clock-control none --metrics gpu__time_duration.sum $B/dsa-indexer bench \
      --device cuda --json $wl ${KT_ARGS:-} --reps 1 > "$OUT/ktimes-$wl.txt" 2>&1
    python3 benches/kernel_times.py "$OUT/ktimes-$wl.txt" | tee -a "$OUT/summary.txt"
  done
fi

if has ncutk; then
  # Hardware counters of the shared-memory row's top-k on v32-16k.
  log "ncu topk_short_f32"
  timeout 180 ncu --clock-control none -k regex:topk_short -c 1 \
    --section SpeedOfLight --section WarpStateStats --section InstructionStats \
    --section SchedulerStats --section Occupancy $B/dsa-indexer bench --device cuda --json v32-16k --reps 1 \
    > "$OUT/ncu-topk.txt" 2>&1
fi

if has phases; then
  # The sampled top-k's phases on v32-64k fast (49,045 sampled rows): each run stops the
  # sampled rows after phase N (TK_STOP, profiling only: those rows' outputs are left
  # unwritten), so the selection time of N minus that of N - 1 is phase N's cost: 1 the
  # sample's threshold, 2 the collecting pass, 3 the exact threshold among the
  # candidates, 4 the ties, 0 the whole row (the ids written). 9 stops every row at once
  # (the launches alone). Needs the `tuning` build.
  log "sampled top-k phases"
  for n in 9 1 2 3 4 0; do
    printf 'TK_STOP=%s ' "$n" | tee -a "$OUT/summary.txt"
    DSA_CUDA_DEFINES="TK_STOP=$n" timeout 120 $B/dsa-indexer bench --device cuda --json \
      --precision fast v32-64k --reps 5 2>&1 | grep '^{' | python3 -c \
      'import json,sys; r=json.loads(sys.stdin.read()); print("selection %.3f ms, logits %.3f ms" % (r["select_ms"], r["logits_ms"]))' \
      | tee -a "$OUT/summary.txt"
  done
fi

if has torch; then
  log "torch.topk"
  timeout 120 python3 benches/torch_topk.py 2>&1 | tail -5 >> "$OUT/summary.txt"
fi
if has sanitize; then
  # compute-sanitizer over the GPU tests (.gpu/bin/cuda) and `run --device cuda`: each
  # tool with --error-exitcode 1, its log under $OUT/sanitize/, and one summary line
  # with the exit status, the tool's error count and its hazards (racecheck); a line
  # with a nonzero rc, errors, hazards or TIMEOUT fails the part. memcheck takes every
  # GPU test; racecheck the shared-memory row's top-k, the boundary sizes (every
  # kernel's shared-memory staging at its tile edges, in four tests) and one row on the
  # cluster top-k (its distributed shared memory); initcheck and synccheck the special
  # values and the golden files, which reach every kernel, synccheck also the cluster's
  # row. SAN_ONLY="NAME ..." runs only the named runs, a name also taking those it
  # prefixes up to a '-' (memcheck; racecheck-bounds-logits-short, -logits-tiles, -topk
  # and -split: the boundary sizes' four tests, 134, 111, 16 and 25 s on an H100;
  # racecheck-topk: the shared-memory row and the cluster's row; initcheck, synccheck,
  # run-memcheck). The timeouts cap the part at 1,295 s; in three parts of under 10
  # minutes each: SAN_ONLY=racecheck-bounds-logits (360 s at most),
  # SAN_ONLY="racecheck-bounds-topk racecheck-bounds-split" (360 s), and
  # SAN_ONLY="memcheck racecheck-topk initcheck synccheck run-memcheck" (575 s).
  # A TIMEOUT line asks for a narrower filter, not a longer cap.
  log "compute-sanitizer"
  mkdir -p "$OUT/sanitize"
  san_fail=0 san_runs=0
  san() {  # san NAME TOOL SECONDS COMMAND...
    local name="$1" tool="$2" secs="$3"; shift 3
    if [ -n "${SAN_ONLY:-}" ]; then
      local want picked=0
      for want in $SAN_ONLY; do [[ "$name" == "$want" || "$name" == "$want"-* ]] && picked=1; done
      [ $picked = 1 ] || return 0
    fi
    san_runs=$((san_runs + 1))
    local logf="$OUT/sanitize/$name.txt"
    DSA_REQUIRE_GPU=1 timeout "$secs" compute-sanitizer --tool "$tool" --error-exitcode 1 \
      --print-limit 50 --log-file "$logf" "$@" > "$OUT/sanitize/$name.out" 2>&1
    local rc=$?
    cat "$OUT/sanitize/$name.out" >> "$logf"; rm -f "$OUT/sanitize/$name.out"
    local errors hazards status=ok
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+|hazards displayed \([0-9]+" "$logf" | tail -1 | grep -oE "[0-9]+$")
    hazards=$(grep -oE "RACECHECK SUMMARY: [0-9]+ hazard" "$logf" | tail -1 | grep -oE "[0-9]+ " | tr -d ' ')
    [ "$rc" -eq 124 ] && status=TIMEOUT
    if [ "$rc" -ne 0 ] || [ "${errors:-0}" != 0 ] || [ "${hazards:-0}" != 0 ]; then
      [ "$status" = ok ] && status=FAILED
      san_fail=$((san_fail + 1))
    fi
    echo "sanitize $name ($tool, ${secs}s): $status rc=$rc errors=${errors:-?} hazards=${hazards:--}" \
      | tee -a "$OUT/summary.txt"
  }
  T="$B/cuda --test-threads=1"
  san memcheck memcheck 240 $T
  san racecheck-bounds-logits-short racecheck 180 $T --exact \
    boundary_sizes_of_the_logits_tiles_within_one_key_tile
  san racecheck-bounds-logits-tiles racecheck 180 $T --exact boundary_sizes_of_the_logits_tiles
  san racecheck-bounds-topk racecheck 180 $T --exact boundary_sizes_of_the_topk_rows
  san racecheck-bounds-split racecheck 180 $T --exact boundary_sizes_of_split_rows_and_source_layers
  san racecheck-topk racecheck 240 $T --exact topk_short_rows_in_shared_memory_match_a_full_sort \
    topk_cluster_one_row_for_the_sanitizers
  san initcheck initcheck 25 $T special_values golden_vectors
  san synccheck synccheck 40 $T special_values golden_vectors topk_cluster_one_row_for_the_sanitizers
  san run-memcheck memcheck 30 $B/dsa-indexer run --device cuda --json
  echo "sanitize: $san_fail of $san_runs runs failed" | tee -a "$OUT/summary.txt"
fi

if has old; then
  # The benchmark on a build of an earlier commit, staged in .gpu/old/ (its bench
  # binary, and its GPU tests binary for racecheck), in the same run as `bench`: the
  # regression check of a change, workload by workload.
  if [ -x .gpu/old/dsa-cuda-bench ]; then
    log "bench at the earlier build (.gpu/old, median of 5)"
    timeout 300 .gpu/old/dsa-cuda-bench $W --reps 5 > "$OUT/bench-old.jsonl" 2>> "$OUT/summary.txt"
    cat "$OUT/bench-old.jsonl" >> "$OUT/summary.txt"
  fi
  if [ -x .gpu/old/cuda ]; then
    log "racecheck at the earlier build"
    DSA_REQUIRE_GPU=1 timeout 120 compute-sanitizer --tool racecheck --print-limit 20 \
      .gpu/old/cuda --test-threads=1 --exact topk_short_rows_in_shared_memory_match_a_full_sort \
      > "$OUT/racecheck-old.txt" 2>&1
    grep -E "RACECHECK SUMMARY|ERROR SUMMARY|test result" "$OUT/racecheck-old.txt" | sed 's/^/earlier build: /' \
      | tee -a "$OUT/summary.txt"
  fi
fi

if has replay; then
  # Every flat golden file through `replay --device cuda`: each must be identical.
  log "replay --device cuda over the golden files"
  rp_fail=0
  for f in "$DSA_GOLDEN_DIR"/*.safetensors; do
    case "$(basename "$f")" in quantizers*) continue ;; esac
    v=$(timeout 60 $B/dsa-indexer replay "$f" --device cuda 2>&1 | grep '^verdict' || echo "verdict: (none)")
    echo "replay $(basename "$f"): $v" | tee -a "$OUT/summary.txt"
    [ "$v" = "verdict: identical" ] || rp_fail=$((rp_fail + 1))
  done
  echo "replay: $rp_fail files not identical" | tee -a "$OUT/summary.txt"
fi

if has decode && ! has bench; then
  # The decode workloads alone, ours and the peers, and their tables (bench runs them too).
  log "bench decode (median of 5)"
  timeout 240 $B/dsa-indexer bench --device cuda --json $DW --reps 5 > "$OUT/bench.jsonl" 2>> "$OUT/summary.txt"
  log "bench decode, fast precision (median of 5)"
  timeout 240 $B/dsa-indexer bench --device cuda --json --precision fast $PDW --reps 5 >> "$OUT/bench.jsonl" 2>> "$OUT/summary.txt"
  cat "$OUT/bench.jsonl" >> "$OUT/summary.txt"
  peers_run --no-ceilings $PDW
  python3 benches/table.py "$OUT" > "$OUT/table.md" 2>&1
  cat "$OUT/table.md" >> "$OUT/summary.txt"
fi

if has peers && ! has bench; then
  # The peers alone (bench runs them too).
  peers_run --accuracy $PW $PDW
  tail -40 "$OUT/peers.txt" >> "$OUT/summary.txt"
fi

if has accuracy; then
  # peers.py's accuracy part (DeepGEMM's |x - ref| / M on random v32 data), its problem
  # written to $OUT/accuracy_problem.safetensors; then ours on the same problem at both
  # precisions (`dsa-indexer logits --device cuda --precision P`), each measured the same
  # way beside DeepGEMM's (or $OURS, a file of other logits of that problem).
  log "peers accuracy"
  install_wheels
  prob="$OUT/accuracy_problem.safetensors"
  PYTHONUNBUFFERED=1 timeout 300 python3 benches/peers.py --accuracy-only \
    --accuracy-save "$prob" ${OURS:+--ours "$OURS"} > "$OUT/accuracy.txt" 2>&1
  echo "accuracy rc=$?" | tee -a "$OUT/summary.txt"
  for p in full fast; do
    if [ -s "$prob" ] && timeout 120 $B/dsa-indexer logits "$prob" --device cuda --precision $p \
        --out "$OUT/ours_$p.safetensors" >> "$OUT/accuracy.txt" 2>&1; then
      PYTHONUNBUFFERED=1 timeout 300 python3 benches/peers.py --accuracy-only \
        --ours "$OUT/ours_$p.safetensors" 2>&1 | sed "s/\"peer\": \"ours\"/\"peer\": \"ours ($p)\"/" >> "$OUT/accuracy.txt"
      rm -f "$OUT/ours_$p.safetensors"
    fi
  done
  grep '^{' "$OUT/accuracy.txt" > "$OUT/accuracy.jsonl"
  grep '"mode": "accuracy"' "$OUT/accuracy.jsonl" | tee -a "$OUT/summary.txt"
fi

if has pyengine; then
  # A real engine's layer through the Python package, then the package's tests.
  log "pyengine: deepgemm_check.py"
  install_wheels
  PYTHONUNBUFFERED=1 timeout 300 python3 python/examples/deepgemm_check.py ${PYENGINE_ARGS:-} \
    > "$OUT/deepgemm_check.txt" 2>&1
  echo "deepgemm_check rc=$?" | tee -a "$OUT/summary.txt"
  grep '^{' "$OUT/deepgemm_check.txt" > "$OUT/deepgemm_check.jsonl"
  grep -vE '^\{' "$OUT/deepgemm_check.txt" | head -20 | tee -a "$OUT/summary.txt"
  log "pyengine: pytest python/tests"
  [ -x $B/dsa-indexer ] && export DSA_INDEXER_BIN="$PWD/$B/dsa-indexer"
  # With the CUDA wheel installed (install_wheels), a skip of a CUDA test is a failure.
  req=0
  ls .whl-cuda/dsa_indexer-*.whl > /dev/null 2>&1 && req=1
  DSA_REQUIRE_GPU=$req timeout 300 python3 -m pytest -q -rf -p no:cacheprovider python/tests > "$OUT/pytest.txt" 2>&1
  echo "pytest rc=$?" | tee -a "$OUT/summary.txt"
  tail -3 "$OUT/pytest.txt" | tee -a "$OUT/summary.txt"
fi

if has clocks; then
  # The SM clock, board power and the driver's clock-event reasons while each long run
  # works: ours (fast precision) on v32-16k, v32-64k and v32-64k-tail (its last 8192 rows,
  # about 4 s back to back), then DeepGEMM's logits kernel alone on those rows and the fp8
  # matmul ceiling, each back to back for 4 s (benches/clock_probe.py); nvidia-smi samples
  # every 20 ms (clocks-NAME.csv; it refreshes about every 100 ms).
  # One line per phase: the median and lowest SM clock, the median power and the reasons
  # mask seen most over the samples at which the GPU was busy (0x4 software power cap,
  # 0x8 hardware slowdown, 0x20 / 0x40 thermal, 0x80 power brake). A kernel that holds a
  # lower clock than its peer for the same work draws more power for it.
  log "clocks"
  install_wheels
  why=clocks_event_reasons.active  # clocks_throttle_reasons.active before driver 535
  nvidia-smi --query-gpu=$why --format=csv > /dev/null 2>&1 || why=clocks_throttle_reasons.active
  sample() {  # sample NAME COMMAND...
    local name="$1"; shift
    nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,utilization.gpu,$why \
      --format=csv,noheader,nounits -lms 20 > "$OUT/clocks-$name.csv" 2>&1 &
    local smi=$!
    "$@" >> "$OUT/clocks.txt" 2>&1
    kill $smi 2> /dev/null; wait $smi 2> /dev/null
    python3 - "$OUT/clocks-$name.csv" "$name" << 'PY' | tee -a "$OUT/summary.txt"
import collections, statistics, sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        mhz, watts, temp, util = float(f[0]), float(f[1]), float(f[2]), float(f[3])
    except (ValueError, IndexError):
        continue
    if util > 50:
        rows.append((mhz, watts, temp, f[4] if len(f) > 4 else "?"))
if rows:
    mhz, watts, temp, why = zip(*rows)
    common = collections.Counter(why).most_common(2)
    print(f"clocks {sys.argv[2]}: {len(rows)} busy samples, SM {statistics.median(mhz):.0f} MHz "
          f"median, {min(mhz):.0f} lowest; {statistics.median(watts):.0f} W median; {max(temp):.0f} C max; "
          f"reasons {', '.join(f'{m} x{c}' for m, c in common)}")
else:
    print(f"clocks {sys.argv[2]}: no busy samples")
PY
  }
  sample ours-16k timeout 120 $B/dsa-indexer bench --device cuda --json --precision fast v32-16k --reps 40
  sample ours-64k timeout 180 $B/dsa-indexer bench --device cuda --json --precision fast v32-64k --reps 20
  sample ours-64k-tail timeout 120 $B/dsa-indexer bench --device cuda --json --precision fast v32-64k-tail --reps 400
  sample deepgemm-64k timeout 120 python3 benches/clock_probe.py --seconds 4
  sample matmul-fp8 timeout 60 python3 benches/clock_probe.py --matmul --seconds 4
  grep '^{' "$OUT/clocks.txt" | grep -o '"name": "[^"]*"\|"median_ms": [0-9.]*\|"logits_ms": [0-9.]*\|"peer": "[^"]*"' \
    | paste -sd' ' | tee -a "$OUT/summary.txt"
fi

log "done"
[ "${san_fail:-0}" -eq 0 ] && [ "${rp_fail:-0}" -eq 0 ]
