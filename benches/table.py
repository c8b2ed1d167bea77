#!/usr/bin/env python3
"""One table per workload: the crate beside its peers, from one GPU run.

Reads the JSON lines of `dsa-indexer bench --device cuda --json` (ours) and of
`benches/peers.py` (the peers) and prints, per workload of ours, a Markdown table:

- ours: end to end, logits, selection (and the path counters per run);
- DeepGEMM + FlashInfer's top-k, DeepGEMM + torch.topk (end to end);
- DeepGEMM's logits alone, FlashInfer's top-k alone, torch.topk alone;
- the fp4 -> fp8 conversion for V4.1 (a peer's fp4 figures run on fp8 converted from
  the fp4 inputs, so it is added beside them);

each with its ratio `peer / ours` against the part of ours it stands for (above 1: ours
is faster). A line of ours run with `--precision fast` gets a table of its own, its
heading marked "fast precision", beside the same peers.

A decode workload of ours (its line has `next_n` and `kv_gbs`) gets its own table: ours
end to end, logits and selection; DeepGEMM's paged logits + FlashInfer's top-k and +
torch.topk (end to end), each part alone, and DeepGEMM's schedule metadata (once per
decode step, in no other figure); each with the KV cache's bytes per second at the floor
(`kv_bytes`: every used page read once per request) and its share of the 4.3 TB/s copy
ceiling, and the ratio. Its peers are peers.py's `decode` mode of the same workload
(E4M3 workloads only; the others show n/a). Peers are taken from the peer workload of the same shape
(`v41-chunk-source` -> `v41-chunk`, `v41-1m-256m` -> `v41-1m`) in the mode that runs
at ours' default budget (`row_chunked` where peers.py chunks, else `single_call`).

Last, when peers.py ran its accuracy part (`--accuracy`), a table of `|x - ref| / M`
against SPEC 4's logits in float64 on random v32 data: max, p99.9 and median as powers of
two, the share of logits equal to the float64 value, and whether the max is within SPEC
4's `2^-8 M`; for DeepGEMM's logits and, where peers.py was given them (`--ours`), ours.

    python3 benches/table.py DIR                 # DIR/bench.jsonl and DIR/peers.jsonl
    python3 benches/table.py --ours A --peers B  # any two files

Lines that are not JSON objects are skipped, so a whole log can be given. Exit status 0,
or 2 when ours has no workload line.
"""

import argparse
import json
import os
import sys

PEER_SHAPE = {"v41-chunk-source": "v41-chunk", "v41-1m-256m": "v41-1m"}
KV_COPY_CEILING_GBS = 4300.0
EMULATED = "EMULATED:"


def read_jsonl(path):
    out = []
    if path is None or not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                v = json.loads(line)
            except ValueError:
                continue
            if isinstance(v, dict):
                out.append(v)
    return out


class Peers:
    """peers.py's records by (workload, mode, peer), `EMULATED:` stripped and noted."""

    def __init__(self, records):
        self.by = {}
        self.emulated = False
        self.flashinfer_missing = None
        for r in records:
            if r.get("flashinfer") is False:
                self.flashinfer_missing = r.get("why", "not available")
            if "peer" not in r or "workload" not in r:
                continue
            peer = r["peer"]
            if peer.startswith(EMULATED):
                peer = peer[len(EMULATED):]
                self.emulated = True
            self.by[(r["workload"], r.get("mode", ""), peer)] = r

    def modes(self, workload):
        return {m for (w, m, _) in self.by if w == workload and m}

    def get(self, workload, mode, peer):
        return self.by.get((workload, mode, peer)) or self.by.get((workload, "", peer))


def ms(x):
    return f"{x:.3f}" if isinstance(x, (int, float)) else ""


def ratio(peer_ms, ours_ms):
    if not isinstance(peer_ms, (int, float)) or not isinstance(ours_ms, (int, float)) or ours_ms <= 0:
        return ""
    return f"{peer_ms / ours_ms:.2f}"


def peer_cell(rec):
    """(ms or None, text): a record's median, or why there is none."""
    if rec is None:
        return None, "n/a"
    if "error" in rec:
        return None, "error: " + str(rec["error"])[:80].replace("|", "/")
    return rec.get("median_ms"), ms(rec.get("median_ms"))


