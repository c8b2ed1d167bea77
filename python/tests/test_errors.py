"""Bad input raises ValueError with the crate's message (field and value); a backend
that cannot run raises RuntimeError; a panic is an exception, not an abort."""

import subprocess
import sys

import numpy as np
import pytest

import dsa_indexer as di
from conftest import GOLDEN, golden


def fp8():
    return golden("v32_plain.safetensors")[2]


def fp4():
    return golden("v41_plain.safetensors")[2]


def edit(args, name, f):
    a = np.array(args[name], copy=True)
    f(a)
    return {**args, name: a}


CASES = [
    # (what, inputs, the message's words)
    ("a negative key scale", lambda: edit(fp8(), "k_scale", lambda a: a.__setitem__(17, -1)), "k_scale[17] = -1: finite and > 0"),
    ("an infinite weight", lambda: edit(fp8(), "weights", lambda a: a.__setitem__((2, 3), np.inf)), "weights[131] = inf: finite"),
    ("an E4M3 NaN code", lambda: edit(fp8(), "q", lambda a: a.__setitem__((0, 0, 5), 0x7F)), "q[5] = 0x7f: E4M3 NaN code"),
    ("a reserved UE8M0 byte", lambda: edit(fp4(), "k_scale", lambda a: a.__setitem__((1, 2), 255)), "k_scale[6] = 255: UE8M0 byte 255 is reserved"),
    ("a negative slot", lambda: edit(fp4(), "k_slots", lambda a: a.__setitem__(4, -2)), "k_slots[4] = -2: a slot >= 0"),
    ("a negative length", lambda: {**fp8(), "seq_lens": np.array([-1, 5], np.int32)}, "seq_lens[0] = -1"),
    ("topk 0", lambda: {**fp8(), "topk": 0}, "topk = 0: 1 ..= 65536"),
    ("a negative topk", lambda: {**fp8(), "topk": -3}, "topk = -3"),
    ("page_cols below topk", lambda: {**fp8(), "page_cols": 3}, "page_cols = 3: page_cols >= topk"),
    ("ratio 0", lambda: {**fp8(), "ratio": 0}, "ratio = 0"),
    ("an unknown role", lambda: {**fp8(), "role": "decoder"}, "role = 'decoder'"),
    ("a tail for a plain layer", lambda: {**fp8(), "tail": 4}, "tail"),
    ("a tail of 0", lambda: {**fp8(), "role": "source", "tail": 0}, "tail = 0: tail >= 1"),
    ("a consumer without candidates", lambda: {**fp8(), "role": "consumer"}, "candidates: missing (role = consumer)"),
    ("weights of the wrong shape", lambda: {**fp8(), "weights": np.ones((55, 32), np.float32)}, "weights: shape [55, 32], expected [55, 64]"),
    ("float64 queries", lambda: {**fp8(), "q": fp8()["q"].astype(np.float64)}, "q: dtype float64, expected one of SPEC 9's"),
    ("float16 weights", lambda: {**fp8(), "weights": fp8()["weights"].astype(np.float16)}, "weights: dtype float16, expected one of SPEC 9's"),
    ("a float32 q_scale", lambda: {**fp4(), "q_scale": fp4()["q_scale"].astype(np.float32)}, "q_scale: shape [100, 32, 4], dtype float32, expected UE8M0 bytes"),
    ("fp4 queries without scales", lambda: {**fp4(), "q_scale": None, "q": fp4()["q"].view(np.int8)}, "q_scale: missing: packed fp4 queries (q dtype int8)"),
    ("fp8 keys with UE8M0 scales", lambda: {**fp8(), "k_scale": np.full((100, 4), 127, np.uint8)}, "k: shape [100, 128], dtype uint8, expected E4M3 codes (float8_e4m3fn, uint8) [100, 128] with a float32 k_scale [100], or packed fp4"),
    ("query_starts past seq_lens", lambda: {**fp8(), "query_starts": np.array([0, 200], np.int32)}, "query_starts"),
    ("no rows at all", lambda: {**fp8(), "query_starts": None}, "either query_starts, or both row_requests and row_positions"),
    ("2-D queries", lambda: {**fp8(), "q": fp8()["q"][0]}, "q: shape [64, 128], dtype uint8, expected"),
    ("heads not a power of two", lambda: {**fp8(), "q": fp8()["q"][:, :48], "weights": fp8()["weights"][:, :48]}, "heads = 48"),
]


@pytest.mark.parametrize("what,make,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_value_error_naming_the_field_and_value(what, make, words):
    with pytest.raises(ValueError) as e:
        di.reference(**make())
    assert words in str(e.value), str(e.value)


def test_a_query_start_past_its_seq_len_is_named():
    # Two requests of 10 and 4 tokens with 3 rows: the second request's start is past it.
    args = fp8()
    t = 3
    args = {
        **args,
        "q": args["q"][:t],
        "weights": args["weights"][:t],
        "k": args["k"][:14],
        "k_scale": args["k_scale"][:14],
        "seq_lens": [10, 4],
        "query_starts": [7, 5],
    }
    with pytest.raises(ValueError, match=r"query_starts\[1\] = 5: query_start <= seq_len"):
        di.reference(**args)


def test_check_names_the_engine_argument():
    args = fp8()
    with pytest.raises(ValueError, match=r"^engine_raw: shape \[55, 3\], expected \[55, 16\]$"):
        di.check(np.zeros((55, 3), np.int32), **args)
    with pytest.raises(ValueError, match="engine_raw"):
        di.check(np.zeros((55, 16), np.float32), **args)


def test_unknown_arguments_are_type_errors():
    with pytest.raises(TypeError, match="reference"):
        di.check(None, qq=1, **fp8())


def test_a_missing_or_malformed_dump_file(tmp_path):
    with pytest.raises(OSError, match="nope.safetensors"):
        di.load_dump(tmp_path / "nope.safetensors")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((GOLDEN / "v32_plain.safetensors").read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"cut.safetensors: dump: tensor `\w+`: truncated"):
        di.replay(cut)


def test_devices():
    path = GOLDEN / "v32_plain.safetensors"
    with pytest.raises(ValueError, match="device = \"tpu\""):
        di.replay(path, device="tpu")
    if not di.CUDA:
        with pytest.raises(RuntimeError, match="no CUDA support"):
            di.replay(path, device="cuda")


def test_a_panic_is_a_runtime_error_and_the_interpreter_goes_on():
    with pytest.raises(RuntimeError, match="internal error in dsa_indexer .*raised on purpose"):
        di._native._panic_for_tests()
    # The module still works afterwards.
    assert di.replay(GOLDEN / "v32_plain.safetensors").verdict == "identical"


def test_a_panic_does_not_abort_the_process():
    code = (
        "import dsa_indexer as di\n"
        "try:\n"
        "    di._native._panic_for_tests()\n"
        "except RuntimeError as e:\n"
        "    print('caught:', type(e).__name__)\n"
        "print('alive')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["caught:", "RuntimeError", "alive"], r.stdout
