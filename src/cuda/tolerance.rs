//! The tolerance class's stated bounds on this backend (SPEC 4): the relative part
//! [`TOLERANCE_LOG2`], the absolute term of f32 rounding in the subnormal range, both
//! together per logit ([`logit_bound`]), and the fast precision mode's bound on the fp8
//! accumulator ([`fast_logit_bound`]).

use super::kernels::{self, Hooks, Precision, Variant};
use crate::problem::{Class, KeyRef, Problem, Queries};
use ndarray::ArrayView1;

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

/// Bits the fp8 `wgmma` accumulator keeps when it aligns a k32 step's products: the
/// unit of a step is `2^(F + 1 - FP8_WGMMA_BITS)` ([`fast_logit_bound`]).
pub const FP8_WGMMA_BITS: i32 = 13;

/// The k32 step of fp8 `wgmma` that dimension `d` of a `dim`-dimensional vector lies in,
/// in `mqa_logits_w8`'s operand layout:
/// - `dim = 128`: the keys reach shared memory by TMA in their natural order and step
///   `s` reads bytes `32 s .. 32 s + 31` of each row, so it holds dims `32 s + e`
///   (`e < 32`; [`crate::cuda::kernels::w8_tma`], SPEC 4);
/// - `dim = 32, 64` (and `dim = 128` under the `W8_TMA=0` define): the keys in registers,
///   each of a quad's four threads holding `dim / 4` contiguous bytes of a key (and of a
///   query column), its words `2 s` and `2 s + 1` going to step `s`, so step `s` holds
///   dims `(dim / 4) t + 8 s + e` (`t < 4`, `e < 8`).
pub fn fp8_wgmma_step(d: usize, dim: usize) -> usize {
    if dim == 128 && crate::cuda::kernels::w8_tma() {
        return d / 32;
    }
    (d % (dim / 4)) / 8
}

/// The exponent fp8 `wgmma` aligns an E4M3 operand by: `floor(log2 |v|)` of a normal
/// value, and `-6` for a subnormal code or a zero (exponent field 0 counts as 1).
pub fn e4m3_align_exp(code: u8) -> i32 {
    (((code >> 3) & 0xF) as i32).max(1) - 7
}

/// The bound on `|a_h - s|` for one head score on fp8 `wgmma` with chained k32 steps
/// (`mqa_logits_w8`), `s` the exact dot product of E4M3 vectors `q` and `k` (codes,
/// `D` each, no scales), in the accumulator model the H200 showed (docs/numerics.md,
/// section 4; GPU test `fp8_wgmma_accumulator_cases_meet_the_stated_bound`):
///
/// - step `s` (dims [`fp8_wgmma_step`]) adds its 32 products in exact pairs, each pair cut
///   toward zero to the step's unit;
/// - the unit is `2^(F_s + 1 - 13)`, `F_s` the largest sum of the two operands'
///   alignment exponents ([`e4m3_align_exp`]) among the step's products; from the
///   second step on, the running sum joins the alignment and is cut too, so the unit is
///   at most `max(2^(F_s - 12), 2^-12 |r|)`, `r` the running sum.
///
/// So `e_0 = 16 u_0`, `e_s = e_(s-1) + 17 u_s` with
/// `u_s = max(2^(F_s - 12), 2^-12 (|S_(s-1)| + e_(s-1)))`, `S_(s-1)` the exact sum of
/// the products of steps before `s` (`|r| <= |S_(s-1)| + e_(s-1)`), and the bound is
/// `e_(S-1)`. In f64: every product and partial sum of E4M3 products is exact there.
pub fn fp8_chain_error(q: ArrayView1<'_, u8>, k: ArrayView1<'_, u8>) -> f64 {
    let dim = q.len();
    debug_assert_eq!(dim, k.len());
    let steps = (dim / 32).clamp(1, 4); // D is 32, 64 or 128 (SPEC 4)
    let (mut f, mut dot) = ([i32::MIN; 4], [0f64; 4]);
    for d in 0..dim {
        let s = fp8_wgmma_step(d, dim);
        f[s] = f[s].max(e4m3_align_exp(q[d]) + e4m3_align_exp(k[d]));
        dot[s] +=
            crate::formats::e4m3::decode(q[d]) as f64 * crate::formats::e4m3::decode(k[d]) as f64;
    }
    let (mut err, mut prefix) = (0f64, 0f64);
    for s in 0..steps {
        let pairs = 2f64.powi(f[s] + 1 - FP8_WGMMA_BITS);
        err += if s == 0 {
            16.0 * pairs
        } else {
            17.0 * pairs.max(2f64.powi(1 - FP8_WGMMA_BITS) * (prefix.abs() + err))
        };
        prefix += dot[s];
    }
    err
}