def is_decode(o):
    return "next_n" in o and "kv_gbs" in o


def kv_cells(kv_bytes, t):
    """(GB/s, % of the ceiling) of `kv_bytes` read in `t` ms, as text."""
    if not isinstance(kv_bytes, (int, float)) or not isinstance(t, (int, float)) or t <= 0:
        return "", ""
    gbs = kv_bytes / (t * 1e-3) / 1e9
    return f"{gbs:.0f}", f"{100.0 * gbs / KV_COPY_CEILING_GBS:.1f} %"


def heading(o):
    """A workload's name, with `, fast precision` when ours ran in the fast mode."""
    return o["name"] + (", fast precision" if o.get("precision") == "fast" else "")


def decode_table(o, peers):
    """The Markdown lines of one decode workload of ours `o`."""
    name = o["name"]
    kv = o.get("kv_bytes")
    e2e, lg, sel = o.get("median_ms"), o.get("logits_ms"), o.get("select_ms")
    lines = [
        f"### {heading(o)} (decode: {o.get('requests', '?')} requests x {o.get('next_n', '?')} rows, "
        f"pages of {o.get('page_size', '?')}; KV floor {kv / 1e6:.1f} MB)" if isinstance(kv, (int, float)) else f"### {heading(o)} (decode)",
        "",
        "| part | median ms | KV GB/s | of 4.3 TB/s | peer / ours |",
        "|---|---|---|---|---|",
    ]
    step = o.get("step_ms")
    for label, t in (("ours, end to end", e2e), ("ours, the engine's decode step", step), ("ours, logits", lg)):
        if label.endswith("step") and step is None:
            continue
        g, pct = kv_cells(kv, t)
        lines.append(f"| {label} | {ms(t)} | {g} | {pct} | |")
    lines.append(f"| ours, selection | {ms(sel)} | | | |")
    rows = [
        ("DeepGEMM paged + FlashInfer top-k", "deepgemm_paged+flashinfer_top_k_page_table_transform", e2e, True),
        ("DeepGEMM paged + torch.topk", "deepgemm_paged+torch_topk", e2e, True),
        ("DeepGEMM paged logits alone", "deepgemm_fp8_paged_mqa_logits", lg, True),
        ("FlashInfer top-k alone", "flashinfer_top_k_page_table_transform", sel, False),
        ("torch.topk alone", "torch_topk", sel, False),
    ]
    for label, peer, ours_ms, reads_kv in rows:
        rec = peers.get(name, "decode", peer)
        t, text = peer_cell(rec)
        g, pct = kv_cells(kv, t) if reads_kv and t is not None else ("", "")
        lines.append(f"| {label} | {text} | {g} | {pct} | {ratio(t, ours_ms)} |")
    meta = peers.get(name, "decode", "deepgemm_get_paged_mqa_logits_metadata")
    if meta is not None:
        lines.append(f"| DeepGEMM schedule metadata (once per step) | {peer_cell(meta)[1]} | | | |")
    lines.append("")
    notes = []
    p = o.get("topk_paths")
    if p:
        notes.append("top-k rows per run: " + ", ".join(f"{k} {v}" for k, v in p.items()))
    any_rec = next((r for (w, m, _), r in peers.by.items() if w == name and m == "decode"), None)
    if any_rec is None:
        notes.append("no peer figures for this workload (peers.py runs the decode peers on the E4M3 workloads)")
    else:
        if any_rec.get("context_lens"):
            notes.append(f"DeepGEMM took context_lens as {any_rec['context_lens']}; its sample max |x - ref| / M = {any_rec.get('sample_max_err_over_M', '?')}")
        if any_rec.get("flashinfer_algorithm"):
            notes.append(f"FlashInfer took {any_rec['flashinfer_algorithm']}; its selection: {any_rec.get('flashinfer_selection', '?')}")
    lines.extend(f"- {n}" for n in notes)
    if notes:
        lines.append("")
    return lines


ACCURACY_LABELS = {"deepgemm_fp8_mqa_logits": "DeepGEMM fp8_fp4_mqa_logits", "ours": "ours"}


