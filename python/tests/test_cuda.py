"""The CUDA entries on the GPU: ``replay(device="cuda")``, ``index`` and ``decode`` on
CUDA torch tensors against the reference, on a non-default stream, inside a CUDA graph,
under ``torch.compile``, without copying their inputs, ``precision="fast"`` against SPEC
4's fast-mode bound, and their errors.

The GPU tests skip without a CUDA build, torch or a GPU, and fail instead under
``DSA_REQUIRE_GPU=1``. The tests at the end run anywhere: the shape checks of a CUDA
build (before any device is touched), and ``RuntimeError`` without a GPU.
"""

import os
import re

import numpy as np
import pytest

import dsa_indexer as di
from conftest import GOLDEN_FILES, PAGED_FILES, assert_bitwise, golden_inputs, read_safetensors

REQUIRE = os.environ.get("DSA_REQUIRE_GPU") == "1"


def why_no_gpu():
    """Why the GPU tests cannot run here, or None."""
    if not di.CUDA:
        return 'the package was built without CUDA (MATURIN_PEP517_ARGS="--features cuda")'
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def need_gpu():
    why = why_no_gpu()
    if why is not None:
        if REQUIRE:
            pytest.fail(f"DSA_REQUIRE_GPU=1, but {why}")
        pytest.skip(why)
    import torch

    return torch


@pytest.fixture
def torch():
    return need_gpu()


def exact_class(meta) -> bool:
    return meta["q_format"] == meta["k_format"] == "e2m1"


# ==== replay ====


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_the_golden_files_replay_on_the_gpu(path):
    if not di.CUDA:
        if REQUIRE:
            pytest.fail('DSA_REQUIRE_GPU=1, but the package was built without CUDA (MATURIN_PEP517_ARGS="--features cuda")')
        pytest.skip("built without the cuda feature")
    try:
        r = di.replay(path, device="cuda")
    except RuntimeError as e:
        if REQUIRE:
            raise
        pytest.skip(f"no CUDA device: {e}")
    meta, _ = read_safetensors(path)
    # The exact class is bitwise on every backend; the tolerance class within SPEC 5.
    assert r.verdict == "identical" if exact_class(meta) else r.verdict != "different", str(r)
    assert "on cuda" in str(r).splitlines()[1]


# ==== index on the golden files ====

# The tensors of a layer that live on the GPU (the index arguments stay on the host).
DEVICE_ARGS = ("q", "q_scale", "k", "k_scale", "weights", "kv_cache", "page_table", "k_slots", "candidates")


def on_gpu(torch, args: dict) -> dict:
    """``args`` with its tensors copied to the GPU (the index arguments stay numpy)."""
    return {
        n: (torch.from_numpy(np.ascontiguousarray(v)).cuda() if n in DEVICE_ARGS and v is not None else v)
        for n, v in args.items()
    }


def host(x):
    return None if x is None else x.cpu().numpy()


def judge(out, args, exact: bool, what: str, expected=None):
    """The GPU's outputs against the reference: bitwise in the exact class (and
    ``expected``, a golden file's tensors), SPEC 9's verdict (SPEC 5's rule with the
    class's tolerance) not "different" in the tolerance class."""
    raw, page = host(out[0]), host(out[1])
    published = host(out[2]) if len(out) > 2 else None
    ref = di.reference(**args)
    if exact:
        assert_bitwise(raw, ref.raw, f"{what}: raw")
        assert_bitwise(page, ref.page, f"{what}: page")
        if ref.published is not None:
            assert_bitwise(published, ref.published, f"{what}: published")
        if expected is not None:
            assert_bitwise(raw, expected["expected_raw"], f"{what}: raw vs golden")
            assert_bitwise(page, expected["expected_page"], f"{what}: page vs golden")
    engine = {"engine_page": page}
    if ref.published is not None:
        engine.update(engine_published=published, engine_published_rows=ref.published_rows)
    r = di.check(raw, **engine, **args)
    if exact:
        assert r.verdict == "identical", f"{what}\n{r}"
    else:
        assert r.verdict != "different", f"{what}\n{r}"
    return r


def golden_index(torch, path):
    meta, t = read_safetensors(path)
    args = golden_inputs(meta, t)
    out = di.index(**on_gpu(torch, args))
    assert out.raw.is_cuda and out.page.is_cuda and out.raw.dtype == torch.int32
    # The golden files give ks / ke for flat keys; the paged ones leave them out, so they
    # are held to the reference's there.
    ref = di.reference(**args)
    assert_bitwise(out.ks.numpy(), t.get("expected_ks", ref.ks), f"{path.name}: ks")
    assert_bitwise(out.ke.numpy(), t.get("expected_ke", ref.ke), f"{path.name}: ke")
    if "expected_published" in t:
        assert out.published.is_cuda
        assert_bitwise(out.published_rows.numpy(), t["expected_published_rows"], f"{path.name}: published_rows")
        parts = (out.raw, out.page, out.published)
    else:
        assert out.published is None and out.published_rows is None
        parts = (out.raw, out.page)
    judge(parts, args, exact_class(meta), path.name, expected=t)


