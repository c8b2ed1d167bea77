"""``check``: an engine's selections judged against the reference in one call."""

import numpy as np
import pytest

import dsa_indexer as di
from conftest import golden


def rows_of(out: di.Output):
    """(row, visible scores) of every row, from the reference's flat logits."""
    n = out.ke - out.ks
    off = np.concatenate([[0], np.cumsum(n)])
    for i in range(len(n)):
        yield i, out.logits[off[i] : off[i + 1]]


def test_the_reference_s_own_selections_are_identical():
    _, _, args = golden("v41_plain.safetensors")
    out = di.reference(**args)
    r = di.check(out.raw, engine_page=out.page, **args)
    assert r.verdict == "identical", str(r)
    assert r.tensors["raw"]["compared_rows"] == out.raw.shape[0]
    assert "verdict: identical" in str(r)


@pytest.mark.parametrize("name", ["v41_plain.safetensors", "v32_plain.safetensors"])
def test_a_moved_index_is_different_and_named(name):
    _, _, args = golden(name)
    out = di.reference(**args, logits=True)
    k = args["topk"]
    i, s = max(rows_of(out), key=lambda r: len(r[1]))
    assert len(s) > k
    sel = out.raw[i][out.raw[i] >= 0]
    unselected = np.setdiff1d(np.arange(len(s)), sel)
    worst = int(unselected[np.argmin(s[unselected])])
    best = int(sel[np.argmax(s[sel])])
    raw = out.raw.copy()
    raw[i][raw[i] == best] = worst  # the row's best key swapped for its worst
    r = di.check(raw, **args)
    assert r.verdict == "different", str(r)
    t = r.tensors["raw"]
    assert (t["rows_different"], t["rows_tolerant"], t["first_different_row"]) == (1, 0, i)
    assert f"only expected: key {worst} " in t["notes"][0], t["notes"]
    assert f"only replayed: key {best} " in t["notes"][0], t["notes"]
    assert r.exit_code == 1


def test_a_tied_swap_is_equal_up_to_ties():
    # fp4 x fp4 with many exactly tied scores: swap a selected key for an unselected
    # candidate of exactly the same score, the K-th (the reference keeps the lower id).
    _, _, args = golden("edge_negative_ties.safetensors")
    out = di.reference(**args, logits=True)
    k = args["topk"]
    raw = out.raw.copy()
    swapped = []
    for i, s in rows_of(out):
        sel = raw[i][raw[i] >= 0]
        if len(sel) < k or len(s) <= k:
            continue
        kth = s[sel].min()
        tied_out = [j for j in range(len(s)) if j not in sel and s[j] == kth]
        tied_in = [j for j in sel if s[j] == kth]
        if tied_out:
            raw[i][raw[i] == tied_in[-1]] = tied_out[0]
            swapped.append(i)
    assert swapped, "the file has rows with ties at the K-th score"
    r = di.check(raw, **args)
    assert r.verdict == "equal up to ties", str(r)
    t = r.tensors["raw"]
    assert (t["rows_ties"], t["rows_tolerant"], t["rows_different"]) == (len(swapped), 0, 0)
    assert r.exit_code == 0
    # fp4 x fp4 is the exact class: without engine logits, exact ties only.
    assert r.tolerance["source"] == "default" and r.tolerance["log2"] is None, r.tolerance
    assert r.tolerance["rule"] == "exact ties only"


def test_unordered_and_differently_padded_rows_are_not_different():
    _, _, args = golden("v4_ratio4.safetensors")
    out = di.reference(**args)
    raw = out.raw[:, ::-1].copy()  # ids descending, the -1 padding first
    r = di.check(raw, **args)
    assert r.tensors["raw"]["rows_different"] == 0, str(r)
    assert r.verdict in ("identical", "equal up to ties")


def test_engine_logits_are_read_only_inside_each_row_s_range():
    _, _, args = golden("v32_plain.safetensors")
    out = di.reference(**args, logits=True)
    t, l = out.raw.shape[0], args["k"].shape[0]
    engine = np.full((t, l), np.nan, np.float32)  # garbage outside [ks, ke)
    for i, s in rows_of(out):
        engine[i, out.ks[i] : out.ke[i]] = s
    r = di.check(out.raw, engine_logits=engine, **args)
    assert r.tensors["engine_logits"]["status"] == "identical", str(r)
    engine[3, out.ks[3]] += 1000.0
    r = di.check(out.raw, engine_logits=engine, **args)
    assert r.tensors["engine_logits"]["status"] == "different", str(r)
    assert r.tensors["engine_logits"]["first_different_row"] == 3


def test_an_engine_s_torch_topk_is_judged():
    torch = pytest.importorskip("torch")
    _, _, args = golden("v41_plain.safetensors")
    out = di.reference(**args, logits=True)
    k = args["topk"]
    # torch.topk over each row's visible scores: int64, best first, -1 where n < K.
    raw = torch.full(out.raw.shape, -1, dtype=torch.int64)
    for i, s in rows_of(out):
        top = torch.topk(torch.from_numpy(s), min(k, len(s))).indices
        raw[i, : len(top)] = top
    r = di.check(raw, **args)
    assert r.tensors["raw"]["rows_different"] == 0, str(r)


def readme_example(path):
    text = path.read_text()
    start = text.index("```python\nimport dsa_indexer\n")
    return text[start + len("```python\n") : text.index("```", start + 3)]


