#!/usr/bin/env python3
"""DeepGEMM's fp8 logits kernel alone, back to back for a few seconds, on one row chunk
of a V3.2 shape (`benches/gpu.sh clocks` samples the SM clock and its slowdown reasons
meanwhile, beside the same for ours).

The chunk is the last rows of one request of `S` keys whose logits fit the budget (2 GiB:
8,192 rows at S = 65,536, the longest rows of v32-64k), inputs drawn as
`benches/peers.py` draws them (E4M3 codes without the NaN codes, key scales in [0.5, 2),
weights in [-1, 1)). Prints one JSON line: the calls, their median time in ms and the
effective TFLOP/s of the chunk's visible pairs.

    python3 benches/clock_probe.py [--keys 65536] [--budget BYTES] [--seconds 3]
"""
import argparse
import json
import time

import torch


def rand_e4m3(shape, g, dev):
    b = torch.randint(0, 256, shape, generator=g, device=dev, dtype=torch.int32).to(torch.uint8)
    b = torch.where((b & 0x7F) == 0x7F, b & 0xF7, b)
    return b.view(torch.float8_e4m3fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=65536, help="keys of the request (default 65536)")
    ap.add_argument("--budget", type=int, default=2 << 30, help="logits bytes of the chunk (default 2 GiB)")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long to run (default 3)")
    args = ap.parse_args()

    import deep_gemm as dg

    dev = torch.device("cuda")
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

    call()
    torch.cuda.synchronize()
    # Back to back, as an engine's layer runs: events recorded around each call and read
    # once per batch of calls, so that no host wait idles the GPU between them.
    times = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(8)]
        for a, b in ev:
            a.record()
            call()
            b.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in ev]
    times.sort()
    med = times[len(times) // 2]
    print(json.dumps({"peer": "deepgemm_fp8_mqa_logits", "keys": s, "rows": rows, "calls": len(times),
                      "median_ms": med, "tflops": 2.0 * pairs * h * d / (med * 1e-3) / 1e12}))


if __name__ == "__main__":
    main()
