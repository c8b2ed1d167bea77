"""The DSA indexer's CPU reference, dumps and SPEC 9 verdict for numpy and torch.

For every query row ``i`` and every earlier compressed key ``j`` of its request::

    logit[i, j] = sum_h  w[i, h] * relu(q[i, h, :] . k[j, :])     (x k_scale[j] for fp8 keys)

then the top ``K`` keys per row (``docs/SPEC.md`` of the crate says it bit for bit).

- :func:`reference` computes a layer's selections on the CPU, bitwise the crate's
  reference, and returns numpy arrays (:class:`Output`).
- :func:`check` judges an engine's selections against the reference in one call
  (SPEC 9's verdict, the judge of ``dsa-indexer replay``) and returns a :class:`Report`.
- :func:`save_dump` / :func:`load_dump` write and read a layer-forward in the dump
  schema that ``dsa-indexer replay FILE`` reads; :func:`replay` replays one.
- :func:`plan` is the row-tile plan and its peak memory, term by term.
- :func:`decode` (the decode step over the paged KV cache) and :func:`index` (the engine
  entry) run the CUDA kernels on CUDA torch tensors, zero copy, on
  ``torch.cuda.current_stream()``, as torch custom ops (``dsa_indexer::decode``,
  ``dsa_indexer::index``) that ``torch.compile`` traces; ``decode`` is capturable in a
  CUDA graph. They need a build with the ``cuda`` feature, torch and an sm_90 GPU.

Inputs are numpy arrays or torch tensors, read through DLPack without a copy where the
dtype allows (see :func:`reference`). A bad input raises ``ValueError`` with the crate's
message, which names the field and the value (``k_scale[17] = -1: finite and > 0``); a
backend that cannot run (no GPU, a build without CUDA) raises ``RuntimeError``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Optional

import numpy as np

from . import _native

__all__ = [
    "Dump",
    "Output",
    "Report",
    "check",
    "decode",
    "decode_workspace_bytes",
    "index",
    "load_dump",
    "plan",
    "reference",
    "replay",
    "save_dump",
]

#: Whether this build carries the crate's CUDA backend (``replay(device="cuda")``,
#: :func:`decode`, :func:`index`).
CUDA: bool = _native.CUDA

DEFAULT_BUDGET = 2 << 30

# ==== inputs ====

# numpy dtypes of ml_dtypes that numpy cannot export through DLPack. Byte-sized
# codes are read as their bytes (the same bits SPEC 9 accepts as uint8); bfloat16
# weights are widened to float32 (exact; the crate computes on f32 weights anyway).
_NUMPY_BYTE_DTYPES = ("float8_e4m3fn", "float8_e8m0fnu")

_torch_dlpack_ok: dict = {}


def _torch_exports(torch: Any, dtype: Any) -> bool:
    """Whether this torch exports ``dtype`` through DLPack (torch < 2.8 refuses fp8/fp4)."""
    ok = _torch_dlpack_ok.get(dtype)
    if ok is None:
        try:
            torch.empty(1, dtype=dtype).__dlpack__()
            ok = True
        except Exception:
            ok = False
        _torch_dlpack_ok[dtype] = ok
    return ok


def _pack_fp4(a: np.ndarray) -> np.ndarray:
    """ml_dtypes' ``float4_e2m1fn`` (one value a byte, code in the low nibble) packed
    two a byte, element ``2i`` in the low nibble (SPEC 2): ``[.., D]`` -> ``[.., D/2]``."""
    codes = np.ascontiguousarray(a).view(np.uint8) & 0x0F
    if codes.shape[-1] % 2:
        raise ValueError(
            f"float4_e2m1fn array of shape {list(a.shape)}: an odd number of values a row"
        )
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _tensor(x: Any) -> Any:
    """``x`` as an object the native module imports through DLPack, in host memory.

    torch tensors are detached, moved to the host (a CUDA tensor is copied) and made
    contiguous if they are not; a dtype this torch cannot export is viewed as its bytes.
    numpy arrays are made contiguous if they are not; lists and scalars become arrays.
    """
    if x is None:
        return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if not x.is_contiguous():
            x = x.contiguous()
        if not _torch_exports(torch, x.dtype) and x.element_size() == 1:
            x = x.view(torch.uint8)
        return x
    if isinstance(x, np.ndarray):
        name = x.dtype.name
        if name in _NUMPY_BYTE_DTYPES:
            x = x.view(np.uint8)
        elif name == "bfloat16":
            x = x.astype(np.float32)
        elif name == "float4_e2m1fn":
            x = _pack_fp4(x)
        return np.ascontiguousarray(x)
    if hasattr(x, "__dlpack__"):
        return x
    return np.ascontiguousarray(np.asarray(x))


def _layer(
    q,
    q_scale,
    k=None,
    k_scale=None,
    weights=None,
    *,
    seq_lens,
    topk,
    query_starts=None,
    row_requests=None,
    row_positions=None,
    ratio=1,
    role="plain",
    tail=None,
    block_size=8,
    num_blocks=2048,
    candidates=None,
    page_cols=None,
    k_slots=None,
    kv_cache=None,
    page_table=None,
    page_size=None,
) -> dict:
    """The arguments dict of the native functions (one layer-forward)."""
    t = _tensor
    return {
        "q": t(q),
        "q_scale": t(q_scale),
        "k": t(k),
        "k_scale": t(k_scale),
        "weights": t(weights),
        "seq_lens": t(seq_lens),
        "query_starts": t(query_starts),
        "row_requests": t(row_requests),
        "row_positions": t(row_positions),
        "topk": topk,
        "ratio": ratio,
        "role": role,
        "tail": tail,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "candidates": t(candidates),
        "page_cols": page_cols,
        "k_slots": t(k_slots),
        "kv_cache": t(kv_cache),
        "page_table": t(page_table),
        "page_size": page_size,
    }


def _inputs(inputs: dict) -> dict:
    """The arguments dict from ``reference``'s keyword arguments given as ``**inputs``."""
    try:
        return _layer(**inputs)
    except TypeError as e:
        raise TypeError(f"{e} (the layer's arguments are those of dsa_indexer.reference)") from None


