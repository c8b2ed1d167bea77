"""Every accepted dtype (SPEC 9) gives bitwise the outputs of the same layer given as
uint8 codes, uint8 scale bytes, float32 weights and int32 indices: numpy (with
ml_dtypes' types where installed) and, where torch is installed, torch CPU tensors."""

import numpy as np
import pytest

import dsa_indexer as di
from conftest import assert_bitwise, golden

# fp4 x fp4 with D = 128 (scale words are the scale bytes) and k_slots; fp4 with D = 64
# and explicit rows; fp8 x fp8; both mixed pairs; a consumer; a source with a tail.
FILES = [
    "v41_plain.safetensors",
    "explicit_rows.safetensors",
    "v32_plain.safetensors",
    "mixed_q4_k8.safetensors",
    "mixed_q8_k4.safetensors",
    "consumer.safetensors",
    "source_tail.safetensors",
]


def same_outputs(got: di.Output, want: di.Output, what: str) -> None:
    for name in ("raw", "page", "ks", "ke", "logits"):
        assert_bitwise(getattr(got, name), getattr(want, name), f"{what}: {name}")
    if want.published is None:
        assert got.published is None, what
    else:
        assert_bitwise(got.published, want.published, f"{what}: published")
        assert_bitwise(got.published_rows, want.published_rows, f"{what}: published_rows")