def accuracy_table(recs):
    """The Markdown lines of peers.py's accuracy records `recs` (one problem)."""
    r0 = recs[0]
    pairs = next((r["pairs"] for r in recs if "pairs" in r), None)
    size = f", {pairs:,} logits" if isinstance(pairs, int) else ""
    bound = r0.get("bound_log2", -8.0)
    lines = [
        f"### Accuracy: |x - ref| / M against float64, random v32 data ({r0.get('rows', '?')} rows x "
        f"{r0.get('keys', '?')} keys, H = {r0.get('heads', '?')}, D = {r0.get('dim', '?')}{size})",
        "",
        f"| logits | max | p99.9 | median | equal to float64 | within 2^{bound:.0f} M |",
        "|---|---|---|---|---|---|",
    ]
    for r in recs:
        peer = r["peer"][len(EMULATED):] if r["peer"].startswith(EMULATED) else r["peer"]
        label = ACCURACY_LABELS.get(peer, peer)
        if peer == "ours" and r.get("file"):
            label += f" ({os.path.basename(r['file'])}, {r.get('layout', '?')})"
        if "error" in r:
            lines.append(f"| {label} | error: {str(r['error'])[:80].replace('|', '/')} | | | | |")
            continue
        worst = r.get("log2_max_err_over_M")
        if worst is None:  # 0 (every logit equal) or inf (a NaN, or an error where M = 0)
            within = "yes" if r.get("max_err_over_M") == "0" else "**no**"
        else:
            within = "yes" if worst <= bound else "**no**"
        exact = r.get("exact_fraction")
        exact = f"{100.0 * exact:.1f} %" if isinstance(exact, (int, float)) else ""
        cells = [r.get(f"{k}_err_over_M", "") for k in ("max", "p99_9", "median")]
        lines.append(f"| {label} | {' | '.join(cells)} | {exact} | {within} |")
    lines.append("")
    return lines


