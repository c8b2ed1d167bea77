"""Dumps: ``save_dump`` writes the files the CLI's ``replay`` reads, and ``replay``
reports what the CLI reports."""

import json
import re
import subprocess

import numpy as np
import pytest

import dsa_indexer as di
from conftest import GOLDEN_FILES, assert_bitwise, golden, golden_inputs, read_safetensors


def cli_replay(cli, path):
    r = subprocess.run(cli + ["replay", str(path)], capture_output=True, text=True)
    assert r.returncode in (0, 1), f"exit {r.returncode}: {r.stderr}"
    return r


def without_times(text: str) -> str:
    """The report without its timing line (`parse 0.01 s, run ...`)."""
    return re.sub(r"(?m)^  parse .*\n", "", text)


def same_json(a: str, b: str) -> None:
    ja, jb = json.loads(a), json.loads(b)
    ja.pop("seconds"), jb.pop("seconds")
    assert ja == jb


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_a_saved_dump_of_the_reference_replays_identical_in_the_cli(tmp_path, cli, path):
    meta, t = read_safetensors(path)
    inputs = golden_inputs(meta, t)
    out = di.reference(**inputs, logits=True)
    f = tmp_path / path.name
    di.save_dump(f, expected=out, description="saved by the Python tests", **inputs)
    r = cli_replay(cli, f)
    assert r.returncode == 0, r.stdout
    assert r.stdout.splitlines()[-1] == "verdict: identical", r.stdout
    py = di.replay(f)
    assert py.verdict == "identical" and py.exit_code == 0
    assert without_times(str(py)) == without_times(r.stdout)
    judged = set(py.tensors)
    assert {"ks", "ke", "raw", "page", "logits"} <= judged, judged
    if out.published is not None:
        assert "published" in judged
    j = subprocess.run(cli + ["replay", "--json", str(f)], capture_output=True, text=True)
    same_json(py.json(), j.stdout)


def test_a_moved_index_in_a_saved_dump_is_different_in_the_cli_and_in_python(tmp_path, cli):
    meta, t, inputs = golden("v41_plain.safetensors")
    out = di.reference(**inputs, logits=True)
    raw = out.raw.copy()
    row = int(np.argmax(out.ke - out.ks))  # the row with the most visible keys
    n = int(out.ke[row] - out.ks[row])
    off = int(np.sum((out.ke - out.ks)[:row]))
    scores = out.logits[off : off + n]
    worst = int(np.argmin(np.where(np.isin(np.arange(n), raw[row]), np.inf, scores)))
    raw[row, 0] = worst
    f = tmp_path / "moved.safetensors"
    di.save_dump(f, expected_raw=raw, **inputs)
    r = cli_replay(cli, f)
    assert r.returncode == 1, r.stdout
    py = di.replay(f)
    assert py.verdict == "different" and py.exit_code == 1
    assert py.tensors["raw"]["first_different_row"] == row
    assert py.tensors["raw"]["rows_different"] == 1
    assert without_times(str(py)) == without_times(r.stdout)


def test_load_dump_reads_what_save_dump_wrote(tmp_path):
    for path in GOLDEN_FILES:
        meta, t = read_safetensors(path)
        inputs = golden_inputs(meta, t)
        out = di.reference(**inputs, logits=True)
        f = tmp_path / path.name
        di.save_dump(f, expected=out, description="round trip", **inputs)
        d = di.load_dump(f)
        assert d.meta["description"] == "round trip"
        for name, want in t.items():
            assert_bitwise(d.tensors[name], want, f"{path.name}: {name}")
        assert set(d.tensors) == set(t), (path.name, set(d.tensors) ^ set(t))
        again = di.reference(**d.inputs(), logits=True)
        assert_bitwise(again.raw, out.raw, f"{path.name}: raw from the loaded dump")
        assert_bitwise(again.logits, out.logits, f"{path.name}: logits from the loaded dump")


def test_replay_of_a_loaded_dump_and_of_its_path_agree():
    path = GOLDEN_FILES[0]
    a, b = di.replay(path), di.replay(di.load_dump(path))
    assert without_times(str(a)) == without_times(str(b))
    assert a.verdict == "identical"


def test_replay_of_some_rows_numbers_them_as_the_dump_does(cli):
    path = [p for p in GOLDEN_FILES if p.name == "v41_plain.safetensors"][0]
    py = di.replay(path, rows=(10, 30))
    r = subprocess.run(cli + ["replay", "--rows", "10..30", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert without_times(str(py)) == without_times(r.stdout)
    assert "(selected)" in str(py).splitlines()[0]
    assert py.tensors["raw"]["compared_rows"] == 20


def test_a_gen_dump_of_the_cli_loads_and_replays(tmp_path, cli):
    f = tmp_path / "gen.safetensors"
    g = subprocess.run(
        cli + ["gen", "--preset", "small", "--role", "source", "--out", str(f)],
        capture_output=True,
        text=True,
    )
    assert g.returncode == 0, g.stderr
    d = di.load_dump(f)
    out = di.reference(**d.inputs())
    assert_bitwise(out.raw, d.tensors["expected_raw"], "gen: raw")
    assert_bitwise(out.published, d.tensors["expected_published"], "gen: published")
    assert di.replay(d).verdict == "identical"


def test_replay_tolerance_is_the_cli_s(tmp_path, cli):
    from test_check import near_tie_swap

    args, raw, row = near_tie_swap("v32_plain.safetensors")
    f = tmp_path / "near_tie.safetensors"
    di.save_dump(f, expected_raw=raw, **args)
    assert di.replay(f).verdict == "equal within tolerance"
    for given in ("0", "2^-10"):
        py = di.replay(f, tolerance=given)
        r = subprocess.run(cli + ["replay", "--tolerance", given, str(f)], capture_output=True, text=True)
        assert without_times(str(py)) == without_times(r.stdout), (r.stdout, r.stderr)
        j = subprocess.run(
            cli + ["replay", "--json", "--tolerance", given, str(f)], capture_output=True, text=True
        )
        same_json(py.json(), j.stdout)
        assert py.tolerance["source"] == "given"
    assert di.replay(f, tolerance=0).verdict == "different"
    with pytest.raises(ValueError, match="tolerance"):
        di.replay(f, tolerance="2^1")
