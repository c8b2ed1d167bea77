//! The tolerance class's stated bounds on this backend (SPEC 4): the relative part
//! [`TOLERANCE_LOG2`] (or [`FP8_WGMMA_TOLERANCE_LOG2`] on the fp8 accumulator), the
//! absolute term of f32 rounding in the subnormal range, and both together per logit
//! ([`logit_bound`]).

use super::kernels::{self, Hooks, Variant};
use crate::problem::{Class, Problem};

/// The relative part of the tolerance class's stated bound on this backend. In full,
/// for logit `[i, j]` ([`tolerance_bound`]):
///
/// `|x - ref| <= 2^TOLERANCE_LOG2 * M + A`, `A = (kscale_j * (G * sum_h |w_h| + H) + 2) * 2^-149`
///
/// with SPEC 4's `M`, `G = D / 32`, `kscale_j = 1` for E2M1 keys; 2^8 times tighter than
/// SPEC 4's `2^-8 * M` wherever `M` is not tiny, and what the tests and the
/// `cuda_vs_reference` fuzz target hold it to. `A` ([`tolerance_abs_term`]) covers f32
/// rounding in the subnormal range, where no relative bound can hold (fuzz/FINDINGS.md
/// F3: a logit of `5.77e-42` one subnormal ulp off, against `2^-16 * M = 3.9e-46`).
///
/// Derivation of the relative part: the tolerance-class kernels form the group sums on
/// f16 tensor cores with f32 accumulation, from operands exact in f16: `mma.sync` e4m3
/// (on sm_90 the SASS is `F2FP` unpacks of the E4M3 operands and two
/// `HMMA.16816.F32`), and `mqa_logits_w16`'s f16 `wgmma` (E4M3 x E4M3, H = 64; the E4M3
/// bytes converted by `cvt`): exact products, f32 sums (seen exact in a probe; assumed
/// here only to round each step to f32; the GPU test
/// `tolerance_fixed_case_448_squared_plus_31_times_14` holds every kernel to the bound
/// with products an accumulator keeping fewer than 24 bits would drop): at most
/// `D / 16 <= 8` roundings of partial sums bounded by the group magnitudes (one per k16
/// step on `wgmma`; `G <= 4` group steps on `mma.sync`). After that the GPU and the
/// reference do the f32 steps of the weight, the head sum and the key scale, each
/// contributing <= 2^-24 relative to `M`: the reference's pairwise head sum of <= 6
/// levels; the kernels' own head sum of SPEC 4's order (<= 6 levels), or for H = 64 on
/// `wgmma` (`tol_lane_heads`, in blocks whose weights are all below 2^96 in magnitude, so
/// that no step overflows: docs/numerics.md) an fma chain over a lane's 16 heads (<= 16
/// roundings) and two shuffle levels; and the reference rounds its exact group sum
/// once: in all at most (8 + 1 + 16 + 2 + 1 + 6 + 2) * 2^-24 * M < 2^-18.8 M.
/// The stated 2^-16 keeps a 7x margin while still catching an accumulator that keeps
/// only ~13 bits (as Hopper's fp8 `wgmma` does), whose errors are near 2^-13 M.
pub const TOLERANCE_LOG2: i32 = -16;

/// The relative part of the bound the tests hold `mqa_logits_w8` to (E4M3 x E4M3,
/// `H = 64` on fp8 `wgmma`; `W8=1` in `$DSA_CUDA_DEFINES` with the `tuning` feature, not
/// the default):
/// SPEC 4's `2^-8 * M`, which it does **not** meet for every input.
///
/// What the H200 showed (GPU test `fp8_wgmma_accumulator_cases_meet_the_stated_bound`;
/// docs/numerics.md, section 4): one k32 `wgmma` step adds its 32 products in exact pairs, each
/// pair cut toward zero to the unit `2^(F + 1 - 13)`, where `F` is the largest sum of the
/// two operands' exponent fields among the step's products (a subnormal E4M3 counts as
/// `2^-6`), and a chained accumulator joins that alignment (`448^2 + 31 x 14` came back
/// `200944`; `256 + 31 x 0.0293` came back `256`). Hence:
///
/// - steps chained in the accumulator (`W8_SPLIT=0`) lose later steps' pairs to the
///   running sum's unit: `2^-6.85 M` measured at D = 128, past SPEC 4's bound;
/// - every step from a zero accumulator, the steps added in f32 (`W8_SPLIT=1`, the
///   kernel's default form): when the product of largest exponent fields is of two
///   normal values, a step loses less than 16 units `= 2^-8 * 2^F <= 2^-8` of the step's
///   `sum |q_d k_d|` (measured `2^-8.14`), inside the bound with a thin margin;
/// - but when that product has a subnormal operand its value can be 8 times (one side)
///   or 64 times (both) below `2^F`: `448 x 2^-9` with the other products just below
///   the unit lost them all, `2^-6 M` measured. No `2^-8 M` bound holds for such inputs,
///   and real fp8 keys and queries hold subnormal codes (quantised values below
///   `2^-6 * scale`), so f16 `wgmma` (`mqa_logits_w16`, [`TOLERANCE_LOG2`]) stays the
///   default.
pub const FP8_WGMMA_TOLERANCE_LOG2: i32 = -8;

