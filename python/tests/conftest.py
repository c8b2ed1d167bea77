"""Shared helpers: the repository's paths, an independent safetensors reader for the
golden files, their mapping to ``dsa_indexer.reference``'s arguments, and the CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
# Every layer-forward file over flat keys (the quantizers' file is not one).
GOLDEN_FILES = sorted(p for p in GOLDEN.glob("*.safetensors") if p.name != "quantizers.safetensors")
# The files over paged keys (SPEC 10): tests/golden/README.md, "Paged keys".
PAGED_FILES = sorted((GOLDEN / "paged").glob("*.safetensors"))

_DTYPES = {"U8": np.uint8, "I8": np.int8, "I32": "<i4", "F32": "<f4"}


def read_safetensors(path: Path):
    """``(metadata, {name: array})`` of a safetensors file, read with numpy alone (the
    format: an 8-byte header length, a JSON header, the data section)."""
    b = Path(path).read_bytes()
    n = int.from_bytes(b[:8], "little")
    header = json.loads(b[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    data = b[8 + n :]
    tensors = {}
    for name, t in header.items():
        lo, hi = t["data_offsets"]
        a = np.frombuffer(data[lo:hi], dtype=_DTYPES[t["dtype"]]).reshape(t["shape"])
        tensors[name] = a.copy()
    return meta, tensors


def golden_inputs(meta: dict, t: dict) -> dict:
    """A golden file's layer as the keyword arguments of ``dsa_indexer.reference``
    (tests/golden/README.md: E4M3 queries carry no ``q_scale``; E4M3 keys' ``k_scale``
    is float32, fp4 keys' UE8M0 bytes; paged files give ``kv_cache``, ``page_table`` and
    the metadata ``page_size`` instead of ``k`` and ``k_scale``)."""
    if meta.get("layout") == "paged":
        keys = {
            "kv_cache": t["kv_cache"],
            "page_table": t["page_table"],
            "page_size": int(meta["page_size"]),
        }
    else:
        keys = {"k": t["k"], "k_scale": t["k_scale"]}
    args = {
        "q": t["q"],
        "q_scale": t["q_scale"] if meta["q_format"] == "e2m1" else None,
        **keys,
        "weights": t["weights"],
        "seq_lens": t["seq_lens"],
        "topk": int(meta["topk"]),
        "ratio": int(meta["ratio"]),
        "role": meta.get("role", "plain"),
        "block_size": int(meta.get("block_size", 8)),
        "num_blocks": int(meta.get("num_blocks", 2048)),
    }
    for name in ("query_starts", "row_requests", "row_positions", "k_slots", "candidates"):
        if name in t:
            args[name] = t[name]
    for name in ("page_cols", "tail"):
        if name in meta:
            args[name] = int(meta[name])
    return args


def golden(name: str):
    """``(meta, tensors, inputs)`` of golden file ``name``."""
    meta, t = read_safetensors(GOLDEN / name)
    return meta, t, golden_inputs(meta, t)


def first_diff(got: np.ndarray, want: np.ndarray, what: str) -> str:
    """Why two arrays are not bitwise equal: the shapes, or the first differing index."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: shape/dtype {got.shape} {got.dtype}, expected {want.shape} {want.dtype}"
    g, w = got.reshape(-1), want.reshape(-1)
    if got.dtype.kind == "f":
        g, w = g.view(f"u{got.dtype.itemsize}"), w.view(f"u{want.dtype.itemsize}")
    i = int(np.flatnonzero(g != w)[0])
    return f"{what}: differs first at flat index {i}: got {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r}"


def assert_bitwise(got, want, what: str) -> None:
    got, want = np.asarray(got), np.asarray(want)
    same = got.shape == want.shape and got.dtype == want.dtype and got.tobytes() == want.tobytes()
    assert same, first_diff(got, want, what)


@pytest.fixture(scope="session")
def cli() -> list:
    """The command line of the `dsa-indexer` binary: ``$DSA_INDEXER_BIN``, the release
    build of this checkout, or ``cargo run --release``."""
    env = os.environ.get("DSA_INDEXER_BIN")
    if env:
        assert Path(env).is_file(), f"DSA_INDEXER_BIN={env}: no such file"
        return [env]
    built = REPO / "target" / "release" / "dsa-indexer"
    if built.is_file():
        return [str(built)]
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.skip("no dsa-indexer binary (set DSA_INDEXER_BIN) and no cargo")
    return [cargo, "run", "--quiet", "--release", "--manifest-path", str(REPO / "Cargo.toml"), "--"]