def _numpy(a: Any) -> Optional[np.ndarray]:
    return None if a is None else np.from_dlpack(a)


# ==== the reference ====


@dataclasses.dataclass(frozen=True)
class Output:
    """A layer's outputs (SPEC 5 and 6), numpy arrays.

    ``raw`` int32 [T, K]: each row's selected request-local key positions, ascending,
    then -1. ``page`` int32 [T, page_cols]: their pool slots (``k_slots``, or the page table's for paged keys), then -1.
    ``published`` int32 [P, NB] and ``published_rows`` int32 [P]: a source layer's kept
    blocks and the rows that published them (``None`` for other roles). ``ks``, ``ke``
    int32 [T]: each row's visible keys ``[ks, ke)`` in the flat key buffer (SPEC 3).
    ``logits`` float32 [sum n] (with ``logits=True``): each row's visible scores, rows
    concatenated, row ``i`` at ``logits[o_i : o_i + ke[i] - ks[i]]``.

    From :func:`index` (the CUDA entry) the fields are torch tensors instead: ``raw``,
    ``page`` and ``published`` on the GPU, ``published_rows``, ``ks`` and ``ke`` on the
    CPU, and no ``logits``.
    """

    raw: np.ndarray
    page: np.ndarray
    published: Optional[np.ndarray]
    published_rows: Optional[np.ndarray]
    ks: np.ndarray
    ke: np.ndarray
    logits: Optional[np.ndarray] = None