@pytest.mark.parametrize("path", GOLDEN_FILES, ids=lambda p: p.stem)
def test_index_equals_the_reference_on_the_golden_files(torch, path):
    golden_index(torch, path)


@pytest.mark.parametrize("path", PAGED_FILES, ids=lambda p: p.stem)
def test_index_equals_the_reference_on_the_paged_golden_files(torch, path):
    meta, t = read_safetensors(path)
    if t["kv_cache"].shape[1] % 16:
        # The engine entry reads pages with 16-byte loads: it refuses pages that are
        # not whole 16-byte chunks (the host backend gathers them instead), with an error
        # naming page_size.
        args = on_gpu(torch, golden_inputs(meta, t))
        with pytest.raises(ValueError, match="page_size = 8 .*multiple of 16 bytes"):
            di.index(**args)
        return
    golden_index(torch, path)


# ==== random decode batches ====

P = 64


class Decode:
    """A random decode batch over a page pool: ``B`` requests of ``next_n`` rows, E4M3
    or packed fp4 queries and keys (SPEC 10's page layout), drawn with numpy."""

    def __init__(self, seed, fmt, next_n, ctx, heads=16, dim=128, topk=64, max_context=512, spare=5):
        rng = np.random.default_rng(seed)
        self.rng, self.fmt, self.next_n, self.topk = rng, fmt, next_n, topk
        self.heads, self.dim, self.max_context = heads, dim, max_context
        self.max_pages = -(-max_context // P)
        self.b = len(ctx)
        r = self.b * next_n
        self.num_pages = self.b * self.max_pages + spare
        d, g = dim, dim // 32
        if fmt == "e4m3":
            self.q = self.e4m3((r, heads, d))
            self.q_scale = None
            codes = self.e4m3((self.num_pages, P * d))
            scales = (2.0 ** rng.uniform(-3, 3, (self.num_pages, P))).astype("<f4").view(np.uint8)
        else:
            self.q = rng.integers(0, 256, (r, heads, d // 2), dtype=np.uint8)
            self.q_scale = rng.integers(120, 135, (r, heads, g), dtype=np.uint8)
            codes = rng.integers(0, 256, (self.num_pages, P * d // 2), dtype=np.uint8)
            scales = rng.integers(120, 135, (self.num_pages, P * g), dtype=np.uint8)
        self.kv = np.ascontiguousarray(np.concatenate([codes, scales], axis=1))
        self.weights = rng.standard_normal((r, heads)).astype(np.float32)
        self.set(ctx)

    def e4m3(self, shape):
        c = self.rng.integers(0, 256, shape, dtype=np.uint8)
        c[(c & 0x7F) == 0x7F] = 0x38  # no NaN codes (SPEC 8)
        return c

    def set(self, ctx):
        """New context lengths and a new page table (distinct pages, drawn anew)."""
        self.ctx = np.asarray(ctx, dtype=np.int32)
        pages = self.rng.permutation(self.num_pages)[: self.b * self.max_pages]
        self.table = pages.reshape(self.b, self.max_pages).astype(np.int32)

    def reference_args(self):
        return dict(
            q=self.q, q_scale=self.q_scale, kv_cache=self.kv, page_table=self.table, page_size=P,
            weights=self.weights, seq_lens=self.ctx, query_starts=self.ctx - self.next_n, topk=self.topk,
        )

    def gpu(self, torch):
        """The inputs as CUDA tensors, DeepGEMM's 4-D view of the pool among them."""
        c = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a)).cuda()
        bpt = self.kv.shape[1] // P
        q = c(self.q)
        if self.fmt == "e4m3":
            q = q.view(torch.float8_e4m3fn)
        return dict(
            q=q, q_scale=c(self.q_scale), weights=c(self.weights),
            kv_cache=c(self.kv).view(self.num_pages, P, 1, bpt), page_table=c(self.table),
            context_lens=c(self.ctx), next_n=self.next_n, topk=self.topk,
            max_context=self.max_context, page_size=P,
        )

    def judge(self, raw, page, what):
        return judge((raw, page), self.reference_args(), self.fmt == "e2m1", what)


CTX = [3, 64, 65, 200, 511]  # fewer keys than K, a page and one more, the longest


@pytest.mark.parametrize("fmt", ["e4m3", "e2m1"])
@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_equals_the_reference_on_random_batches(torch, fmt, next_n):
    for seed in range(3):
        case = Decode(seed, fmt, next_n, CTX)
        raw, page = di.decode(**case.gpu(torch))
        assert raw.shape == (len(CTX) * next_n, case.topk) and page.shape == (len(CTX) * next_n, 64)
        case.judge(raw, page, f"{fmt} next_n={next_n} seed={seed}")


def test_decode_writes_into_out_and_takes_a_workspace(torch):
    case = Decode(7, "e4m3", 2, CTX)
    args = case.gpu(torch)
    n = di.decode_workspace_bytes(**args)
    assert n == di.decode_workspace_bytes(**args, sms=torch.cuda.get_device_properties(0).multi_processor_count)
    ws = torch.empty(n, dtype=torch.uint8, device="cuda")
    raw = torch.full((len(CTX) * 2, case.topk), -7, dtype=torch.int32, device="cuda")
    page = torch.full((len(CTX) * 2, 64), -7, dtype=torch.int32, device="cuda")
    got = di.decode(**args, out=(raw, page), workspace=ws)
    assert got[0] is raw and got[1] is page
    case.judge(raw, page, "out= and workspace=")
    with pytest.raises(ValueError, match="workspace"):
        di.decode(**args, workspace=ws[: n - 256])


def test_decode_with_check_accepts_good_values_and_names_a_bad_one(torch):
    case = Decode(8, "e4m3", 1, CTX)
    args = case.gpu(torch)
    raw, page = di.decode(**args, check=True)
    case.judge(raw, page, "check=True")
    args["context_lens"][1] = case.max_context + 1
    with pytest.raises(ValueError, match=r"context_lens\[1\]"):
        di.decode(**args, check=True)


# ==== the fast precision (SPEC 4, "fast mode") ====


def spec5_rule(args, raw, page, precision, what):
    """``raw`` and ``page`` (numpy) of a paged tolerance-class layer ``args`` (the
    reference's arguments, ``query_starts`` form) against SPEC 5's rule: the selected
    keys' reference scores at least the ``K``-th best minus the row's largest bound at
    ``precision`` (``cuda::logit_bound``), the others at most it plus that bound; every
    key of a row of at most ``K``; ascending, then -1; ``page`` their pool slots."""
    ref = di.reference(**args, logits=True)
    bounds = di._cuda_row_bounds(precision=precision, **args)
    table, p = args["page_table"], args["page_size"]
    starts, seq = np.asarray(args["query_starts"]), np.asarray(args["seq_lens"])
    requests = np.repeat(np.arange(len(seq)), seq - starts)
    k = raw.shape[1]
    off = 0
    for i in range(raw.shape[0]):
        n = int(ref.ke[i] - ref.ks[i])
        scores = ref.logits[off : off + n].astype(np.float64)
        off += n
        chosen = raw[i][raw[i] >= 0]
        tag = f"{what}: row {i} ({n} keys, bound {bounds[i]:.6g})"
        assert (raw[i][len(chosen) :] == -1).all() and (np.diff(chosen) > 0).all(), f"{tag}: raw {raw[i]}"
        assert len(chosen) == min(n, k) and (chosen < n).all(), f"{tag}: raw {raw[i]}"
        slots = table[requests[i], chosen // p] * p + chosen % p
        assert (page[i, : len(chosen)] == slots).all() and (page[i, len(chosen) :] == -1).all(), f"{tag}: page"
        if n <= k:
            continue
        key = np.where(np.isnan(scores), -np.inf, scores)  # NaN ranks as -inf (-0 == +0 here)
        kth = np.sort(key)[::-1][k - 1]
        sel = np.zeros(n, bool)
        sel[chosen] = True
        lo, hi = key[sel].min(), key[~sel].max()
        assert lo >= kth - bounds[i], f"{tag}: a selected score {lo!r} < K-th best {kth!r} - bound"
        assert hi <= kth + bounds[i], f"{tag}: an unselected score {hi!r} > K-th best {kth!r} + bound"


def fast_case(seed, next_n):
    """A random E4M3 x E4M3 decode batch at H = 64, D = 128: the fast mode's kernel."""
    return Decode(seed, "e4m3", next_n, CTX, heads=64, dim=128)


@pytest.mark.parametrize("next_n", [1, 2])
def test_fast_decode_equals_fast_index_and_meets_the_fast_bound(torch, next_n):
    for seed in range(3):
        case = fast_case(60 + seed, next_n)
        what = f"fast next_n={next_n} seed={seed}"
        raw, page = di.decode(**case.gpu(torch), precision="fast")
        args = case.reference_args()
        out = di.index(**on_gpu(torch, args), precision="fast")
        # The same kernels on the same problem: the same logits, the same selection.
        assert_bitwise(host(raw), host(out.raw), f"{what}: decode raw vs index raw")
        assert_bitwise(host(page), host(out.page), f"{what}: decode page vs index page")
        spec5_rule(args, host(raw), host(page), "fast", what)


@pytest.mark.parametrize("next_n", [1, 2])
def test_full_precision_is_the_default_and_keeps_its_bound(torch, next_n):
    case = fast_case(70, next_n)
    args = case.reference_args()
    raw, page = di.decode(**case.gpu(torch), precision="full")
    raw0, page0 = di.decode(**case.gpu(torch))
    assert_bitwise(host(raw), host(raw0), "decode: precision='full' vs default raw")
    assert_bitwise(host(page), host(page0), "decode: precision='full' vs default page")
    spec5_rule(args, host(raw), host(page), "full", f"full decode next_n={next_n}")
    out = di.index(**on_gpu(torch, args), precision="full")
    out0 = di.index(**on_gpu(torch, args))
    assert_bitwise(host(out.raw), host(out0.raw), "index: precision='full' vs default raw")
    assert_bitwise(host(out.page), host(out0.page), "index: precision='full' vs default page")
    spec5_rule(args, host(out.raw), host(out.page), "full", f"full index next_n={next_n}")
    case.judge(raw, page, f"full decode next_n={next_n}")


def accumulator_case():
    """One row of 64 keys (E4M3 x E4M3, H = 64, D = 128, key scales 1, weights 1, top 1)
    whose choice tells the precisions apart: every head's query is 448 at dim 0 and 2 at
    dim 1; key 0 is 448 at dim 0 (score 448^2 per head), key 1 also 7 at dim 1 (448^2 +
    14), the others 0. Exactly, key 1 wins by 64 x 14, beyond the full bound (2^-16 M,
    about 196); the fp8 accumulator cuts the pair 448^2 + 14 to 200704 (docs/numerics.md
    section 4, seen on the H200), a tie that key 0 wins."""
    case = Decode(80, "e4m3", 1, [64], heads=64, dim=128, topk=1, max_context=64)
    case.q[:] = 0
    case.q[:, :, 0], case.q[:, :, 1] = 0x7E, 0x40  # 448, 2
    case.weights[:] = 1.0
    d = case.dim
    codes = np.zeros((case.num_pages, P * d), np.uint8)
    first = case.table[0, 0]
    codes[first, 0] = codes[first, d] = 0x7E  # keys 0 and 1: 448 at dim 0
    codes[first, d + 1] = 0x4E  # key 1: 7 at dim 1
    scales = np.ones((case.num_pages, P), "<f4").view(np.uint8)
    case.kv = np.ascontiguousarray(np.concatenate([codes, scales], axis=1))
    return case


def test_the_precision_reaches_the_kernels(torch):
    case = accumulator_case()
    args = case.reference_args()
    ref = di.reference(**args, logits=True)
    assert ref.logits[1] - ref.logits[0] == 64 * 14 and ref.raw.tolist() == [[1]]
    for precision, want in [("full", 1), ("fast", 0)]:
        raw, page = di.decode(**case.gpu(torch), precision=precision)
        out = di.index(**on_gpu(torch, args), precision=precision)
        for name, got in [("decode", raw), ("index", out.raw)]:
            assert host(got).tolist() == [[want]], f"{name}(precision={precision!r}): {host(got)}"
        spec5_rule(args, host(raw), host(page), precision, f"accumulator case, {precision}")


# ==== streams, graphs, compile ====


def delayed(torch, s):
    """Keep stream ``s`` busy for about 50 ms: work queued on it after this runs only
    then, so a call that read its inputs on another stream would read them unwritten."""
    with torch.cuda.stream(s):
        torch.cuda._sleep(100_000_000)


def test_decode_and_index_run_on_the_current_non_default_stream(torch):
    case = Decode(11, "e4m3", 2, CTX)
    src = case.gpu(torch)
    dst = {n: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else v) for n, v in src.items()}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    delayed(torch, s)
    with torch.cuda.stream(s):
        for n, v in src.items():
            if isinstance(v, torch.Tensor):
                dst[n].copy_(v)  # written on s, after the delay
        raw, page = di.decode(**dst)
    torch.cuda.current_stream().wait_stream(s)
    case.judge(raw, page, "decode on a side stream")

    meta, t = read_safetensors(GOLDEN_FILES[-1])
    args = golden_inputs(meta, t)
    src = on_gpu(torch, args)
    dst = {n: (torch.zeros_like(v) if n in DEVICE_ARGS and v is not None else v) for n, v in src.items()}
    s.wait_stream(torch.cuda.current_stream())
    delayed(torch, s)
    with torch.cuda.stream(s):
        for n in DEVICE_ARGS:
            if dst.get(n) is not None:
                dst[n].copy_(src[n])
        out = di.index(**dst)
    torch.cuda.current_stream().wait_stream(s)
    judge((out.raw, out.page), args, exact_class(meta), f"index on a side stream: {GOLDEN_FILES[-1].name}")


def test_decode_replays_in_a_cuda_graph_with_new_lengths_and_page_tables(torch):
    case = Decode(21, "e4m3", 2, CTX)
    args = case.gpu(torch)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        di.decode(**args)  # warm-up: compiles and loads the kernels
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        raw, page = di.decode(**args)
    for i, ctx in enumerate([CTX, [511, 2, 130, 64, 3], [100, 100, 100, 100, 100], [2, 3, 4, 5, 6]]):
        case.set(ctx)
        args["context_lens"].copy_(torch.from_numpy(case.ctx))
        args["page_table"].copy_(torch.from_numpy(case.table))
        g.replay()
        case.judge(raw, page, f"graph replay {i}: context_lens {ctx}")


def test_decode_and_index_under_torch_compile_fullgraph(torch):
    case = Decode(31, "e2m1", 2, CTX)
    args = case.gpu(torch)
    tensors = {n: v for n, v in args.items() if isinstance(v, torch.Tensor)}
    scalars = {n: v for n, v in args.items() if not isinstance(v, torch.Tensor)}
    f = torch.compile(lambda **t: di.decode(**t, **scalars), fullgraph=True)
    raw, page = f(**tensors)
    case.judge(raw, page, "decode under torch.compile")

    meta, t = read_safetensors(GOLDEN_FILES[-1])
    args = golden_inputs(meta, t)
    gpu = on_gpu(torch, args)
    tensors = {n: v for n, v in gpu.items() if n in DEVICE_ARGS and v is not None}
    # Index arguments as lists: torch.compile takes them as constants (and the device
    # arguments this file lacks, such as q_scale of E4M3 queries, as None).
    rest = {
        n: (v.tolist() if isinstance(v, np.ndarray) else v)
        for n, v in gpu.items()
        if n not in tensors
    }
    h = torch.compile(lambda **t: di.index(**t, **rest).raw, fullgraph=True)
    raw = h(**tensors)
    want = di.index(**gpu).raw
    assert torch.equal(raw, want), "index under torch.compile"


# ==== zero copy ====


@pytest.fixture
def pointer_hook():
    di._set_pointer_hook(True)
    yield
    di._set_pointer_hook(False)


def test_no_input_of_decode_is_copied(torch, pointer_hook):
    for fmt in ("e4m3", "e2m1"):
        case = Decode(41, fmt, 2, CTX)
        args = case.gpu(torch)
        ws = torch.empty(di.decode_workspace_bytes(**args), dtype=torch.uint8, device="cuda")
        raw = torch.empty((len(CTX) * 2, case.topk), dtype=torch.int32, device="cuda")
        page = torch.empty((len(CTX) * 2, 64), dtype=torch.int32, device="cuda")
        di.decode(**args, out=(raw, page), workspace=ws)
        got = di._kernel_pointers()
        names = ["q", "weights", "kv_cache", "page_table", "context_lens"] + (["q_scale"] if fmt == "e2m1" else [])
        want = {n: args[n].data_ptr() for n in names}
        want.update(raw=raw.data_ptr(), page=page.data_ptr(), workspace=ws.data_ptr())
        assert got == want, fmt


@pytest.mark.parametrize("path", [GOLDEN_FILES[-1], PAGED_FILES[2]], ids=lambda p: p.stem)
def test_no_input_of_index_is_copied(torch, pointer_hook, path):
    meta, t = read_safetensors(path)
    gpu = on_gpu(torch, golden_inputs(meta, t))
    out = di.index(**gpu)
    got = di._kernel_pointers()
    for n in ("workspace", "backend_allocated_bytes", "workspace_bytes"):
        assert n in got, n
        got.pop(n)
    want = {n: gpu[n].data_ptr() for n in DEVICE_ARGS if gpu.get(n) is not None}
    want.update(raw=out.raw.data_ptr(), page=out.page.data_ptr())
    assert got == want


@pytest.mark.parametrize("path", [GOLDEN_FILES[-1], PAGED_FILES[2]], ids=lambda p: p.stem)
def test_index_takes_all_its_device_memory_from_torch(torch, pointer_hook, path):
    """The backend allocates nothing itself (its own count stays 0); its workspace is a
    torch tensor (torch's peak grows by at least the workspace's bytes), and out=
    tensors are written in place."""
    meta, t = read_safetensors(path)
    gpu = on_gpu(torch, golden_inputs(meta, t))
    want = di.index(**gpu)
    raw = torch.full_like(want.raw, 12345)
    page = torch.full_like(want.page, 12345)
    out = (raw, page) if want.published is None else (raw, page, torch.full_like(want.published, 7))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    got = di.index(**gpu, out=out)
    torch.cuda.synchronize()
    ptrs = di._kernel_pointers()
    assert ptrs["backend_allocated_bytes"] == 0
    assert ptrs["workspace_bytes"] > 0
    assert torch.cuda.max_memory_allocated() - base >= ptrs["workspace_bytes"]
    assert ptrs["raw"] == raw.data_ptr() and ptrs["page"] == page.data_ptr()
    assert got.raw is raw and torch.equal(raw, want.raw)
    assert torch.equal(page, want.page)
    if want.published is not None:
        assert torch.equal(out[2], want.published)


def test_index_under_cuda_graph_capture_raises_runtime_error(torch):
    meta, t = read_safetensors(GOLDEN_FILES[-1])
    gpu = on_gpu(torch, golden_inputs(meta, t))
    di.index(**gpu)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="dsa_indexer.decode is the capturable entry"):
        with torch.cuda.graph(g):
            di.index(**gpu)


# ==== errors on the GPU ====


@pytest.mark.parametrize(
    "match, change",
    [
        (r"^q: a tensor on cpu", lambda a: {"q": a["q"].cpu()}),
        (r"^weights: .*on cpu|^weights: .*host memory", lambda a: {"weights": a["weights"].cpu()}),
        (r"^weights: .*bfloat16", lambda a: {"weights": a["weights"].bfloat16()}),
        (r"^weights: shape", lambda a: {"weights": a["weights"][:-1]}),
        (r"^page_table: .*int64", lambda a: {"page_table": a["page_table"].long()}),
        (r"^context_lens: .*\[4\]", lambda a: {"context_lens": a["context_lens"][:4]}),
        (r"^kv_cache: ", lambda a: {"kv_cache": a["kv_cache"][:, :, :, :-4]}),
        (r"^q: .*strides", lambda a: {"q": a["q"].transpose(0, 1).contiguous().transpose(0, 1)}),
        (r"^raw: ", lambda a: {"out": (torch_empty_like(a, (10, 63)), torch_empty_like(a, (10, 64)))}),
        (r"^next_n = 0", lambda a: {"next_n": 0}),
    ],
    ids=["q_on_cpu", "weights_on_cpu", "bf16_weights", "weights_rows", "int64_page_table",
         "context_lens_len", "kv_width", "q_strides", "raw_shape", "next_n_0"],
)
def test_bad_decode_inputs_raise_value_error_naming_the_field(torch, match, change):
    case = Decode(51, "e4m3", 2, CTX)
    args = case.gpu(torch)
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        di.decode(**args)


def torch_empty_like(args, shape):
    import torch

    return torch.empty(shape, dtype=torch.int32, device=args["q"].device)


def test_bad_index_inputs_raise_value_error_naming_the_field(torch):
    meta, t = read_safetensors(GOLDEN_FILES[-1])
    gpu = on_gpu(torch, golden_inputs(meta, t))
    for name, bad, match in [
        ("k_scale", gpu["k_scale"].cpu(), r"^k_scale: "),
        ("k", gpu["k"][:-1], r"^k"),
        ("weights", gpu["weights"].double(), r"^weights: "),
    ]:
        with pytest.raises(ValueError, match=match):
            di.index(**{**gpu, name: bad})
    with pytest.raises(ValueError, match=r"^q: a tensor on cpu"):
        di.index(**{**gpu, "q": gpu["q"].cpu()})


# ==== anywhere: shape checks before the device, RuntimeError without a GPU ====


def native_decode_args(**change):
    """Well-formed decode arguments as numpy arrays (host memory)."""
    b, n, h, d, k = 2, 2, 16, 128, 64
    a = dict(
        q=np.zeros((b * n, h, d), np.uint8), q_scale=None, weights=np.zeros((b * n, h), np.float32),
        kv_cache=np.zeros((4, P * (d + 4)), np.uint8), page_table=np.zeros((b, 2), np.int32),
        context_lens=np.full(b, 100, np.int32), raw=np.zeros((b * n, k), np.int32),
        page=np.zeros((b * n, 64), np.int32), workspace=np.zeros(1 << 16, np.uint8),
        next_n=n, topk=k, max_context=128, page_size=P, ratio=1, page_cols=None,
    )
    a.update(change)
    return a


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(q=np.zeros((3, 16, 128), np.uint8)), r"^q: shape \[3, 16, 128\].*B \* next_n = 4"),
        (dict(weights=np.zeros((4, 8), np.float32)), r"^weights: shape \[4, 8\]"),
        (dict(context_lens=np.zeros(3, np.int32)), r"^context_lens: shape \[3\]"),
        (dict(context_lens=np.zeros(2, np.int64)), r"^context_lens: .*int64"),
        (dict(raw=np.zeros((4, 63), np.int32)), r"^raw: shape \[4, 63\]"),
        (dict(page=np.zeros((4, 64), np.int64)), r"^page: "),
        (dict(workspace=np.zeros((2, 8), np.uint8)), r"^workspace: "),
        (dict(kv_cache=np.zeros((4, 100), np.uint8)), r"^kv_cache: "),
        (dict(page_table=np.zeros(2, np.int32)), r"^page_table: "),
        (dict(next_n=-1), r"^next_n = -1"),
        (dict(weights=None), r"^weights: missing"),
    ],
)
def test_the_native_decode_checks_shapes_before_it_touches_a_device(change, match):
    if not di.CUDA:
        pytest.skip("built without the cuda feature")
    with pytest.raises(ValueError, match=match):
        di._native.decode(native_decode_args(**change), 0, 0, False)


