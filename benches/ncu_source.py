#!/usr/bin/env python3
"""Where a kernel's warps stall and what it issues, from ncu's per-instruction export.

    ncu --clock-control none -k regex:mqa_logits -c 1 --set full -o rep \\
        .gpu/bin/dsa-indexer bench --device cuda --json v32-64k --precision fast --reps 1
    ncu --import rep.ncu-rep --page source --print-source sass --csv > src.csv
    python3 benches/ncu_source.py src.csv [--per N] [--top K]

(`NCU_SET=full bash benches/gpu.sh ncu` writes src.csv as ncu-src-WORKLOAD.csv.) Prints
the kernel's warp-stall samples by reason (each a share of all samples), its SASS
opcodes by executed warp instructions, divided by N (`--per`: for a count per tile and
warp, the launch's tiles times the warps of a tile), and the K instructions with the
most samples with their leading reasons. benches/ncu_source_test.py tests it on a
recorded excerpt.
"""

import argparse
import collections
import csv

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def parse(text):
    """(kernel name, rows): each row a dict of the export's columns. A file without the
    kernel line, the header or its sample and instruction columns is an error naming what
    is missing, not an empty summary."""
    lines = list(csv.reader(text.splitlines()))
    if len(lines) < 2 or not lines[0] or lines[0][0] != "Kernel Name":
        raise ValueError("not ncu's source export: no 'Kernel Name' line first")
    kernel = lines[0][1] if len(lines[0]) > 1 else ""
    header = lines[1]
    for col in ("Address", "Source", SAMPLES, EXECUTED):
        if col not in header:
            raise ValueError(f"ncu source export without the column {col!r}")
    rows = [dict(zip(header, r)) for r in lines[2:] if len(r) == len(header)]
    return kernel, rows


def count(row, col):
    v = row.get(col, "") or "0"
    return int(v.replace(",", ""))


def reasons(header_cols):
    """The stall-reason columns of all samples (not the not-issued ones)."""
    return [c for c in header_cols if c.startswith("stall_") and "Not Issued" not in c]


def opcode(source):
    """A SASS line's opcode without its modifiers or predicate: `@!P0 BRA 0x..` -> BRA."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summary(rows, per=1.0):
    """(total samples, [(reason, samples)] descending, [(opcode, executed / per)]
    descending, the reason columns)."""
    total = sum(count(r, SAMPLES) for r in rows)
    cols = reasons(rows[0].keys()) if rows else []
    by_reason = collections.Counter({c: sum(count(r, c) for r in rows) for c in cols})
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r["Source"])] += count(r, EXECUTED) / per
    return total, by_reason.most_common(), by_op.most_common(), cols


def main(argv):
    ap = argparse.ArgumentParser(description="ncu's per-instruction export, summarised.")
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--per", type=float, default=1.0,
                    help="divide executed instructions by this (tiles times warps)")
    ap.add_argument("--top", type=int, default=15, help="instructions with the most samples")
    a = ap.parse_args(argv)
    if a.per <= 0:
        ap.error(f"--per must be positive, not {a.per}")
    per, top = a.per, a.top
    with open(a.csv) as f:
        kernel, rows = parse(f.read())
    total, by_reason, by_op, cols = summary(rows, per)
    print(f"{kernel}: {total} warp-stall samples over {len(rows)} SASS instructions")
    for name, n in by_reason:
        if n:
            print(f"  {name[len('stall_'):]:<20} {n:>10} {100 * n / max(total, 1):5.1f} %")
    unit = "executed warp instructions" if per == 1.0 else f"executed warp instructions / {per:g}"
    print(f"opcodes, {unit}: {sum(v for _, v in by_op):.1f} in all")
    for name, v in by_op:
        if v:
            print(f"  {name:<12} {v:12.1f}")
    print(f"the {top} instructions with the most samples:")
    for r in sorted(rows, key=lambda r: -count(r, SAMPLES))[:top]:
        s = count(r, SAMPLES)
        lead = sorted(((count(r, c), c) for c in cols), reverse=True)[:2]
        why = ", ".join(f"{c[len('stall_'):]} {n}" for n, c in lead if n)
        print(f"  {100 * s / max(total, 1):5.1f} %  {r['Source'].strip()[:56]:<56} {why}")


if __name__ == "__main__":
    main(None)
