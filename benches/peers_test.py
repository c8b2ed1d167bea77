#!/usr/bin/env python3
"""CPU tests of benches/peers.py's own parts: `python3 benches/peers_test.py`. Most need
torch and skip without it; the float64 reference (`spec4_f64`) and the dump writer are
checked against the crate with numpy alone, through a `dsa-indexer` binary
($DSA_INDEXER_BIN, else target/release or target/debug), and skip without them. The GPU
paths are exercised by `peers.py --check` and `--accuracy` there."""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest

try:
    import torch
except ImportError:
    torch = None
try:
    import numpy as np
except ImportError:
    np = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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


def read_pool(pool, table, page_size, d, b, j):
    """Key `j` of request `b` read from an E4M3 pool as SPEC 10 lays it out (written here
    from the spec, not from peers.py): its D codes and its f32 scale."""
    page = int(table[b, j // page_size])
    t = j % page_size
    codes = pool[page, t * d : (t + 1) * d]
    at = page_size * d + 4 * t
    scale = pool[page, at : at + 4].contiguous().view(torch.float32)[0]
    return codes, scale


@unittest.skipIf(torch is None, "torch is not importable")
class DecodePoolTest(unittest.TestCase):
    """The decode peer's inputs: the pool, its tables and the context lengths."""

    def setUp(self):
        self.g = torch.Generator().manual_seed(5)
        self.lens = [130, 64, 1, 17]
        self.p, self.d = 16, 128
        self.k8 = peers.rand_e4m3((4, 130, self.d), self.g, torch.device("cpu"))
        self.ks = peers.rand_uniform((4, 130), 0.5, 2.0, self.g, torch.device("cpu"))
        self.pool, self.table = peers.build_pool(self.k8, self.ks, self.lens, self.p, self.g)

    def test_the_pool_reads_back_through_the_page_table(self):
        pages = sum((l + self.p - 1) // self.p for l in self.lens)
        self.assertEqual(tuple(self.pool.shape), (pages, self.p * (self.d + 4)))
        ids = sorted(int(x) for x in self.table.flatten() if x >= 0)
        self.assertEqual(ids, list(range(pages)))
        self.assertNotEqual(self.table[0, :9].tolist(), list(range(9)))  # random page order
        for b, l in enumerate(self.lens):
            self.assertTrue(bool((self.table[b, (l + self.p - 1) // self.p :] == -1).all()))
            for j in range(l):
                codes, scale = read_pool(self.pool, self.table, self.p, self.d, b, j)
                self.assertTrue(torch.equal(codes, self.k8[b, j].view(torch.uint8)), (b, j))
                self.assertEqual(float(scale), float(self.ks[b, j]), (b, j))

    def test_the_slot_table_is_specs_page_mapping(self):
        slots = peers.slot_table(self.table, torch.tensor(self.lens), self.p, 130)
        for b, l in enumerate(self.lens):
            for j in range(130):
                want = int(self.table[b, j // self.p]) * self.p + j % self.p if j < l else -1
                self.assertEqual(int(slots[b, j]), want, (b, j))

    def test_context_lens_both_forms_give_each_rows_keys(self):
        lens = torch.tensor([100, 7])
        for next_n in (1, 2, 4):
            want = [l - next_n + n + 1 for l in (100, 7) for n in range(next_n)]
            c2 = peers.decode_context_lens(lens, next_n, True)
            self.assertEqual(tuple(c2.shape), (2, next_n))
            self.assertEqual(c2.dtype, torch.int32)
            self.assertEqual(peers.decode_row_lens(c2, next_n).tolist(), want)
            c1 = peers.decode_context_lens(lens, next_n, False)
            self.assertEqual(c1.tolist(), [100, 7])
            self.assertEqual(peers.decode_row_lens(c1, next_n).tolist(), want)

    def test_kv_floor_counts_whole_pages(self):
        self.assertEqual(peers.kv_bytes_floor([65, 64, 1], 64, 132), (128 + 64 + 64) * 132)
        self.assertEqual(peers.kv_bytes_floor([32768] * 64, 64, 132), 64 * 32768 * 132)


def run_emulated(name, spec, args, decode=False):
    """peers.py's Runner on the stand-ins over workload `name` (registered as `spec` for the
    run only), its output swallowed; returns the runner (its records and failures)."""
    peers.WORKLOADS[name] = spec
    try:
        r = peers.Runner(args, peers.EmulatedDeepGemm(), True, torch.device("cpu"))
        with contextlib.redirect_stdout(io.StringIO()):
            (r.decode_workload if decode else r.workload)(name)
    finally:
        del peers.WORKLOADS[name]
    return r


@unittest.skipIf(torch is None, "torch is not importable")
class PrefillPeerTest(unittest.TestCase):
    """The prefill harness on the stand-ins, rows chunked: every part recorded, and
    DeepGEMM's logits timed inside its run with FlashInfer's top-k."""

    def test_an_emulated_chunked_workload_records_the_logits_inside_the_pipeline(self):
        # 16 rows of 96 keys per call: three chunks.
        args = argparse.Namespace(reps=2, shrink=1, budget=4 * 96 * 16, full_max=0, flashinfer_so=None)
        r = run_emulated("test-prefill", dict(fp4=False, heads=64, dim=128, topk=16, seq_len=96, rows=48), args)
        self.assertEqual(r.failures, [])
        by = {x["peer"]: x for x in r.records}
        inside = by["EMULATED:deepgemm_fp8_mqa_logits_in_e2e_fi"]
        e2e = by["EMULATED:deepgemm+flashinfer_top_k_page_table_transform"]
        self.assertEqual((inside["mode"], inside["chunks"]), ("row_chunked", 3))
        self.assertGreater(inside["median_ms"], 0.0)
        self.assertLess(inside["median_ms"], e2e["median_ms"])


@unittest.skipIf(torch is None, "torch is not importable")
class DecodePeerTest(unittest.TestCase):
    """The decode harness on the stand-ins: the reference check, FlashInfer's slots mapped
    back to keys, and one emulated workload's records."""

    def setUp(self):
        self.g = torch.Generator().manual_seed(6)
        self.dev = torch.device("cpu")
        self.dp = peers.DecodeProblem(3, 2, 150, 32, 128, 64, self.g, self.dev)
        self.dg = peers.EmulatedDeepGemm()
        self.ctx = peers.decode_context_lens(self.dp.lens, 2)
        self.sched = self.dg.get_paged_mqa_logits_metadata(self.ctx, 64, self.dg.get_num_sms())

    def logits(self, table):
        return peers.dg_paged_logits(self.dg, self.dp.q8, self.dp.kv_cache(), self.dp.w, self.ctx, table, self.sched, 150, False)

    def worst(self, lg):
        lens = peers.decode_row_lens(self.ctx, 2).tolist()
        return max(
            peers.reference_error(self.dp.request(r), [0, 1], lg[2 * r : 2 * r + 2], [0, 0], lens[2 * r : 2 * r + 2])
            for r in range(3)
        )

    def test_the_reference_check_passes_the_pool_and_catches_a_swapped_page(self):
        self.assertLess(self.worst(self.logits(self.dp.table)), 2.0**-16)
        bad = self.dp.table.clone()
        bad[1, 0], bad[1, 1] = self.dp.table[1, 1], self.dp.table[1, 0]
        self.assertGreater(self.worst(self.logits(bad)), 2.0**-8)

    def test_flashinfer_slots_map_back_to_a_top_k(self):
        lg = self.logits(self.dp.table)
        row_lens = peers.decode_row_lens(self.ctx, 2).long()
        slots = peers.slot_table(self.dp.table, self.dp.lens, 64, 150)
        fi = peers.EmulatedFlashInferTopK()
        meta = fi.prepare_decode(row_lens, slots, 2)
        self.assertEqual(meta["row_to_batch"].tolist(), [0, 0, 1, 1, 2, 2])
        k = 40
        got = fi.page_table_transform(lg, meta, k)
        pool_slots = self.dp.pool.shape[0] * 64
        keys = peers.slots_to_keys(got, slots, meta["row_to_batch"], pool_slots)
        zero = torch.zeros_like(row_lens)
        self.assertTrue(peers.same_selection(lg, zero, row_lens, keys, k)[0])
        # Another request's slot in row 2 (request 1) is no key of that row's window.
        other = got.clone()
        other[2, 0] = slots[0, int(keys[2, 0])]
        self.assertFalse(peers.same_selection(lg, zero, row_lens, peers.slots_to_keys(other, slots, meta["row_to_batch"], pool_slots), k)[0])

    def test_an_emulated_decode_workload_records_every_part(self):
        spec = dict(fp4=False, heads=32, dim=128, topk=64, seq_len=200, rows=2, decode=dict(requests=3, page_size=64))
        r = run_emulated("test-decode", spec, argparse.Namespace(reps=2, shrink=1, flashinfer_so=None), decode=True)
        self.assertEqual(r.failures, [])
        by = {x["peer"]: x for x in r.records}
        want = ["deepgemm_get_paged_mqa_logits_metadata", "deepgemm_fp8_paged_mqa_logits", "deepgemm_fp8_paged_mqa_logits_clean",
                "torch_topk", "flashinfer_top_k_page_table_transform", "deepgemm_paged+flashinfer_top_k_page_table_transform",
                "deepgemm_paged+torch_topk"]
        self.assertEqual(sorted(by), sorted("EMULATED:" + w for w in want))
        e2e = by["EMULATED:deepgemm_paged+flashinfer_top_k_page_table_transform"]
        self.assertEqual(e2e["mode"], "decode")
        self.assertEqual(e2e["kv_bytes"], 3 * 256 * 132)  # 200 keys: 4 pages of 64
        self.assertEqual(e2e["valid_pairs"], 3 * (199 + 200))
        self.assertAlmostEqual(e2e["kv_gbs"], e2e["kv_bytes"] / (e2e["median_ms"] * 1e-3) / 1e9)
        self.assertTrue(e2e["flashinfer_selection_ok"] and e2e["clean_logits_ok"])
        self.assertEqual(e2e["context_lens"], "[B, next_n]")


@unittest.skipIf(torch is None, "torch is not importable")
class AccuracyTest(unittest.TestCase):
    """The accuracy part on the stand-in: DeepGEMM's distribution over every visible pair,
    the problem written as a dump, and --ours read in both layouts."""

    T, L = 6, 300

    def run_part(self, ours=None, save=None):
        args = argparse.Namespace(accuracy_rows=self.T, accuracy_keys=self.L, accuracy_save=save, ours=ours, flashinfer_so=None)
        r = peers.Runner(args, peers.EmulatedDeepGemm(), True, torch.device("cpu"))
        with contextlib.redirect_stdout(io.StringIO()):
            ok = r.accuracy()
        return ok, {x["peer"]: x for x in r.records}

    def reference_f32(self):
        """The accuracy problem's float64 logits rounded to f32: `[T, L]` (0 past each row's
        keys) and `[sum n]`."""
        prob, ks, ke = peers.accuracy_problem(self.T, self.L, torch.device("cpu"))
        qf, wf = prob.decoded_rows(list(range(self.T)))
        full = torch.zeros((self.T, self.L), dtype=torch.float32)
        self.m = torch.zeros((self.T, self.L), dtype=torch.float64)
        for r in range(self.T):
            kf, sc = prob.decoded_keys(0, int(ke[r]))
            ref, self.m[r, : int(ke[r])] = peers.spec4_f64(qf[r], wf[r], kf, sc)
            full[r, : int(ke[r])] = ref.float()
        flat = torch.cat([full[r, : int(ke[r])] for r in range(self.T)])
        return prob, full, flat

    def test_deepgemm_is_measured_over_every_visible_pair_and_the_problem_is_saved(self):
        with tempfile.TemporaryDirectory() as d:
            dump = os.path.join(d, "acc.safetensors")
            ok, by = self.run_part(save=dump)
            self.assertTrue(ok)
            rec = by["EMULATED:deepgemm_fp8_mqa_logits"]
            self.assertEqual(rec["mode"], "accuracy")
            self.assertEqual(rec["pairs"], sum(self.L - self.T + i + 1 for i in range(self.T)))
            self.assertLess(rec["log2_max_err_over_M"], peers.SPEC_BOUND_LOG2)
            self.assertLessEqual(rec["log2_median_err_over_M"], rec["log2_p99_9_err_over_M"])
            self.assertLessEqual(rec["log2_p99_9_err_over_M"], rec["log2_max_err_over_M"])
            prob, _, _ = self.reference_f32()
            f = peers.read_safetensors(dump)
            self.assertEqual(peers.tensor_bytes(f["q"]), peers.tensor_bytes(prob.q8))
            self.assertEqual(peers.tensor_bytes(f["k_scale"]), peers.tensor_bytes(prob.kscale))
            self.assertEqual(f["query_starts"].tolist(), [self.L - self.T])

    def test_ours_in_either_layout_and_a_wrong_logit(self):
        _, full, flat = self.reference_f32()
        with tempfile.TemporaryDirectory() as d:
            for name, x in (("logits", full), ("expected_logits", flat)):
                path = os.path.join(d, f"{name}.safetensors")
                peers.write_safetensors(path, {name: ("F32", list(x.shape), peers.tensor_bytes(x))}, {})
                _, by = self.run_part(ours=path)
                self.assertLess(by["ours"]["log2_max_err_over_M"], -23, name)
            bad = full.clone()
            bad[2, 100] += float(self.m[2, 100]) / 64  # one logit 2^-6 M off
            path = os.path.join(d, "bad.safetensors")
            peers.write_safetensors(path, {"logits": ("F32", list(bad.shape), peers.tensor_bytes(bad))}, {})
            _, by = self.run_part(ours=path)
            self.assertAlmostEqual(by["ours"]["log2_max_err_over_M"], -6.0, places=3)
            self.assertLess(by["ours"]["log2_p99_9_err_over_M"], -23)


REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def dsa_indexer_bin():
    """The crate's CLI: $DSA_INDEXER_BIN, else a build under target/, else None."""
    env = os.environ.get("DSA_INDEXER_BIN")
    if env:
        return env
    for sub in ("release", "debug"):
        path = os.path.join(REPO, "target", sub, "dsa-indexer")
        if os.access(path, os.X_OK):
            return path
    return None


def raw_safetensors(path):
    """A safetensors file as (name -> (dtype, shape, bytes), metadata), no torch."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    return {k: (t["dtype"], t["shape"], data[t["data_offsets"][0] : t["data_offsets"][1]]) for k, t in header.items()}, meta


def e4m3_table():
    """f64 value of every E4M3 byte (NaN for the two NaN codes): SPEC 2, bias 7."""
    out = []
    for b in range(256):
        sign, e, m = -1.0 if b & 0x80 else 1.0, (b >> 3) & 0xF, b & 7
        if e == 0xF and m == 7:
            out.append(float("nan"))
        elif e == 0:
            out.append(sign * m / 8 * 2.0**-6)
        else:
            out.append(sign * (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out)


@unittest.skipIf(np is None or dsa_indexer_bin() is None, "needs numpy and a dsa-indexer binary")
class Spec4F64Test(unittest.TestCase):
    """spec4_f64 on numpy arrays against the crate's CPU reference: a small V3.2-shaped dump
    from `dsa-indexer gen` (E4M3 q and k, per-key scales, H = 64, D = 128, two requests),
    its `expected_logits` (SPEC 4's f32 arithmetic) within f32 rounding of the float64
    formula, and a dump written by `write_safetensors` read back by `dsa-indexer replay`."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.path = os.path.join(cls.tmp.name, "v32.safetensors")
        subprocess.run(
            [dsa_indexer_bin(), "gen", "--preset", "v32", "--seq-lens", "300,70", "--query-starts", "280,60",
             "--topk", "16", "--logits", "yes", "--out", cls.path],
            check=True, capture_output=True,
        )
        cls.t, cls.meta = raw_safetensors(cls.path)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def arrays(self):
        """Decoded f64 q [T, H, D], k [L, D], key scales [L], weights [T, H]; each row's
        [ks, ke) in the flat keys; the reference's visible logits, rows concatenated."""
        t, tab = self.t, e4m3_table()
        h, d = int(self.meta["heads"]), int(self.meta["dim"])
        get = lambda n, dt: np.frombuffer(t[n][2], dtype=dt).reshape(t[n][1])
        self.assertIn(t["q"][0], ("U8", "F8_E4M3"))
        self.assertIn(t["k"][0], ("U8", "F8_E4M3"))
        self.assertEqual((t["k_scale"][0], t["weights"][0]), ("F32", "F32"))
        q = tab[get("q", np.uint8)].reshape(-1, h, d)
        k = tab[get("k", np.uint8)].reshape(-1, d)
        return q, k, get("k_scale", np.float32).astype(np.float64), get("weights", np.float32).astype(np.float64), \
            get("expected_ks", np.int32), get("expected_ke", np.int32), get("expected_logits", np.float32)

    def worst(self, drop_scale=False):
        q, k, sc, w, ks, ke, want = self.arrays()
        worst, at = 0.0, 0
        for r in range(q.shape[0]):
            a, b = int(ks[r]), int(ke[r])
            ref, m = peers.spec4_f64(q[r], w[r], k[a:b], np.ones(b - a) if drop_scale else sc[a:b])
            x = want[at : at + b - a].astype(np.float64)
            at += b - a
            worst = max(worst, float((np.abs(x - ref) / m).max()))
        self.assertEqual(at, want.size)
        return worst

    def test_the_reference_is_within_f32_rounding_of_the_float64_formula(self):
        # SPEC 4's f32 steps: a_h rounded once, w_h * relu(a_h), the pairwise sum over 64
        # heads (6 levels), times the key scale: at most 9 roundings of 2^-24 M each.
        self.assertLess(self.worst(), 2.0**-20)

    def test_a_formula_without_the_key_scale_is_far_off(self):
        self.assertGreater(self.worst(drop_scale=True), 2.0**-4)

    def test_a_written_dump_replays_identical(self):
        path = os.path.join(self.tmp.name, "rewritten.safetensors")
        peers.write_safetensors(path, self.t, self.meta)
        r = subprocess.run([dsa_indexer_bin(), "replay", path], capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        self.assertIn("verdict: identical", r.stdout)


if __name__ == "__main__":
    unittest.main()
