#!/usr/bin/env python3
"""Tests of benches/ncu_source.py (no GPU): `python3 benches/ncu_source_test.py`.
benches/testdata/ncu_source.csv is an excerpt (63 of 1,344 SASS instructions: the 30
with the most samples and every 40th) of ncu's source export of `mqa_logits_w8`'s first
v32-64k launch at the fast precision on an H100 (`NCU_SET=full bash benches/gpu.sh ncu`)."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ncu_source  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata", "ncu_source.csv")
# The loop's wgmma wait executes once per tile and warp: 16,801,792 times in the excerpt's
# launch (4.2 M tiles of 64 keys, four warps each).
TILE_WARPS = 16801792


class NcuSource(unittest.TestCase):
    def setUp(self):
        with open(DATA) as f:
            self.kernel, self.rows = ncu_source.parse(f.read())

    def test_the_kernel_and_its_instructions(self):
        self.assertEqual(self.kernel, "mqa_logits_w8")
        self.assertEqual(len(self.rows), 63)

    def test_the_wait_is_the_top_instruction_and_the_barrier_its_reason(self):
        total, by_reason, _, _ = ncu_source.summary(self.rows)
        top = max(self.rows, key=lambda r: ncu_source.count(r, ncu_source.SAMPLES))
        self.assertIn("WARPGROUP.DEPBAR", top["Source"])
        self.assertEqual(ncu_source.count(top, ncu_source.SAMPLES), 148615)
        self.assertEqual(ncu_source.count(top, ncu_source.EXECUTED), TILE_WARPS)
        self.assertEqual(by_reason[0], ("stall_barrier", 144873))
        self.assertEqual(total, 491111)  # the excerpt's samples: the wait holds 30.3 %

    def test_four_mmas_per_tile_and_warp(self):
        _, _, by_op, _ = ncu_source.summary(self.rows, per=TILE_WARPS)
        self.assertEqual(dict(by_op)["QGMMA"], 4.0)

    def test_opcodes_drop_predicates_and_modifiers(self):
        self.assertEqual(ncu_source.opcode("      @!P0  BRA 0x7fa4bf7afc90"), "BRA")
        self.assertEqual(ncu_source.opcode("FMNMX R27, RZ, R30, !PT"), "FMNMX")
        self.assertEqual(ncu_source.opcode("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4]"), "QGMMA")
        self.assertEqual(ncu_source.opcode(""), "")

    def test_other_files_are_errors_that_say_why(self):
        with self.assertRaisesRegex(ValueError, "Kernel Name"):
            ncu_source.parse('"Address","Source"\n"0x1","NOP"\n')
        with self.assertRaisesRegex(ValueError, "Instructions Executed"):
            ncu_source.parse('"Kernel Name","k"\n"Address","Source",'
                             '"Warp Stall Sampling (All Samples)"\n')


if __name__ == "__main__":
    unittest.main()