def test_well_formed_host_arrays_reach_the_device_check():
    if not di.CUDA:
        pytest.skip("built without the cuda feature")
    # Here the device is reached: without one, RuntimeError; with one, the host arrays
    # are refused by name.
    try:
        di._native.decode(native_decode_args(), 0, 0, False)
    except RuntimeError as e:
        assert why_no_gpu() is not None, e
    except ValueError as e:
        assert str(e).startswith("q: ") and "host memory" in str(e), e
    else:
        pytest.fail("host arrays were taken as device memory")


def test_the_cuda_entries_raise_runtime_error_without_a_gpu():
    if why_no_gpu() is None:
        pytest.skip("a GPU is here")
    a = native_decode_args()
    with pytest.raises(RuntimeError):
        di.decode(q=a["q"], weights=a["weights"], kv_cache=a["kv_cache"], page_table=a["page_table"],
                  context_lens=a["context_lens"], next_n=2, topk=64, max_context=128, page_size=P)
    with pytest.raises(RuntimeError):
        di.index(a["q"], None, np.zeros((4, 128), np.uint8), np.ones(4, np.float32), a["weights"],
                 seq_lens=[2, 2], query_starts=[0, 0], topk=4)


def test_the_decode_workspace_is_sized_without_a_gpu_given_the_sms():
    if not di.CUDA:
        pytest.skip("built without the cuda feature")
    torch = pytest.importorskip("torch")
    a = {n: torch.from_numpy(v) for n, v in native_decode_args().items() if isinstance(v, np.ndarray)}
    n = di.decode_workspace_bytes(q=a["q"], kv_cache=a["kv_cache"], page_table=a["page_table"],
                                  next_n=2, topk=64, max_context=128, page_size=P, sms=132)
    # 4 rows: metadata (4 x 256-byte regions), the path counters, 4 x 128 float logits,
    # and the split top-k's scratch of 4 rows x segments x 64.
    assert n % 256 == 0 and n >= 4 * 256 + 4 * 128 * 4, n
    wide = di.decode_workspace_bytes(q=a["q"], kv_cache=a["kv_cache"], page_table=a["page_table"],
                                     next_n=2, topk=64, max_context=4096, page_size=P, sms=132)
    assert wide >= n + 4 * (4096 - 128) * 4


