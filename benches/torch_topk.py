"""torch.topk on logits of the bench workloads' shapes, for the comparison in RESULTS.md.

Random f32 logits (never zeros), invisible keys masked to -inf as an engine does,
timed with CUDA events after a warm-up, median of 5. Rate = 4 * valid_pairs / t.
"""
import torch

def bench(name, rows, n_last, k, chunk_rows):
    # Row i sees n_last - rows + 1 + i keys (causal, the request's last `rows` positions).
    t = []
    valid = sum(n_last - rows + 1 + i for i in range(rows))
    for rep in range(6):
        total = 0.0
        for r0 in range(0, rows, chunk_rows):
            r1 = min(rows, r0 + chunk_rows)
            x = torch.randn(r1 - r0, n_last, device="cuda")
            n = torch.arange(n_last - rows + 1 + r0, n_last - rows + 1 + r1, device="cuda")
            x.masked_fill_(torch.arange(n_last, device="cuda")[None, :] >= n[:, None], float("-inf"))
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            torch.topk(x, k, dim=1)
            e1.record()
            e1.synchronize()
            total += e0.elapsed_time(e1)
            del x
        if rep:
            t.append(total)
    t.sort()
    ms = t[len(t) // 2]
    print(f"torch.topk {name}: {ms:.3f} ms, {4 * valid / ms / 1e6:.1f} GB/s of valid logits")

bench("v32-16k", 16384, 16384, 2048, 16384)
bench("v41-chunk", 4096, 262144, 512, 2048)
