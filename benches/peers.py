#!/usr/bin/env python3
"""Peers of the CUDA indexer, measured on the workload shapes of `src/cuda/bench.rs`.

The crate's speed claims are ratios against these figures, taken in the same run on
the same GPU. Peers:

- DeepGEMM's logits kernel, `deep_gemm.fp8_fp4_mqa_logits((q, None), (k, kscale),
  weights, ks, ke, clean_logits, max_seqlen_k=0)`, from the PyPI wheel
  `sgl-deep-gemm==0.1.4.post1` (with its pin `apache-tvm-ffi==0.1.11`). It returns
  `[T, L]` f32 logits (a view with a padded row stride). Timed with
  `clean_logits=False` (the kernel alone) and with `clean_logits=True` (plus DeepGEMM's
  own kernel that writes -inf outside each row's `[ks, ke)`).
- `torch.topk(logits, K, dim=-1)` (sorted, as engines call it) on those logits, after
  the invisible columns are set to -inf. Two ways of masking are timed: DeepGEMM's
  `clean_logits=True` (what an engine that calls torch.topk on DeepGEMM's output
  passes), and a torch `masked_fill_` of a column-index comparison (`torch_mask`,
  timed on its own).
- FlashInfer's radix top-k as an engine calls it on DeepGEMM's logits:
  `flashinfer.top_k_page_table_transform(logits, page_table, lengths, K, row_to_batch,
  row_starts=ks)` on the unmasked, strided `[T, L]` logits, one request's identity page
  table (so an index comes back as the key `ks + i`), `lengths = ke - ks`. (Its ragged
  variant wants contiguous rows, which DeepGEMM's padded view is not; the page-table
  entry takes the row stride.) It runs through our C ABI
  (`benches/flashinfer_topk/binding.cu`: the call FlashInfer's own launcher makes, its
  FilteredTopK / multi-CTA RadixTopK heuristic included), built from the
  flashinfer-python wheel by `benches/flashinfer_topk/build.sh` into
  `.whl/flashinfer_topk/libdsa_fi_topk.so` (or `--flashinfer-so`, or
  `$DSA_FI_TOPK_SO`) and loaded with ctypes. Its selection is checked against
  `torch.topk`'s on the same logits, up to exact ties (`--check`, and once per workload).
  When the library is missing or does not load, the script prints
  "flashinfer: not available (why)" and measures the rest.
- Two ceilings, once per run: a 2 GiB device-to-device copy (GB/s read + write) and
  8192^3 matmuls through torch (bf16, and fp8 e4m3 through `torch._scaled_mm`).

Workloads (one request of `S` tokens, its last `rows` positions as query rows, ratio
1, so row `i` at position `p = S - rows + i` sees keys `[ks, ke) = [0, p + 1)`; `L = S`):

| name      | format      | H  | D   | K    | S       | rows  |
|-----------|-------------|----|-----|------|---------|-------|
| v32-16k   | e4m3 x e4m3 | 64 | 128 | 2048 | 16384   | 16384 |
| v32-64k   | e4m3 x e4m3 | 64 | 128 | 2048 | 65536   | 65536 |
| v32-64k-tail | e4m3 x e4m3 | 64 | 128 | 2048 | 65536 | 8192 (one call) |
| v41-chunk | e2m1 x e2m1 | 32 | 128 | 512  | 262144  | 4096  |
| v41-chunk-wide | e2m1 x e2m1, uniform scales | 32 | 128 | 512 | 262144 | 4096 |
| v41-1m    | e2m1 x e2m1 | 32 | 128 | 512  | 1048576 | 16384 |

Inputs are drawn as `dsa-indexer bench` (src/bin/cli/bench.rs) draws them, in
distribution, not bit for bit (torch's generator, not ChaCha8): E4M3 codes are uniform
random bytes with the NaN codes (`b & 0x7F == 0x7F`) mapped to `b & 0xF7`, per-key
scales uniform in [0.5, 2), weights uniform in [-1, 1). fp4 inputs are engine-like: f32
activations, each element a standard normal times `2^u_c` with one `u_c` per channel
(per (head, channel) for queries, per channel for keys) uniform in [-2, 2], through a
torch copy of SPEC 2's fp4 block quantizer (DeepGEMM's floor; `--check` compares it with
the crate's golden quantizer vectors). `v41-chunk-wide` keeps the stress draw: uniform
random E2M1 bytes and UE8M0 block scales uniform in 124..=130 (2^-3 .. 2^3), one per 32
elements. `dsa-indexer bench`'s v41-chunk-source and v41-1m-256m have the shapes of
v41-chunk and v41-1m here.

fp4 workloads: on SM90 this DeepGEMM has no fp4 logits kernel (its fp4 path is
SM100 only). The script probes it once in a child process, so that a failure cannot
take the measuring process down, and prints what the probe said. Then the peer runs on
E4M3 converted from the fp4 data: q and k are decoded to f32 (code value times its
block scale) and quantized to E4M3 with a power-of-two scale per (row, head) of q and
per key of k (`scale = 2^ceil(log2(max(amax, 1e-4) / 448))`), the q scale folded into
the weights and the k scale passed as DeepGEMM's per-key scale. The conversion is exact
when each vector's group scales (over groups holding a nonzero code) span at most 14
binades: every value of group g is a multiple of `0.5 * 2^(e_g - 127)` with at most two
significant bits, the vector's scale is at most `2^(e_max - 127 - 6)` (`amax <= 6 *
2^(e_max - 127)`, and `6 / 448` rounds up to `2^-6`), so every scaled value is a
multiple of `2^(e_g - e_max - 1 + 6) >= 2^-9`, E4M3's subnormal step, and at most 448.
The engine-like draw spans a binade or two and the uniform one at most 6, so it holds on
every workload; the script verifies it bit for bit (`conversion_exact`): the peer then
computes the same function as the crate. The conversion (torch ops, not a fused
kernel) is timed on its own and reported, q and k apart; it is not part of any other
figure.

Decode workloads (`v32-decode-b64-32k`: 64 requests of 32768 keys, `next_n` 1;
`v32-decode-b128-128k-mtp2`: 128 requests of 131072 keys, `next_n` 2; E4M3 as v32-16k,
pages of 64; `dsa-indexer bench`'s v41-decode-b64-64k has E2M1 keys and no peer here).
Inputs drawn as bench.rs draws them, in distribution: weights `[B * next_n, H]`, queries
`[B, next_n, H, D]`, each request's keys and per-key scales, written into SPEC 10's pool
(`u8 [pages, 64 * 132]`: 64 x 128 E4M3 codes, then 64 f32 scales) of exactly the pages
used, handed out in a random page order; the page table `i32 [B, L / 64]`. The peers:

- DeepGEMM's paged logits, `deep_gemm.fp8_fp4_paged_mqa_logits((q, None), kv_cache,
  weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits)`
  with `kv_cache` the pool viewed as `u8 [pages, 64, 1, 132]`, `context_lens` int32
  `[B, next_n]` (row `n` of request `b` sees `L_b - next_n + n + 1` keys; `[B]` with
  `L_b` where this DeepGEMM refuses the 2-D form; the line says which it took) and
  `schedule_meta = get_paged_mqa_logits_metadata(context_lens, 64, get_num_sms())`. It
  returns `[B * next_n, max_context_len]` f32. The metadata is timed on its own: engines
  compute it once per decode step for all layers, so it is in no other figure.
- FlashInfer's top-k, `top_k_page_table_transform` on the unmasked logits with each row's
  length, no row starts, each row's request and the engine's token-level slot table
  (`page_table[b, j // 64] * 64 + j % 64`), so an index comes back as a pool slot
  (SPEC 10's `page`); its selection is mapped back to keys and checked against
  torch.topk's, once per workload.
- `torch.topk` on DeepGEMM's `clean_logits=True` output.

End to end: the logits call plus the top-k, one region. Every figure of a decode line
carries `kv_bytes`, the floor of the KV-cache bytes read (every used page once per
request, `sum_b ceil(L_b / 64) * 64 * 132`), and the logits and end-to-end figures
`kv_gbs` and `kv_ceiling_fraction` against the 4.3 TB/s copy ceiling. DeepGEMM's
logits of the first, middle and last request are checked against the float64 reference
over the flat keys (2^-8 M), and `clean_logits=True` for -inf past each row's keys. One
input set (every pool is larger than two L2s); `--shrink N` divides the keys per
request by N.

Row chunking: as the serving engine does (the crate's default budget too), a
workload whose `[T, L]` f32 logits exceed `--budget` (2 GiB) runs in chunks of
`budget // (4 L)` consecutive rows, each chunk a DeepGEMM call (all L keys) followed
by its top-k, the logits buffer reused; chunk times are summed per repetition. When
chunked logits would still fit `--full-max` (8 GiB), the single call is measured too.
So v32-16k is one call; v32-64k runs in 8 chunks; v41-chunk in 2 chunks and also as
one call (4 GiB); v41-1m in 32 chunks (its full logits are 64 GiB).

Timing: CUDA events around each region, after a warm-up call (DeepGEMM compiles its
kernel on first use) and one discarded repetition, median of `--reps`. Input sets
smaller than two L2s (120 MB) are replicated (up to 4 sets) and rotated between
repetitions. Effective TFLOP/s = `2 * valid_pairs * H * D / t` with
`valid_pairs = sum over rows of (ke - ks)`; top-k rates are given as GB/s of logits
read (`4 * rows * L / t`, what torch.topk reads) and as `4 * valid_pairs / t` (the
crate's `topk_gbs`).

Output: one JSON line per workload, mode and peer part, then a human table
(`benches/table.py` puts them beside `dsa-indexer bench --json`'s lines).
Exit status: 0 when every requested part ran, 1 when a workload (or a check) failed,
2 when deep_gemm cannot be imported. FlashInfer being unavailable is not a failure;
a FlashInfer call that fails, or selects differently from torch.topk, is.

Usage (on the GPU machine; the wheels in `.whl/`):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 benches/peers.py --check                  # DeepGEMM vs a float64 reference
    python3 benches/peers.py --accuracy-only [--ours FILE]   # |x - ref| / M on random v32 data
    python3 benches/peers.py [WORKLOAD ...] [--reps N] [--no-ceilings]

`--check` compares DeepGEMM's logits on small ragged problems (fp8, and fp4 converted
to fp8; H = 32 and 64) against a float64 reference computed in torch, and reports
`max |x - ref| / M` as a power of two, `M = kscale * sum_h |w_h| * sum_d |q_d k_d|`
(block scales included): the tolerance class of SPEC 4 bounds it by 2^-8. It also
checks that `clean_logits=True` writes -inf outside `[ks, ke)` and the same bits
inside, that row chunks give the same bits as one call, that top-k after the mask
selects only visible keys, and that FlashInfer's top-k on the unmasked logits selects
the same values as torch.topk on the masked ones (ragged rows, rows shorter than K).
First it compares the torch fp4 block quantizer with the crate's golden vectors
(`tests/golden/quantizers.safetensors`). `benches/peers_test.py` tests the selection
comparison, the quantizer and the loader on the CPU.

`--accuracy` (or `--accuracy-only`) measures DeepGEMM's error on random data, the figure
issue 16's fast mode is to report beside its own: one request of `--accuracy-keys`
(32768) keys, its last `--accuracy-rows` (256) positions the rows, E4M3 x E4M3 at H = 64,
D = 128, drawn as the v32 workloads (uniform E4M3 codes away from NaN, key scales in
[0.5, 2), weights in [-1, 1)) from a fixed seed. DeepGEMM's `fp8_fp4_mqa_logits` (the
flat call above) against SPEC 4's logits computed in float64 on the device
(`spec4_f64`: decoded E4M3 values, relu, weights, key scale), each over SPEC 4's
magnitude `M`; the JSON line (`"mode": "accuracy"`) gives the distribution of
`|x - ref| / M` over every visible (row, key): max, p99.9 and median (as log2 and as
`2^x`), and the share equal to the float64 value. A max past `2^-8` is a failure.
`--accuracy-save FILE` writes the problem as a crate dump (SPEC 9), and `--ours FILE`
reads our logits of it (safetensors: `logits` or `engine_logits` F32 `[T, L]`, or
`expected_logits` F32 `[sum n]`, the crate's layout; a file that also holds `q`, `k`,
`k_scale` or `weights` must hold this problem's) and reports them the same way, in the
same run. `benches/peers_test.py` checks `spec4_f64` against the crate's CPU reference
(with numpy, no torch needed).

`--emulate` replaces deep_gemm by a torch stand-in (`EmulatedDeepGemm`, the same
formula in f32), and FlashInfer by one too (`EmulatedFlashInferTopK`, the page-table
transform's contract in torch; unless `--flashinfer-so` names a library), so the
harness can be tried on a machine without a GPU, e.g.
`python3 benches/peers.py --emulate --shrink 128 --reps 1 --check`. Its figures are
labelled `EMULATED:` and are never peer figures. `--shrink N` divides S and rows by N
(and the budget by N^2, so the chunk count stays), for quick trials.
"""