/// The relative part of the bound for problem `p`'s logits on a device under test hooks
/// `hooks` ([`Hooks::default()`] in production): [`TOLERANCE_LOG2`], or
/// [`FP8_WGMMA_TOLERANCE_LOG2`] when `p`'s variant runs on the fp8 accumulator (only
/// under the `W8=1` knob of the `tuning` feature, and not under
/// [`Hooks::mma_sync_only`]).
pub fn tolerance_log2(p: &Problem, hooks: Hooks) -> i32 {
    let v = Variant::Logits {
        heads: p.heads,
        groups: p.dim / 32,
        q: p.q_format(),
        k: p.k_format(),
        paged: false,
    };
    if kernels::logits_on_fp8_accumulator(v, hooks) {
        FP8_WGMMA_TOLERANCE_LOG2
    } else {
        TOLERANCE_LOG2
    }
}

/// f32's least subnormal, `2^-149`: the unit of the bound's absolute term.
pub const F32_SUBNORMAL_ULP: f64 = f32::from_bits(1) as f64;

/// The tolerance class's stated bound for one logit of magnitude `magnitude` (SPEC 4's
/// `M`) and absolute term `abs_term` ([`tolerance_abs_term`]) on the kernels that add in
/// f32 (every variant but the fp8 accumulator's: [`logit_bound`] picks):
/// `2^TOLERANCE_LOG2 * magnitude + abs_term`. In f64, as the tests compare
/// `|x - ref|` (f64) with it.
pub fn tolerance_bound(magnitude: f64, abs_term: f64) -> f64 {
    2f64.powi(TOLERANCE_LOG2) * magnitude + abs_term
}

/// The absolute term of the tolerance bound,
/// `A = (kscale_j * (G * sum_h |w_h| + H) + 2) * 2^-149`, for key scale `kscale`
/// (1 for E2M1 keys), `sum_abs_weights = sum_h |w[i, h]|`, `groups = G = D / 32` and
/// `heads = H`.
///
/// Why absolute: one f32 rounding of a real `y` errs by at most `2^-24 |y|` when
/// `|y| >= 2^-126`, but below that by up to half the least subnormal, `2^-150`, however
/// small `y` is (and never by more than `|y|`: 0 is representable). The relative part
/// `2^TOLERANCE_LOG2 * M` covers the first kind; `A` the second. `|x - ref|` collects
/// both sides' errors. The f32 products of SPEC 4's steps 2-4 that can round in the
/// subnormal range (each by `<= 2^-150` where it is made), and what multiplies them
/// afterwards:
///
/// - `a_h`: the device's `<= G` scale products `s_g * c_g` (one per group, in the f32
///   form) and the reference's one rounding of its exact sum: `G + 1` per head, each
///   then multiplied by `|w_h| * kscale_j`;
/// - `term_h = w_h * relu(a_h)`: one per head on each side, then times `kscale_j`;
/// - `logit * kscale_j` (E4M3 keys): one on each side.
///
/// Sum over heads: `(G + 1) * kscale_j * sum_h |w_h| + 2 H kscale_j + 2` half-ulps, that
/// is `(kscale_j * ((G + 1) / 2 * sum_h |w_h| + H) + 1) * 2^-149 <= A` (`G >= 1`).
/// Steps with no absolute term: the group sums (E4M3 and E2M1 products are multiples of
/// `2^-18`, never subnormal, so MMA accumulation rounds relatively) and every sum of
/// the head tree (two f32 whose exact sum is below `2^-125` are multiples of `2^-149`
/// with a sum of at most 24 significant bits: exact; above, the rounding is relative).
/// `relu` does not enlarge a difference. The device row allows the f32 form
/// `f32(s_g) * c_g` per group; the current kernel forms `a_h` as the reference does (f64
/// products, one rounding), i.e. one step, not `G`. Second order: each later f32 step
/// scales an earlier error by at most `1 + 2^-24`, at most 20 steps (term product, the
/// head sum's <= 16 fma and 2 shuffle levels, key scale): `(1 + 2^-24)^20 - 1 < 2^-19.6`.
/// Each absolute error is at most the value rounded, itself at most its share of `M`
/// (about `G + 5 <= 9` shares in all), so the excess is below `9 * 2^-19.6 M < 2^-16.4 M`:
/// inside the margin of the relative part (`2^-16 M` stated against `< 2^-18.8 M`
/// derived leaves more than `2^-16.3 M`). Flush-to-zero (an
/// error up to `2^-126` per step) stays far outside `A` unless
/// `kscale_j * (G * sum_h |w_h| + H)` nears `2^23`.
pub fn tolerance_abs_term(kscale: f64, sum_abs_weights: f64, groups: usize, heads: usize) -> f64 {
    (kscale * (groups as f64 * sum_abs_weights + heads as f64) + 2.0) * F32_SUBNORMAL_ULP
}

/// The stated bound of logit `[i, j]` (row `i`, request-local visible key `j`) of a
/// tolerance-class problem `p` whose SPEC 4 magnitude `M` is `magnitude` (the caller
/// computes `M`: the tests do it independently of the crate):
/// `2^tolerance_log2(p, hooks) * M + A` ([`tolerance_log2`], [`tolerance_abs_term`]) on a
/// device under test hooks `hooks`.
pub fn logit_bound(p: &Problem, i: usize, j: usize, magnitude: f64, hooks: Hooks) -> f64 {
    let kscale = p.key(&p.batch.rows()[i], j).kscale() as f64;
    let sum_abs_weights: f64 = p
        .inputs
        .weights
        .row(i)
        .iter()
        .map(|&w| (w as f64).abs())
        .sum();
    2f64.powi(tolerance_log2(p, hooks)) * magnitude
        + tolerance_abs_term(kscale, sum_abs_weights, p.dim / 32, p.heads)
}

/// Whether `p`'s class is held bitwise (exact) on this backend.
pub fn is_bitwise(p: &Problem) -> bool {
    p.class() == Class::Exact
}
