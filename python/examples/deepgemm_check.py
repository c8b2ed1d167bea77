#!/usr/bin/env python3
"""One DeepSeek-V3.2 indexer layer computed as SGLang computes it on Hopper, judged by
`dsa_indexer.check`.

    python3 python/examples/deepgemm_check.py [--rows N] [--seq-len S]   # on an H200
    python3 python/examples/deepgemm_check.py --emulate --rows 32 --seq-len 4096

The engine path (SGLang's for V3.2 on SM90):

- logits: `deep_gemm.fp8_fp4_mqa_logits((q_fp8, None), (k_fp8, k_scale), weights, ks,
  ke, clean_logits=True, max_seqlen_k=0)` from the PyPI wheel `sgl-deep-gemm==0.1.4.post1`
  (with its pin `apache-tvm-ffi==0.1.11`, installed as benches/peers.py says): fp8
  `wgmma` with DeepGEMM's accumulator, `-inf` outside each row's `[ks, ke)`;
- selection: `torch.topk(logits, K, dim=-1).indices` (best first; an index whose logit
  is -inf, in a row with fewer than K visible keys, becomes -1), handed to the judge
  sorted ascending, -1 last, so that a row is judged on its set alone.

The layer has the V3.2 indexer's shape (H = 64, D = 128, K = 2048, E4M3 queries and
keys, f32 per-key scales, f32 weights): one request of `--seq-len` tokens (8192) whose
last `--rows` positions (2048) are the query rows, so row `i` sees keys `[0, S - rows +
i + 1)`. Inputs are drawn as `dsa-indexer bench` draws its `v32-*` workloads (in
distribution, torch's generator): uniform E4M3 bytes away from the NaN codes, key
scales uniform in [0.5, 2), weights uniform in [-1, 1).

Then:

- `dsa_indexer.check(indices, engine_logits=logits, **layer)` (the CPU reference and
  SPEC 9's judge, on the host copies) gives the verdict, printed as the judge words
  it, and per tensor the rows that differ from the reference only within ties and
  SPEC 4's tolerance (`rows_tolerant`) and those that really differ;
- against a float64 reference computed here on the GPU (exact products: E4M3 times
  E4M3 sums of 128 fit f64's mantissa), the largest `|engine logit - ref| / M` over
  every visible (row, key), with SPEC 4's `M = kscale * sum_h |w_h| sum_d |q_d k_d|`;
  SPEC 4's tolerance class bounds it by 2^-8.

- `dsa_indexer.index(q8, None, k8, kscale, w, ...)`, the crate's CUDA kernels on the same
  CUDA tensors (a build with CUDA, on a GPU; both precisions), each judged by
  `dsa_indexer.check` the same way (without engine logits: SPEC 9's default tolerance of
  the class), and the rows whose selected set differs from DeepGEMM's (`"ours"` in the
  JSON line; absent under `--emulate` or without the CUDA build).

The CPU reference bounds `--rows` by time: the default layer (2048 rows x 8192 keys)
takes `check` 29 s on two busy cores, 51 s with the engine's logits judged too, linear
in rows x keys (the JSON line gives `check_s`).

Output: one JSON line (`"emulated": true` and every figure labelled EMULATED under
`--emulate`), then a short summary. `--emulate` replaces deep_gemm by the torch
stand-in of benches/peers.py (`EmulatedDeepGemm`: the same formula in f32 on the CPU,
NOT DeepGEMM), to try the script without a GPU. `--dump PATH` writes the layer, the
engine's indices and logits as a dump (`dsa-indexer replay PATH`) when the verdict is
different. Exit status: 0 when the verdict is not "different", 1 when it is, 2 when
deep_gemm or a CUDA device is missing.
"""

import argparse
import json
import math
import os
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("deepgemm_check.py: needs torch (2.11 with CUDA on the GPU machine)")

import dsa_indexer

H, D, K = 64, 128, 2048
SPEC_BOUND_LOG2 = -8
HERE = os.path.dirname(os.path.abspath(__file__))

# The input draw and the emulated engine are benches/peers.py's.
sys.path.insert(0, os.path.join(HERE, "..", "..", "benches"))
from peers import rand_e4m3  # noqa: E402


def emulated_deep_gemm():
    """benches/peers.py's `EmulatedDeepGemm` (the torch stand-in; not a peer)."""
    from peers import EmulatedDeepGemm

    return EmulatedDeepGemm()


