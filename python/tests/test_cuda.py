"""``replay(device="cuda")``: the golden files on the GPU through the package. They
skip without a CUDA build or a GPU, and fail instead under ``DSA_REQUIRE_GPU=1``."""

import os

import pytest

import dsa_indexer as di
from conftest import GOLDEN_FILES, read_safetensors

REQUIRE = os.environ.get("DSA_REQUIRE_GPU") == "1"


def replay_on_gpu(path):
    if not di.CUDA:
        if REQUIRE:
            pytest.fail('DSA_REQUIRE_GPU=1, but the package was built without CUDA (MATURIN_PEP517_ARGS="--features cuda")')
        pytest.skip("built without the cuda feature")
    try:
        return di.replay(path, device="cuda")
    except RuntimeError as e:
        if REQUIRE:
            raise
        pytest.skip(f"no CUDA device: {e}")


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_the_golden_files_replay_on_the_gpu(path):
    r = replay_on_gpu(path)
    meta, _ = read_safetensors(path)
    exact = meta["q_format"] == meta["k_format"] == "e2m1"
    # The exact class is bitwise on every backend; the tolerance class within SPEC 5.
    assert r.verdict == "identical" if exact else r.verdict != "different", str(r)
    assert "on cuda" in str(r).splitlines()[1]
