#!/usr/bin/env python3
"""Tests of benches/kernel_times.py (no GPU): `python3 benches/kernel_times_test.py`.
benches/testdata/ncu_times.txt is ncu's report of one `dsa-indexer bench --device cuda
--json v41-chunk --reps 1` process on an H100 (`--metrics gpu__time_duration.sum`)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_times  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "ncu_times.txt")

HEADER = "  {} {}, Context 1, Stream 13, Device 0, CC 9.0"
SHAPE = "(32, 259, 1)x(128, 1, 1)"
METRIC = "    gpu__time_duration.sum          {}        {}"


def report(*launches, shape=SHAPE):
    """A report of (kernel, unit, value) launches in ncu's layout, or (kernel, unit,
    value, shape) for a launch of its own shape."""
    lines = ["[1] dsa-indexer@127.0.0.1"]
    for launch in launches:
        name, unit, value = launch[:3]
        lines += [HEADER.format(name, launch[3] if len(launch) > 3 else shape),
                  "    Section: Command line profiler metrics"]
        if unit is not None:
            lines.append(METRIC.format(unit, value))
        lines.append("")
    return "\n".join(lines)


class RecordedReport(unittest.TestCase):
    def test_every_launch_in_order_with_its_time_in_ms(self):
        with open(DATA, encoding="utf-8") as f:
            triples = kernel_times.launches(f.read())
        self.assertEqual(len(triples), 17)
        self.assertEqual(triples[0], ("wgi8_decode_keys", "(4096, 1, 1)x(256, 1, 1)", 22.37e-3))
        self.assertEqual(triples[1], ("mqa_logits_wgi8_r8", "(32, 259, 1)x(128, 1, 1)", 5.66))
        self.assertAlmostEqual(triples[2][2], 0.78682)

    def test_the_two_tile_shapes_are_rows_of_their_own(self):
        # v41-chunk's two tiles launch the logits on 259 and 253 row groups, and the
        # top-k on 2072 and 2024 rows: four launches of each shape.
        with open(DATA, encoding="utf-8") as f:
            triples = kernel_times.launches(f.read())
        rows = kernel_times.summary(triples)
        self.assertEqual([r[:3] for r in rows], [
            ("wgi8_decode_keys", "(4096, 1, 1)x(256, 1, 1)", 1),
            ("mqa_logits_wgi8_r8", "(32, 259, 1)x(128, 1, 1)", 4),
            ("topk_ragged_f32", "(2072, 1, 1)x(512, 1, 1)", 4),
            ("mqa_logits_wgi8_r8", "(32, 253, 1)x(128, 1, 1)", 4),
            ("topk_ragged_f32", "(2024, 1, 1)x(512, 1, 1)", 4)])
        self.assertAlmostEqual(sum(r[6] for r in rows), sum(t[2] for t in triples))
        big = [ms for n, s, ms in triples if n == "mqa_logits_wgi8_r8" and s.startswith("(32, 259")]
        name, shape, k, med, lo, hi, total = rows[1]
        self.assertEqual((lo, hi), (min(big), max(big)))
        self.assertAlmostEqual(total, sum(big))


class Units(unittest.TestCase):
    def test_each_unit_to_ms(self):
        text = report(("a", "ns", "1,500"), ("b", "usecond", "2.5"), ("c", "s", "0.001"),
                      ("a", "msecond", "3"))
        self.assertEqual([(n, ms) for n, _, ms in kernel_times.launches(text)],
                         [("a", 1.5e-3), ("b", 2.5e-3), ("c", 1.0), ("a", 3.0)])

    def test_an_unknown_unit_is_an_error_naming_it(self):
        with self.assertRaisesRegex(ValueError, "unit 'cycle' of k"):
            kernel_times.launches(report(("k", "cycle", "10")))

    def test_a_launch_without_its_duration_is_an_error(self):
        with self.assertRaisesRegex(ValueError, "launch of a has no"):
            kernel_times.launches(report(("a", None, None), ("b", "ms", "1")))
        with self.assertRaisesRegex(ValueError, "launch of b at the end"):
            kernel_times.launches(report(("a", "ms", "1"), ("b", None, None)))

    def test_the_table_sums_every_launch(self):
        rows = kernel_times.summary([("x", "s", 1.0), ("y", "s", 0.5), ("x", "s", 3.0)])
        self.assertEqual(rows, [("x", "s", 2, 2.0, 1.0, 3.0, 4.0),
                                ("y", "s", 1, 0.5, 0.5, 0.5, 0.5)])
        self.assertTrue(kernel_times.table(rows).endswith("| all | | 3 | | | | 4.500 |"))

    def test_one_kernel_of_two_shapes_is_two_rows(self):
        text = report(("k", "ms", "1"), ("k", "ms", "5", "(8, 1, 1)x(128, 1, 1)"),
                      ("k", "ms", "3"))
        rows = kernel_times.summary(kernel_times.launches(text))
        self.assertEqual(rows, [("k", SHAPE, 2, 2.0, 1.0, 3.0, 4.0),
                                ("k", "(8, 1, 1)x(128, 1, 1)", 1, 5.0, 5.0, 5.0, 5.0)])


if __name__ == "__main__":
    unittest.main()
