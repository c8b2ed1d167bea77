#!/usr/bin/env python3
"""Tests of benches/table.py on the recorded lines in benches/testdata (no GPU, no torch):
`python3 benches/table_test.py`. benches/testdata/decode holds made-up figures in the
fields `dsa-indexer bench --json` and peers.py write for the decode workloads (no decode
run has been recorded yet)."""

import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import table  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
DECODE = os.path.join(DATA, "decode")


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

    def test_deepgemm_logits_inside_its_pipeline_get_a_row_when_recorded(self):
        # The recorded lines predate the record: no row. With one (a made-up 2.30 ms for
        # v32-16k), its ratio is against our logits.
        self.assertFalse(any("inside DeepGEMM" in l for l in section(self.text, "v32-16k")))
        with open(os.path.join(DATA, "peers.jsonl")) as f:
            lines = f.read().splitlines()
        base = next(l for l in lines if '"v32-16k"' in l and '"peer": "deepgemm_fp8_mqa_logits"' in l)
        extra = base.replace('"peer": "deepgemm_fp8_mqa_logits"', '"peer": "deepgemm_fp8_mqa_logits_in_e2e_fi"')
        extra = extra.replace('"median_ms": 2.06', '"median_ms": 2.3')
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "peers.jsonl"), "w") as f:
                f.write("\n".join(lines + [extra]) + "\n")
            rc, text = render("--ours", os.path.join(DATA, "bench.jsonl"), "--peers", os.path.join(d, "peers.jsonl"))
        self.assertEqual(rc, 0)
        r = row(section(text, "v32-16k"), "DeepGEMM logits inside DeepGEMM + FlashInfer")
        self.assertEqual((r[1], r[3]), ("2.300", "0.64"))  # 2.30 / 3.59

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


class DecodeTableTest(unittest.TestCase):
    def setUp(self):
        self.rc, self.text = render(DECODE)

    def test_ratios_and_kv_rates_at_the_floor(self):
        self.assertEqual(self.rc, 0)
        s = section(self.text, "v32-decode-b64-32k")
        self.assertIn("64 requests x 1 rows, pages of 64; KV floor 276.8 MB", s[0])
        # kv_bytes = 64 * 32768 * 132 = 276824064; / 0.080 ms = 3460 GB/s, 80.5 % of 4300.
        self.assertEqual(row(s, "ours, end to end")[1:4], ["0.080", "3460", "80.5 %"])
        self.assertEqual(row(s, "ours, logits")[2:4], ["3955", "92.0 %"])  # / 0.070 ms
        self.assertEqual(row(s, "DeepGEMM paged + FlashInfer top-k")[1:], ["0.152", "1821", "42.4 %", "1.90"])
        self.assertEqual(row(s, "DeepGEMM paged + torch.topk")[4], "5.25")  # 0.42 / 0.08
        self.assertEqual(row(s, "DeepGEMM paged logits alone")[1:], ["0.110", "2517", "58.5 %", "1.57"])  # vs logits
        self.assertEqual(row(s, "FlashInfer top-k alone")[1:], ["0.040", "", "", "2.00"])  # vs selection
        self.assertEqual(row(s, "torch.topk alone")[4], "15.00")
        self.assertEqual(row(s, "DeepGEMM schedule metadata (once per step)")[1], "0.006")
        self.assertTrue(any("context_lens as [B, next_n]" in l for l in s))
        self.assertTrue(any("FlashInfer took RadixTopK multi-CTA" in l for l in s))

    def test_mtp2_counts_both_rows_and_shows_errors(self):
        s = section(self.text, "v32-decode-b128-128k-mtp2")
        self.assertIn("128 requests x 2 rows", s[0])
        # 128 * 131072 * 132 B / 0.700 ms = 3164 GB/s.
        self.assertEqual(row(s, "ours, end to end")[2:4], ["3164", "73.6 %"])
        r = row(s, "DeepGEMM paged + FlashInfer top-k")
        self.assertTrue(r[1].startswith("error: RuntimeError"))
        self.assertEqual(r[2:], ["", "", ""])
        self.assertEqual(row(s, "DeepGEMM paged logits alone")[1:], ["0.597", "3710", "86.3 %", "0.96"])

    def test_the_share_names_its_ceiling_off_the_h200(self):
        self.assertNotIn("H200's measured copy ceiling", self.text)
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(DECODE, "bench.jsonl")) as f:
                lines = f.read().replace('"NVIDIA H200"', '"NVIDIA H100 80GB HBM3"')
            with open(os.path.join(d, "bench.jsonl"), "w") as f:
                f.write(lines)
            rc, text = render("--ours", os.path.join(d, "bench.jsonl"), "--peers", os.path.join(DECODE, "peers.jsonl"))
        self.assertEqual(rc, 0)
        self.assertIn("NVIDIA H100 80GB HBM3's is not measured here", text)
        # The shares themselves stay against 4.3 TB/s.
        self.assertEqual(row(section(text, "v32-decode-b64-32k"), "ours, end to end")[1:4], ["0.080", "3460", "80.5 %"])

    def test_a_decode_workload_without_peers_says_so(self):
        s = section(self.text, "v41-decode-b64-64k")
        # E2M1 pages: 68 B a token, 64 * 65536 * 68 = 285212672.
        self.assertIn("KV floor 285.2 MB", s[0])
        self.assertEqual(row(s, "DeepGEMM paged + FlashInfer top-k")[1:], ["n/a", "", "", ""])
        self.assertTrue(any("no peer figures" in l for l in s))

    def test_prefill_tables_ignore_decode_lines(self):
        rc, text = render("--ours", os.path.join(DATA, "bench.jsonl"), "--peers", os.path.join(DECODE, "peers.jsonl"))
        self.assertEqual(rc, 0)
        s = section(text, "v32-16k")
        self.assertEqual(row(s, "DeepGEMM + FlashInfer top-k")[1], "n/a")
        self.assertNotIn("KV GB/s", text)


class AccuracyTableTest(unittest.TestCase):
    """benches/testdata/accuracy.jsonl: made-up records in the fields of peers.py's
    accuracy part, DeepGEMM's and an `--ours` file's."""

    def setUp(self):
        self.rc, self.text = render("--ours", os.path.join(DATA, "bench.jsonl"), "--peers", os.path.join(DATA, "accuracy.jsonl"))

    def test_the_distribution_and_the_bound_per_logits(self):
        self.assertEqual(self.rc, 0)
        s = section(self.text, "Accuracy:")
        self.assertIn("256 rows x 32768 keys", s[0])
        self.assertEqual(row(s, "DeepGEMM fp8_fp4_mqa_logits")[1:], ["2^-13.21", "2^-16.02", "2^-19.50", "1.2 %", "yes"])
        self.assertEqual(row(s, "ours (ours.safetensors, [sum n])")[1:], ["2^-7.50", "2^-24.10", "0", "31.0 %", "**no**"])

    def test_no_accuracy_records_no_table(self):
        self.assertNotIn("### Accuracy", render(DATA)[1])


if __name__ == "__main__":
    unittest.main()