def test_the_readme_example_runs(tmp_path, monkeypatch, capsys):
    from conftest import REPO

    code = readme_example(REPO / "README.md")
    assert code == readme_example(REPO / "python" / "README.md")
    assert len(code.strip().splitlines()) <= 12
    _, _, a = golden("v32_plain.safetensors")
    names = dict(q_fp8=a["q"], k_fp8=a["k"], k_scale=a["k_scale"], weights=a["weights"],
                 seq_lens=a["seq_lens"], query_starts=a["query_starts"])
    full = di.reference(**{**a, "topk": 2048, "page_cols": None})
    monkeypatch.chdir(tmp_path)
    exec(code, {**names, "topk_indices": full.raw})
    assert capsys.readouterr().out.splitlines() == ["identical"]
    moved = full.raw.copy()
    moved[40, 0] = -1  # row 40 leaves out a key it must select
    exec(code, {**names, "topk_indices": moved})
    out = capsys.readouterr().out
    assert out.startswith("different\nreplay check: 55 rows"), out
    assert di.replay(tmp_path / "layer.safetensors").verdict == "different"


def near_tie_swap(name):
    """The layer of `name` and its reference selections with, in the row where the
    K-th selected score and the best unselected one are closest (and not tied), the
    one swapped for the other: (args, raw, row)."""
    _, _, args = golden(name)
    out = di.reference(**args, logits=True)
    k = args["topk"]
    best = None
    for i, s in rows_of(out):
        sel = out.raw[i][out.raw[i] >= 0]
        if len(sel) < k or len(s) <= k:
            continue
        rest = np.setdiff1d(np.arange(len(s)), sel)
        a, b = int(sel[np.argmin(s[sel])]), int(rest[np.argmax(s[rest])])
        gap = float(s[a]) - float(s[b])
        if gap > 0 and (best is None or gap < best[0]):
            best = (gap, i, a, b)
    assert best is not None, "the file has a row with more visible keys than K"
    _, i, a, b = best
    raw = out.raw.copy()
    raw[i][raw[i] == a] = b
    return args, raw, i


def test_tolerance_decides_a_near_tie():
    # fp8 keys are the tolerance class: without engine logits the default is 2^-13 M.
    args, raw, row = near_tie_swap("v32_plain.safetensors")
    auto = di.check(raw, **args)
    assert auto.tolerance["source"] == "default", auto.tolerance
    assert (auto.tolerance["rule"], auto.tolerance["log2"]) == ("2^-13 M", -13), auto.tolerance
    [m] = auto.margins()
    need = m["needs_log2"]
    assert m["row"] == row and need is not None and need <= -13, (m, str(auto))
    assert auto.verdict == "equal within tolerance", str(auto)
    summary = auto.margin_summary()
    assert (summary["worst_row"], summary["beyond_default"]) == (row, 0), summary
    assert summary["worst_log2"] == summary["median_log2"] == need
    assert f"needs 2^{need:.1f} M" in str(auto) or f"needs 2^{need:.0f} M" in str(auto)
    for exact in (0, "0", "ties", 0.0):
        r = di.check(raw, tolerance=exact, **args)
        assert r.verdict == "different", (exact, str(r))
        assert r.tolerance["source"] == "given" and r.tolerance["log2"] is None, r.tolerance
        assert r.exit_code == 1
    # Just above what the row needs passes it, just below does not: as a number, as text.
    above = di.check(raw, tolerance=2.0 ** (need + 0.25), **args)
    assert above.verdict == "equal within tolerance", str(above)
    assert above.tolerance["source"] == "given"
    assert abs(above.tolerance["log2"] - (need + 0.25)) < 1e-9, above.tolerance
    below = di.check(raw, tolerance=f"2^{need - 0.25}", **args)
    assert below.verdict == "different", str(below)
    assert below.margins()[0]["needs_log2"] == need


@pytest.mark.parametrize(
    "bad", [1.5, -2.0**-13, float("nan"), float("inf"), "2^3", "2^-x", "loose", True, [0]]
)
def test_a_bad_tolerance_is_a_value_error_naming_it(bad):
    _, _, args = golden("v32_plain.safetensors")
    out = di.reference(**args)
    with pytest.raises(ValueError, match="tolerance"):
        di.check(out.raw, tolerance=bad, **args)


def test_engine_logits_measure_the_tolerance_and_their_error():
    _, _, args = golden("v32_plain.safetensors")
    out = di.reference(**args, logits=True)
    t, l = out.raw.shape[0], args["k"].shape[0]
    engine = np.zeros((t, l), np.float32)
    for i, s in rows_of(out):
        engine[i, out.ks[i] : out.ke[i]] = s
    exact = di.check(out.raw, engine_logits=engine, **args)
    assert exact.engine_logits_error_log2 is None, str(exact)
    assert exact.tolerance["source"] == "measured", exact.tolerance
    assert exact.tensors["engine_topk"]["status"] == "identical", str(exact)
    engine[5, out.ks[5]] = np.nextafter(engine[5, out.ks[5]], np.float32(np.inf))
    off = di.check(out.raw, engine_logits=engine, **args)
    e = off.engine_logits_error_log2
    assert e is not None and -40 < e < -13, (e, str(off))
    assert off.tensors["engine_logits"]["worst_rows"][0]["row"] == 5
    assert off.tolerance["source"] == "measured"
