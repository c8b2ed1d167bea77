#!/usr/bin/env python3
"""CPU tests of benches/peers.py's own parts (needs torch; skips without it):
`python3 benches/peers_test.py`. The GPU paths are exercised by `peers.py --check` there."""

import os
import sys
import unittest

try:
    import torch
except ImportError:
    torch = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
if torch is not None:
    import peers  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden", "quantizers.safetensors")


@unittest.skipIf(torch is None, "torch is not importable")
class SelectionTest(unittest.TestCase):
    """same_selection: equal to torch.topk up to exact ties, nothing looser."""

    def setUp(self):
        g = torch.Generator().manual_seed(1)
        # Few distinct values, so every row has ties at its k-th value.
        self.lg = torch.randint(0, 6, (5, 40), generator=g).float()
        self.ks = torch.tensor([0, 3, 10, 0, 35])
        self.ke = torch.tensor([40, 30, 12, 7, 40])
        self.k = 8
        fi = peers.EmulatedFlashInferTopK()
        self.meta = fi.prepare(self.ks, self.ke, 40)
        self.got = fi.page_table_transform(self.lg, self.meta, self.k)

    def test_a_top_k_passes(self):
        self.assertTrue(peers.same_selection(self.lg, self.ks, self.ke, self.got, self.k)[0])

    def test_another_tied_key_passes(self):
        got = self.got.clone()
        r, kth = 0, got[0, self.k - 1]
        v = self.lg[r, kth]
        chosen = set(got[r].tolist())
        other = next(j for j in range(40) if self.lg[r, j] == v and j not in chosen)
        got[r, self.k - 1] = other
        self.assertTrue(peers.same_selection(self.lg, self.ks, self.ke, got, self.k)[0])

    def test_a_smaller_value_fails(self):
        got = self.got.clone()
        r = 0
        low = int(torch.argmin(self.lg[r]))
        worst = min(range(self.k), key=lambda i: float(self.lg[r, got[r, i]]))
        self.assertGreater(float(self.lg[r, got[r, worst]]), float(self.lg[r, low]))
        got[r, worst] = low
        self.assertFalse(peers.same_selection(self.lg, self.ks, self.ke, got, self.k)[0])

    def test_a_key_outside_the_window_fails(self):
        got = self.got.clone()
        got[1, 0] = 2  # row 1 sees [3, 30)
        self.assertFalse(peers.same_selection(self.lg, self.ks, self.ke, got, self.k)[0])

    def test_a_repeated_key_fails(self):
        got = self.got.clone()
        got[0, 1] = got[0, 0]
        self.assertFalse(peers.same_selection(self.lg, self.ks, self.ke, got, self.k)[0])

    def test_padding_must_be_exact(self):
        # Row 2 sees 2 keys, row 4 five: -1 from there on.
        self.assertEqual(self.got[2, 2:].tolist(), [-1] * (self.k - 2))
        got = self.got.clone()
        got[2, 3] = 10
        self.assertFalse(peers.same_selection(self.lg, self.ks, self.ke, got, self.k)[0])
        got = self.got.clone()
        got[4, 0] = -1
        self.assertFalse(peers.same_selection(self.lg, self.ks, self.ke, got, self.k)[0])


@unittest.skipIf(torch is None, "torch is not importable")
class QuantizerTest(unittest.TestCase):
    def test_matches_the_crates_golden_vectors(self):
        self.assertTrue(peers.quantizer_matches_golden(GOLDEN))

    def test_rounding_ties_to_even_and_saturation(self):
        # One group of 32 whose amax is 6 (scale 1): the values land on E2M1's ties.
        x = torch.zeros(32)
        x[:10] = torch.tensor([6.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, -5.0, -7.0])
        x[31] = 0.1
        packed, scale = peers.quantize_fp4_blocks(x)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten()
        self.assertEqual(int(scale[0]), 127 + 1)  # pow2ceil(7 / 6) = 2
        # x / 2: 3, 0.125 -> +0, 0.375 -> 0.5, 0.625 -> 0.5, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
        # -0.125 -> +0, -2.5 -> -2, -3.5 -> -4; 0.05 -> +0
        self.assertEqual(codes[:10].tolist(), [5, 0, 1, 1, 2, 4, 4, 0, 12, 14])
        self.assertEqual(int(codes[31]), 0)

    def test_engine_like_scales_span_few_binades_and_the_conversion_is_exact(self):
        g = torch.Generator().manual_seed(2)
        p = peers.Problem(True, 64, 4096, 32, 128, g, torch.device("cpu"))
        st = peers.scale_span_stats(p)
        for side in ("q", "k"):
            self.assertLessEqual(len(st[side]) - 1, 4, st)  # max span
            self.assertGreater(sum(st[side][:3]), 0.98, st)  # span <= 2
        w = peers.Problem(True, 64, 4096, 32, 128, g, torch.device("cpu"), "uniform")
        self.assertGreater(sum(peers.scale_span_stats(w)["k"][4:]), 0.3)
        for prob in (p, w):
            prob.convert()
            self.assertTrue(peers.conversion_exact(prob))


@unittest.skipIf(torch is None, "torch is not importable")
class LoaderTest(unittest.TestCase):
    def test_a_missing_library_is_not_available_with_the_reason(self):
        fi, why = peers.load_flashinfer("/nonexistent/libdsa_fi_topk.so", False)
        self.assertIsNone(fi)
        self.assertIn("build.sh", why)

    def test_a_file_that_is_no_library_is_not_available(self):
        fi, why = peers.load_flashinfer(__file__, False)
        self.assertIsNone(fi)
        self.assertIn("OSError", why)


if __name__ == "__main__":
    unittest.main()