def words(scale: np.ndarray) -> np.ndarray:
    """UE8M0 bytes ``[.., G]`` as int32 words ``[..]``, byte ``g`` = group ``g``."""
    pad = np.zeros(scale.shape[:-1] + (4,), np.uint8)
    pad[..., : scale.shape[-1]] = scale
    return pad.view("<i4").reshape(scale.shape[:-1])


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Packed fp4 ``[.., D/2]`` as one code a byte ``[.., D]`` (element 2i low nibble)."""
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def fp4(args: dict, side: str) -> bool:
    return (side == "q" and args["q_scale"] is not None) or (
        side == "k" and args["k_scale"].dtype != np.float32
    )


def numpy_variants(args: dict):
    """(name, inputs) pairs: the same layer in other numpy dtypes and layouts."""
    for side, scale in (("q", "q_scale"), ("k", "k_scale")):
        if fp4(args, side):
            yield f"{side} int8", {**args, side: args[side].view(np.int8)}
            yield f"{scale} int32 words", {**args, scale: words(args[scale])}
            yield f"{scale} int32 words [.., 1]", {**args, scale: words(args[scale])[..., None]}
    if args["k_scale"].dtype == np.float32:
        yield "k_scale [L, 1]", {**args, "k_scale": args["k_scale"][:, None]}
    idx = ("seq_lens", "query_starts", "row_requests", "row_positions", "k_slots", "candidates")
    yield "int64 indices", {
        **args,
        **{n: args[n].astype(np.int64) for n in idx if args.get(n) is not None},
    }
    yield "index lists", {**args, **{n: args[n].tolist() for n in idx if args.get(n) is not None}}
    yield "weights Fortran order", {**args, "weights": np.asfortranarray(args["weights"])}
    yield "q strided", {**args, "q": np.repeat(args["q"], 2, axis=2)[:, :, 0::2]}


@pytest.mark.parametrize("name", FILES)
def test_numpy_dtypes_and_layouts_give_the_same_outputs(name):
    _, _, args = golden(name)
    want = di.reference(**args, logits=True)
    n = 0
    for what, variant in numpy_variants(args):
        same_outputs(di.reference(**variant, logits=True), want, f"{name}, {what}")
        n += 1
    assert n >= 5


def ml_dtypes_variants(args: dict, ml):
    for side, scale in (("q", "q_scale"), ("k", "k_scale")):
        if fp4(args, side):
            yield f"{side} ml_dtypes float4_e2m1fn", {
                **args,
                side: unpack_fp4(args[side]).view(ml.float4_e2m1fn),
            }
            yield f"{scale} ml_dtypes float8_e8m0fnu", {
                **args,
                scale: args[scale].view(ml.float8_e8m0fnu),
            }
        else:
            yield f"{side} ml_dtypes float8_e4m3fn", {**args, side: args[side].view(ml.float8_e4m3fn)}


@pytest.mark.parametrize("name", FILES)
def test_ml_dtypes_arrays_give_the_same_outputs(name):
    ml = pytest.importorskip("ml_dtypes")
    _, _, args = golden(name)
    want = di.reference(**args, logits=True)
    for what, variant in ml_dtypes_variants(args, ml):
        same_outputs(di.reference(**variant, logits=True), want, f"{name}, {what}")
    # bfloat16 weights: the layer whose float32 weights are the bfloat16 values.
    w16 = args["weights"].astype(ml.bfloat16)
    want16 = di.reference(**{**args, "weights": w16.astype(np.float32)}, logits=True)
    got16 = di.reference(**{**args, "weights": w16}, logits=True)
    same_outputs(got16, want16, f"{name}, weights ml_dtypes bfloat16")


def torch_variants(args: dict, torch):
    """(name, inputs): the same layer as torch CPU tensors of every dtype SPEC 9 lists."""
    t = torch.from_numpy
    base = {
        n: (t(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for n, v in args.items()
    }
    yield "uint8 / float32 / int32 tensors", base
    for side, scale in (("q", "q_scale"), ("k", "k_scale")):
        if fp4(args, side):
            yield f"{side} float4_e2m1fn_x2", {**base, side: base[side].view(torch.float4_e2m1fn_x2)}
            yield f"{scale} float8_e8m0fnu", {**base, scale: base[scale].view(torch.float8_e8m0fnu)}
            yield f"{scale} int32 words", {**base, scale: t(words(args[scale]))}
            yield f"{side} int8", {**base, side: base[side].view(torch.int8)}
        else:
            yield f"{side} float8_e4m3fn", {**base, side: base[side].view(torch.float8_e4m3fn)}
    idx = ("seq_lens", "query_starts", "row_requests", "row_positions", "k_slots", "candidates")
    yield "int64 index tensors", {
        **base,
        **{n: base[n].to(torch.int64) for n in idx if base.get(n) is not None},
    }
    yield "weights requiring grad", {**base, "weights": base["weights"].clone().requires_grad_()}
    yield "weights non-contiguous", {**base, "weights": base["weights"].t().contiguous().t()}


@pytest.mark.parametrize("name", FILES)
def test_torch_dtypes_give_the_same_outputs(name):
    torch = pytest.importorskip("torch")
    _, _, args = golden(name)
    want = di.reference(**args, logits=True)
    for what, variant in torch_variants(args, torch):
        same_outputs(di.reference(**variant, logits=True), want, f"{name}, torch {what}")
    w16 = torch.from_numpy(args["weights"]).to(torch.bfloat16)
    want16 = di.reference(**{**args, "weights": w16.float().numpy()}, logits=True)
    got16 = di.reference(**{**args, "weights": w16}, logits=True)
    same_outputs(got16, want16, f"{name}, torch weights bfloat16")


IN_PLACE = {
    "v41_plain.safetensors": ("q", "q_scale", "k", "k_scale", "weights", "k_slots"),
    "v32_plain.safetensors": ("q", "k", "k_scale", "weights"),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_inputs_are_read_in_place(name):
    """The library reads the caller's buffers of codes, scale bytes, float32 weights
    and key scales and int32 slots: the addresses it views are the arrays' own."""
    _, _, args = golden(name)
    args = {n: (np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v) for n, v in args.items()}
    ptrs = di._input_pointers(**args)
    assert set(ptrs) == set(IN_PLACE[name]), ptrs
    for n in IN_PLACE[name]:
        assert ptrs[n] == args[n].ctypes.data, n


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_torch_inputs_are_read_in_place(name):
    torch = pytest.importorskip("torch")
    _, _, args = golden(name)
    t = {n: (torch.from_numpy(np.ascontiguousarray(v)) if isinstance(v, np.ndarray) else v) for n, v in args.items()}
    if args["q_scale"] is None:
        t["q"] = t["q"].view(torch.float8_e4m3fn)
        t["k"] = t["k"].view(torch.float8_e4m3fn)
    else:
        t["q"] = t["q"].view(torch.float4_e2m1fn_x2)
        t["k_scale"] = t["k_scale"].view(torch.float8_e8m0fnu)
    ptrs = di._input_pointers(**t)
    for n in IN_PLACE[name]:
        assert ptrs[n] == t[n].data_ptr(), n