def table(o, peers):
    """The Markdown lines of one workload of ours `o`."""
    if is_decode(o):
        return decode_table(o, peers)
    name = o["name"]
    pw = PEER_SHAPE.get(name, name)
    modes = peers.modes(pw)
    mode = "row_chunked" if "row_chunked" in modes else ("single_call" if "single_call" in modes else "")
    e2e, lg, sel = o.get("median_ms"), o.get("logits_ms"), o.get("select_ms")
    conv = peers.get(pw, "", "fp4_to_fp8_total")
    conv_ms = conv.get("median_ms") if conv and "error" not in conv else None
    lines = []
    head = f"### {heading(o)}"
    if pw != name:
        head += f" (peers: the {pw} shape)"
    if mode:
        head += f", peers {mode}"
        any_rec = next((r for (w, m, _), r in peers.by.items() if w == pw and m == mode), {})
        if "chunks" in any_rec:
            head += f" ({any_rec['chunks']} call{'s' if any_rec['chunks'] != 1 else ''})"
    lines.append(head)
    lines.append("")
    lines.append("| part | median ms | TFLOP/s or GB/s | peer / ours |")
    lines.append("|---|---|---|---|")
    lines.append(f"| ours, end to end | {ms(e2e)} | {o.get('tflops', 0):.1f} TFLOP/s | |")
    lines.append(f"| ours, logits | {ms(lg)} | {o.get('logits_tflops', 0):.1f} TFLOP/s | |")
    lines.append(f"| ours, selection | {ms(sel)} | {o.get('topk_gbs', 0):.0f} GB/s | |")
    # (label, peer, ours, unit, plus the fp4 conversion, shown only when recorded)
    rows = [
        ("DeepGEMM + FlashInfer top-k", "deepgemm+flashinfer_top_k_page_table_transform", e2e, "tflops", True, False),
        ("DeepGEMM + torch.topk", "deepgemm+torch_topk", e2e, "tflops", True, False),
        ("DeepGEMM logits alone", "deepgemm_fp8_mqa_logits", lg, "tflops", False, False),
        ("DeepGEMM logits inside DeepGEMM + FlashInfer", "deepgemm_fp8_mqa_logits_in_e2e_fi", lg, "tflops", False, True),
        ("FlashInfer top-k alone", "flashinfer_top_k_page_table_transform", sel, "gbs", False, False),
        ("torch.topk alone", "torch_topk", sel, "gbs", False, False),
    ]
    for label, peer, ours_ms, unit, plus_conv, optional in rows:
        rec = peers.get(pw, mode, peer) if mode else None
        if rec is None and optional:
            continue  # lines from before peers.py recorded it
        t, text = peer_cell(rec)
        rate = ""
        if t is not None and unit == "tflops" and rec.get("effective_tflops") is not None:
            rate = f"{rec['effective_tflops']:.1f} TFLOP/s"
        elif t is not None and unit == "gbs" and rec.get("gbs_valid") is not None:
            rate = f"{rec['gbs_valid']:.0f} GB/s"
        r = ratio(t, ours_ms)
        if t is not None and plus_conv and conv_ms is not None:
            text += f" (+{conv_ms:.3f} conversion)"
            r += f" ({ratio(t + conv_ms, ours_ms)} with it)"
        lines.append(f"| {label} | {text} | {rate} | {r} |")
    if conv is not None:
        t, text = peer_cell(conv)
        lines.append(f"| fp4 -> fp8 conversion (V4.1, q + k) | {text} | | |")
    lines.append("")
    notes = []
    p, f = o.get("topk_paths"), o.get("fold_counts")
    if p:
        notes.append("top-k rows per run: " + ", ".join(f"{k} {v}" for k, v in p.items()))
    if f and any(f.values()):
        qf, qp = f.get("query_blocks_folded", 0), f.get("query_blocks_plain", 0)
        share = f" ({100.0 * qf / (qf + qp):.1f} % folded)" if qf + qp else ""
        notes.append("exact-class fold counters per run: " + ", ".join(f"{k} {v}" for k, v in f.items()) + share)
    fi = peers.get(pw, mode, "flashinfer_top_k_page_table_transform") if mode else None
    if fi and fi.get("flashinfer_algorithm"):
        notes.append(f"FlashInfer took {fi['flashinfer_algorithm']}; its selection: {fi.get('flashinfer_selection', '?')}")
    lines.extend(f"- {n}" for n in notes)
    if notes:
        lines.append("")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", help="folder with bench.jsonl and peers.jsonl")
    ap.add_argument("--ours", help="dsa-indexer bench --json lines (default DIR/bench.jsonl)")
    ap.add_argument("--peers", help="benches/peers.py lines (default DIR/peers.jsonl)")
    a = ap.parse_args(argv)
    if a.dir is None and a.ours is None:
        ap.error("give DIR or --ours")
    ours_path = a.ours or os.path.join(a.dir, "bench.jsonl")
    peers_path = a.peers or (os.path.join(a.dir, "peers.jsonl") if a.dir else None)
    ours = [r for r in read_jsonl(ours_path) if "name" in r and "median_ms" in r]
    peers = Peers(read_jsonl(peers_path))
    if not ours:
        print(f"table.py: no workload line of dsa-indexer bench in {ours_path}", file=sys.stderr)
        return 2
    device = ours[0].get("device", "?")
    print(f"## Ours and the peers on {device}, one run")
    print()
    if "H200" not in device and any("kv_bytes" in o for o in ours):
        # The decode tables' share is against the H200's measured copy rate.
        print(f"The decode tables' shares are of 4.3 TB/s, the H200's measured copy ceiling; "
              f"{device}'s is not measured here, so they understate where its memory is slower.")
        print()
    if peers.emulated:
        print("EMULATED: the peer figures below come from peers.py --emulate; they are no peer figures.")
        print()
    if not peers.by:
        print(f"No peer figures ({peers_path or 'no peers file'}).")
        print()
    elif peers.flashinfer_missing:
        print(f"flashinfer: not available ({peers.flashinfer_missing})")
        print()
    for o in ours:
        print("\n".join(table(o, peers)))
    acc = [r for (_, m, _), r in peers.by.items() if m == "accuracy"]
    if acc:
        print("\n".join(accuracy_table(acc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