def reference(
    q,
    q_scale,
    k=None,
    k_scale=None,
    weights=None,
    *,
    seq_lens,
    topk,
    query_starts=None,
    row_requests=None,
    row_positions=None,
    ratio=1,
    role="plain",
    tail=None,
    block_size=8,
    num_blocks=2048,
    candidates=None,
    page_cols=None,
    k_slots=None,
    kv_cache=None,
    page_table=None,
    page_size=None,
    budget=DEFAULT_BUDGET,
    logits=False,
) -> Output:
    """One layer-forward on the CPU: bitwise the crate's reference (SPEC 4 to 6).

    Shapes and dtypes as the engines hold them (numpy arrays or torch tensors):

    - ``q``: E4M3 ``[T, H, D]`` (``torch.float8_e4m3fn`` or uint8 codes) with
      ``q_scale=None`` (fold the query scale into ``weights``), or packed fp4
      ``[T, H, D/2]`` (uint8, int8 or ``torch.float4_e2m1fn_x2``) with ``q_scale``
      UE8M0 ``[T, H, D/32]`` (uint8 or ``torch.float8_e8m0fnu``) or int32 words
      ``[T, H]`` (byte ``g`` scales group ``g``).
    - ``k``: E4M3 ``[L, D]`` with ``k_scale`` float32 ``[L]``, or packed fp4 ``[L, D/2]``
      with UE8M0 ``k_scale`` ``[L, D/32]`` or int32 words ``[L]``; requests
      concatenated. The dtype of ``k_scale`` decides: float32 means E4M3 keys.
    - Or paged keys (SPEC 10), the engines' KV cache, instead of ``k`` and ``k_scale``:
      ``kv_cache`` uint8 ``[num_pages, page_size * bytes_per_token]`` (or
      ``[num_pages, page_size, 1, bytes_per_token]``, DeepGEMM's view of the same
      bytes), ``page_table`` int32 ``[B, max_pages]`` and ``page_size`` (a power of two
      up to 256; engines use 64). A page holds its tokens' codes, then their scales:
      ``bytes_per_token`` is ``D + 4`` for E4M3 keys (f32 scales), ``D/2 + D/32`` for
      packed fp4 (UE8M0 scales), which tells the two apart. ``page`` then holds pool
      slots ``page_table[b, j // page_size] * page_size + j % page_size``; ``k_slots``
      is not given. Flat and paged keys together, or neither, raise ``ValueError``.
    - ``weights``: float32 or bfloat16 ``[T, H]``.
    - ``seq_lens`` int32 ``[B]``, and either ``query_starts`` int32 ``[B]`` (request
      ``b``'s rows are positions ``query_starts[b] .. seq_lens[b]-1``) or
      ``row_requests`` and ``row_positions`` int32 ``[T]``. int64 and Python lists are
      accepted for every index argument.
    - ``role``: ``"plain"``, ``"source"`` (publishes candidate blocks; ``tail`` keeps only
      each request's last ``tail`` rows) or ``"consumer"`` (``candidates`` int32
      ``[T, NB]``: the source's published blocks for these rows).
    - ``k_slots`` int32 ``[L]``: each key's pool slot (``page`` holds slots), default
      the identity. ``page_cols``: width of ``page`` (default ``K`` rounded up to 64).
    - ``budget``: bytes of the logits tile of the chunked driver; the outputs do not
      depend on it.

    float32, int32 and byte tensors are read in place (DLPack); bfloat16 weights, int32
    scale words of ``D < 128`` and int64 indices are converted. torch tensors on a GPU
    are copied to the host first. numpy has no DLPack code for ml_dtypes' types:
    ``float8_e4m3fn`` and ``float8_e8m0fnu`` arrays are read as their bytes,
    ``bfloat16`` widened to float32, ``float4_e2m1fn`` (one value a byte) packed.
    """
    args = _layer(
        q,
        q_scale,
        k,
        k_scale,
        weights,
        seq_lens=seq_lens,
        topk=topk,
        query_starts=query_starts,
        row_requests=row_requests,
        row_positions=row_positions,
        ratio=ratio,
        role=role,
        tail=tail,
        block_size=block_size,
        num_blocks=num_blocks,
        candidates=candidates,
        page_cols=page_cols,
        k_slots=k_slots,
        kv_cache=kv_cache,
        page_table=page_table,
        page_size=page_size,
    )
    d = _native.reference(args, budget, logits)
    return Output(**{name: _numpy(a) for name, a in d.items()})


