"""The CUDA entries on torch tensors: :func:`decode` and :func:`index`, each a torch
custom op (``dsa_indexer::decode``, ``dsa_indexer::index``) with a fake implementation,
so that ``torch.compile`` traces them and ``torch.cuda.graph`` captures the decode step.

The ops mutate the output (and workspace) tensors they are given and return nothing;
the wrappers allocate those through torch (``torch.empty``, the caching allocator) when
the caller passes none. The kernels run on ``torch.cuda.current_stream()`` of the
queries' device and read every input in place (DLPack, no synchronisation asked of
torch).
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from . import Output, _native

_NO_CUDA = (
    "this build of dsa_indexer has no CUDA support (build it with "
    'MATURIN_PEP517_ARGS="--features cuda" pip install ./python, or bash python/build_wheel.sh '
    "OUT_DIR --features cuda)"
)


def _cuda_device(q) -> torch.device:
    """The CUDA device of ``q`` (every tensor of a call lives there): ``RuntimeError``
    without a CUDA build or a GPU, ``ValueError`` for a ``q`` elsewhere."""
    if not _native.CUDA:
        raise RuntimeError(_NO_CUDA)
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: torch.cuda.is_available() is False")
    if not isinstance(q, torch.Tensor) or q.device.type != "cuda":
        where = q.device if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q: a tensor on {where}, expected a CUDA tensor")
    return q.device


# Precision::parse's names. Only another value crosses into the native module, for the
# crate's error (naming ``precision`` and the value): a valid name stays a constant that
# torch.compile traces through.
_PRECISIONS = ("full", "fast")


def _precision(precision) -> str:
    """``precision`` checked (``"full"`` or ``"fast"``), before any device work:
    ``ValueError`` naming it and the value, ``RuntimeError`` without a CUDA build."""
    if isinstance(precision, str) and precision in _PRECISIONS:
        return precision
    if not _native.CUDA:
        raise RuntimeError(_NO_CUDA)
    return _native.precision_name(precision)


def _dl(x: Optional[torch.Tensor]):
    """``x`` as the native module imports it: detached (same memory), and viewed as its
    bytes when this torch cannot export its dtype through DLPack."""
    if x is None:
        return None
    x = x.detach()
    if x.element_size() == 1 and x.dtype not in (torch.uint8, torch.int8):
        try:
            x.__dlpack__()
        except Exception:
            x = x.view(torch.uint8)
    return x


def _host(x: Optional[List[int]]):
    return None if x is None else np.asarray(x, dtype=np.int64)


# ==== the decode step ====


@torch.library.custom_op("dsa_indexer::decode", mutates_args=("raw", "page", "workspace"))
def _decode_op(
    q: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    weights: torch.Tensor,
    kv_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    raw: torch.Tensor,
    page: torch.Tensor,
    workspace: torch.Tensor,
    next_n: int,
    topk: int,
    max_context: int,
    page_size: int,
    page_cols: int,
    ratio: int,
    check: bool,
    precision: str,
) -> None:
    dev = _cuda_device(q)
    args = {
        "q": _dl(q),
        "q_scale": _dl(q_scale),
        "weights": _dl(weights),
        "kv_cache": _dl(kv_cache),
        "page_table": _dl(page_table),
        "context_lens": _dl(context_lens),
        "raw": _dl(raw),
        "page": _dl(page),
        "workspace": _dl(workspace),
        "next_n": next_n,
        "topk": topk,
        "max_context": max_context,
        "page_size": page_size,
        "page_cols": page_cols,
        "ratio": ratio,
    }
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        _native.decode(args, dev.index, stream, check, precision)


@_decode_op.register_fake
def _decode_fake(
    q, q_scale, weights, kv_cache, page_table, context_lens, raw, page, workspace,
    next_n, topk, max_context, page_size, page_cols, ratio, check, precision,
) -> None:
    return None


@torch.compiler.assume_constant_result
def _decode_workspace(
    q_shape: tuple,
    q_packed: bool,
    kv_shape: tuple,
    table_shape: tuple,
    next_n: int,
    topk: int,
    max_context: int,
    page_size: int,
    page_cols,
    ratio: int,
    sms,
    ordinal: int,
) -> int:
    if not _native.CUDA:
        raise RuntimeError(_NO_CUDA)
    return _native.decode_workspace_bytes(
        list(q_shape), q_packed, list(kv_shape), list(table_shape), next_n, topk,
        max_context, page_size, page_cols, ratio, sms, ordinal,
    )


def decode_workspace_bytes(
    *,
    q,
    kv_cache,
    page_table,
    next_n,
    topk,
    max_context,
    page_size,
    q_scale=None,
    page_cols=None,
    ratio=1,
    sms=None,
    weights=None,
    context_lens=None,
    out=None,
    workspace=None,
    check=None,
    precision="full",
) -> int:
    """Bytes of workspace :func:`decode` takes for its arguments (the same keywords;
    only the shapes of ``q``, ``kv_cache`` and ``page_table`` are read): the rows'
    metadata, the logits of every row at ``max_context``, the split top-k's scratch.
    ``sms``: the GPU's multiprocessors (default: those of the device of ``q``, which
    needs a GPU; give it to size a workspace anywhere). ``precision`` is checked but
    changes nothing: both precisions write the same float32 logits."""
    _precision(precision)
    if sms is None:
        ordinal = _cuda_device(q).index
    else:
        ordinal = 0
        if not _native.CUDA:
            raise RuntimeError(_NO_CUDA)
    return _decode_workspace(
        tuple(q.shape), q_scale is not None, tuple(kv_cache.shape), tuple(page_table.shape),
        next_n, topk, max_context, page_size, page_cols, ratio, sms, ordinal,
    )


def decode(
    *,
    q,
    weights,
    kv_cache,
    page_table,
    context_lens,
    next_n,
    topk,
    max_context,
    page_size,
    q_scale=None,
    page_cols=None,
    ratio=1,
    out=None,
    workspace=None,
    check=False,
    precision="full",
):
    """One decode step (SPEC 10) on CUDA tensors, on ``torch.cuda.current_stream()``:
    the ``next_n`` newest positions of each request against its keys in the paged KV
    cache, top ``topk`` keys per row. Returns ``(raw, page)``, int32 ``[B * next_n,
    topk]`` request-local key positions (ascending, then -1) and ``[B * next_n,
    page_cols]`` their pool slots.

    - ``q``: E4M3 ``[B * next_n, H, D]`` (``torch.float8_e4m3fn`` or uint8), or packed
      fp4 ``[B * next_n, H, D/2]`` (uint8, int8, ``torch.float4_e2m1fn_x2``) with
      ``q_scale`` UE8M0 ``[B * next_n, H, D/32]`` (uint8, ``torch.float8_e8m0fnu``) or
      int32 words ``[B * next_n, H]`` (D = 128). Rows request after request, oldest
      position first.
    - ``weights``: float32 ``[B * next_n, H]``.
    - ``kv_cache``: uint8 ``[num_pages, page_size * bytes_per_token]`` (or DeepGEMM's
      ``[num_pages, page_size, 1, bytes_per_token]``), 16-byte aligned; the width tells
      E4M3 keys (``D + 4`` bytes a token) from fp4 keys (``D/2 + D/32``).
    - ``page_table``: int32 ``[B, max_pages]``; ``context_lens``: int32 ``[B]`` on the
      device (``S_b``: request ``b``'s rows are positions ``S_b - next_n .. S_b - 1``).
    - ``max_context``: the longest ``S_b`` any call may see (longer contexts are cut to
      it); it sizes the workspace and the launches, not ``context_lens``.
    - ``out=(raw, page)``: write there instead of new tensors. ``workspace``: a uint8
      CUDA tensor of at least :func:`decode_workspace_bytes` bytes (default: one from
      torch's caching allocator).
    - ``check=True`` first checks the values (SPEC 8: ``context_lens`` in ``next_n ..=
      max_context``, codes, page ids, weights), which reads ``context_lens`` back (a
      host wait; not inside a CUDA graph capture).
    - ``precision``: ``"full"`` (the default) or ``"fast"``, opt-in: E4M3 x E4M3 at
      ``H = 64`` on fp8 tensor cores (DeepGEMM's arithmetic), held to SPEC 4's fast-mode
      bound instead of the tolerance class's; every other case runs as under ``"full"``
      (``Engine::with_precision``). Another value raises ``ValueError``.

    Every launch shape follows from these host scalars and the tensors' shapes, so the
    call is capturable by ``torch.cuda.graph``: replays read the ``context_lens`` and
    ``page_table`` values then in the captured buffers. Nothing is allocated outside
    torch and nothing is synchronised. Bad shapes, dtypes or devices raise
    ``ValueError`` naming the argument; no GPU or an NVRTC failure ``RuntimeError``.
    """
    precision = _precision(precision)
    _cuda_device(q)
    rows = q.shape[0]
    cols = page_cols if page_cols is not None else -(-topk // 64) * 64
    if out is None:
        raw = torch.empty((rows, topk), dtype=torch.int32, device=q.device)
        page = torch.empty((rows, cols), dtype=torch.int32, device=q.device)
    else:
        raw, page = out
    if workspace is None:
        n = decode_workspace_bytes(
            q=q, q_scale=q_scale, kv_cache=kv_cache, page_table=page_table, next_n=next_n,
            topk=topk, max_context=max_context, page_size=page_size, page_cols=cols,
            ratio=ratio,
        )
        workspace = torch.empty(n, dtype=torch.uint8, device=q.device)
    torch.ops.dsa_indexer.decode(
        q, q_scale, weights, kv_cache, page_table, context_lens, raw, page, workspace,
        next_n, topk, max_context, page_size, cols, ratio, check, precision,
    )
    return raw, page


# ==== the engine entry ====


@torch.library.custom_op("dsa_indexer::index", mutates_args=("raw", "page", "published"))
def _index_op(
    q: torch.Tensor,
    q_scale: Optional[torch.Tensor],
    k: Optional[torch.Tensor],
    k_scale: Optional[torch.Tensor],
    weights: torch.Tensor,
    kv_cache: Optional[torch.Tensor],
    page_table: Optional[torch.Tensor],
    k_slots: Optional[torch.Tensor],
    candidates: Optional[torch.Tensor],
    raw: torch.Tensor,
    page: torch.Tensor,
    published: torch.Tensor,
    seq_lens: List[int],
    query_starts: Optional[List[int]],
    row_requests: Optional[List[int]],
    row_positions: Optional[List[int]],
    topk: int,
    ratio: int,
    role: str,
    tail: Optional[int],
    block_size: int,
    num_blocks: int,
    page_cols: Optional[int],
    page_size: Optional[int],
    budget: int,
    precision: str,
) -> None:
    dev = _cuda_device(q)
    args = {
        "q": _dl(q),
        "q_scale": _dl(q_scale),
        "k": _dl(k),
        "k_scale": _dl(k_scale),
        "weights": _dl(weights),
        "kv_cache": _dl(kv_cache),
        "page_table": _dl(page_table),
        "k_slots": _dl(k_slots),
        "candidates": _dl(candidates),
        "seq_lens": _host(seq_lens),
        "query_starts": _host(query_starts),
        "row_requests": _host(row_requests),
        "row_positions": _host(row_positions),
        "topk": topk,
        "ratio": ratio,
        "role": role,
        "tail": tail,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "page_cols": page_cols,
        "page_size": page_size,
    }
    pub = _dl(published) if role == "source" else None
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "dsa_indexer.index cannot be captured in a CUDA graph: its tiles are planned "
            "on the host from the batch and its value checks read a verdict back; "
            "dsa_indexer.decode is the capturable entry"
        )
    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev).cuda_stream
        # The workspace, sized by the engine, from torch's caching allocator on this
        # stream (stream-ordered: its memory returns to the cache for later work on the
        # same stream only).
        held = []

        def workspace(nbytes):
            ws = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, device=dev)
            held.append(ws)
            return _dl(ws)

        _native.index(
            args, _dl(raw), _dl(page), pub, workspace, budget, dev.index, stream, precision
        )


@_index_op.register_fake
def _index_fake(
    q, q_scale, k, k_scale, weights, kv_cache, page_table, k_slots, candidates, raw, page,
    published, seq_lens, query_starts, row_requests, row_positions, topk, ratio, role, tail,
    block_size, num_blocks, page_cols, page_size, budget, precision,
) -> None:
    return None


@torch.compiler.assume_constant_result
def _index_shapes(seq_lens, query_starts, row_requests, row_positions, ratio, role, tail, topk, page_cols):
    def lst(x):
        return None if x is None else list(x)

    t, cols, prows, ks, ke = _native.index_shapes(
        list(seq_lens), lst(query_starts), lst(row_requests), lst(row_positions), ratio, role,
        tail, topk, page_cols,
    )
    return t, cols, tuple(prows), tuple(ks), tuple(ke)


def _ints(name: str, x) -> Optional[tuple]:
    """An index argument as host integers: a list, a numpy array or a torch tensor (a
    CUDA tensor is read back, a host wait)."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return tuple(x.tolist())
    if isinstance(x, np.ndarray):
        return tuple(x.reshape(-1).tolist())
    return tuple(int(v) for v in x)


def index(
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
    budget=2 << 30,
    out=None,
    precision="full",
):
    """One layer-forward on CUDA tensors through the engine entry (``prepare_device``),
    on ``torch.cuda.current_stream()``: :func:`dsa_indexer.reference`'s arguments, the
    tensors on the GPU and read in place. Returns an :class:`dsa_indexer.Output` whose
    ``raw``, ``page`` and (source layers) ``published`` are CUDA int32 tensors, and
    ``published_rows``, ``ks``, ``ke`` CPU int32 tensors (they follow from the index
    arguments alone).

    On the device: ``q``, ``q_scale``, ``k``, ``k_scale`` (or ``kv_cache`` and
    ``page_table``), ``weights`` (float32), ``k_slots`` and a consumer's
    ``candidates`` (int32). On the host: ``seq_lens``, ``query_starts`` or
    ``row_requests`` and ``row_positions`` (lists, numpy arrays or tensors; a CUDA
    tensor is read back, and ``torch.compile`` needs lists). ``out=(raw, page)`` or
    ``(raw, page, published)``: write there (default: new tensors from torch).
    ``precision``: ``"full"`` (the default) or ``"fast"``, as in :func:`decode`.

    Memory: the outputs are torch tensors (or ``out=``), written in place, and the
    run's transient buffers (row metadata, the logits tile under ``budget``, block
    scores, top-k scratch) are regions of one uint8 workspace that the engine sizes and
    torch's caching allocator provides on the current stream: the call allocates no
    device memory outside torch's view.

    The engine entry checks the values on the device and reads its verdict back (one
    host wait for the stream), and plans its tiles on the host from the batch. So this
    call cannot be captured in a CUDA graph; under capture it raises ``RuntimeError``
    (the decode step is capturable: :func:`dsa_indexer.decode`).
    """
    precision = _precision(precision)
    _cuda_device(q)
    seq = _ints("seq_lens", seq_lens)
    qs = _ints("query_starts", query_starts)
    rr = _ints("row_requests", row_requests)
    rp = _ints("row_positions", row_positions)
    rows, cols, prows, ks, ke = _index_shapes(seq, qs, rr, rp, ratio, role, tail, topk, page_cols)
    dev = q.device
    source = role == "source"
    published = None
    if out is None:
        raw = torch.empty((rows, topk), dtype=torch.int32, device=dev)
        page = torch.empty((rows, cols), dtype=torch.int32, device=dev)
        if source:
            published = torch.empty((len(prows), num_blocks), dtype=torch.int32, device=dev)
    elif len(out) == 3:
        raw, page, published = out
    else:
        raw, page = out
    if source and published is None:
        published = torch.empty((len(prows), num_blocks), dtype=torch.int32, device=dev)
    pub = published if published is not None else torch.empty((0, num_blocks), dtype=torch.int32, device=dev)
    torch.ops.dsa_indexer.index(
        q, q_scale, k, k_scale, weights, kv_cache, page_table, k_slots, candidates, raw, page,
        pub, list(seq), None if qs is None else list(qs), None if rr is None else list(rr),
        None if rp is None else list(rp), topk, ratio, role, tail, block_size, num_blocks,
        page_cols, page_size, budget, precision,
    )
    return Output(
        raw=raw,
        page=page,
        published=published if source else None,
        published_rows=torch.tensor(list(prows), dtype=torch.int32) if source else None,
        ks=torch.tensor(list(ks), dtype=torch.int32),
        ke=torch.tensor(list(ke), dtype=torch.int32),
    )


def _set_pointer_hook(on: bool) -> None:
    if _native.CUDA:
        _native._pointer_hook(on)


def _kernel_pointers() -> dict:
    return dict(_native._kernel_pointers()) if _native.CUDA else {}