/// The fast precision mode's stated bound for logit `[i, j]` of an E4M3 x E4M3
/// problem `p` ([`crate::cuda::Precision::Fast`], `mqa_logits_w8`) whose SPEC 4 magnitude
/// is `magnitude` (SPEC 4, "Fast mode"):
///
/// `kscale_j * sum_h |w_h| * fp8_chain_error(q[i, h], k[j]) + 2^TOLERANCE_LOG2 * M + A`
///
/// The first term is what the accumulator loses ([`fp8_chain_error`]; `relu` does not
/// enlarge it, the weight and key scale multiply it); the rest is the full mode's bound
/// ([`tolerance_bound`]), which covers the f32 steps after the head scores, the same
/// steps in the same order as `mqa_logits_w16`'s.
pub fn fast_logit_bound(p: &Problem, i: usize, j: usize, magnitude: f64) -> f64 {
    let key = p.key(&p.batch.rows()[i], j);
    let (KeyRef::E4m3 { codes, scale }, Queries::E4m3(q)) = (key, p.inputs.q) else {
        unreachable!("the fast mode's kernel serves E4M3 x E4M3 only")
    };
    let w = p.inputs.weights.row(i);
    let lost: f64 = (0..p.heads)
        .map(|h| (w[h] as f64).abs() * fp8_chain_error(q.slice(ndarray::s![i, h, ..]), codes))
        .sum();
    let sum_abs_weights: f64 = w.iter().map(|&x| (x as f64).abs()).sum();
    scale as f64 * lost
        + tolerance_bound(
            magnitude,
            tolerance_abs_term(scale as f64, sum_abs_weights, p.dim / 32, p.heads),
        )
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
/// computes `M`: the tests do it independently of the crate), on a device under test
/// hooks `hooks` at precision `precision`: [`fast_logit_bound`] where `p`'s variant runs
/// on the fp8 accumulator ([`Precision::Fast`], E4M3 x E4M3 at `H = 64`, not under
/// [`Hooks::mma_sync_only`]), otherwise `2^TOLERANCE_LOG2 * M + A` ([`tolerance_bound`],
/// [`tolerance_abs_term`]).
pub fn logit_bound(
    p: &Problem,
    i: usize,
    j: usize,
    magnitude: f64,
    hooks: Hooks,
    precision: Precision,
) -> f64 {
    if on_fp8_accumulator(p, hooks, precision) {
        return fast_logit_bound(p, i, j, magnitude);
    }
    let kscale = p.key(&p.batch.rows()[i], j).kscale() as f64;
    let sum_abs_weights: f64 = p
        .inputs
        .weights
        .row(i)
        .iter()
        .map(|&w| (w as f64).abs())
        .sum();
    tolerance_bound(
        magnitude,
        tolerance_abs_term(kscale, sum_abs_weights, p.dim / 32, p.heads),
    )
}

/// Whether problem `p`'s logits add their products on fp8 `wgmma`'s accumulator on a
/// device under `hooks` at `precision` (`mqa_logits_w8`).
pub fn on_fp8_accumulator(p: &Problem, hooks: Hooks, precision: Precision) -> bool {
    let v = Variant::logits(
        p.heads,
        p.dim / 32,
        p.q_format(),
        p.k_format(),
        false,
        precision,
    );
    kernels::logits_on_fp8_accumulator(v, hooks)
}

/// Whether `p`'s class is held bitwise (exact) on this backend.
pub fn is_bitwise(p: &Problem) -> bool {
    p.class() == Class::Exact
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::e4m3;
    use rand::{Rng, SeedableRng};

    /// The accumulator model of [`fp8_chain_error`], step by step: each k32 step's
    /// products in exact pairs (neighbours in the step), the unit
    /// `2^(max(F + 1, floor(log2 |r|) + 1) - 13)` (the running sum `r` joining from the
    /// second step on), each pair and the running sum cut toward zero to it.
    fn emulate(q: &[u8], k: &[u8]) -> f64 {
        let dim = q.len();
        let steps = (dim / 32).max(1);
        let mut acc = 0f64;
        for s in 0..steps {
            let dims: Vec<usize> = (0..dim).filter(|&d| fp8_wgmma_step(d, dim) == s).collect();
            assert_eq!(dims.len(), 32);
            let f = dims
                .iter()
                .map(|&d| e4m3_align_exp(q[d]) + e4m3_align_exp(k[d]))
                .max()
                .unwrap();
            let mut top = f + 1;
            if s > 0 && acc != 0.0 {
                top = top.max(acc.abs().log2().floor() as i32 + 1);
            }
            let unit = 2f64.powi(top - FP8_WGMMA_BITS);
            let cut = |x: f64| (x / unit).trunc() * unit;
            let mut sum = cut(acc);
            for pair in dims.chunks(2) {
                let p: f64 = pair
                    .iter()
                    .map(|&d| e4m3::decode(q[d]) as f64 * e4m3::decode(k[d]) as f64)
                    .sum();
                sum += cut(p);
            }
            acc = sum;
        }
        acc
    }

    fn chain_error(q: &[u8], k: &[u8]) -> f64 {
        fp8_chain_error(ArrayView1::from(q), ArrayView1::from(k))
    }

    fn exact(q: &[u8], k: &[u8]) -> f64 {
        q.iter()
            .zip(k)
            .map(|(&a, &b)| e4m3::decode(a) as f64 * e4m3::decode(b) as f64)
            .sum()
    }

    #[test]
    fn the_model_reproduces_what_the_h200_returned() {
        // 448^2 + 31 x 14 in one step (D = 32): 200944 on the H200 (exact 201138).
        let (mut q, mut k) = (vec![0x56u8; 32], vec![0x38u8; 32]);
        assert_eq!(e4m3::decode(0x56) * e4m3::decode(0x38), 14.0);
        q[0] = 0x7E;
        k[0] = 0x7E;
        assert_eq!(exact(&q, &k), 201138.0);
        assert_eq!(emulate(&q, &k), 200944.0);
        assert!((exact(&q, &k) - emulate(&q, &k)).abs() <= chain_error(&q, &k));
    }

    /// The bound holds for the model on random codes (normal, subnormal and zero, both
    /// signs) and on the adversarial cases of the GPU test, at every dim; and it is not
    /// vacuous: on `448^2` first and `15.75` after, at D = 128, it is within 2x of what
    /// the model loses.
    #[test]
    fn the_chain_bound_holds_for_the_model() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let code = |rng: &mut rand_chacha::ChaCha8Rng| loop {
            let c: u8 = rng.gen();
            if c & 0x7F != 0x7F {
                return c;
            }
        };
        for dim in [32usize, 64, 128] {
            for trial in 0..4000 {
                // Every fourth trial draws from a narrow exponent band, as quantised
                // data has, so that the pairs sit near the unit.
                let (q, k): (Vec<u8>, Vec<u8>) = (0..dim)
                    .map(|_| {
                        if trial % 4 == 0 {
                            let narrow = |rng: &mut rand_chacha::ChaCha8Rng| {
                                (rng.gen::<u8>() & 0x80) | rng.gen_range(0x30..0x48)
                            };
                            (narrow(&mut rng), narrow(&mut rng))
                        } else {
                            (code(&mut rng), code(&mut rng))
                        }
                    })
                    .unzip();
                let (got, want) = (emulate(&q, &k), exact(&q, &k));
                let b = chain_error(&q, &k);
                assert!(
                    (got - want).abs() <= b,
                    "dim {dim}, trial {trial}: |{got} - {want}| > {b}"
                );
            }
        }
        let (mut q, mut k) = (vec![0x46u8; 128], vec![0x49u8; 128]);
        q[0] = 0x7E;
        k[0] = 0x7E;
        let lost = (exact(&q, &k) - emulate(&q, &k)).abs();
        let b = chain_error(&q, &k);
        assert!(lost <= b && b <= 2.0 * lost, "lost {lost}, bound {b}");
    }

    #[test]
    fn steps_and_alignment_exponents() {
        let step1 = |dim: usize| {
            (0..dim)
                .filter(|&d| fp8_wgmma_step(d, dim) == 1)
                .collect::<Vec<_>>()
        };
        // D = 128: the natural order (keys by TMA), or 32 t + 8 s + e (keys in registers,
        // W8_TMA=0).
        let registers = [8..16, 40..48, 72..80, 104..112].into_iter().flatten();
        if crate::cuda::kernels::w8_tma() {
            assert_eq!(step1(128), (32..64).collect::<Vec<usize>>());
        } else {
            assert_eq!(step1(128), registers.collect::<Vec<usize>>());
        }
        // D = 64: 16 t + 8 s + e.
        assert_eq!(
            step1(64),
            [8..16, 24..32, 40..48, 56..64]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
        );
        assert!((0..32).all(|d| fp8_wgmma_step(d, 32) == 0));
        // 448 = 1.75 * 2^8; 2^-6 the least normal; subnormals and zero count as 2^-6.
        assert_eq!(e4m3_align_exp(0x7E), 8);
        assert_eq!(e4m3_align_exp(0x08), -6);
        assert_eq!(e4m3_align_exp(0x01), -6);
        assert_eq!(e4m3_align_exp(0x00), -6);
        assert_eq!(e4m3_align_exp(0xFE), 8);
    }
}