def test_decode_and_index_trace_into_one_graph_under_torch_compile(monkeypatch):
    # Traced on the CPU with a backend that keeps the graph and runs nothing: the
    # wrappers' device check is the only part that needs a GPU, so it is lifted here.
    torch = pytest.importorskip("torch")
    from dsa_indexer import _ops

    monkeypatch.setattr(_ops, "_cuda_device", lambda q: q.device)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: None

    b, n, h, d = 2, 2, 16, 64
    q = torch.zeros((b * n, h, d), dtype=torch.float8_e4m3fn)
    w = torch.zeros((b * n, h))
    kv = torch.zeros((8, P, 1, d + 4), dtype=torch.uint8)
    table = torch.zeros((b, 4), dtype=torch.int32)
    lens = torch.zeros(b, dtype=torch.int32)
    ws = torch.zeros(1 << 20, dtype=torch.uint8)

    def step(q, w, kv, table, lens, ws):
        return di.decode(q=q, weights=w, kv_cache=kv, page_table=table, context_lens=lens, next_n=n,
                         topk=16, max_context=256, page_size=P, workspace=ws)

    def layer(q, w, kv, table):
        o = di.index(q, None, None, None, w, kv_cache=kv, page_table=table, page_size=P,
                     seq_lens=[100, 200], query_starts=[98, 198], topk=16, role="source", tail=1)
        return o.raw, o.page, o.published, o.ks

    for f, args, op in [(step, (q, w, kv, table, lens, ws), "decode"), (layer, (q, w, kv, table), "index")]:
        with pytest.raises(TypeError):  # the kept graph returns nothing
            torch.compile(f, fullgraph=True, backend=keep)(*args)
        code = graphs[-1].code
        assert code.count(f"torch.ops.dsa_indexer.{op}(") == 1, code
    # The outputs are allocated in the graph with the shapes the host arguments give.
    assert "torch.empty((4, 16)" in graphs[0].code and "torch.empty((2, 2048)" in graphs[1].code