def plan(*, budget=DEFAULT_BUDGET, **inputs) -> dict:
    """The CPU backend's plan of a layer (the arguments of :func:`reference`) under
    ``budget``: ``tiles`` (each a dict of ``rows``, ``published``, ``logits_bytes``,
    ``block_score_bytes``, ``oversized``), ``peak`` term by term with its ``total``,
    ``workers``, ``max_tile_rows``, ``published_rows``, ``oversized_row`` and
    ``unbounded_bytes`` (the seed engine's transient), all in bytes."""
    return _native.plan(_inputs(inputs), budget)


def _cuda_row_bounds(*, precision="full", **inputs) -> np.ndarray:
    """Per row of a layer (the arguments of :func:`reference`, host arrays): the largest
    bound the CUDA backend states for its logits at ``precision`` over the row's visible
    keys (``cuda::logit_bound``, SPEC 4; the fast mode's where it applies), float64
    ``[T]``: the "row's largest bound" of SPEC 5's rule for a tolerance-class layer
    (a test helper; a build with CUDA, no GPU needed)."""
    if not _native.CUDA:
        raise RuntimeError("dsa_indexer._cuda_row_bounds needs a build with the cuda feature")
    return np.asarray(_native.row_bounds(_inputs(inputs), precision), dtype=np.float64)


def _input_pointers(**inputs) -> dict:
    """The addresses of the buffers the crate reads for a layer (a test hook)."""
    return dict(_native._input_pointers(_inputs(inputs)))


# ==== the verdict ====


@dataclasses.dataclass(frozen=True)
class Report:
    """SPEC 9's verdict on an engine's outputs, as ``dsa-indexer replay`` reports it.

    ``verdict``: ``"identical"``, ``"equal up to ties"``, ``"equal within tolerance"``,
    ``"different"`` or ``"no expected outputs"`` (the worst part's). ``tensors``: each
    judged part (``ks``, ``ke``, ``raw``, ``page``, ``published``, ``logits``,
    ``engine_logits``, ``engine_topk``) by name, as ``--json`` writes it: a dict of
    ``status``, ``compared_rows``, ``rows_ties``, ``rows_tolerant``, ``rows_different``,
    ``first_different_row`` and ``notes`` (the first differing rows), and where the part
    has them ``tolerance``, ``margins`` (each differing row's ``row``, ``status``,
    ``needs_log2``, ``tolerance_log2``), ``margin_summary`` (``worst_log2``,
    ``worst_row``, ``median_log2``, ``beyond_default``, ...), ``worst_error_log2`` and
    ``worst_rows`` (logit parts: ``log2`` of the worst ``|x - ref| / M``).
    ``tolerance``: the tolerance the selections were judged with, a dict of ``source``
    (``"measured"``, ``"default"``, ``"given"``), ``rule``, ``log2`` (``None``: exact
    ties only) and ``why``. ``exit_code``: the CLI's, 1 when different. ``str(report)``
    is the CLI's text, :meth:`json` its ``--json``.
    """

    verdict: str
    tensors: dict
    tolerance: dict
    exit_code: int
    text: str
    _json: str = dataclasses.field(repr=False)

    def __str__(self) -> str:
        return self.text

    def json(self) -> str:
        """The report as ``dsa-indexer replay --json`` prints it."""
        return self._json

    def margins(self, part="raw") -> list:
        """The differing rows' margins of a selection part (``raw``, ``page``,
        ``published``, ``engine_topk``): ``[]`` when it has none or is not judged."""
        return self.tensors.get(part, {}).get("margins", [])

    def margin_summary(self, part="raw") -> Optional[dict]:
        """The distribution of a part's margins: ``worst_log2`` (its ``worst_row``),
        ``median_log2``, ``beyond_default`` (rows the class's default would not pass),
        ``rows``, ``ties``, ``unfixable``, ``default_log2``; ``None`` without margins."""
        return self.tensors.get(part, {}).get("margin_summary")

    @property
    def engine_logits_error_log2(self) -> Optional[float]:
        """``log2`` of the engine logits' worst ``|x - ref| / M``; ``None`` when the
        outputs carry no engine logits or they are bitwise the reference's."""
        return self.tensors.get("engine_logits", {}).get("worst_error_log2")


def _report(native) -> Report:
    """The one wrapper of the crate's judge's report (for :func:`replay` and :func:`check`)."""
    return Report(
        verdict=native.verdict,
        tensors=dict(native.tensors()),
        tolerance=native.tolerance(),
        exit_code=native.exit_code,
        text=native.text(),
        _json=native.json(),
    )