def draw(rows, seq_len, seed, dev):
    """The layer's device tensors: q [rows, H, D] and k [S, D] E4M3, k_scale [S] and
    weights [rows, H] f32, and each row's visible keys [ks, ke) (int32)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    q8 = rand_e4m3((rows, H, D), g, dev)
    k8 = rand_e4m3((seq_len, D), g, dev)
    kscale = torch.rand((seq_len,), generator=g, device=dev) * 1.5 + 0.5
    w = torch.rand((rows, H), generator=g, device=dev) * 2.0 - 1.0
    pos = torch.arange(seq_len - rows, seq_len, dtype=torch.int32, device=dev)
    return q8, k8, kscale, w, torch.zeros_like(pos), pos + 1


def engine(dg, q8, k8, kscale, w, ks, ke):
    """SGLang's indexer on Hopper: DeepGEMM's logits with -inf outside [ks, ke), then
    torch.topk; -1 for a selected -inf (a row with fewer than K visible keys)."""
    logits = dg.fp8_fp4_mqa_logits((q8, None), (k8, kscale), w, ks, ke, clean_logits=True, max_seqlen_k=0)
    top = torch.topk(logits, min(K, logits.shape[1]), dim=-1)
    idx = torch.where(top.values == float("-inf"), torch.full_like(top.indices, -1), top.indices)
    return logits, idx


def max_err_over_m(q8, k8, kscale, w, logits, ke, chunk_bytes=1 << 30):
    """max over visible (row, key) of `|logit - ref| / M` against the float64 reference
    (ks = 0 for every row here), computed in row chunks on the logits' device."""
    t, l = logits.shape
    kf = k8.double()
    kabs = kf.abs()
    sc = kscale.double()
    cols = torch.arange(l, device=logits.device)[None, :]
    step = max(1, chunk_bytes // (8 * H * l))
    worst = 0.0
    for a in range(0, t, step):
        b = min(t, a + step)
        qf, wf = q8[a:b].double(), w[a:b].double()
        s = torch.einsum("rhd,ld->rhl", qf, kf)
        ref = (wf[:, :, None] * s.clamp_min_(0.0)).sum(1) * sc[None, :]
        del s
        m = (wf.abs()[:, :, None] * torch.einsum("rhd,ld->rhl", qf.abs(), kabs)).sum(1) * sc[None, :]
        x = logits[a:b].double()
        err = (x - ref).abs()
        ratio = torch.where(m > 0, err / m.clamp_min(1e-300), torch.where(err > 0, math.inf, 0.0))
        ratio = torch.where(torch.isnan(x), math.inf, ratio)
        ratio = torch.where(cols < ke[a:b, None].long(), ratio, 0.0)
        worst = max(worst, float(ratio.max()))
    return worst


def theirs_vs_ours(q8, k8, kscale, w, engine_raw, layer):
    """The crate's CUDA entry on the same CUDA tensors at both precisions, each judged
    by `dsa_indexer.check` like the engine's (without logits: the class's default
    tolerance), with the rows whose selected set differs from the engine's."""
    out = {}
    for prec in ("full", "fast"):
        o = dsa_indexer.index(q8, None, k8, kscale, w, seq_lens=layer["seq_lens"],
                              query_starts=layer["query_starts"], topk=K, precision=prec)
        raw = o.raw.cpu()
        rep = dsa_indexer.check(raw, **layer)
        sel = rep.tensors.get("raw", {})
        out[prec] = {
            "verdict": rep.verdict,
            "rows_within_ties_and_tolerance": sel.get("rows_tolerant"),
            "rows_different": sel.get("rows_different"),
            "rows_differing_from_engine": int((raw != engine_raw).any(dim=1).sum()),
        }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048, help="query rows, the request's last positions (default 2048)")
    ap.add_argument("--seq-len", type=int, default=8192, help="the request's tokens, = keys (default 8192)")
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--no-engine-logits", action="store_true", help="judge the selections only, not DeepGEMM's logits")
    ap.add_argument("--dump", default=None, help="write the layer here as a dump when the verdict is different")
    ap.add_argument("--emulate", action="store_true", help="torch CPU stand-in for deep_gemm (no engine figures)")
    args = ap.parse_args()
    if not 1 <= args.rows <= args.seq_len:
        ap.error(f"--rows {args.rows}: must be in 1..=--seq-len ({args.seq_len})")

    if args.emulate:
        dg, dev = emulated_deep_gemm(), torch.device("cpu")
        print("deepgemm_check.py: EMULATED: deep_gemm is a torch stand-in; no figure is DeepGEMM's", file=sys.stderr)
    else:
        try:
            import deep_gemm as dg
        except Exception as e:
            print(f"deepgemm_check.py: cannot import deep_gemm ({type(e).__name__}: {e}); install the wheels "
                  "as benches/peers.py says", file=sys.stderr)
            return 2
        if not torch.cuda.is_available():
            print("deepgemm_check.py: no CUDA device visible to torch (--emulate tries the script)", file=sys.stderr)
            return 2
        dev = torch.device("cuda")

    q8, k8, kscale, w, ks, ke = draw(args.rows, args.seq_len, args.seed, dev)
    t0 = time.perf_counter()
    logits, idx = engine(dg, q8, k8, kscale, w, ks, ke)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    engine_s = time.perf_counter() - t0  # the first call: DeepGEMM compiles its kernel

    t0 = time.perf_counter()
    worst = max_err_over_m(q8, k8, kscale, w, logits, ke)
    f64_s = time.perf_counter() - t0

    layer = dict(q=q8.cpu(), q_scale=None, k=k8.cpu(), k_scale=kscale.cpu(), weights=w.cpu(),
                 seq_lens=[args.seq_len], query_starts=[args.seq_len - args.rows], topk=K)
    # The judge takes any order; ascending with the -1 padding last (the reference's
    # layout) makes a row of the reference's ids identical, so `rows_tolerant` counts
    # the rows whose set differs, not those in another order.
    big = torch.iinfo(torch.int32).max
    raw = idx.to(torch.int32)
    raw = torch.sort(torch.where(raw < 0, big, raw), dim=-1).values
    raw = torch.where(raw == big, -1, raw).cpu()
    engine_logits = None if args.no_engine_logits else logits.cpu()
    t0 = time.perf_counter()
    report = dsa_indexer.check(raw, engine_logits=engine_logits, **layer)
    check_s = time.perf_counter() - t0

    per_tensor = {
        name: {key: v for key, v in t.items() if key != "notes"} for name, t in report.tensors.items()
    }
    ours = theirs_vs_ours(q8, k8, kscale, w, raw, layer) if dev.type == "cuda" and dsa_indexer.CUDA else None
    sel = per_tensor.get("raw", {})
    different = report.verdict == "different"
    rec = {
        "what": "DeepGEMM fp8_fp4_mqa_logits + torch.topk, judged by dsa_indexer.check",
        "emulated": args.emulate,
        "verdict": report.verdict,
        "rows": args.rows,
        "seq_len": args.seq_len,
        "heads": H, "dim": D, "topk": K,
        "seed": args.seed,
        "rows_within_ties_and_tolerance": sel.get("rows_tolerant"),
        "rows_different": sel.get("rows_different"),
        "tensors": per_tensor,
        "max_err_over_M": worst,
        "max_err_over_M_log2": math.log2(worst) if 0 < worst < math.inf else None,
        "spec4_bound_log2": SPEC_BOUND_LOG2,
        "within_spec4_bound": worst <= 2.0**SPEC_BOUND_LOG2,
        "engine_s": engine_s,
        "f64_reference_s": f64_s,
        "check_s": check_s,
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "deep_gemm": getattr(dg, "__version__", "?"),
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
        "ours": ours,
    }
    print(json.dumps(rec), flush=True)

    tag = "EMULATED (torch stand-in, not DeepGEMM): " if args.emulate else ""
    err = f"2^{math.log2(worst):.2f}" if 0 < worst < math.inf else str(worst)
    print(f"{tag}verdict: {report.verdict}")
    for name, t in per_tensor.items():
        print(f"{tag}{name}: {t.get('status')}; rows of {args.rows} within ties and tolerance: "
              f"{t.get('rows_tolerant')}, different: {t.get('rows_different')}")
    print(f"{tag}max |engine logit - ref| / M = {err} (SPEC 4 bound 2^{SPEC_BOUND_LOG2})")
    print(f"{tag}engine {engine_s:.2f} s (first call), f64 reference {f64_s:.2f} s, check {check_s:.2f} s")
    for prec, o in (ours or {}).items():
        print(f"dsa_indexer.index ({prec}): {o['verdict']}; rows within ties and tolerance "
              f"{o['rows_within_ties_and_tolerance']}, different {o['rows_different']}; "
              f"rows whose set differs from DeepGEMM + torch.topk's: {o['rows_differing_from_engine']}")
    if different:
        print(report, file=sys.stderr)
        if args.dump:
            dsa_indexer.save_dump(args.dump, expected_raw=raw, engine_logits=engine_logits,
                                  description=f"deepgemm_check.py: {rec['what']}, seed {args.seed}", **layer)
            print(f"dump: {args.dump}", file=sys.stderr)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