@pytest.mark.parametrize("bad", ["fp8", "FULL", "", 8])
def test_a_bad_precision_raises_value_error_before_any_device_work(bad):
    if not di.CUDA:
        pytest.skip("built without the cuda feature")
    shown = bad if isinstance(bad, str) else repr(bad)
    match = rf"^precision = {re.escape(shown)}: full or fast$"
    # The native entries, host arrays: refused before the device is opened.
    with pytest.raises(ValueError, match=match):
        di._native.decode(native_decode_args(), 0, 0, False, bad)
    with pytest.raises(ValueError, match=match):
        di._native.precision_name(bad)
    try:
        import torch
    except ImportError:
        return
    a = {n: torch.from_numpy(v) for n, v in native_decode_args().items() if isinstance(v, np.ndarray)}
    # The wrappers check it before they look for a GPU (host tensors, no GPU needed).
    with pytest.raises(ValueError, match=match):
        di.decode(q=a["q"], weights=a["weights"], kv_cache=a["kv_cache"], page_table=a["page_table"],
                  context_lens=a["context_lens"], next_n=2, topk=64, max_context=128, page_size=P,
                  precision=bad)
    with pytest.raises(ValueError, match=match):
        di.decode_workspace_bytes(q=a["q"], kv_cache=a["kv_cache"], page_table=a["page_table"], next_n=2,
                                  topk=64, max_context=128, page_size=P, sms=132, precision=bad)
    with pytest.raises(ValueError, match=match):
        di.index(a["q"], None, torch.zeros((4, 128), dtype=torch.uint8), torch.ones(4), a["weights"],
                 seq_lens=[2, 2], query_starts=[0, 0], topk=4, precision=bad)