def check(
    engine_raw,
    *,
    engine_page=None,
    engine_published=None,
    engine_published_rows=None,
    engine_ks=None,
    engine_ke=None,
    engine_logits=None,
    budget=DEFAULT_BUDGET,
    max_notes=5,
    full_ids=False,
    tolerance=None,
    **inputs,
) -> Report:
    """Judge an engine's outputs of one layer against the reference, without a file.

    ``engine_raw`` int [T, K]: the engine's selected request-local key positions, in
    any order, -1 padded anywhere (or ``None`` to judge only the others).
    ``engine_page`` [T, page_cols]: their pool slots. ``engine_published`` [P, NB] and
    ``engine_published_rows`` [P]: a source's kept blocks. ``engine_ks``,
    ``engine_ke`` [T]: the visible ranges it used. ``engine_logits`` float [T, L]: its
    logits over the flat key buffer (only ``[ks, ke)`` of each row is read).
    ``inputs``: the layer, as the keyword arguments of :func:`reference` (``q=``,
    ``q_scale=``, ``k=``, ``k_scale=`` or ``kv_cache=``, ``page_table=``,
    ``page_size=``, ``weights=``, ``seq_lens=``, ``topk=``, ...).

    A row of the same ids as the reference's in another order, or swapping keys of
    exactly the K-th score, is *equal up to ties*. Otherwise it is *equal within
    tolerance* when every key it selects scores at least the row's K-th reference score
    minus the row's tolerance and every key it leaves out at most that score plus it,
    and *different* if not. The verdict is the worst part's.

    ``tolerance`` (SPEC 9, the CLI's ``--tolerance``): ``None`` or ``"auto"`` twice each
    row's measured logit error when ``engine_logits`` is given, else the class's
    default (``2^-13 M`` for fp8 operands, exact ties for fp4 x fp4); ``0`` exact ties
    only; ``2**-13`` or ``"2^-13"`` that factor of the row's largest SPEC 4 magnitude
    ``M``. Anything else raises ``ValueError`` naming ``tolerance``.
    """
    engine = {
        "raw": _tensor(engine_raw),
        "page": _tensor(engine_page),
        "published": _tensor(engine_published),
        "published_rows": _tensor(engine_published_rows),
        "ks": _tensor(engine_ks),
        "ke": _tensor(engine_ke),
        "engine_logits": _tensor(engine_logits),
    }
    return _report(
        _native.check(_inputs(inputs), engine, budget, max_notes, full_ids, tolerance)
    )


# ==== dumps ====


@dataclasses.dataclass(frozen=True)
class Dump:
    """A dump read by the crate's reader (:func:`load_dump`).

    ``meta``: ``heads``, ``dim``, ``topk``, ``ratio``, ``q_format``, ``k_format``,
    ``role``, ``block_size``, ``num_blocks``, ``page_cols``, ``tail``, ``page_size``
    (``None`` for flat keys), ``next_n``, ``description``. ``tensors``: numpy arrays by
    the schema's names (codes, packed fp4 and the page pool ``kv_cache`` uint8, scale
    bytes uint8, key scales and weights float32, indices and ``page_table`` int32).
    """

    path: str
    meta: dict
    tensors: dict
    _native: Any = dataclasses.field(repr=False)

    def inputs(self) -> dict:
        """The layer as the keyword arguments of :func:`reference` (and of
        :func:`check`, :func:`plan`, :func:`save_dump`)."""
        t, m = self.tensors, self.meta
        if "kv_cache" in t:
            keys = {
                "kv_cache": t["kv_cache"],
                "page_table": t["page_table"],
                "page_size": m["page_size"],
            }
        else:
            keys = {"k": t["k"], "k_scale": t["k_scale"]}
        return {
            "q": t["q"],
            "q_scale": t.get("q_scale"),
            **keys,
            "weights": t["weights"],
            "seq_lens": t["seq_lens"],
            "query_starts": t.get("query_starts"),
            "row_requests": t.get("row_requests"),
            "row_positions": t.get("row_positions"),
            "topk": m["topk"],
            "ratio": m["ratio"],
            "role": m["role"],
            "tail": m["tail"],
            "block_size": m["block_size"],
            "num_blocks": m["num_blocks"],
            "candidates": t.get("candidates"),
            "page_cols": m["page_cols"],
            "k_slots": t.get("k_slots"),
        }

    def expected(self) -> dict:
        """The outputs the dump carries, by the schema's names (``expected_raw``, ...,
        ``engine_logits``)."""
        return {
            n: a for n, a in self.tensors.items() if n.startswith("expected_") or n == "engine_logits"
        }


