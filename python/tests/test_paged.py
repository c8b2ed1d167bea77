"""Paged keys (SPEC 10): ``kv_cache``, ``page_table`` and ``page_size`` instead of ``k``
and ``k_scale``, through ``reference``, ``check``, ``save_dump`` / ``load_dump`` and
``replay``, against the golden files of ``tests/golden/paged/`` and the CLI."""

import subprocess

import numpy as np
import pytest

import dsa_indexer as di
from conftest import PAGED_FILES, assert_bitwise, golden, golden_inputs, read_safetensors
from test_dumps import cli_replay, same_json, without_times


def paged(name="paged_decode_e4m3"):
    return golden(f"paged/{name}.safetensors")


def test_the_paged_golden_files_are_there():
    assert len(PAGED_FILES) >= 7, [p.name for p in PAGED_FILES]


def check_outputs(name, out, t):
    assert_bitwise(out.raw, t["expected_raw"], f"{name}: raw")
    assert_bitwise(out.page, t["expected_page"], f"{name}: page")
    if "expected_published" in t:
        assert_bitwise(out.published, t["expected_published"], f"{name}: published")
        assert_bitwise(out.published_rows, t["expected_published_rows"], f"{name}: published_rows")
    else:
        assert out.published is None, name
    assert_bitwise(out.logits, t["expected_logits"], f"{name}: logits")


@pytest.mark.parametrize("path", PAGED_FILES, ids=lambda p: p.stem)
def test_reference_reproduces_the_paged_golden_file_bitwise(path):
    meta, t = read_safetensors(path)
    args = golden_inputs(meta, t)
    assert "kv_cache" in args and "k" not in args
    check_outputs(path.name, di.reference(**args, logits=True), t)
    # The chunked driver at a tiny budget: the same outputs.
    out = di.reference(**args, budget=1)
    assert_bitwise(out.raw, t["expected_raw"], f"{path.name} at budget 1: raw")
    assert_bitwise(out.page, t["expected_page"], f"{path.name} at budget 1: page")