import argparse
import ctypes
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback

try:
    import torch
except ImportError:
    # Importable (and --help) without torch: main() refuses to run, and spec4_f64 takes
    # numpy arrays too (benches/peers_test.py checks it against the crate without torch).
    torch = None

GIB = 1 << 30
L2_BYTES = 60_000_000
E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SPEC_BOUND_LOG2 = -8.0

WORKLOADS = {
    "v32-16k": dict(fp4=False, heads=64, dim=128, topk=2048, seq_len=16384, rows=16384),
    "v32-64k": dict(fp4=False, heads=64, dim=128, topk=2048, seq_len=65536, rows=65536),
    "v32-64k-tail": dict(fp4=False, heads=64, dim=128, topk=2048, seq_len=65536, rows=8192),
    "v41-chunk": dict(fp4=True, heads=32, dim=128, topk=512, seq_len=262144, rows=4096),
    "v41-chunk-wide": dict(fp4=True, heads=32, dim=128, topk=512, seq_len=262144, rows=4096, draw="uniform"),
    "v41-1m": dict(fp4=True, heads=32, dim=128, topk=512, seq_len=1 << 20, rows=16384),
    # Decode over paged keys (src/cuda/bench.rs): `requests` requests of `seq_len` tokens,
    # each request's `rows` newest positions (next_n) its query rows, keys in pages of 64.
    "v32-decode-b64-32k": dict(fp4=False, heads=64, dim=128, topk=2048, seq_len=32768, rows=1, decode=dict(requests=64, page_size=64)),
    "v32-decode-b128-128k-mtp2": dict(fp4=False, heads=64, dim=128, topk=2048, seq_len=131072, rows=2, decode=dict(requests=128, page_size=64)),
    "v32-decode-b1-128k": dict(fp4=False, heads=64, dim=128, topk=2048, seq_len=131072, rows=1, decode=dict(requests=1, page_size=64)),
}
KV_COPY_CEILING_GBS = 4300.0


def emit(obj):
    """Print one JSON line now."""
    print(json.dumps(obj), flush=True)


def note(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# The stand-in for deep_gemm (harness tests only)
# ---------------------------------------------------------------------------------------


class EmulatedDeepGemm:
    """Stand-in for `deep_gemm` under `--emulate`: NOT a peer.

    The same formula as DeepGEMM's SM90 logits kernel (`sum_h w_h relu(q_h . k) * kscale`)
    in f32 torch ops, with DeepGEMM's output shape (a `[T, L]` view of a buffer whose
    rows are `L + 256` long). Columns outside `[ks, ke)` hold a huge finite value, as
    uninitialised memory would, unless `clean_logits=True` writes -inf there. Packed
    fp4 is refused as DeepGEMM refuses it on SM90.
    """

    __version__ = "emulated"

    @staticmethod
    def fp8_fp4_mqa_logits(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0, logits_dtype=None):
        q8, q_sf = q
        k8, k_sf = kv
        if q_sf is not None:
            raise RuntimeError("emulated deep_gemm: packed fp4 is refused (Unsupported architecture)")
        assert max_seqlen_k == 0
        assert q8.dtype == torch.float8_e4m3fn and k8.dtype == torch.float8_e4m3fn
        assert k_sf.dtype == torch.float32 and weights.dtype == torch.float32
        assert ks.dtype == torch.int32 and ke.dtype == torch.int32
        t, h, d = q8.shape
        l = k8.shape[0]
        assert k8.shape == (l, d) and k_sf.shape == (l,) and weights.shape == (t, h)
        buf = torch.empty((t, align(l + 256, 8)), dtype=torch.float32, device=q8.device)
        out = buf[:, :l]
        kf = k8.float()
        cols = torch.arange(l, device=q8.device)
        fill = float("-inf") if clean_logits else 3.0e38
        step = max(1, (1 << 22) // max(1, h * l))
        for r0 in range(0, t, step):
            r1 = min(t, r0 + step)
            s = torch.einsum("rhd,ld->rhl", q8[r0:r1].float(), kf).clamp_min_(0.0)
            v = (s * weights[r0:r1, :, None]).sum(1) * k_sf[None, :]
            inside = (cols[None, :] >= ks[r0:r1, None].long()) & (cols[None, :] < ke[r0:r1, None].long())
            out[r0:r1] = torch.where(inside, v, torch.full_like(v, fill))
        return out


    @staticmethod
    def get_num_sms():
        return 132

    @staticmethod
    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms, indices=None):
        assert context_lens.dtype == torch.int32 and block_kv == 64 and indices is None
        return torch.zeros((num_sms + 1, 2), dtype=torch.int32, device=context_lens.device)

    @staticmethod
    def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits=False, logits_dtype=None, indices=None):
        """The paged kernel's contract: row `b * next_n + n` holds, for the keys `j <
        len(b, n)` of request `b` (`context_lens[b, n]`, or `context_lens[b] - next_n + n + 1`
        when it is `[B]`), `sum_h w_h relu(q_h . k_j) * kscale_j`, each key read from page
        `block_table[b, j // P]` of `kv_cache` (SPEC 10's E4M3 layout: P x D codes, then
        P f32 scales)."""
        q8, q_sf = q
        if q_sf is not None:
            raise RuntimeError("emulated deep_gemm: packed fp4 is refused (Unsupported architecture)")
        assert q8.dtype == torch.float8_e4m3fn and kv_cache.dtype == torch.uint8 and indices is None
        b, next_n, h, d = q8.shape
        pages, p, one, width = kv_cache.shape
        assert one == 1 and width == d + 4 and weights.shape == (b * next_n, h)
        lens = decode_row_lens(context_lens, next_n)
        raw = kv_cache.reshape(pages, p * width)
        codes = raw[:, : p * d].contiguous().view(torch.float8_e4m3fn).reshape(pages, p, d)
        scales = raw[:, p * d :].contiguous().view(torch.float32).reshape(pages, p)
        buf = torch.empty((b * next_n, align(max_context_len, 256)), dtype=torch.float32, device=q8.device)
        buf.fill_(float("-inf") if clean_logits else 3.0e38)
        out = buf[:, :max_context_len]
        for r in range(b):
            n_keys = int(lens[r * next_n : (r + 1) * next_n].max())
            ids = block_table[r, : (n_keys + p - 1) // p].long()
            kf = codes[ids].reshape(-1, d)[:n_keys].float()
            sc = scales[ids].reshape(-1)[:n_keys]
            s_ = torch.einsum("nhd,ld->nhl", q8[r].float(), kf).clamp_min_(0.0)
            v = (s_ * weights[r * next_n : (r + 1) * next_n, :, None]).sum(1) * sc[None, :]
            for n in range(next_n):
                m = int(lens[r * next_n + n])
                out[r * next_n + n, :m] = v[n, :m]
        return out


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------


def align(x, a):
    return (x + a - 1) // a * a


def median(v):
    """The upper median, as bench.rs takes it."""
    s = sorted(v)
    return s[len(s) // 2] if s else float("nan")


def log2_str(x):
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    return f"2^{math.log2(x):.2f}"


class Clock:
    """Times a region: CUDA events on the current stream, or the wall clock on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def time(self, fn):
        if self.cuda:
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            r = fn()
            e1.record()
            e1.synchronize()
            return e0.elapsed_time(e1), r
        t0 = time.perf_counter()
        r = fn()
        return (time.perf_counter() - t0) * 1e3, r

    def mark(self):
        """A point on the stream (a recorded event), for `elapsed` once the stream has
        passed it: times inside a region that `time` measures whole."""
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed(self, m0, m1):
        """Milliseconds between two marks (the stream has passed both)."""
        if self.cuda:
            return m0.elapsed_time(m1)
        return (m1 - m0) * 1e3

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------
# Inputs: drawn as bench.rs draws them, decoded, and converted
# ---------------------------------------------------------------------------------------


def fp8_matmul(m, dev, fast):
    """An `m^3` fp8 e4m3 matmul through `torch._scaled_mm` (bf16 out): the fp8 ceiling, as a
    call to time."""
    a8 = (torch.randn(m, m, device=dev) * 8).to(torch.float8_e4m3fn)
    b8 = (torch.randn(m, m, device=dev) * 8).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev, dtype=torch.float32)
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)


def rand_bytes(shape, g, dev, lo=0, hi=256):
    return torch.randint(lo, hi, shape, dtype=torch.uint8, generator=g, device=dev)


def rand_e4m3(shape, g, dev):
    """Uniform E4M3 bytes away from the NaN codes (bench.rs: `b & 0xF7` for `b & 0x7F == 0x7F`)."""
    b = rand_bytes(shape, g, dev)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xF7, b)
    return b.view(torch.float8_e4m3fn)


def rand_uniform(shape, lo, hi, g, dev):
    return torch.rand(shape, generator=g, device=dev, dtype=torch.float32) * (hi - lo) + lo


def ue8m0_to_f32(e):
    """UE8M0 bytes to f32 `2^(e - 127)`, bit exact (e = 0 is the subnormal 2^-127)."""
    bits = (e.to(torch.int32) << 23).view(torch.float32)
    return torch.where(e == 0, torch.full_like(bits, 2.0**-127), bits)


def ue8m0_ceil(x):
    """SPEC 2's UE8M0 byte of the smallest power of two >= x (f32, > 0), clamped to [1, 254]
    (src/formats/ue8m0.rs `encode_ceil`; an f32 subnormal gives 1)."""
    bits = x.contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    e = torch.where(exp == 0, torch.ones_like(exp), exp + ((bits & 0x7FFFFF) != 0).to(torch.int32))
    return e.clamp(1, 254).to(torch.uint8)


# E2M1 code of each doubled magnitude 0..12 (entries off the grid are never looked up).
E2M1_CODE_OF_DOUBLED = [0, 1, 2, 3, 4, 0, 5, 0, 6, 0, 0, 0, 7]


def encode_e2m1(y):
    """SPEC 2's E2M1 codes of f32 `y`: round to nearest, ties to even, saturating to +-6; a
    result that rounds to zero is +0 (src/formats/e2m1.rs `encode`)."""
    a = y.abs()
    quantum = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    v = (torch.round(a / quantum) * quantum).clamp_max(6.0)  # torch.round: half to even
    table = torch.tensor(E2M1_CODE_OF_DOUBLED, dtype=torch.uint8, device=y.device)
    idx = table[(2.0 * v).long()]
    return torch.where((y < 0) & (v != 0), idx | 8, idx)


def quantize_fp4_blocks(x):
    """SPEC 2's fp4 block quantizer (DeepGEMM's floor) over the last dim of f32 `x` (a
    multiple of 32): per 32 elements `scale = pow2ceil(max(amax, 1e-4) / 6)` (the division
    in f32), codes of `x / scale`. Returns packed codes `[..., D/2]` (element 2i in the low
    nibble) and UE8M0 bytes `[..., D/32]`, as src/formats/quant.rs `quantize_fp4_blocks`."""
    if not torch.isfinite(x).all():
        raise ValueError("quantize_fp4_blocks: x holds NaN or infinity")
    g = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = g.abs().amax(dim=-1)
    e = ue8m0_ceil(amax.clamp_min(1e-4) / 6.0)
    codes = encode_e2m1(g / ue8m0_to_f32(e)[..., None]).reshape(x.shape)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), e


CHANNEL_LOG2_SPREAD = 2.0


def engine_like_fp4(shape, channels, g, dev):
    """Engine-like fp4 vectors of `shape` (`[..., P, D]`, `channels` the `[P, D]`
    per-channel exponents): f32 activations, a standard normal times `2^u_c`, through
    SPEC 2's fp4 block quantizer. As src/bin/cli/workload.rs draws them, in distribution."""
    x = torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * torch.exp2(channels)
    return quantize_fp4_blocks(x)


def channel_exponents(shape, g, dev):
    """Per-channel exponents `u_c`, uniform in [-CHANNEL_LOG2_SPREAD, CHANNEL_LOG2_SPREAD]."""
    return rand_uniform(shape, -CHANNEL_LOG2_SPREAD, CHANNEL_LOG2_SPREAD, g, dev)


def read_safetensors(path):
    """The tensors of a safetensors file as CPU torch tensors: U8, I32 and F32, and F8_E4M3
    as its code bytes (uint8); tensors of other dtypes are left out."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    dtypes = {"U8": torch.uint8, "I32": torch.int32, "F32": torch.float32, "F8_E4M3": torch.uint8}
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or t["dtype"] not in dtypes:
            continue
        a, b = t["data_offsets"]
        dt = dtypes[t["dtype"]]
        flat = torch.frombuffer(bytearray(data[a:b]), dtype=dt) if b > a else torch.zeros(0, dtype=dt)
        out[name] = flat.reshape(t["shape"])
    return out


def write_safetensors(path, tensors, metadata):
    """Write `tensors` (name -> (safetensors dtype, shape, bytes)) and `metadata` (values
    written as strings) as a safetensors file: the format of the crate's dumps (SPEC 9)."""
    header = {"__metadata__": {k: str(v) for k, v in metadata.items()}}
    off = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for _, (_, _, data) in tensors.items():
            f.write(data)


def tensor_bytes(t):
    """A tensor's bytes in C order (any device, any dtype)."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return b""
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def quantizer_matches_golden(path):
    """The torch fp4 block quantizer against the crate's golden quantizer vectors."""
    t = read_safetensors(path)
    packed, scale = quantize_fp4_blocks(t["x"])
    return bool(torch.equal(packed, t["expected_fp4_packed"]) and torch.equal(scale, t["expected_fp4_scale"]))


def decode_e2m1(packed, scale):
    """Packed E2M1 `[..., D/2]` (element 2i in the low nibble) times its UE8M0 block scales
    `[..., D/32]`, as f32 `[..., D]`. Exact: a code value times a power of two."""
    table = torch.tensor(E2M1_VALUES + [-v for v in E2M1_VALUES], dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    v = table[codes]
    return v * ue8m0_to_f32(scale).repeat_interleave(32, dim=-1)


def ceil_pow2(x):
    """The smallest power of two >= x (x > 0, normal), as DeepGEMM's `ceil_to_ue8m0`."""
    bits = x.view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp.clamp(1, 254) << 23).view(torch.float32)


def quantize_e4m3_pow2(x):
    """E4M3 codes of `x / s` with `s = ceil_pow2(max(amax, 1e-4) / 448)` over the last dim."""
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-4)
    s = ceil_pow2(amax / 448.0)
    return (x / s).to(torch.float8_e4m3fn), s.squeeze(-1)


