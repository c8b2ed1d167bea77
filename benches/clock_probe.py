#!/usr/bin/env python3
"""DeepGEMM's fp8 logits kernel alone, back to back for a few seconds, on one row chunk
of a V3.2 shape (`benches/gpu.sh clocks` samples the SM clock and its slowdown reasons
meanwhile, beside the same for ours).

The chunk is the last rows of one request of `S` keys whose logits fit the budget (2 GiB:
8,192 rows at S = 65,536, the longest rows of v32-64k), inputs drawn as
`benches/peers.py` draws them (E4M3 codes without the NaN codes, key scales in [0.5, 2),
weights in [-1, 1)). Prints one JSON line: the calls, their median and fastest times in
ms, and the effective TFLOP/s of the chunk's visible pairs at each.

    python3 benches/clock_probe.py [--keys 65536] [--budget BYTES] [--seconds 3]
    python3 benches/clock_probe.py --matmul [--seconds 3]

`--matmul` runs 8192^3 fp8 e4m3 matmuls (`torch._scaled_mm`, fast accumulation, the
fp8 ceiling of benches/RESULTS.md) back to back instead: the tensor rate the board
sustains at its power cap, beside the rate of a short burst.
"""
import argparse
import json
import time

import torch

from peers import fp8_matmul, rand_e4m3  # benches/peers.py: the peers' draw and fp8 ceiling


def back_to_back(call, seconds):
    """Times (ms) of `call` run back to back for `seconds` after one warm-up call: events
    recorded around each call and read once per batch of 8, so that no host wait idles
    the GPU between calls. Returns {median_ms, min_ms, calls}: the median is the rate
    the board sustains, the fastest call that of a short burst before the cap binds."""
    call()
    torch.cuda.synchronize()
    times = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(8)]
        for a, b in ev:
            a.record()
            call()
            b.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in ev]
    times.sort()
    return {"median_ms": times[len(times) // 2], "min_ms": times[0], "calls": len(times)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=65536, help="keys of the request (default 65536)")
    ap.add_argument("--budget", type=int, default=2 << 30, help="logits bytes of the chunk (default 2 GiB)")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long to run (default 3)")
    ap.add_argument("--matmul", action="store_true", help="fp8 8192^3 matmuls instead of DeepGEMM")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.matmul:
        m = 8192
        t = back_to_back(fp8_matmul(m, dev, True), args.seconds)
        flops = 2.0 * m**3
        print(json.dumps({"peer": "torch_scaled_mm_fp8_8192", **t, "tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
                          "tflops_best": flops / (t["min_ms"] * 1e-3) / 1e12}))
        return

    import deep_gemm as dg

    g = torch.Generator(device=dev)
    g.manual_seed(0)
    s, h, d = args.keys, 64, 128
    rows = min(s, max(1, args.budget // (4 * s)))
    q = rand_e4m3((rows, h, d), g, dev)
    k = rand_e4m3((s, d), g, dev)
    kscale = torch.rand(s, generator=g, device=dev) * 1.5 + 0.5
    w = torch.rand((rows, h), generator=g, device=dev) * 2 - 1
    ke = torch.arange(s - rows + 1, s + 1, dtype=torch.int32, device=dev)
    ks = torch.zeros_like(ke)
    pairs = int(ke.sum().item())

    def call():
        return dg.fp8_fp4_mqa_logits((q, None), (k, kscale), w, ks, ke, clean_logits=False, max_seqlen_k=0)

    t = back_to_back(call, args.seconds)
    flops = 2.0 * pairs * h * d
    print(json.dumps({"peer": "deepgemm_fp8_mqa_logits", "keys": s, "rows": rows, **t,
                      "tflops": flops / (t["median_ms"] * 1e-3) / 1e12,
                      "tflops_best": flops / (t["min_ms"] * 1e-3) / 1e12}))


if __name__ == "__main__":
    main()
