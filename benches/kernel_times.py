#!/usr/bin/env python3
"""Per-kernel device times from ncu's text report: where a run's time goes, launch by launch.

    ncu --clock-control none --metrics gpu__time_duration.sum \\
        .gpu/bin/dsa-indexer bench --device cuda --json v41-chunk --reps 1 > ncu.txt
    python3 benches/kernel_times.py ncu.txt [more.txt ...]

Prints one table per report: each kernel and launch shape (grid x block) in order of
its first launch, its launches and the median, lowest, highest and summed
`gpu__time_duration.sum` in ms. Launches of one kernel with different grids (a run's
tiles of different row counts, or one kernel serving two steps) are rows of their own,
so that a median never mixes them. The
benchmark process launches every kernel of a warm-up and of each repetition, so the
sums span those runs; the medians are per launch. `bash benches/gpu.sh ktimes` runs
it on the device (benches/kernel_times_test.py: its tests, on a recorded report).
"""

import re
import statistics
import sys

# A launch's header line: `  name (gx, gy, gz)x(bx, by, bz), Context 1, Stream 13, ...`.
LAUNCH = re.compile(r"^  (\S+) (\(\d+, \d+, \d+\)x\(\d+, \d+, \d+\))")
DURATION = re.compile(r"^\s+gpu__time_duration\.sum\s+(\S+)\s+([\d.,]+)\s*$")
TO_MS = {
    "ns": 1e-6,
    "nsecond": 1e-6,
    "us": 1e-3,
    "usecond": 1e-3,
    "ms": 1.0,
    "msecond": 1.0,
    "s": 1e3,
    "second": 1e3,
}


def launches(text):
    """The (kernel, shape, ms) triples of a report, in launch order; shape is the
    launch's `(grid)x(block)` as ncu prints it. A launch whose duration is missing or in
    an unknown unit is an error naming it, not a silent zero."""
    out, name, shape = [], None, None
    for n, line in enumerate(text.splitlines(), 1):
        m = LAUNCH.match(line)
        if m:
            if name is not None:
                raise ValueError(f"line {n}: launch of {name} has no gpu__time_duration.sum")
            name, shape = m.group(1), m.group(2)
            continue
        m = DURATION.match(line)
        if m:
            if name is None:
                raise ValueError(f"line {n}: a duration outside any launch")
            unit, value = m.group(1), m.group(2).replace(",", "")
            if unit not in TO_MS:
                raise ValueError(f"line {n}: unit {unit!r} of {name}'s duration is not a time")
            out.append((name, shape, float(value) * TO_MS[unit]))
            name = None
    if name is not None:
        raise ValueError(f"launch of {name} at the end has no gpu__time_duration.sum")
    return out


def summary(triples):
    """Per kernel and launch shape, in order of first launch: (name, shape, launches,
    median, min, max, sum), the times in ms."""
    by = {}
    for name, shape, ms in triples:
        by.setdefault((name, shape), []).append(ms)
    return [
        (name, shape, len(t), statistics.median(t), min(t), max(t), sum(t))
        for (name, shape), t in by.items()
    ]


def table(rows):
    lines = [
        "| kernel | grid x block | launches | median ms | min | max | sum ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, shape, k, med, lo, hi, total in rows:
        lines.append(f"| {name} | {shape} | {k} | {med:.3f} | {lo:.3f} | {hi:.3f} | {total:.3f} |")
    total = sum(r[6] for r in rows)
    lines.append(f"| all | | {sum(r[2] for r in rows)} | | | | {total:.3f} |")
    return "\n".join(lines)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    for path in argv:
        with open(path, encoding="utf-8", errors="replace") as f:
            triples = launches(f.read())
        if not triples:
            print(f"{path}: no kernel launch with gpu__time_duration.sum", file=sys.stderr)
            return 1
        print(f"{path}:\n\n{table(summary(triples))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