def load_dump(path) -> Dump:
    """Read a dump (SPEC 9, the schema of ``docs/cli.md``) with the crate's reader."""
    d = _native.load_dump(os.fspath(path))
    return Dump(
        path=d.path,
        meta=dict(d.meta()),
        tensors={n: np.from_dlpack(a) for n, a in d.tensors()},
        _native=d,
    )


def save_dump(
    path,
    *,
    expected: Optional[Output] = None,
    expected_raw=None,
    expected_page=None,
    expected_published=None,
    expected_published_rows=None,
    expected_ks=None,
    expected_ke=None,
    expected_logits=None,
    engine_logits=None,
    description="",
    **inputs,
) -> None:
    """Write one layer-forward as a dump that ``dsa-indexer replay FILE`` reads.

    ``inputs``: the layer, as the keyword arguments of :func:`reference`. The outputs
    to judge go under the schema's names: ``expected_raw`` [T, K] (request-local, any
    order), ``expected_page``, ``expected_published`` with ``expected_published_rows``,
    ``expected_ks``, ``expected_ke``, ``expected_logits`` [sum n] and ``engine_logits``
    [T, L]. ``expected=`` an :class:`Output` fills those not given from it (the
    reference's outputs, for a file that replays as identical).
    """
    given = {
        "raw": expected_raw,
        "page": expected_page,
        "published": expected_published,
        "published_rows": expected_published_rows,
        "ks": expected_ks,
        "ke": expected_ke,
        "logits": expected_logits,
    }
    if expected is not None:
        for name in given:
            if given[name] is None:
                given[name] = getattr(expected, name)
    outs = {name: _tensor(a) for name, a in given.items()}
    outs["engine_logits"] = _tensor(engine_logits)
    _native.save_dump(os.fspath(path), _inputs(inputs), outs, description)


def replay(
    path_or_dump,
    device="cpu",
    *,
    rows=None,
    request=None,
    budget=None,
    max_notes=5,
    full_ids=False,
    tolerance=None,
) -> Report:
    """Replay a dump (a path or a :class:`Dump`) on ``device`` (``"cpu"``, or ``"cuda"``
    in a build with the CUDA backend) and judge the outputs it carries, as
    ``dsa-indexer replay`` does. ``rows=(a, b)`` and ``request=r`` replay part of it
    (the CLI's ``--rows a..b``, ``--request r``); ``budget`` defaults to the CLI's;
    ``tolerance`` is :func:`check`'s (the CLI's ``--tolerance``)."""
    src = path_or_dump._native if isinstance(path_or_dump, Dump) else os.fspath(path_or_dump)
    rows = None if rows is None else (int(rows[0]), int(rows[1]))
    return _report(
        _native.replay(src, device, rows, request, budget, max_notes, full_ids, tolerance)
    )


# ==== the CUDA entries ====

try:
    import torch as _torch
except ImportError:
    _torch = None

if _torch is not None:
    from ._ops import _kernel_pointers, _set_pointer_hook, decode, decode_workspace_bytes, index
else:

    def _needs_torch(name):
        def f(*args, **kwargs):
            raise RuntimeError(f"dsa_indexer.{name} takes CUDA torch tensors: torch is not installed")

        f.__name__ = name
        return f

    decode = _needs_torch("decode")
    decode_workspace_bytes = _needs_torch("decode_workspace_bytes")
    index = _needs_torch("index")

    def _set_pointer_hook(on: bool) -> None:
        pass

    def _kernel_pointers() -> dict:
        return {}
