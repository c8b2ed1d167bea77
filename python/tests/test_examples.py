"""``python/examples/deepgemm_check.py`` end to end on the CPU, DeepGEMM replaced by
benches/peers.py's torch stand-in (``--emulate``): the script's engine path, its
float64 error and its call of ``check`` agree on a small layer."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "python" / "examples" / "deepgemm_check.py"


def run(*args):
    pytest.importorskip("torch")
    p = subprocess.run([sys.executable, str(SCRIPT), "--emulate", *args], capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, p.stdout + p.stderr
    return p, json.loads(lines[0])


def test_the_emulated_engine_is_judged_and_its_error_is_within_spec4():
    p, rec = run("--rows", "24", "--seq-len", "2304")
    assert p.returncode == 0, p.stdout + p.stderr
    assert rec["emulated"] is True and "EMULATED" in p.stdout
    assert rec["verdict"] != "different", p.stderr
    assert rec["rows_different"] == 0 and rec["tensors"]["raw"]["compared_rows"] == 24
    assert rec["tensors"]["engine_logits"]["status"] != "different"
    # The stand-in sums in f32: an error above zero, far below 2^-8 M.
    assert rec["max_err_over_M_log2"] is not None and rec["max_err_over_M_log2"] < -12
    assert rec["within_spec4_bound"] is True


def test_rows_with_fewer_than_k_keys_are_minus_one_padded():
    # 2100 keys, 100 rows: the first rows see fewer than K = 2048 keys.
    p, rec = run("--rows", "100", "--seq-len", "2100", "--no-engine-logits")
    assert p.returncode == 0, p.stdout + p.stderr
    assert rec["rows_different"] == 0 and "engine_logits" not in rec["tensors"]
