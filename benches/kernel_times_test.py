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

HEADER = "  {} (32, 259, 1)x(128, 1, 1), Context 1, Stream 13, Device 0, CC 9.0"
METRIC = "    gpu__time_duration.sum          {}        {}"


def report(*launches):
    """A report of (kernel, unit, value) launches in ncu's layout."""
    lines = ["[1] dsa-indexer@127.0.0.1"]
    for name, unit, value in launches:
        lines += [HEADER.format(name), "    Section: Command line profiler metrics"]
        if unit is not None:
            lines.append(METRIC.format(unit, value))
        lines.append("")
    return "\n".join(lines)


class RecordedReport(unittest.TestCase):
    def test_every_launch_in_order_with_its_time_in_ms(self):
        with open(DATA, encoding="utf-8") as f:
            pairs = kernel_times.launches(f.read())
        self.assertEqual(len(pairs), 17)
        self.assertEqual(pairs[0], ("wgi8_decode_keys", 22.37e-3))
        self.assertEqual(pairs[1], ("mqa_logits_wgi8_r8", 5.66))
        self.assertAlmostEqual(pairs[2][1], 0.78682)
        rows = kernel_times.summary(pairs)
        self.assertEqual([r[:2] for r in rows], [
            ("wgi8_decode_keys", 1), ("mqa_logits_wgi8_r8", 8), ("topk_ragged_f32", 8)])
        name, k, med, lo, hi, total = rows[1]
        self.assertEqual((lo, hi), (5.53, 5.67))
        self.assertAlmostEqual(med, 5.64)
        self.assertAlmostEqual(total, 45.02)


class Units(unittest.TestCase):
    def test_each_unit_to_ms(self):
        text = report(("a", "ns", "1,500"), ("b", "usecond", "2.5"), ("c", "s", "0.001"),
                      ("a", "msecond", "3"))
        self.assertEqual(kernel_times.launches(text),
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
        rows = kernel_times.summary([("x", 1.0), ("y", 0.5), ("x", 3.0)])
        self.assertEqual(rows, [("x", 2, 2.0, 1.0, 3.0, 4.0), ("y", 1, 0.5, 0.5, 0.5, 0.5)])
        self.assertTrue(kernel_times.table(rows).endswith("| all | 3 | | | | 4.500 |"))


if __name__ == "__main__":
    unittest.main()