def test_the_fast_bound_applies_only_to_the_fast_kernels_shape():
    if not di.CUDA:
        pytest.skip("built without the cuda feature")
    # H = 64, E4M3 x E4M3: the fast mode's bound, far above the full one (the accumulator
    # keeps about 13 bits); H = 16: the fast mode runs the full kernels, the same bound.
    for heads, wider in [(64, True), (16, False)]:
        args = Decode(90, "e4m3", 2, CTX, heads=heads).reference_args()
        full = di._cuda_row_bounds(precision="full", **args)
        fast = di._cuda_row_bounds(precision="fast", **args)
        assert full.shape == fast.shape == (len(CTX) * 2,) and (full > 0).all()
        if wider:
            assert (fast > 16 * full).all(), (heads, fast / full)
        else:
            assert_bitwise(fast, full, f"H = {heads}: fast vs full bounds")
    case = accumulator_case()
    full = di._cuda_row_bounds(precision="full", **case.reference_args())
    fast = di._cuda_row_bounds(precision="fast", **case.reference_args())
    # The row's M is 64 x (448^2 + 14); the exact gap between its two keys, 64 x 14,
    # lies between the two bounds.
    assert full[0] < 64 * 14 < fast[0], (full, fast)
    with pytest.raises(ValueError, match=r"^precision = fp8: full or fast$"):
        di._cuda_row_bounds(precision="fp8", **case.reference_args())


def test_the_rule_takes_the_reference_and_the_fast_choice_only_under_the_fast_bound():
    if not di.CUDA:
        pytest.skip("built without the cuda feature")
    for next_n in (1, 2):
        args = fast_case(95, next_n).reference_args()
        ref = di.reference(**args)
        spec5_rule(args, ref.raw, ref.page, "full", f"the reference, next_n={next_n}")
    case = accumulator_case()
    args = case.reference_args()
    first = case.table[0, 0] * P
    fast = (np.array([[0]], np.int32), np.array([[first] + [-1] * 63], np.int32))
    spec5_rule(args, *fast, "fast", "key 0 under the fast bound")
    with pytest.raises(AssertionError, match="a selected score"):
        spec5_rule(args, *fast, "full", "key 0 under the full bound")
    wrong = fast[1].copy()
    wrong[0, 0] += 1  # the next slot of the page
    with pytest.raises(AssertionError, match="page"):
        spec5_rule(args, fast[0], wrong, "fast", "a wrong slot")
