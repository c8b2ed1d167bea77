#!/usr/bin/env python3
"""Tests of benches/table.py on the recorded lines in benches/testdata (no GPU, no torch):
`python3 benches/table_test.py`."""

import contextlib
import io
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")


def render(*argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = table.main(list(argv))
    return rc, out.getvalue()


def section(text, name):
    """The lines of workload `name`'s table."""
    lines = text.splitlines()
    start = next(i for i, l in enumerate(lines) if (l + " ").startswith((f"### {name} ", f"### {name},")))
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("### ")), len(lines))
    return lines[start:end]


def row(lines, label):
    cells = [c.strip() for c in next(l for l in lines if l.startswith(f"| {label} |")).strip("|").split("|")]
    return cells


class TableTest(unittest.TestCase):
    def setUp(self):
        self.rc, self.text = render(DATA)

    def test_ratios_are_peer_over_ours(self):
        self.assertEqual(self.rc, 0)
        s = section(self.text, "v32-16k")
        self.assertEqual(row(s, "DeepGEMM + FlashInfer top-k")[3], "0.84")  # 3.39 / 4.03
        self.assertEqual(row(s, "DeepGEMM logits alone")[3], "0.57")  # 2.06 / 3.59
        self.assertEqual(row(s, "FlashInfer top-k alone")[3], "2.85")  # 1.37 / 0.48
        self.assertEqual(row(s, "torch.topk alone")[3], "8.75")  # 4.2 / 0.48

    def test_fp4_adds_the_conversion_and_takes_the_budget_mode(self):
        s = section(self.text, "v41-chunk")
        self.assertIn("row_chunked (2 calls)", s[0])
        r = row(s, "DeepGEMM + FlashInfer top-k")
        self.assertEqual(r[1], "11.700 (+1.480 conversion)")
        self.assertEqual(r[3], "0.36 (0.41 with it)")  # 11.7 / 32.1, 13.18 / 32.1
        self.assertEqual(row(s, "fp4 -> fp8 conversion (V4.1, q + k)")[1], "1.480")
        self.assertTrue(any("100.0 % folded" in l for l in s))

    def test_variants_use_their_base_shape(self):
        s = section(self.text, "v41-chunk-source")
        self.assertIn("peers: the v41-chunk shape", s[0])
        self.assertEqual(row(s, "FlashInfer top-k alone")[3], "1.94")  # 2.97 / 1.53

    def test_errors_and_missing_peers_are_shown_not_guessed(self):
        s = section(self.text, "v41-chunk-wide")
        self.assertTrue(row(s, "FlashInfer top-k alone")[1].startswith("error: RuntimeError"))
        self.assertEqual(row(s, "FlashInfer top-k alone")[3], "")
        self.assertTrue(any("97.7 % folded" in l for l in s))
        s = section(self.text, "v41-1m")
        self.assertEqual(row(s, "DeepGEMM + torch.topk")[1:], ["n/a", "", ""])

    def test_no_lines_of_ours_is_an_error(self):
        rc, _ = render("--ours", os.path.join(DATA, "peers.jsonl"))
        self.assertEqual(rc, 2)

    def test_without_peers_ours_still_prints(self):
        rc, text = render("--ours", os.path.join(DATA, "bench.jsonl"))
        self.assertEqual(rc, 0)
        self.assertIn("No peer figures", text)
        self.assertEqual(row(section(text, "v32-16k"), "ours, end to end")[1], "4.030")


if __name__ == "__main__":
    unittest.main()