def convert_q(q4, qs, w):
    """fp4 queries to E4M3 per (row, head), the scale folded into the weights (exact: a
    power of two). Returns the codes, the folded weights and the scales."""
    q8, s = quantize_e4m3_pow2(decode_e2m1(q4, qs))
    return q8, (w * s).contiguous(), s


def convert_k(k4, ks8):
    """fp4 keys to E4M3 per key, the scale as DeepGEMM's f32 per-key scale."""
    k8, s = quantize_e4m3_pow2(decode_e2m1(k4, ks8))
    return k8, s.contiguous()


def scale_span_stats(p):
    """How far each fp4 vector's group scales spread: the share of query (row, head)
    vectors and of keys whose UE8M0 bytes span 0, 1, ... binades (max - min)."""

    def shares(e):
        sp = (e.amax(dim=-1).to(torch.int32) - e.amin(dim=-1).to(torch.int32)).flatten()
        counts = torch.bincount(sp, minlength=int(sp.max()) + 1).tolist()
        return [round(c / sp.numel(), 6) for c in counts]

    return {"q": shares(p.qs), "k": shares(p.ks8)}


def conversion_exact(p):
    """True when problem `p`'s E4M3 data times its scales is its fp4 data, bit for bit,
    and its folded weights are `w` times the query scales."""
    ok = bool(torch.equal(p.w8, p.w * p.qscale))
    step = 1 << 16
    for a in range(0, p.k4.shape[0], step):
        ref = decode_e2m1(p.k4[a : a + step], p.ks8[a : a + step])
        got = p.k8[a : a + step].float() * p.kscale[a : a + step, None]
        ok &= bool(torch.equal(ref, got))
    step = max(1, (1 << 24) // (p.q4.shape[1] * p.q4.shape[2] * 2))
    for a in range(0, p.q4.shape[0], step):
        ref = decode_e2m1(p.q4[a : a + step], p.qs[a : a + step])
        got = p.q8[a : a + step].float() * p.qscale[a : a + step, :, None]
        ok &= bool(torch.equal(ref, got))
    return ok


class Problem:
    """One input set: what the crate takes (fp8 or fp4) and what DeepGEMM takes (fp8)."""

    def __init__(self, fp4, t, l, h, d, g, dev, draw="engine"):
        self.fp4 = fp4
        self.w = rand_uniform((t, h), -1.0, 1.0, g, dev)
        if fp4 and draw == "uniform":
            self.q4 = rand_bytes((t, h, d // 2), g, dev)
            self.qs = rand_bytes((t, h, d // 32), g, dev, 124, 131)
            self.k4 = rand_bytes((l, d // 2), g, dev)
            self.ks8 = rand_bytes((l, d // 32), g, dev, 124, 131)
        elif fp4:
            qc = channel_exponents((h, d), g, dev)
            kc = channel_exponents((d,), g, dev)
            self.q4, self.qs = engine_like_fp4((t, h, d), qc, g, dev)
            # Keys in slices, so the f32 activations of a long request never exist at once.
            step = 1 << 18
            parts = [engine_like_fp4((min(step, l - a), d), kc, g, dev) for a in range(0, l, step)]
            self.k4 = torch.cat([p[0] for p in parts])
            self.ks8 = torch.cat([p[1] for p in parts])
        if fp4:
            self.q8 = self.w8 = self.k8 = self.kscale = self.qscale = None
        else:
            self.q8 = rand_e4m3((t, h, d), g, dev)
            self.k8 = rand_e4m3((l, d), g, dev)
            self.kscale = rand_uniform((l,), 0.5, 2.0, g, dev)
            self.w8 = self.w

    def convert(self):
        self.q8, self.w8, self.qscale = convert_q(self.q4, self.qs, self.w)
        self.k8, self.kscale = convert_k(self.k4, self.ks8)

    def fp8_bytes(self):
        t, h, d = self.q8.shape if self.q8 is not None else (self.q4.shape[0], self.q4.shape[1], 2 * self.q4.shape[2])
        l = self.k8.shape[0] if self.k8 is not None else self.k4.shape[0]
        return t * h * d + l * d + 4 * l + 4 * t * h + 8 * t

    def decoded_rows(self, rows):
        """f64 `[R, H, D]` decoded query values (block scales applied) and `[R, H]` weights."""
        if self.fp4:
            return decode_e2m1(self.q4[rows], self.qs[rows]).double(), self.w[rows].double()
        return self.q8[rows].double(), self.w[rows].double()

    def decoded_keys(self, a, b):
        """f64 `[n, D]` decoded key values and `[n]` per-key scales (1 for fp4)."""
        if self.fp4:
            kf = decode_e2m1(self.k4[a:b], self.ks8[a:b]).double()
            return kf, torch.ones(b - a, dtype=torch.float64, device=kf.device)
        return self.k8[a:b].double(), self.kscale[a:b].double()


def spec4_f64(qf, wf, kf, sc):
    """SPEC 4's logits of one row over keys `kf` in float64, and SPEC 4's magnitude `M`.

    `qf` `[H, D]` decoded query values (block scales applied), `wf` `[H]` weights, `kf`
    `[n, D]` decoded key values (block scales applied), `sc` `[n]` per-key scales (1 for
    fp4 keys), all float64: torch tensors, or numpy arrays (only operators and methods the
    two share). Returns `(ref, M)`, each `[n]`:
    `ref = sc * sum_h w_h relu(q_h . k)` and `M = sc * sum_h |w_h| sum_d |q_hd k_d|`.
    The dot products are exact in float64 (products of E4M3 or E2M1 values times powers
    of two, over at most 128 dims); the sum over heads rounds in float64, so `ref` is
    within about `2^-50 M` of the real value: the yardstick for f32 logits."""
    s = qf @ kf.T  # [H, n]
    ref = (wf[:, None] * s.clip(min=0.0)).sum(0) * sc
    m = (abs(wf)[:, None] * (abs(qf) @ abs(kf).T)).sum(0) * sc
    return ref, m


def error_ratios(prob, rows, logits, ks, ke, key_step=1 << 17, flat=False):
    """`|x - ref| / M` of every visible (row, key), float64 rows concatenated, against
    `spec4_f64`, for the rows `rows` of `prob` whose logits are `logits[r]` (DeepGEMM's
    column = key), or with `flat` the visible scores of each row concatenated (the
    crate's `expected_logits` layout). 0 where `x == ref`, inf for a NaN `x` or an error
    where `M = 0`."""
    qf, wf = prob.decoded_rows(rows)
    out, at = [], 0
    for r in range(len(rows)):
        a0, b0 = int(ks[r]), int(ke[r])
        for a in range(a0, b0, key_step):
            b = min(b0, a + key_step)
            kf, sc = prob.decoded_keys(a, b)
            ref, m = spec4_f64(qf[r], wf[r], kf, sc)
            x = (logits[at + a - a0 : at + b - a0] if flat else logits[r, a:b]).double()
            err = (x - ref).abs()
            ratio = torch.where(m > 0, err / m.clamp_min(1e-300), torch.where(err > 0, float("inf"), 0.0))
            out.append(torch.where(torch.isnan(x), float("inf"), ratio))
        at += b0 - a0
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def reference_error(prob, rows, logits, ks, ke, key_step=1 << 17):
    """max over visible (row, key) of `|x - ref| / M` against the float64 reference, for
    the rows `rows` of `prob` whose logits are `logits[r]` (DeepGEMM's column = key)."""
    v = error_ratios(prob, rows, logits, ks, ke, key_step)
    return float(v.max()) if v.numel() else 0.0


def log2_or_none(x):
    """log2 of a finite positive x; None for 0 (exact) and inf (JSON has neither)."""
    return math.log2(x) if 0 < x < float("inf") else None


def error_distribution(v):
    """The distribution of error ratios `v` (float64, any order): max, p99.9 and median
    (nearest rank) as log2 (None for 0 or inf) and as `2^x` text, and the share that is 0."""
    n = v.numel()
    srt = v.sort().values
    at = lambda q: float(srt[min(n - 1, int(q * (n - 1) + 0.5))]) if n else 0.0
    stats = {"pairs": n, "exact_fraction": float((v == 0).sum()) / n if n else 1.0}
    for key, q in (("max", 1.0), ("p99_9", 0.999), ("median", 0.5)):
        x = at(q)
        stats[f"log2_{key}_err_over_M"] = log2_or_none(x)
        stats[f"{key}_err_over_M"] = log2_str(x)
    return stats


# ---------------------------------------------------------------------------------------
# Decode over paged keys: the pool, the page table, the context lengths
# ---------------------------------------------------------------------------------------


def decode_row_lens(context_lens, next_n):
    """Keys each decode row sees, `[B * next_n]`: `context_lens` as DeepGEMM's paged kernel
    takes it, `[B, next_n]` (row by row) or `[B]` (row `n` of request `b` sees
    `context_lens[b] - next_n + n + 1` keys)."""
    if context_lens.dim() == 2:
        return context_lens.reshape(-1)
    n = torch.arange(next_n, device=context_lens.device, dtype=torch.int32)
    return (context_lens[:, None] - next_n + n[None, :] + 1).reshape(-1)


def decode_context_lens(lens, next_n, two_d=True):
    """DeepGEMM's `context_lens` for a decode batch of `lens` keys per request (ratio 1:
    row `n` sits at position `L_b - next_n + n` and sees keys `0 ..= L_b - next_n + n`):
    int32 `[B, next_n]` with `L_b - next_n + n + 1`, or `[B]` with `L_b`."""
    lens = lens.to(torch.int32)
    if not two_d:
        return lens.contiguous()
    n = torch.arange(next_n, device=lens.device, dtype=torch.int32)
    return (lens[:, None] - next_n + n[None, :] + 1).contiguous()


def build_pool(k8, kscale, lens, page_size, g):
    """SPEC 10's E4M3 page pool of a decode batch: request `b`'s first `lens[b]` keys of
    `k8` (`[B, Lmax, D]` E4M3) and `kscale` (`[B, Lmax]` f32) written page by page (P x D
    codes, then P f32 scales) into `sum_b ceil(L_b / P)` pages handed out in the random
    order of a permutation from `g`. Returns the pool `u8 [pages, P * (D + 4)]` and the
    page table `i32 [B, max_b ceil(L_b / P)]`, -1 past a request's pages; the slots of a
    last page past `L_b` hold zeros."""
    b, lmax, d = k8.shape
    p = page_size
    dev = k8.device
    used = [(int(l) + p - 1) // p for l in lens]
    pages, width = sum(used), max(used)
    perm = torch.randperm(pages, generator=g, device=dev).to(torch.int32)
    pool = torch.zeros((pages, p * (d + 4)), dtype=torch.uint8, device=dev)
    table = torch.full((b, width), -1, dtype=torch.int32, device=dev)
    codes = k8.view(torch.uint8)
    at = 0
    for r in range(b):
        n_pages, l = used[r], int(lens[r])
        ids = perm[at : at + n_pages]
        at += n_pages
        table[r, :n_pages] = ids
        c = torch.zeros((n_pages * p, d), dtype=torch.uint8, device=dev)
        c[:l] = codes[r, :l]
        sc = torch.zeros(n_pages * p, dtype=torch.float32, device=dev)
        sc[:l] = kscale[r, :l]
        pool[ids.long()] = torch.cat([c.reshape(n_pages, p * d), sc.view(torch.uint8).reshape(n_pages, p * 4)], dim=1)
    return pool, table


def slot_table(table, lens, page_size, width):
    """The engine's token-level table, `i32 [B, width]`: key `j` of request `b` at pool slot
    `table[b, j // P] * P + j % P` (SPEC 10's `page`), -1 past `L_b`."""
    j = torch.arange(width, device=table.device)
    idx = (j // page_size).clamp_max(table.shape[1] - 1)
    slots = table[:, idx].long() * page_size + (j % page_size)[None, :]
    inside = j[None, :] < lens.to(table.device)[:, None].long()
    return torch.where(inside, slots, -1).to(torch.int32).contiguous()


def slots_to_keys(got, slots, row_to_batch, pool_slots):
    """Pool slots selected per row (`[T, k]`, -1 padded) back to request-local keys,
    through the inverse of `slot_table`'s map (requests share no page here). A slot that
    no key of the row's own request (`row_to_batch`) holds becomes `pool_slots`, which no
    window contains."""
    dev = slots.device
    owner = torch.full((pool_slots + 1,), -1, dtype=torch.int64, device=dev)
    inv = torch.full((pool_slots + 1,), pool_slots, dtype=torch.int64, device=dev)
    b = torch.arange(slots.shape[0], device=dev)[:, None].expand_as(slots)
    j = torch.arange(slots.shape[1], device=dev)[None, :].expand_as(slots)
    used = slots >= 0
    owner[slots[used].long()] = b[used]
    inv[slots[used].long()] = j[used]
    g = got.long()
    g = torch.where((g < 0) | (g >= pool_slots), pool_slots, g)
    mine = owner[g] == row_to_batch.long()[:, None].to(dev)
    keys = torch.where(mine, inv[g], pool_slots)
    return torch.where(got < 0, -1, keys).to(torch.int32)


def kv_bytes_floor(lens, page_size, bytes_per_token):
    """Every page a request uses, read once for that request: `sum_b ceil(L_b / P) * P *
    bytes_per_token` (bench.rs `kv_bytes_floor`)."""
    return sum((int(l) + page_size - 1) // page_size * page_size * bytes_per_token for l in lens)


class DecodeProblem:
    """One decode input set, drawn as bench.rs draws a decode workload (in distribution):
    weights `[B * next_n, H]` in [-1, 1), E4M3 queries `[B, next_n, H, D]`, each request's
    E4M3 keys with per-key scales in [0.5, 2), the keys in a page pool of random page order."""

    def __init__(self, b, next_n, l, h, d, page_size, g, dev):
        self.b, self.next_n, self.h, self.d, self.p = b, next_n, h, d, page_size
        self.lens = torch.full((b,), l, dtype=torch.int64)
        self.w = rand_uniform((b * next_n, h), -1.0, 1.0, g, dev)
        self.q8 = rand_e4m3((b, next_n, h, d), g, dev)
        k8 = rand_e4m3((b, l, d), g, dev)
        ks = rand_uniform((b, l), 0.5, 2.0, g, dev)
        self.pool, self.table = build_pool(k8, ks, self.lens.tolist(), page_size, g)
        self.max_len = l
        # The flat keys stay only as long as the reference check needs them (small sets).
        self.k8, self.kscale = k8, ks

    def kv_cache(self):
        """The pool as DeepGEMM takes it: `u8 [pages, P, 1, D + 4]`."""
        return self.pool.view(self.pool.shape[0], self.p, 1, self.d + 4)

    def request(self, r):
        """Request `r` as a flat `Problem`-like view (its rows and keys) for `reference_error`."""
        return _FlatRequest(self, r)


class _FlatRequest:
    def __init__(self, dp, r):
        self.fp4 = False
        self.dp, self.r = dp, r

    def decoded_rows(self, rows):
        dp, r = self.dp, self.r
        return dp.q8[r][rows].double(), dp.w[r * dp.next_n : (r + 1) * dp.next_n][rows].double()

    def decoded_keys(self, a, b):
        return self.dp.k8[self.r, a:b].double(), self.dp.kscale[self.r, a:b].double()


# ---------------------------------------------------------------------------------------
# The peers
# ---------------------------------------------------------------------------------------


def dg_logits(dg, q8, k8, kscale, w, ks, ke, clean):
    return dg.fp8_fp4_mqa_logits((q8, None), (k8, kscale), w, ks, ke, clean_logits=clean, max_seqlen_k=0)


def dg_paged_logits(dg, q8, kv_cache, w, context_lens, block_table, sched, max_len, clean):
    """DeepGEMM's paged logits, `[B * next_n, max_len]` f32 (a view with a padded row stride)."""
    return dg.fp8_fp4_paged_mqa_logits((q8, None), kv_cache, w, context_lens, block_table, sched, max_len, clean_logits=clean)


def mask_invalid_(logits, ks, ke):
    """Set columns outside `[ks, ke)` to -inf in place (a bool `[rows, L]` mask, as engines build)."""
    cols = torch.arange(logits.shape[1], device=logits.device)[None, :]
    logits.masked_fill_((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))
    return logits


FI_ABI_VERSION = 1
FI_DEFAULT_SO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".whl", "flashinfer_topk", "libdsa_fi_topk.so")


class FlashInferTopK:
    """FlashInfer's top-k page-table transform through our C ABI (benches/flashinfer_topk).

    `prepare(ks, ke, l)` builds what an engine holds for one prefill request (lengths, row
    starts, a one-request identity page table, the row-to-request map) outside any timed
    region; `page_table_transform(logits, meta, k)` is the timed call: `[T, k]` int32 key
    indices `ks + i`, -1 past a row's length, in no particular order."""

    name = "flashinfer"

    def __init__(self, path):
        lib = ctypes.CDLL(os.path.abspath(path))
        lib.dsa_fi_abi_version.restype = ctypes.c_int
        got = lib.dsa_fi_abi_version()
        if got != FI_ABI_VERSION:
            raise RuntimeError(f"{path}: ABI version {got}, expected {FI_ABI_VERSION} (rebuild it with build.sh)")
        lib.dsa_fi_row_state_bytes.restype = ctypes.c_int64
        lib.dsa_fi_uses_filtered.restype = ctypes.c_int
        lib.dsa_fi_uses_filtered.argtypes = [ctypes.c_uint32] * 3 + [ctypes.c_int]
        lib.dsa_fi_error_string.restype = ctypes.c_char_p
        lib.dsa_fi_error_string.argtypes = [ctypes.c_int]
        f = lib.dsa_fi_top_k_page_table_transform
        f.restype = ctypes.c_int
        vp, i64, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32
        f.argtypes = [vp, i64, vp, vp, i64, vp, vp, vp, u32, u32, u32, vp, ctypes.c_int, vp]
        self.lib, self.path, self.row_states = lib, path, None

    def algorithm(self, rows, k, l):
        """Which kernel FlashInfer's heuristic takes for f32 rows of this shape."""
        return "FilteredTopK" if self.lib.dsa_fi_uses_filtered(rows, k, l, 0) else "RadixTopK multi-CTA"

    def prepare(self, ks, ke, l):
        dev = ks.device
        return {
            "lengths": (ke - ks).to(torch.int32).contiguous(),
            "starts": ks.to(torch.int32).contiguous(),
            "table": torch.arange(l, dtype=torch.int32, device=dev)[None, :],
            "row_to_batch": torch.zeros_like(ks, dtype=torch.int32),
        }

    @staticmethod
    def prepare_decode(row_lens, slots, next_n):
        """What an engine holds for a decode batch: each row's length, no row starts (0),
        the token-level slot table `[B, max_len]` (`slot_table`) and each row's request, so
        an index comes back as SPEC 10's pool slot."""
        t = row_lens.shape[0]
        dev = row_lens.device
        return {
            "lengths": row_lens.to(torch.int32).contiguous(),
            "starts": torch.zeros(t, dtype=torch.int32, device=dev),
            "table": slots,
            "row_to_batch": torch.arange(t // next_n, dtype=torch.int32, device=dev).repeat_interleave(next_n).contiguous(),
        }

    def page_table_transform(self, logits, meta, k):
        t, l = logits.shape
        if not logits.is_cuda or logits.dtype != torch.float32 or logits.stride(1) != 1:
            raise ValueError(f"flashinfer top-k: wants CUDA f32 rows with unit column stride, got {logits.device} {logits.dtype} strides {logits.stride()}")
        if meta["lengths"].shape != (t,) or meta["table"].shape[1] < l or not 0 < k <= 1 << 16:
            raise ValueError(f"flashinfer top-k: metadata for {meta['lengths'].shape[0]} rows of {meta['table'].shape[1]} keys, logits [{t}, {l}], k = {k}")
        if self.row_states is None or self.row_states.device != logits.device:
            self.row_states = torch.zeros(self.lib.dsa_fi_row_state_bytes(), dtype=torch.uint8, device=logits.device)
        out = torch.empty((t, k), dtype=torch.int32, device=logits.device)
        rc = self.lib.dsa_fi_top_k_page_table_transform(
            logits.data_ptr(), logits.stride(0), out.data_ptr(), meta["table"].data_ptr(), meta["table"].stride(0),
            meta["lengths"].data_ptr(), meta["starts"].data_ptr(), meta["row_to_batch"].data_ptr(),
            t, k, l, self.row_states.data_ptr(), 0, torch.cuda.current_stream(logits.device).cuda_stream,
        )
        if rc != 0:
            raise RuntimeError(f"flashinfer top-k: CUDA error {rc} ({self.lib.dsa_fi_error_string(rc).decode()})")
        return out


class EmulatedFlashInferTopK(FlashInferTopK):
    """Stand-in for FlashInferTopK under `--emulate`: NOT a peer. The page-table transform's
    contract in torch (the top k of each row's window, through the identity table)."""

    name = "EMULATED:flashinfer"

    def __init__(self):
        self.path, self.row_states = "emulated", None

    def algorithm(self, rows, k, l):
        return "emulated"

    def page_table_transform(self, logits, meta, k):
        t, l = logits.shape
        s0, n = meta["starts"].long(), meta["lengths"].long()
        cols = torch.arange(l, device=logits.device)[None, :]
        inside = (cols >= s0[:, None]) & (cols < (s0 + n)[:, None])
        idx = torch.where(inside, logits, float("-inf")).topk(min(k, l), dim=-1).indices
        keys = meta["table"][meta["row_to_batch"].long()].long().gather(1, idx)
        out = torch.full((t, k), -1, dtype=torch.int32, device=logits.device)
        out[:, : idx.shape[1]] = torch.where(torch.arange(idx.shape[1], device=logits.device)[None, :] < n[:, None], keys, -1).to(torch.int32)
        return out


def load_flashinfer(path, emulated):
    """(the FlashInfer peer, None) or (None, why not)."""
    if emulated and path is None:
        return EmulatedFlashInferTopK(), None
    path = path or os.environ.get("DSA_FI_TOPK_SO") or FI_DEFAULT_SO
    if not os.path.exists(path):
        return None, f"no {os.path.normpath(path)}; build it with benches/flashinfer_topk/build.sh"
    try:
        return FlashInferTopK(path), None
    except Exception as e:
        return None, f"{os.path.normpath(path)}: {type(e).__name__}: {e}"


def same_selection(logits, ks, ke, got, k):
    """Whether `got` (`[T, k]` key indices, -1 padded) is a top-k of each row's visible
    logits `[ks, ke)`: the same values as torch.topk's, so equal up to exact ties, with
    distinct visible keys and -1 exactly past `min(k, ke - ks)`. Returns (ok, why)."""
    t, l = logits.shape
    dev = logits.device
    m = (ke - ks).long().clamp(0, k)
    pos = torch.arange(k, device=dev)[None, :]
    valid = pos < m[:, None]
    if got.shape != (t, k):
        return False, f"shape {tuple(got.shape)}, expected {(t, k)}"
    if not torch.equal(got < 0, ~valid):
        return False, "the -1 padding is not exactly past min(k, ke - ks)"
    g = got.long().clamp_min(0)
    if not bool(((g >= ks[:, None]) & (g < ke[:, None]))[valid].all()):
        return False, "a selected key outside its row's [ks, ke)"
    srt = torch.where(valid, g, -1 - pos).sort(dim=1).values
    if bool((srt[:, 1:] == srt[:, :-1]).any()):
        return False, "a key selected twice in one row"
    mine = torch.where(valid, logits.gather(1, g), float("-inf")).sort(dim=1, descending=True).values
    masked = mask_invalid_(logits.clone(), ks, ke)
    ref = torch.topk(masked, min(k, l), dim=-1).values
    ref = torch.nn.functional.pad(ref, (0, k - ref.shape[1]), value=float("-inf"))
    ref = torch.where(valid, ref, float("-inf"))
    del masked
    bad = (mine != ref).any(dim=1)
    if bool(bad.any()):
        r = int(bad.nonzero()[0])
        return False, f"{int(bad.sum())} rows select other values than torch.topk (first: row {r})"
    return True, "same values as torch.topk (equal up to ties)"


def row_layout(s, rows, dev):
    """ks, ke (i32) of the last `rows` positions of one request of `s` keys, ratio 1."""
    p = torch.arange(s - rows, s, dtype=torch.int32, device=dev)
    return torch.zeros_like(p), p + 1


def chunk_plan(t, l, budget):
    per_row = 4 * l
    if t * per_row <= budget:
        return [(0, t)]
    r = max(1, budget // per_row)
    return [(a, min(t, a + r)) for a in range(0, t, r)]


def probe_fp4_direct(script, timeout=600):
    """Ask a child process whether DeepGEMM takes packed fp4 on this GPU."""
    try:
        r = subprocess.run(
            [sys.executable, script, "--probe-fp4"], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"fp4_direct": False, "why": f"probe timed out after {timeout} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    tail = (r.stderr or r.stdout)[-400:]
    return {"fp4_direct": False, "why": f"probe exited {r.returncode}: {tail}"}


def fp4_direct_args(prob, rows=slice(None)):
    """DeepGEMM's fp4 operands: packed bytes as int8, four UE8M0 bytes per int32 word."""
    q = prob.q4[rows].contiguous().view(torch.int8)
    qsf = prob.qs[rows].contiguous().view(torch.int32).squeeze(-1)
    k = prob.k4.view(torch.int8)
    ksf = prob.ks8.contiguous().view(torch.int32).squeeze(-1)
    return q, qsf, k, ksf


def run_probe_fp4():
    """Child process: one tiny packed-fp4 call; prints one JSON line."""
    try:
        import deep_gemm as dg
    except Exception as e:
        emit({"fp4_direct": False, "why": f"import deep_gemm: {type(e).__name__}: {e}"})
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=dev).manual_seed(7)
    prob = Problem(True, 8, 512, 32, 128, g, dev)
    ks, ke = row_layout(512, 8, dev)
    q, qsf, k, ksf = fp4_direct_args(prob)
    tries = []
    for dt in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)):
        if dt is None:
            continue
        try:
            out = dg.fp8_fp4_mqa_logits((q.view(dt), qsf), (k.view(dt), ksf), prob.w, ks, ke, clean_logits=False, max_seqlen_k=0)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            err = reference_error(prob, list(range(8)), out, ks, ke)
            emit({"fp4_direct": True, "dtype": str(dt), "max_err_over_M": log2_str(err)})
            return 0
        except Exception as e:
            tries.append(f"{dt}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
    emit({"fp4_direct": False, "why": " | ".join(tries)})
    return 0


# ---------------------------------------------------------------------------------------
# Accuracy on random data: |x - ref| / M against float64
# ---------------------------------------------------------------------------------------

ACCURACY_SHAPE = dict(heads=64, dim=128, topk=2048)
ACCURACY_SEED = 0xACC


def accuracy_problem(t, l, dev):
    """The accuracy part's problem: one request of `l` keys, its last `t` positions the
    rows (ratio 1), E4M3 x E4M3 at H = 64, D = 128, drawn as the v32 workloads are
    (`Problem`), from a generator seeded with ACCURACY_SEED. Returns the problem and each
    row's `[ks, ke)`."""
    g = torch.Generator(device=dev).manual_seed(ACCURACY_SEED)
    prob = Problem(False, t, l, ACCURACY_SHAPE["heads"], ACCURACY_SHAPE["dim"], g, dev)
    ks, ke = row_layout(l, t, dev)
    return prob, ks, ke


def accuracy_dump(path, prob, t, l):
    """Write the accuracy problem as a flat dump of the crate (SPEC 9, plain layer of
    K = 2048): what `--ours` logits are to be computed from."""
    i32 = lambda v: ("I32", [len(v)], tensor_bytes(torch.tensor(v, dtype=torch.int32)))
    h, d = ACCURACY_SHAPE["heads"], ACCURACY_SHAPE["dim"]
    tensors = {
        "seq_lens": i32([l]),
        "query_starts": i32([l - t]),
        "q": ("F8_E4M3", [t, h, d], tensor_bytes(prob.q8)),
        "k": ("F8_E4M3", [l, d], tensor_bytes(prob.k8)),
        "k_scale": ("F32", [l], tensor_bytes(prob.kscale)),
        "weights": ("F32", [t, h], tensor_bytes(prob.w)),
    }
    meta = dict(heads=h, dim=d, topk=min(ACCURACY_SHAPE["topk"], l), ratio=1, role="plain", q_format="e4m3", k_format="e4m3",
                description=f"peers.py accuracy problem: {t} rows x {l} keys, seed {ACCURACY_SEED:#x}")
    write_safetensors(path, tensors, meta)


def read_ours(path, prob, t, l, ks, ke):
    """Our logits of the accuracy problem from the safetensors file `path`: `logits` or
    `engine_logits` F32 `[T, L]` (DeepGEMM's layout: column = key, only `[ks, ke)` read),
    or `expected_logits` F32 `[sum n]` (the crate's: each row's visible scores, rows
    concatenated). Returns (logits, flat). A file that also holds the problem's tensors (a
    dump) must hold the drawn problem's bytes."""
    f = read_safetensors(path)
    for name, mine in (("q", prob.q8), ("k", prob.k8), ("k_scale", prob.kscale), ("weights", prob.w)):
        if name in f and tensor_bytes(f[name]) != tensor_bytes(mine):
            raise ValueError(f"{path}: its {name} is not the accuracy problem's (rows {t}, keys {l}, seed {ACCURACY_SEED:#x})")
    pairs = int((ke - ks).sum())
    for name, shape, flat in (("logits", (t, l), False), ("engine_logits", (t, l), False), ("expected_logits", (pairs,), True)):
        if name in f:
            x = f[name]
            if x.dtype != torch.float32 or tuple(x.shape) != shape:
                raise ValueError(f"{path}: {name} is {x.dtype} {list(x.shape)}, expected float32 {list(shape)}")
            return x, flat
    raise ValueError(f"{path}: no logits, engine_logits or expected_logits tensor")


# ---------------------------------------------------------------------------------------
# One workload
# ---------------------------------------------------------------------------------------


class Shape:
    def __init__(self, name, spec, shrink, budget):
        self.name = name if shrink == 1 else f"{name}/shrink{shrink}"
        self.fp4 = spec["fp4"]
        self.draw = spec.get("draw", "engine")
        self.h, self.d = spec["heads"], spec["dim"]
        self.s = max(1, spec["seq_len"] // shrink)
        self.t = max(1, min(self.s, spec["rows"] // shrink))
        self.l = self.s
        self.k = min(spec["topk"], self.l)
        self.budget = max(1, budget // (shrink * shrink))
        p0 = self.s - self.t
        self.valid_pairs = self.t * p0 + self.t * (self.t + 1) // 2
        self.flops = 2.0 * self.valid_pairs * self.h * self.d

    def meta(self):
        return {
            "workload": self.name,
            "rows": self.t,
            "keys": self.l,
            "heads": self.h,
            "dim": self.d,
            "topk": self.k,
            "valid_pairs": self.valid_pairs,
            "format": "e2m1 x e2m1 (run as e4m3 x e4m3)" if self.fp4 else "e4m3 x e4m3",
            **({"fp4_draw": "uniform scales 124..=130" if self.draw == "uniform" else "engine-like (quantized normal activations)"} if self.fp4 else {}),
        }


class DecodeShape:
    """A decode workload: `requests` requests of `seq_len` keys (ratio 1), `next_n` rows each."""

    def __init__(self, name, spec, shrink):
        self.name = name if shrink == 1 else f"{name}/shrink{shrink}"
        dec = spec["decode"]
        self.b, self.p = dec["requests"], dec["page_size"]
        self.h, self.d = spec["heads"], spec["dim"]
        self.next_n = spec["rows"]
        self.l = max(self.next_n, spec["seq_len"] // shrink)
        self.t = self.b * self.next_n
        self.k = min(spec["topk"], self.l - self.next_n + 1)
        self.lens = [self.l] * self.b
        self.valid_pairs = self.b * sum(self.l - self.next_n + n + 1 for n in range(self.next_n))
        self.flops = 2.0 * self.valid_pairs * self.h * self.d
        self.bytes_per_token = self.d + 4
        self.kv_bytes = kv_bytes_floor(self.lens, self.p, self.bytes_per_token)

    def meta(self):
        return {
            "workload": self.name,
            "mode": "decode",
            "requests": self.b,
            "next_n": self.next_n,
            "keys_per_request": self.l,
            "page_size": self.p,
            "rows": self.t,
            "heads": self.h,
            "dim": self.d,
            "topk": self.k,
            "valid_pairs": self.valid_pairs,
            "bytes_per_token": self.bytes_per_token,
            "kv_bytes": self.kv_bytes,
            "format": "e4m3 x e4m3, paged keys",
        }


class Runner:
    def __init__(self, args, dg, emulated, dev):
        self.args = args
        self.dg = dg
        self.emulated = emulated
        self.dev = dev
        self.clock = Clock(dev)
        self.records = []
        self.failures = []
        self.fi, self.fi_why = load_flashinfer(args.flashinfer_so, emulated)
        self.fp4_probe = None
        self.device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"

    def peer(self, name):
        return f"EMULATED:{name}" if self.emulated else name

    def record(self, base, peer, **kw):
        rec = dict(base)
        rec["peer"] = self.peer(peer)
        rec.update(kw)
        rec["device"] = self.device_name
        if self.emulated:
            rec["emulated"] = True
        emit(rec)
        self.records.append(rec)

    def stats(self, v):
        return {"median_ms": median(v), "min_ms": min(v), "reps": len(v)}

    # -- a workload -------------------------------------------------------------------

    def workload(self, name):
        sh = Shape(name, WORKLOADS[name], self.args.shrink, self.args.budget)
        base = sh.meta()
        full_max = self.args.full_max // (self.args.shrink * self.args.shrink)
        g = torch.Generator(device=self.dev).manual_seed(0x5EED)
        first = Problem(sh.fp4, sh.t, sh.l, sh.h, sh.d, g, self.dev, sh.draw)
        if sh.fp4:
            first.convert()
        set_bytes = first.fp8_bytes()
        nsets = 1 if set_bytes >= 2 * L2_BYTES else min(4, math.ceil(2 * L2_BYTES / set_bytes))
        sets = [first] + [Problem(sh.fp4, sh.t, sh.l, sh.h, sh.d, g, self.dev, sh.draw) for _ in range(nsets - 1)]
        if sh.fp4:
            for p in sets[1:]:
                p.convert()
        ks, ke = row_layout(sh.s, sh.t, self.dev)
        base["input_sets"] = nsets
        self.conversion_ms = None

        if sh.fp4:
            self.fp4_conversion(base, sets)
            exact = all(conversion_exact(p) for p in sets)
            base["conversion_exact"] = exact
            if not exact:
                raise RuntimeError("the fp4 -> e4m3 conversion is not exact on these inputs")
            if self.fp4_probe is None:
                if self.emulated:
                    self.fp4_probe = {"fp4_direct": False, "why": "not probed (emulated)"}
                else:
                    self.fp4_probe = probe_fp4_direct(os.path.abspath(__file__))
                emit({"probe": "deepgemm_fp4_direct", **self.fp4_probe})
            base["fp4_direct"] = bool(self.fp4_probe.get("fp4_direct"))

        self.sample_check(sh, base, sets[0], ks, ke)
        if sh.fp4:
            base["group_scale_span"] = scale_span_stats(sets[0])

        plan = chunk_plan(sh.t, sh.l, sh.budget)
        modes = [("row_chunked" if len(plan) > 1 else "single_call", plan)]
        if len(plan) > 1 and 4 * sh.t * sh.l <= full_max:
            modes.append(("single_call", [(0, sh.t)]))
        for mode, chunks in modes:
            mb = dict(base)
            mb.update(mode=mode, chunks=len(chunks), chunk_rows=chunks[0][1] - chunks[0][0])
            mb["chunk_logits_bytes"] = 4 * mb["chunk_rows"] * align(sh.l + 256, 8)
            self.measure(sh, mb, sets, ks, ke, chunks)
            free_memory()

    def decode_workload(self, name):
        """DeepGEMM's paged logits, then FlashInfer's top-k through the slot table (the call
        engines make for DSA decode) or torch.topk, on one decode batch."""
        sh = DecodeShape(name, WORKLOADS[name], self.args.shrink)
        base = sh.meta()
        dg, clock, fi, K = self.dg, self.clock, self.fi, sh.k
        g = torch.Generator(device=self.dev).manual_seed(0x5EED)
        prob = DecodeProblem(sh.b, sh.next_n, sh.l, sh.h, sh.d, sh.p, g, self.dev)
        base["pool_pages"] = int(prob.pool.shape[0])
        base["input_sets"] = 1  # every pool is larger than two L2s
        kv = prob.kv_cache()
        lens = prob.lens.to(self.dev)
        num_sms = dg.get_num_sms()
        # context_lens as [B, next_n] (the engines' form with MTP); [B] where it is refused.
        ctx, refused = None, []
        for two_d in (True, False):
            form = "[B, next_n]" if two_d else "[B]"
            c = decode_context_lens(lens, sh.next_n, two_d)
            try:
                sched = dg.get_paged_mqa_logits_metadata(c, sh.p, num_sms)
                lg = dg_paged_logits(dg, prob.q8, kv, prob.w, c, prob.table, sched, sh.l, False)
                clock.sync()
                ctx = c
                base["context_lens"] = form
                break
            except Exception as e:
                refused.append(f"{form}: {type(e).__name__}: {str(e).strip()[-200:]}")
        if ctx is None:
            raise RuntimeError("DeepGEMM's paged logits refused both context_lens forms: " + " | ".join(refused))
        if refused:
            base["context_lens_refused"] = refused
        row_lens = decode_row_lens(ctx, sh.next_n).to(torch.int64)
        clean_ctx, outside = self.decode_sample_check(sh, base, prob, lg, ctx, sched, kv, row_lens)
        prob.k8 = prob.kscale = None
        free_memory()

        slots = slot_table(prob.table, lens, sh.p, sh.l)
        meta = fi.prepare_decode(row_lens, slots, sh.next_n) if fi is not None else None
        fi_errors = {}
        if fi is not None:
            try:
                lg = dg_paged_logits(dg, prob.q8, kv, prob.w, ctx, prob.table, sched, sh.l, False)
                got = fi.page_table_transform(lg, meta, K)
                ok, why = same_selection(lg, torch.zeros_like(row_lens), row_lens, slots_to_keys(got, slots, meta["row_to_batch"], prob.pool.shape[0] * sh.p), K)
                base["flashinfer_algorithm"] = fi.algorithm(sh.t, K, sh.l)
                base["flashinfer_selection_ok"] = ok
                base["flashinfer_selection"] = why
                if not ok:
                    self.failures.append(f"{sh.name}: flashinfer's selection: {why}")
                del lg, got
            except Exception as e:
                fi_errors["fi"] = fi_errors["e2e_fi"] = f"{type(e).__name__}: {e}"
                self.failures.append(f"{sh.name}: flashinfer: {fi_errors['fi']}")
            free_memory()

        def logits(clean):
            if clean and clean_ctx is None:
                # No clean_logits in this DeepGEMM: -inf past each row's keys by hand.
                return dg_paged_logits(dg, prob.q8, kv, prob.w, ctx, prob.table, sched, sh.l, False).masked_fill_(outside, float("-inf"))
            c = clean_ctx if clean else ctx
            return dg_paged_logits(dg, prob.q8, kv, prob.w, c, prob.table, sched, sh.l, clean)

        runs = {}
        for rep in range(self.args.reps + 1):
            acc = {}
            ms, _ = clock.time(lambda: dg.get_paged_mqa_logits_metadata(ctx, sh.p, num_sms))
            acc["metadata"] = ms
            ms, lg = clock.time(lambda: logits(False))
            acc["logits"] = ms
            if fi is not None and "fi" not in fi_errors:
                try:
                    acc["fi"], _ = clock.time(lambda: fi.page_table_transform(lg, meta, K))
                    acc["e2e_fi"], _ = clock.time(lambda: fi.page_table_transform(logits(False), meta, K))
                except Exception as e:
                    fi_errors["fi"] = fi_errors["e2e_fi"] = f"{type(e).__name__}: {e}"
                    self.failures.append(f"{sh.name}: flashinfer: {fi_errors['fi']}")
            del lg
            ms, lc = clock.time(lambda: logits(True))
            acc["logits_clean"] = ms
            acc["topk"], _ = clock.time(lambda: torch.topk(lc, K, dim=-1))
            del lc
            acc["e2e_clean"], _ = clock.time(lambda: torch.topk(logits(True), K, dim=-1))
            if rep:
                for key, v in acc.items():
                    runs.setdefault(key, []).append(v)

        def kv_rates(ms):
            gbs = sh.kv_bytes / (ms * 1e-3) / 1e9
            return {"kv_gbs": gbs, "kv_ceiling_gbs": KV_COPY_CEILING_GBS, "kv_ceiling_fraction": gbs / KV_COPY_CEILING_GBS}

        def tflops(ms):
            return sh.flops / (ms * 1e-3) / 1e12

        def sel_rates(ms):
            return {"gbs_logits_read": 4.0 * sh.t * sh.l / (ms * 1e-3) / 1e9, "gbs_valid": 4.0 * sh.valid_pairs / (ms * 1e-3) / 1e9}

        st = self.stats(runs["metadata"])
        self.record(base, "deepgemm_get_paged_mqa_logits_metadata", what="once per decode step, shared by the layers; in no other figure", num_sms=num_sms, **st)
        st = self.stats(runs["logits"])
        self.record(base, "deepgemm_fp8_paged_mqa_logits", clean_logits=False, effective_tflops=tflops(st["median_ms"]), **kv_rates(st["median_ms"]), **st)
        st = self.stats(runs["logits_clean"])
        clean = "clean_logits=True" if clean_ctx is not None else "clean_logits=False, then masked_fill(-inf) past each row's keys"
        self.record(base, "deepgemm_fp8_paged_mqa_logits_clean", clean_logits=clean, effective_tflops=tflops(st["median_ms"]), **kv_rates(st["median_ms"]), **st)
        st = self.stats(runs["topk"])
        self.record(base, "torch_topk", sorted=True, **sel_rates(st["median_ms"]), **st)
        if "fi" in fi_errors:
            self.record(base, "flashinfer_top_k_page_table_transform", error=fi_errors["fi"])
            self.record(base, "deepgemm_paged+flashinfer_top_k_page_table_transform", error=fi_errors["e2e_fi"])
        elif "fi" in runs:
            st = self.stats(runs["fi"])
            self.record(base, "flashinfer_top_k_page_table_transform", library=fi.path, **sel_rates(st["median_ms"]), **st)
            st = self.stats(runs["e2e_fi"])
            self.record(base, "deepgemm_paged+flashinfer_top_k_page_table_transform", mask="clean_logits=False, row lengths", effective_tflops=tflops(st["median_ms"]), **kv_rates(st["median_ms"]), **st)
        st = self.stats(runs["e2e_clean"])
        self.record(base, "deepgemm_paged+torch_topk", mask=clean, effective_tflops=tflops(st["median_ms"]), **kv_rates(st["median_ms"]), **st)

    def decode_sample_check(self, sh, base, prob, lg, ctx, sched, kv, row_lens):
        """DeepGEMM's paged logits of the first, middle and last request against the float64
        reference over the flat keys, and clean_logits=True: -inf past each row's keys, the
        same bits before."""
        reqs = sorted({0, sh.b // 2, sh.b - 1})
        worst = 0.0
        for r in reqs:
            rows = list(range(sh.next_n))
            n = row_lens[r * sh.next_n : (r + 1) * sh.next_n].tolist()
            worst = max(worst, reference_error(prob.request(r), rows, lg[r * sh.next_n : (r + 1) * sh.next_n], [0] * sh.next_n, n))
        base["sample_requests"] = reqs
        base["sample_max_err_over_M"] = log2_str(worst)
        if not worst <= 2.0**SPEC_BOUND_LOG2:
            raise RuntimeError(f"DeepGEMM's paged logits differ from the reference: max |x - ref| / M = {log2_str(worst)}")
        # clean_logits=True, with context_lens in either form: some builds refuse both
        # (0.1.4.post1 asserts a 2-D form and, for clean logits, a 1-D one). Then the
        # torch.topk peer masks the rows itself (masked_fill, timed with it).
        inside = torch.arange(sh.l, device=lg.device)[None, :] < row_lens.to(lg.device)[:, None]
        refused = []
        for c in (ctx, decode_context_lens(prob.lens.to(ctx.device), sh.next_n, False)):
            try:
                lc = dg_paged_logits(self.dg, prob.q8, kv, prob.w, c, prob.table, sched, sh.l, True)
            except Exception as e:
                refused.append(f"{type(e).__name__}: {str(e).strip()[-120:]}")
                continue
            same = torch.equal(lg[inside].view(torch.int32), lc[inside].view(torch.int32))
            base["clean_logits_ok"] = bool(same and bool((lc[~inside] == float("-inf")).all()))
            del lc
            if not base["clean_logits_ok"]:
                raise RuntimeError("DeepGEMM's clean_logits=True is not -inf past each row's keys with the same bits before")
            return c, ~inside
        base["clean_logits"] = "refused: " + " | ".join(refused)
        return None, ~inside

    def fp4_conversion(self, base, sets):
        """Time the fp4 -> e4m3 conversion (q with its weight fold, and k) on its own."""
        tq, tk = [], []
        for rep in range(self.args.reps + 1):
            p = sets[rep % len(sets)]
            mq, _ = self.clock.time(lambda: convert_q(p.q4, p.qs, p.w))
            mk, _ = self.clock.time(lambda: convert_k(p.k4, p.ks8))
            if rep:
                tq.append(mq)
                tk.append(mk)
            free_memory()
        what = "E2M1 x UE8M0 -> f32 -> E4M3 with a power-of-two scale (torch ops)"
        self.record(base, "fp4_to_fp8_q", what=what + ", per (row, head), folded into w", **self.stats(tq))
        self.record(base, "fp4_to_fp8_k", what=what + ", per key", **self.stats(tk))
        tot = [a + b for a, b in zip(tq, tk)]
        self.record(base, "fp4_to_fp8_total", **self.stats(tot))
        self.conversion_ms = median(tot)

    def sample_check(self, sh, base, prob, ks, ke):
        """DeepGEMM on the first, middle and last rows against the float64 reference."""
        rows = sorted({0, sh.t // 2, sh.t - 1})
        idx = torch.tensor(rows, device=self.dev)
        q8, w8 = prob.q8[idx].contiguous(), prob.w8[idx].contiguous()
        s0, s1 = ks[idx].contiguous(), ke[idx].contiguous()
        out = dg_logits(self.dg, q8, prob.k8, prob.kscale, w8, s0, s1, False)
        err = reference_error(prob, rows, out, s0.tolist(), s1.tolist())
        base["sample_rows"] = rows
        base["sample_max_err_over_M"] = log2_str(err)
        del out
        free_memory()
        if not err <= 2.0**SPEC_BOUND_LOG2:
            raise RuntimeError(f"DeepGEMM's logits differ from the reference: max |x - ref| / M = {log2_str(err)}")

    def measure(self, sh, mb, sets, ks, ke, chunks):
        """Time every part over all chunks, per repetition, and report the medians."""
        dg, K, clock, fi = self.dg, sh.k, self.clock, self.fi
        fp4_dt = None
        if sh.fp4 and self.fp4_probe.get("fp4_direct"):
            fp4_dt = {"torch.int8": torch.int8, "torch.uint8": torch.uint8}.get(self.fp4_probe.get("dtype"), torch.int8)

        def args_of(p, a, b):
            return p.q8[a:b], p.k8, p.kscale, p.w8[a:b], ks[a:b], ke[a:b]

        fi_meta = {}
        if fi is not None:
            for a, b in chunks:
                fi_meta[a] = fi.prepare(ks[a:b], ke[a:b], sh.l)

        def e2e(p, how, marks=None):
            # marks: where each chunk's logits call starts and ends, when given.
            for a, b in chunks:
                q8, k8, sc, w8, s0, s1 = args_of(p, a, b)
                m0 = clock.mark() if marks is not None else None
                lg = dg_logits(dg, q8, k8, sc, w8, s0, s1, how == "clean")
                if marks is not None:
                    marks.append((m0, clock.mark()))
                if how == "mask":
                    mask_invalid_(lg, s0, s1)
                if how == "fi":
                    fi.page_table_transform(lg, fi_meta[a], K)
                else:
                    torch.topk(lg, K, dim=-1)
                del lg

        # Warm-up: DeepGEMM compiles its kernels on first use.
        q8, k8, sc, w8, s0, s1 = args_of(sets[0], *chunks[0])
        for clean in (False, True):
            lg = dg_logits(dg, q8, k8, sc, w8, s0, s1, clean)
            del lg
        clock.sync()

        fi_errors = {}
        if fi is not None:
            # FlashInfer's selection against torch.topk's on the first chunk's logits.
            try:
                a, b = chunks[0]
                lg = dg_logits(dg, q8, k8, sc, w8, s0, s1, False)
                ok, why = same_selection(lg, s0, s1, fi.page_table_transform(lg, fi_meta[a], K), K)
                mb["flashinfer_algorithm"] = fi.algorithm(b - a, K, sh.l)
                mb["flashinfer_selection_ok"] = ok
                mb["flashinfer_selection"] = why
                del lg
                if not ok:
                    self.failures.append(f"{sh.name}: flashinfer's selection: {why}")
            except Exception as e:
                fi_errors["fi"] = fi_errors["e2e_fi"] = f"{type(e).__name__}: {e}"
                self.failures.append(f"{sh.name}: flashinfer: {fi_errors['fi']}")
            free_memory()
        runs = {}
        for rep in range(self.args.reps + 1):
            p = sets[rep % len(sets)]
            acc = {}

            def add(key, ms):
                acc[key] = acc.get(key, 0.0) + ms

            def try_fi(key, fn):
                if key in fi_errors:
                    return
                try:
                    ms, _ = clock.time(fn)
                    add(key, ms)
                except Exception as e:
                    fi_errors[key] = f"{type(e).__name__}: {e}"
                    self.failures.append(f"{sh.name}: flashinfer: {fi_errors[key]}")

            for a, b in chunks:
                q8, k8, sc, w8, s0, s1 = args_of(p, a, b)
                if fp4_dt is not None:
                    q4, qsf, k4, ksf = fp4_direct_args(p, slice(a, b))
                    fp4_in = ((q4.view(fp4_dt), qsf), (k4.view(fp4_dt), ksf))
                    ms, lg = clock.time(
                        lambda: dg.fp8_fp4_mqa_logits(*fp4_in, p.w[a:b], s0, s1, clean_logits=False, max_seqlen_k=0)
                    )
                    add("logits_fp4", ms)
                    del lg
                ms, lg = clock.time(lambda: dg_logits(dg, q8, k8, sc, w8, s0, s1, False))
                add("logits", ms)
                if fi is not None:
                    try_fi("fi", lambda: fi.page_table_transform(lg, fi_meta[a], K))
                ms, _ = clock.time(lambda: mask_invalid_(lg, s0, s1))
                add("mask", ms)
                ms, _ = clock.time(lambda: torch.topk(lg, K, dim=-1))
                add("topk", ms)
                del lg
                ms, lg = clock.time(lambda: dg_logits(dg, q8, k8, sc, w8, s0, s1, True))
                add("logits_clean", ms)
                del lg
            ms, _ = clock.time(lambda: e2e(p, "clean"))
            add("e2e_clean", ms)
            ms, _ = clock.time(lambda: e2e(p, "mask"))
            add("e2e_mask", ms)
            if fi is not None:
                # DeepGEMM's logits as they run inside that pipeline, each chunk between
                # top-k kernels as ours run between our selections: the logits figure to
                # set beside ours (the one above runs between more, and cooler, kernels).
                marks = []
                try_fi("e2e_fi", lambda: e2e(p, "fi", marks))
                if "e2e_fi" not in fi_errors and marks:
                    add("logits_in_e2e_fi", sum(clock.elapsed(m0, m1) for m0, m1 in marks))
            if rep:
                for key, v in acc.items():
                    runs.setdefault(key, []).append(v)

        logits_bytes = 4.0 * sh.t * sh.l
        valid_bytes = 4.0 * sh.valid_pairs

        def tflops(ms):
            return sh.flops / (ms * 1e-3) / 1e12

        def rates(ms):
            return {"gbs_logits_read": logits_bytes / (ms * 1e-3) / 1e9, "gbs_valid": valid_bytes / (ms * 1e-3) / 1e9}

        if "logits_fp4" in runs:
            st = self.stats(runs["logits_fp4"])
            self.record(mb, "deepgemm_fp4_mqa_logits", clean_logits=False, effective_tflops=tflops(st["median_ms"]), **st)
        st = self.stats(runs["logits"])
        self.record(mb, "deepgemm_fp8_mqa_logits", clean_logits=False, effective_tflops=tflops(st["median_ms"]), **st)
        if "logits_in_e2e_fi" in runs:
            st_p = self.stats(runs["logits_in_e2e_fi"])
            self.record(
                mb,
                "deepgemm_fp8_mqa_logits_in_e2e_fi",
                clean_logits=False,
                what="its logits calls inside DeepGEMM + FlashInfer's run, summed",
                effective_tflops=tflops(st_p["median_ms"]),
                **st_p,
            )
        st_c = self.stats(runs["logits_clean"])
        self.record(
            mb,
            "deepgemm_fp8_mqa_logits_clean",
            clean_logits=True,
            effective_tflops=tflops(st_c["median_ms"]),
            clean_over_plain_ms=st_c["median_ms"] - st["median_ms"],
            **st_c,
        )
        st = self.stats(runs["mask"])
        self.record(mb, "torch_mask", what="masked_fill_(-inf) outside [ks, ke)", **rates(st["median_ms"]), **st)
        st = self.stats(runs["topk"])
        self.record(mb, "torch_topk", sorted=True, **rates(st["median_ms"]), **st)
        if "fi" in fi_errors:
            self.record(mb, "flashinfer_top_k_page_table_transform", error=fi_errors["fi"])
        elif "fi" in runs:
            st = self.stats(runs["fi"])
            self.record(mb, "flashinfer_top_k_page_table_transform", library=fi.path, **rates(st["median_ms"]), **st)
        for key, peer, how in (
            ("e2e_clean", "deepgemm+torch_topk", "clean_logits=True"),
            ("e2e_mask", "deepgemm+torch_mask+torch_topk", "clean_logits=False, then torch masked_fill_"),
            ("e2e_fi", "deepgemm+flashinfer_top_k_page_table_transform", "clean_logits=False, page-table top-k with row starts"),
        ):
            if key in fi_errors:
                self.record(mb, peer, error=fi_errors[key])
                continue
            if key not in runs:
                continue
            st = self.stats(runs[key])
            kw = {}
            if self.conversion_ms is not None:
                kw["conversion_ms"] = self.conversion_ms
                kw["median_plus_conversion_ms"] = st["median_ms"] + self.conversion_ms
            self.record(
                mb,
                peer,
                mask=how,
                effective_tflops=tflops(st["median_ms"]),
                rows_per_s=sh.t / (st["median_ms"] * 1e-3),
                **kw,
                **st,
            )

    # -- accuracy -----------------------------------------------------------------------

    def accuracy(self):
        """DeepGEMM's logits (and ours, from --ours) on random v32 data against SPEC 4's
        logits in float64 on the device: the distribution of `|x - ref| / M` over every
        visible (row, key). Returns whether DeepGEMM stayed within SPEC 4's 2^-8 M."""
        a, dev = self.args, self.dev
        t, l = a.accuracy_rows, a.accuracy_keys
        prob, ks, ke = accuracy_problem(t, l, dev)
        base = {
            "workload": f"v32-accuracy-{t}x{l}",
            "mode": "accuracy",
            "rows": t,
            "keys": l,
            "heads": ACCURACY_SHAPE["heads"],
            "dim": ACCURACY_SHAPE["dim"],
            "format": "e4m3 x e4m3",
            "draw": "as the v32 workloads: uniform E4M3 codes, key scales in [0.5, 2), weights in [-1, 1)",
            "seed": ACCURACY_SEED,
            "reference": "SPEC 4 in float64 on the device (spec4_f64)",
            "bound_log2": SPEC_BOUND_LOG2,
        }
        if a.accuracy_save:
            accuracy_dump(a.accuracy_save, prob, t, l)
            base["problem_file"] = a.accuracy_save
        rows = list(range(t))
        s0, s1 = ks.tolist(), ke.tolist()
        lg = dg_logits(self.dg, prob.q8, prob.k8, prob.kscale, prob.w8, ks, ke, False)
        v = error_ratios(prob, rows, lg, s0, s1)
        dist = error_distribution(v)
        ok = float(v.max()) <= 2.0**SPEC_BOUND_LOG2
        del lg, v
        self.record(base, "deepgemm_fp8_mqa_logits", clean_logits=False, **dist)
        say = lambda who, d: note(f"accuracy ({t} x {l}): {who}: |x - ref| / M max {d['max_err_over_M']}, p99.9 {d['p99_9_err_over_M']}, median {d['median_err_over_M']}")
        say(self.peer("DeepGEMM"), dist)
        if not ok:
            self.failures.append(f"accuracy: DeepGEMM's max |x - ref| / M = {dist['max_err_over_M']}, past SPEC 4's 2^{SPEC_BOUND_LOG2:.0f}")
        if a.ours:
            x, flat = read_ours(a.ours, prob, t, l, ks, ke)
            dist = error_distribution(error_ratios(prob, rows, x.to(dev), s0, s1, flat=flat))
            rec = dict(base, peer="ours", file=a.ours, layout="[sum n]" if flat else "[T, L]", device=self.device_name, **dist)
            emit(rec)
            self.records.append(rec)
            say("ours", dist)
        free_memory()
        return ok

    # -- ceilings -----------------------------------------------------------------------

    def ceilings(self):
        cuda = self.dev.type == "cuda"
        base = {"workload": "ceiling"}
        reps = max(self.args.reps, 5)
        n = (GIB // 2) if cuda else (1 << 22)
        try:
            src = torch.rand(n, device=self.dev)
            dst = torch.empty_like(src)
            dst.copy_(src)
            v = []
            for rep in range(reps + 1):
                ms, _ = self.clock.time(lambda: dst.copy_(src))
                if rep:
                    v.append(ms)
            st = self.stats(v)
            self.record(base, "device_copy", bytes=4 * n, gbs_read_plus_write=2 * 4 * n / (st["median_ms"] * 1e-3) / 1e9, **st)
            del src, dst
        except Exception as e:
            self.record(base, "device_copy", error=f"{type(e).__name__}: {e}")
        m = 8192 if cuda else 512
        flops = 2.0 * m**3
        try:
            a = torch.randn(m, m, device=self.dev, dtype=torch.bfloat16)
            b = torch.randn(m, m, device=self.dev, dtype=torch.bfloat16)
            v = []
            for rep in range(reps + 2):
                ms, _ = self.clock.time(lambda: a @ b)
                if rep > 1:
                    v.append(ms)
            st = self.stats(v)
            self.record(base, "torch_bf16_matmul", n=m, tflops=flops / (st["median_ms"] * 1e-3) / 1e12, **st)
        except Exception as e:
            self.record(base, "torch_bf16_matmul", error=f"{type(e).__name__}: {e}")
        for fast in (False, True):
            try:
                mm = fp8_matmul(m, self.dev, fast)
                v = []
                for rep in range(reps + 2):
                    ms, _ = self.clock.time(mm)
                    if rep > 1:
                        v.append(ms)
                st = self.stats(v)
                self.record(base, "torch_fp8_e4m3_matmul", n=m, use_fast_accum=fast, tflops=flops / (st["median_ms"] * 1e-3) / 1e12, **st)
            except Exception as e:
                self.record(base, "torch_fp8_e4m3_matmul", use_fast_accum=fast, error=f"{type(e).__name__}: {e}")
        free_memory()

    # -- the check ------------------------------------------------------------------------

    def check(self):
        """The torch fp4 quantizer against the crate's golden vectors, then DeepGEMM
        against the float64 reference (and FlashInfer's selection against torch.topk's)
        on small ragged problems."""
        ok_all = True
        golden = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "quantizers.safetensors")
        try:
            ok = quantizer_matches_golden(golden)
            emit({"check": "torch fp4 block quantizer vs tests/golden/quantizers.safetensors", "pass": ok})
        except Exception as e:
            ok = False
            emit({"check": "torch fp4 block quantizer vs tests/golden/quantizers.safetensors", "pass": False, "error": f"{type(e).__name__}: {e}"})
        ok_all &= ok
        t, l, d, kk = 99, 3000, 128, 64
        for fp4 in (False, True):
            for h in (64, 32):
                name = f"{'e2m1->e4m3' if fp4 else 'e4m3'} H={h} T={t} L={l}"
                try:
                    ok_all &= self.check_case(name, fp4, t, l, h, d, kk)
                except Exception as e:
                    traceback.print_exc()
                    emit({"check": self.peer(name), "pass": False, "error": f"{type(e).__name__}: {e}"})
                    ok_all = False
                free_memory()
        return ok_all

    def check_case(self, name, fp4, t, l, h, d, kk):
        dev, dg = self.dev, self.dg
        g = torch.Generator(device=dev).manual_seed(1234 + h + fp4)
        prob = Problem(fp4, t, l, h, d, g, dev)
        rec = {"check": self.peer(name)}
        if fp4:
            prob.convert()
            rec["conversion_exact"] = conversion_exact(prob)
        # Ragged rows: random [ks, ke), plus a full row, a one-key row and a row at the end.
        ks = torch.randint(0, l // 2, (t,), generator=g, device=dev, dtype=torch.int32)
        span = torch.randint(1, l // 2, (t,), generator=g, device=dev, dtype=torch.int32)
        ke = torch.minimum(ks + span, torch.full_like(ks, l))
        ks[0], ke[0] = 0, l
        ks[1], ke[1] = 17, 18
        ks[2], ke[2] = l - 5, l
        lg = dg_logits(dg, prob.q8, prob.k8, prob.kscale, prob.w8, ks, ke, False)
        err = reference_error(prob, list(range(t)), lg, ks.tolist(), ke.tolist())
        rec["max_err_over_M"] = log2_str(err)
        rec["log2_max_err_over_M"] = math.log2(err) if 0 < err < float("inf") else None
        rec["bound"] = f"2^{SPEC_BOUND_LOG2:.0f}"
        cols = torch.arange(l, device=dev)[None, :]
        inside = (cols >= ks[:, None]) & (cols < ke[:, None])
        # clean_logits=True: -inf outside, the same bits inside.
        lc = dg_logits(dg, prob.q8, prob.k8, prob.kscale, prob.w8, ks, ke, True)
        same_inside = torch.equal(torch.where(inside, lg, 0.0).view(torch.int32)[inside], torch.where(inside, lc, 0.0).view(torch.int32)[inside])
        rec["clean_logits_ok"] = bool(same_inside and bool((lc[~inside] == float("-inf")).all()))
        # Row chunks give the same bits as one call.
        parts = []
        for a, b in ((0, 37), (37, 38), (38, t)):
            parts.append(dg_logits(dg, prob.q8[a:b], prob.k8, prob.kscale, prob.w8[a:b], ks[a:b], ke[a:b], False).clone())
        lch = torch.cat(parts)
        rec["row_chunks_same_bits"] = bool(torch.equal(lch[inside].view(torch.int32), lg[inside].view(torch.int32)))
        # Top-k after the mask selects visible keys only (rows with at least K of them).
        masked = mask_invalid_(lg.clone(), ks, ke)
        idx = torch.topk(masked, kk, dim=-1).indices
        long_rows = (ke - ks) >= kk
        vis = (idx >= ks[:, None]) & (idx < ke[:, None])
        rec["topk_selects_visible"] = bool(vis[long_rows].all())
        fi_ok = True
        if self.fi is not None:
            try:
                got = self.fi.page_table_transform(lg, self.fi.prepare(ks, ke, l), kk)
                fi_ok, why = same_selection(lg, ks, ke, got, kk)
            except Exception as e:
                fi_ok, why = False, f"{type(e).__name__}: {e}"
            rec["flashinfer_selection_ok"] = fi_ok
            rec["flashinfer_selection"] = why
        rec["pass"] = bool(
            err <= 2.0**SPEC_BOUND_LOG2
            and rec["clean_logits_ok"]
            and rec["row_chunks_same_bits"]
            and rec["topk_selects_visible"]
            and rec.get("conversion_exact", True)
            and fi_ok
        )
        if self.emulated:
            rec["emulated"] = True
        emit(rec)
        return rec["pass"]

    # -- the table ----------------------------------------------------------------------

    def table(self):
        rows = [r for r in self.records if "median_ms" in r or "error" in r]
        if not rows:
            return
        hdr = ("workload", "mode", "peer", "median ms", "TFLOP/s", "GB/s read", "GB/s valid")
        out = []
        for r in rows:
            tf = r.get("effective_tflops", r.get("tflops"))
            gb = r.get("gbs_logits_read", r.get("gbs_read_plus_write"))
            out.append((
                r.get("workload", ""),
                r.get("mode", ""),
                r["peer"],
                f"{r['median_ms']:.3f}" if "median_ms" in r else "error",
                f"{tf:.4g}" if tf is not None else "",
                f"{gb:.4g}" if gb is not None else "",
                f"{r['gbs_valid']:.4g}" if "gbs_valid" in r else "",
            ))
        w = [max(len(hdr[i]), *(len(o[i]) for o in out)) for i in range(len(hdr))]
        line = lambda c: "| " + " | ".join(str(x).ljust(w[i]) for i, x in enumerate(c)) + " |"
        print()
        print(line(hdr))
        print("|" + "|".join("-" * (x + 2) for x in w) + "|")
        for o in out:
            print(line(o))
        if self.emulated:
            print("EMULATED: deep_gemm was replaced by a torch stand-in; these are no peer figures.")
        sys.stdout.flush()


# ---------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", help=f"any of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions, median reported (default 5)")
    ap.add_argument("--budget", type=int, default=2 * GIB, help="logits bytes per row chunk (default 2 GiB)")
    ap.add_argument("--full-max", type=int, default=8 * GIB, help="largest single-call logits also measured (default 8 GiB)")
    ap.add_argument("--check", action="store_true", help="compare DeepGEMM with a float64 reference first")
    ap.add_argument("--check-only", action="store_true", help="run --check and nothing else")
    ap.add_argument("--accuracy", action="store_true", help="measure |x - ref| / M of DeepGEMM's logits on random v32 data against float64 first")
    ap.add_argument("--accuracy-only", action="store_true", help="run --accuracy (after --check, if given) and nothing else")
    ap.add_argument("--accuracy-rows", type=int, default=256, help="rows of the accuracy problem (default 256)")
    ap.add_argument("--accuracy-keys", type=int, default=32768, help="keys of the accuracy problem (default 32768)")
    ap.add_argument("--accuracy-save", metavar="FILE", help="write the accuracy problem as a crate dump (SPEC 9) to FILE")
    ap.add_argument("--ours", metavar="FILE", help="our logits of the accuracy problem (safetensors: logits [T, L] or expected_logits [sum n]), measured beside DeepGEMM's")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the copy and matmul ceilings")
    ap.add_argument("--emulate", action="store_true", help="torch stand-in for deep_gemm (harness tests; no peer figures)")
    ap.add_argument("--shrink", type=int, default=1, help="divide S and rows by N (budget by N^2)")
    ap.add_argument("--flashinfer-so", default=None, help=f"FlashInfer top-k library (default $DSA_FI_TOPK_SO, else {os.path.normpath(FI_DEFAULT_SO)})")
    ap.add_argument("--probe-fp4", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.probe_fp4 and torch is not None:
        return run_probe_fp4()
    if args.reps < 1 or args.shrink < 1 or args.budget < 1:
        ap.error("--reps, --shrink and --budget must be >= 1")
    if not 1 <= args.accuracy_rows <= args.accuracy_keys:
        ap.error("--accuracy-rows must be in 1 ..= --accuracy-keys")
    if (args.ours or args.accuracy_save) and not (args.accuracy or args.accuracy_only):
        ap.error("--ours and --accuracy-save go with --accuracy or --accuracy-only")
    names = args.workloads or list(WORKLOADS)
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload(s) {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    if torch is None:
        print("peers.py: torch is not importable; this script needs torch (2.11 with CUDA on the GPU machine)", file=sys.stderr)
        return 2

    if args.emulate:
        dg = EmulatedDeepGemm()
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        note("peers.py: EMULATED run: deep_gemm is a torch stand-in; no figure below is a peer figure")
    else:
        try:
            import deep_gemm as dg
        except Exception as e:
            print(
                "peers.py: cannot import deep_gemm "
                f"({type(e).__name__}: {e}).\n"
                "Install the wheels first: python3 -m pip install -q --no-index --no-deps --no-compile "
                "--no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site "
                "(`bash benches/peers_prepare.sh` fills .whl/ from the package registries)",
                file=sys.stderr,
            )
            return 2
        if not torch.cuda.is_available():
            print("peers.py: no CUDA device visible to torch; DeepGEMM needs one (--emulate tests the harness)", file=sys.stderr)
            return 2
        dev = torch.device("cuda")

    r = Runner(args, dg, args.emulate, dev)
    env = {
        "env": True,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deep_gemm": getattr(dg, "__version__", "?"),
        "device": r.device_name,
        "emulated": args.emulate,
        "reps": args.reps,
        "budget": args.budget,
        "shrink": args.shrink,
    }
    if dev.type == "cuda":
        prop = torch.cuda.get_device_properties(dev)
        env.update(sm_count=prop.multi_processor_count, memory_bytes=prop.total_memory, capability=f"{prop.major}.{prop.minor}")
    emit(env)
    if r.fi is None:
        print(f"flashinfer: not available ({r.fi_why})", flush=True)
        emit({"flashinfer": False, "why": r.fi_why})
    else:
        emit({"flashinfer": True, "library": r.fi.path})

    failed = False
    if args.check or args.check_only:
        if not r.check():
            failed = True
            note("peers.py: --check FAILED")
        if args.check_only:
            return 1 if failed else 0
    if args.accuracy or args.accuracy_only:
        try:
            if not r.accuracy():
                failed = True
        except Exception as e:
            failed = True
            traceback.print_exc()
            emit({"workload": "v32-accuracy", "mode": "accuracy", "peer": r.peer("all"), "error": f"{type(e).__name__}: {e}"})
        if args.accuracy_only:
            r.table()
            for f in r.failures:
                note(f"peers.py: {f}")
            return 1 if failed or r.failures else 0
    if not args.no_ceilings:
        r.ceilings()
    for name in names:
        try:
            if "decode" in WORKLOADS[name]:
                r.decode_workload(name)
            else:
                r.workload(name)
        except Exception as e:
            failed = True
            traceback.print_exc()
            label = name if args.shrink == 1 else f"{name}/shrink{args.shrink}"
            rec = {"workload": label, "peer": r.peer("all"), "error": f"{type(e).__name__}: {e}"}
            emit(rec)
            r.records.append(rec)
        free_memory()
    r.table()
    for f in r.failures:
        note(f"peers.py: {f}")
    return 1 if failed or r.failures else 0


if __name__ == "__main__":
    sys.exit(main())