def gather(meta, t):
    """The paged file's keys laid out flat (SPEC 3's order) with their pool slots, in
    numpy, from SPEC 10's page layout."""
    p = int(meta["page_size"])
    ratio = int(meta["ratio"])
    d = int(meta["dim"])
    kv, table = t["kv_cache"], t["page_table"]
    slots = [
        table[b, j // p] * p + j % p
        for b, s in enumerate(t["seq_lens"])
        for j in range(int(s) // ratio)
    ]
    pages = np.array([s // p for s in slots], dtype=np.int64)
    tok = np.array([s % p for s in slots], dtype=np.int64)
    if meta["k_format"] == "e4m3":
        k = np.stack([kv[g, u * d : (u + 1) * d] for g, u in zip(pages, tok)])
        sc = np.stack([kv[g, p * d + 4 * u : p * d + 4 * u + 4] for g, u in zip(pages, tok)])
        k_scale = np.ascontiguousarray(sc).view("<f4").reshape(-1)
    else:
        w, g_ = d // 2, d // 32
        k = np.stack([kv[g, u * w : (u + 1) * w] for g, u in zip(pages, tok)])
        k_scale = np.stack([kv[g, p * w + u * g_ : p * w + (u + 1) * g_] for g, u in zip(pages, tok)])
    return k, k_scale, np.array(slots, dtype=np.int32)


@pytest.mark.parametrize("path", PAGED_FILES, ids=lambda p: p.stem)
def test_paged_keys_give_what_the_same_keys_laid_out_flat_give(path):
    meta, t = read_safetensors(path)
    args = golden_inputs(meta, t)
    k, k_scale, slots = gather(meta, t)
    flat = {n: v for n, v in args.items() if n not in ("kv_cache", "page_table", "page_size")}
    a = di.reference(**args, logits=True)
    b = di.reference(**flat, k=k, k_scale=k_scale, k_slots=slots, logits=True)
    for name in ("raw", "page", "ks", "ke", "logits", "published", "published_rows"):
        if getattr(a, name) is None:
            assert getattr(b, name) is None, name
        else:
            assert_bitwise(getattr(a, name), getattr(b, name), f"{path.name}: {name}")


def test_deepgemm_s_four_dimensional_view_of_the_pool_is_accepted():
    meta, t, args = paged()
    p, d = int(meta["page_size"]), int(meta["dim"])
    kv4 = args["kv_cache"].reshape(-1, p, 1, d + 4)
    out = di.reference(**{**args, "kv_cache": kv4})
    assert_bitwise(out.page, t["expected_page"], "page")


def test_the_pool_and_the_page_table_are_read_in_place():
    _, _, args = paged()
    ptr = di._input_pointers(**args)
    assert ptr["kv_cache"] == args["kv_cache"].ctypes.data
    assert ptr["page_table"] == args["page_table"].ctypes.data


def test_torch_paged_keys_on_the_cpu():
    torch = pytest.importorskip("torch")
    meta, t, args = paged("paged_decode_e2m1")
    targs = {
        **args,
        "kv_cache": torch.from_numpy(args["kv_cache"]),
        "page_table": torch.from_numpy(args["page_table"]),
    }
    out = di.reference(**targs)
    assert_bitwise(out.page, t["expected_page"], "page")


# ==== dumps ====


@pytest.mark.parametrize("path", PAGED_FILES, ids=lambda p: p.stem)
def test_a_saved_paged_dump_replays_identical_in_the_cli_and_in_python(tmp_path, cli, path):
    meta, t = read_safetensors(path)
    args = golden_inputs(meta, t)
    out = di.reference(**args, logits=True)
    f = tmp_path / path.name
    di.save_dump(f, expected=out, **args)
    r = cli_replay(cli, f)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == "verdict: identical", r.stdout
    py = di.replay(f)
    assert py.verdict == "identical"
    assert without_times(str(py)) == without_times(r.stdout)
    assert {"raw", "page", "logits"} <= set(py.tensors)
    j = subprocess.run(cli + ["replay", "--json", str(f)], capture_output=True, text=True)
    same_json(py.json(), j.stdout)
    # What load_dump returns is the layer again.
    d = di.load_dump(f)
    assert d.meta["page_size"] == int(meta["page_size"])
    assert_bitwise(d.tensors["kv_cache"], t["kv_cache"], "kv_cache")
    assert_bitwise(d.tensors["page_table"], t["page_table"], "page_table")
    assert "k" not in d.tensors and "k_scale" not in d.tensors
    again = di.reference(**d.inputs())
    assert_bitwise(again.page, out.page, "page of the loaded dump")


def test_the_golden_paged_files_replay_identical_with_rows_selected(cli):
    path = paged_path = PAGED_FILES[[p.stem for p in PAGED_FILES].index("paged_decode_mtp")]
    py = di.replay(path, rows=(3, 9))
    r = subprocess.run(cli + ["replay", "--rows", "3..9", str(paged_path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert py.verdict == "identical" and py.tensors["page"]["compared_rows"] == 6
    assert without_times(str(py)) == without_times(r.stdout)
    assert di.load_dump(path).meta["next_n"] == 2


def moved_slot(out, args):
    """The expected page with one row's first slot moved to a slot no key of the row has."""
    page = out.page.copy()
    page[0, 0] = args["kv_cache"].shape[0] * args["page_size"] - 1
    assert page[0, 0] not in out.page[0]
    return page


def test_a_moved_pool_slot_is_different_in_the_cli_and_in_python(tmp_path, cli):
    _, _, args = paged()
    out = di.reference(**args, logits=True)
    f = tmp_path / "moved.safetensors"
    di.save_dump(f, expected_raw=out.raw, expected_page=moved_slot(out, args), **args)
    r = cli_replay(cli, f)
    assert r.returncode == 1, r.stdout
    py = di.replay(f)
    assert py.verdict == "different"
    assert py.tensors["page"]["status"] == "different" and py.tensors["page"]["first_different_row"] == 0
    assert py.tensors["raw"]["status"] == "identical"
    assert without_times(str(py)) == without_times(r.stdout)


def test_check_judges_paged_slots():
    _, _, args = paged()
    out = di.reference(**args)
    assert di.check(out.raw, engine_page=out.page, **args).verdict == "identical"
    bad = di.check(out.raw, engine_page=moved_slot(out, args), **args)
    assert bad.verdict == "different" and bad.tensors["page"]["first_different_row"] == 0
    # Slots are the pool's: request-local ids where slots belong are different.
    ids = np.where(out.raw >= 0, out.raw, -1)
    page = np.full_like(out.page, -1)
    page[:, : ids.shape[1]] = ids
    assert di.check(out.raw, engine_page=page, **args).tensors["page"]["status"] == "different"


# ==== bad input ====


def edit(args, name, f):
    a = np.array(args[name], copy=True)
    f(a)
    return {**args, name: a}


def first_page(args, b=0):
    return int(args["page_table"][b, 0])


BAD = [
    # (what, inputs, the message's words)
    ("flat and paged keys", lambda a: {**a, "k": np.zeros((4, 128), np.uint8), "k_scale": np.ones(4, np.float32)}, "kv_cache: given with k"),
    ("neither flat nor paged keys", lambda a: {n: v for n, v in a.items() if n not in ("kv_cache", "page_table", "page_size")}, "k: missing"),
    ("a page table without a pool", lambda a: {n: v for n, v in a.items() if n != "kv_cache"}, "kv_cache: missing"),
    ("a pool without a page table", lambda a: {n: v for n, v in a.items() if n != "page_table"}, "page_table: missing"),
    ("a pool without a page size", lambda a: {**a, "page_size": None}, "page_size: missing"),
    ("a page size not a power of two", lambda a: {**a, "page_size": 48}, "page_size = 48: a power of two in 1..=256"),
    ("a negative page size", lambda a: {**a, "page_size": -64}, "page_size = -64"),
    ("a pool of the wrong width", lambda a: {**a, "kv_cache": a["kv_cache"][:, :-4].copy()}, "kv_cache: "),
    ("a float pool", lambda a: {**a, "kv_cache": a["kv_cache"].astype(np.float32)}, "kv_cache: "),
    ("a one-dimensional page table", lambda a: {**a, "page_table": a["page_table"].reshape(-1)}, "page_table: "),
    ("a page id out of range", lambda a: edit(a, "page_table", lambda t: t.__setitem__((1, 0), 9999)), "page_table[1, 0] = 9999"),
    ("a negative used page id", lambda a: edit(a, "page_table", lambda t: t.__setitem__((2, 0), -1)), "page_table[2, 0] = -1"),
    ("a page table too narrow", lambda a: {**a, "page_table": a["page_table"][:, :1].copy()}, "entries: at least ceil(L_b / page_size)"),
    ("a NaN code in a read slot", lambda a: edit(a, "kv_cache", lambda kv: kv.__setitem__((first_page(a), 3), 0x7F)), "slot 0].k"),
    ("a zero scale in a read slot", lambda a: edit(a, "kv_cache", lambda kv: kv[first_page(a), 64 * 128 : 64 * 128 + 4].__setitem__(slice(None), 0)), "scale"),
    ("k_slots with paged keys", lambda a: {**a, "k_slots": np.arange(1506, dtype=np.int32)}, "k_slots"),
]


@pytest.mark.parametrize("what,make,words", BAD, ids=[c[0] for c in BAD])
def test_bad_paged_input_is_a_value_error_naming_the_field(what, make, words):
    _, _, args = paged()
    with pytest.raises(ValueError) as e:
        di.reference(**make(args))
    assert words in str(e.value), f"{what}: {e.value}"


def test_garbage_in_unused_pages_is_not_read():
    _, t, args = paged()
    used = set()
    for b, s in enumerate(t["seq_lens"]):
        used.update(int(x) for x in t["page_table"][b, : -(-int(s) // 64)])
    unused = [g for g in range(args["kv_cache"].shape[0]) if g not in used]
    assert unused
    kv = args["kv_cache"].copy()
    kv[unused] = 0x7F  # NaN codes, NaN scales
    out = di.reference(**{**args, "kv_cache": kv})
    assert_bitwise(out.page, t["expected_page"], "page")


def test_the_plan_of_paged_keys_is_the_plan_of_the_same_keys_flat():
    meta, t, args = paged("paged_prefill_shared")
    k, k_scale, slots = gather(meta, t)
    flat = {n: v for n, v in args.items() if n not in ("kv_cache", "page_table", "page_size")}
    for budget in (1, 4096, 1 << 30):
        assert di.plan(budget=budget, **args) == di.plan(budget=budget, **flat, k=k, k_scale=k_scale, k_slots=slots)
