"""The golden vectors (tests/golden/), read with numpy alone, through
``dsa_indexer.reference``: every expected tensor bitwise."""

import numpy as np
import pytest

import dsa_indexer as di
from conftest import GOLDEN_FILES, assert_bitwise, golden_inputs, read_safetensors


def test_the_golden_files_are_there():
    assert len(GOLDEN_FILES) >= 14, [p.name for p in GOLDEN_FILES]


def check_outputs(name: str, out: di.Output, t: dict, logits: bool = True) -> None:
    assert_bitwise(out.raw, t["expected_raw"], f"{name}: raw")
    assert_bitwise(out.page, t["expected_page"], f"{name}: page")
    assert_bitwise(out.ks, t["expected_ks"], f"{name}: ks")
    assert_bitwise(out.ke, t["expected_ke"], f"{name}: ke")
    if "expected_published" in t:
        assert_bitwise(out.published, t["expected_published"], f"{name}: published")
        assert_bitwise(out.published_rows, t["expected_published_rows"], f"{name}: published_rows")
    else:
        assert out.published is None and out.published_rows is None, name
    if logits:
        assert_bitwise(out.logits, t["expected_logits"], f"{name}: logits")
    else:
        assert out.logits is None


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_reference_reproduces_the_golden_file_bitwise(path):
    meta, t = read_safetensors(path)
    out = di.reference(**golden_inputs(meta, t), logits=True)
    check_outputs(path.name, out, t)


@pytest.mark.parametrize("budget", [1, 64, 1 << 20])
@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_the_outputs_do_not_depend_on_the_budget(path, budget):
    meta, t = read_safetensors(path)
    out = di.reference(**golden_inputs(meta, t), budget=budget)
    check_outputs(f"{path.name} at budget {budget}", out, t, logits=False)


def test_outputs_are_writable_numpy_arrays_of_the_documented_dtypes():
    meta, t = read_safetensors(GOLDEN_FILES[0])
    out = di.reference(**golden_inputs(meta, t), logits=True)
    for name in ("raw", "page", "ks", "ke"):
        a = getattr(out, name)
        assert isinstance(a, np.ndarray) and a.dtype == np.int32, name
    assert out.logits.dtype == np.float32
    out.raw[0, 0] = 7  # the caller owns its outputs
