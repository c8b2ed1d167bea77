//! A model of the exact class (E2M1 x E2M1) on int8 tensor cores: not the oracle, a
//! restatement of a kernel's arithmetic that is checked against it
//! (`tests/kernel_arithmetic.rs`). `docs/numerics.md` section 6 derives every constant.
//!
//! Each vector (a query row's head, or a key) shifts its doubled E2M1 values
//! (integers in [-12, 12]) left by its group's scale exponent minus the vector's
//! smallest, so that one `s8.s8.s32` accumulation over all `D` dims gives
//! `Y = sum_g 4 s_g 2^(shift_q,g + shift_k,g)` exactly, and one f32 multiply by
//! `C = 2^(eq_min + ek_min - 256)` gives SPEC 4's `a_h` bit for bit, where the guard
//! admits the pair. [`int8_path_admits`] is the guard a kernel evaluates once per block;
//! [`int8_pair_admits`] is the exact condition for one (head vector, key) pair.

use crate::error::{Error, Result};
use crate::formats::e2m1;

/// The largest span of a vector's group scale exponents that fits s8 for every code:
/// `12 * 2^3 = 96 <= 127 < 192 = 12 * 2^4`.
pub const S8_MAX_SPAN: u8 = 3;

/// `eq_min + ek_min` at least this: `C = 2^(eq_min + ek_min - 256) >= 2^-149` is an f32,
/// and every `t_g` and partial sum of SPEC 4 is a multiple of `2^-149` (no underflow).
pub const MIN_EXP_SUM: u32 = 107;

/// `eq_min + ek_min` at most this: `C <= 2^127` is an f32.
pub const MAX_C_EXP_SUM: u32 = 383;

/// Every query group byte at most this: SPEC 4's first product `s_g * 2^(eq_g - 127)`,
/// `|s_g| <= 1152`, stays below `2^128` (`1152 * 2^117 < 2^128 <= 1152 * 2^118`).
pub const MAX_Q_EXP: u8 = 244;

/// Every group's `eq_g + ek_g` at most this (`G >= 2`): `t_g`, at most
/// `4608 * 2^(eq_g + ek_g - 256)`, stays below `2^128`.
pub const MAX_GROUP_EXP_SUM: u32 = 371;

/// The largest `|4 s_g|`: 32 products of doubled E2M1 values, `32 * 12 * 12`.
pub const MAX_GROUP_DOT: i32 = 4608;

/// The block guard's bound on `eq_hi + ek_hi` for `G` groups: no f32 value of SPEC 4
/// step 2, `a_h` included, can reach `2^128` (`G * 4608 * 2^(x - 256) < 2^128`):
/// 371, 370, 369 for `G` = 1, 2, 4. `None` for any other `G`.
pub fn block_max_exp_sum(groups: usize) -> Option<u32> {
    match groups {
        1 => Some(371),
        2 => Some(370),
        4 => Some(369),
        _ => None,
    }
}

/// One vector's operand on the int8 path: doubled E2M1 values shifted by their group's
/// scale offset from the vector's smallest, and that smallest scale byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shifted {
    /// `2 * e2m1 * 2^(e_g - e_min)` per element, `D` values (each in [-96, 96]).
    pub codes: Vec<i8>,
    /// The vector's smallest group scale byte.
    pub e_min: u8,
}

impl Shifted {
    /// The `s8.s8.s32` accumulation of all `D` products, `Y = sum_g 4 s_g 2^(shift)`
    /// (`|Y| <= D * 96 * 96 < 2^21`, exact in i32 and in f32). `None` when the two
    /// vectors' lengths differ.
    pub fn dot(&self, other: &Shifted) -> Option<i32> {
        (self.codes.len() == other.codes.len()).then(|| {
            self.codes
                .iter()
                .zip(&other.codes)
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum()
        })
    }
}

/// One vector's shifted operand from its packed E2M1 codes (`D / 2` bytes, SPEC 2's
/// order) and its UE8M0 group bytes (`D / 32`). `Ok(None)` when the bytes span more
/// than [`S8_MAX_SPAN`] binades (the vector takes the fallback); an error when the
/// lengths disagree or a byte is 255.
pub fn shifted_codes(packed: &[u8], scales: &[u8]) -> Result<Option<Shifted>> {
    if scales.is_empty() || packed.len() != 16 * scales.len() {
        return Err(Error::range(
            "packed.len",
            packed.len(),
            "16 bytes per scale byte, at least one",
        ));
    }
    if let Some(i) = scales.iter().position(|&e| e == 255) {
        return Err(Error::reserved_scale("scales", i));
    }
    let (lo, hi) = (
        scales.iter().copied().min().unwrap_or(0),
        scales.iter().copied().max().unwrap_or(0),
    );
    if hi - lo > S8_MAX_SPAN {
        return Ok(None);
    }
    let codes = (0..32 * scales.len())
        .map(|d| {
            let v = e2m1::DOUBLED[(e2m1::unpack(packed, d) & 0xF) as usize];
            v << (scales[d / 32] - lo)
        })
        .collect();
    Ok(Some(Shifted { codes, e_min: lo }))
}

/// `2^e` as an f32, where it is one (`e` in [-149, 127]).
pub fn pow2_f32(e: i32) -> Option<f32> {
    match e {
        -126..=127 => Some(f32::from_bits(((e + 127) as u32) << 23)),
        -149..=-127 => Some(f32::from_bits(1u32 << (e + 149))),
        _ => None,
    }
}

/// The int8 path's head score: `f32(y) * C`, one f32 multiply by
/// `C = 2^(eq_min + ek_min - 256)`. `None` when `C` is not an f32 (the guard sends such
/// pairs to the fallback). Where [`int8_pair_admits`] holds, this is SPEC 4's `a_h`.
pub fn int8_head_score(y: i32, eq_min: u8, ek_min: u8) -> Option<f32> {
    let c = pow2_f32(eq_min as i32 + ek_min as i32 - 256)?;
    Some(y as f32 * c)
}

/// The exact condition for one (head vector, key) pair, from its group bytes (`G` = 1,
/// 2 or 4 each; anything else is not admitted): the int8 path's [`int8_head_score`]
/// equals SPEC 4's `a_h` for every code of both vectors if and only if this holds
/// (given that the path needs spans within s8 and `C` an f32; `docs/numerics.md` 6.3).
pub fn int8_pair_admits(eq: &[u8], ek: &[u8]) -> bool {
    let g = eq.len();
    if ![1, 2, 4].contains(&g) || ek.len() != g || eq.iter().chain(ek).any(|&e| e == 255) {
        return false;
    }
    let span = |v: &[u8]| v.iter().max().unwrap_or(&0) - v.iter().min().unwrap_or(&0);
    let lo = *eq.iter().min().unwrap_or(&0) as u32 + *ek.iter().min().unwrap_or(&0) as u32;
    if span(eq) > S8_MAX_SPAN
        || span(ek) > S8_MAX_SPAN
        || !(MIN_EXP_SUM..=MAX_C_EXP_SUM).contains(&lo)
    {
        return false;
    }
    if g == 1 {
        // t_0 is the last step: only the first product must not overflow, and it
        // matters only when the key's scale is below 1.
        return eq[0] <= MAX_Q_EXP || ek[0] >= 127;
    }
    let mut e = [0u32; 4];
    for (x, (&a, &b)) in e.iter_mut().zip(eq.iter().zip(ek)) {
        *x = a as u32 + b as u32;
    }
    let e = &e[..g];
    let groups_ok = eq.iter().all(|&x| x <= MAX_Q_EXP) && e.iter().all(|&x| x <= MAX_GROUP_EXP_SUM);
    // G = 4: the two half sums must not overflow either (both at 371 can).
    let halves_ok = g != 4
        || e.chunks(2)
            .all(|p| !(p[0] == MAX_GROUP_EXP_SUM && p[1] == MAX_GROUP_EXP_SUM));
    groups_ok && halves_ok
}

/// The scale bytes of one side of a block, summarised over its vectors (query side: the
/// (row, head) vectors of a row tile; key side: the keys of a key tile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScaleWindow {
    /// The smallest group byte of any vector.
    pub lo: u8,
    /// The largest group byte of any vector.
    pub hi: u8,
    /// The largest span (largest byte minus smallest) of one vector.
    pub span: u8,
}

impl ScaleWindow {
    /// The window of `scales`, consecutive vectors of `groups` bytes each. `None` when
    /// `scales` is empty or not a whole number of vectors.
    pub fn of(scales: &[u8], groups: usize) -> Option<ScaleWindow> {
        if groups == 0 || scales.is_empty() || !scales.len().is_multiple_of(groups) {
            return None;
        }
        let mut w = ScaleWindow {
            lo: u8::MAX,
            hi: 0,
            span: 0,
        };
        for v in scales.chunks(groups) {
            let (lo, hi) = (*v.iter().min()?, *v.iter().max()?);
            w.lo = w.lo.min(lo);
            w.hi = w.hi.max(hi);
            w.span = w.span.max(hi - lo);
        }
        Some(w)
    }
}

/// The guard a kernel evaluates once per block, from each side's [`ScaleWindow`]: every
/// vector spans at most [`S8_MAX_SPAN`], `q.lo + k.lo >= 107`, `q.hi <= 244` and
/// `q.hi + k.hi <= block_max_exp_sum(G)`. It implies [`int8_pair_admits`] for every pair
/// of the block, and moreover that no f32 value of SPEC 4 step 2 overflows. Any `G`
/// other than 1, 2, 4, or a byte 255, is not admitted.
pub fn int8_path_admits(q: ScaleWindow, k: ScaleWindow, groups: usize) -> bool {
    let Some(top) = block_max_exp_sum(groups) else {
        return false;
    };
    q.span <= S8_MAX_SPAN
        && k.span <= S8_MAX_SPAN
        && q.hi < 255
        && k.hi < 255
        && q.lo as u32 + k.lo as u32 >= MIN_EXP_SUM
        && q.hi <= MAX_Q_EXP
        && q.hi as u32 + k.hi as u32 <= top
}

/// The head epilogue's guard bounds (`docs/numerics.md` 6.7): with `v_h = w_h * cq_h`
/// and `f` an f32's biased exponent field, `f_lo >= 24` over the nonzero weights...
pub const EPI_MIN_V_EXP: u32 = 24;
/// ... `f_hi <= 227` over all ...
pub const EPI_MAX_V_EXP: u32 = 227;
/// ... and every key's `ek_min + f_lo >= 151` ...
pub const EPI_MIN_VK_EXP: u32 = 151;
/// ... and `ek_min + f_hi <= 354`.
pub const EPI_MAX_VK_EXP: u32 = 354;

/// `v_h = w_h * 2^(eq_min,h - 129)` of one head, one f32 multiply (the kernel's per-column
/// constant).
pub fn epilogue_weight(w: f32, eq_min: u8) -> f32 {
    // eq_min - 129 >= -129: always an f32.
    w * pow2_f32(eq_min as i32 - 129).expect("2^(e - 129) is an f32 for every byte")
}

/// The exponent window of the weights' `v_h`: `f_lo`, the smallest biased exponent
/// field over the heads whose `w_h != 0` (255 when there is none), and `f_hi`, the
/// largest over all heads (0 when there is none).
pub fn weight_window(w: &[f32], v: &[f32]) -> (u32, u32) {
    let f = |x: f32| (x.to_bits() >> 23) & 0xFF;
    let lo = w
        .iter()
        .zip(v)
        .filter(|(&w, _)| w != 0.0)
        .map(|(_, &v)| f(v))
        .min()
        .unwrap_or(255);
    let hi = v.iter().map(|&v| f(v)).max().unwrap_or(0);
    (lo, hi)
}

/// Whether the head epilogue's guard admits one (row, key): the weights' `v_h`
/// ([`epilogue_weight`]) and the key's smallest scale byte `ek_min`. The kernel checks
/// the same bounds over a block's rows and a tile's keys, which implies this for each
/// (row, key) of the tile.
pub fn epilogue_admits(w: &[f32], v: &[f32], ek_min: u8) -> bool {
    let (lo, hi) = weight_window(w, v);
    let k = ek_min as u32;
    lo >= EPI_MIN_V_EXP
        && hi <= EPI_MAX_V_EXP
        && k + lo >= EPI_MIN_VK_EXP
        && k + hi <= EPI_MAX_VK_EXP
}

/// The head epilogue's fma form (`docs/numerics.md` 6.7; the kernel's before the
/// subnormal-operand form, [`epilogue_logit_subnormal`], whose guard adds one bound to
/// this one's) for one (row, key), from the int32 head sums `y` (one per head, a
/// power-of-two count), the heads' `eq_min`, the weights `w` and the key's
/// `ek_min`: `T_h = fma(v_h, 2^23 + max(y_h, 0), -v_h 2^23)`, `L = P(T) * 2^(ek_min - 127)`,
/// and `-0` for a zero `L` when every weight has its sign bit set. Where
/// [`epilogue_admits`] holds and every head's pair is admitted ([`int8_pair_admits`]),
/// this is SPEC 4's logit.
pub fn epilogue_logit(y: &[i32], eq_min: &[u8], w: &[f32], ek_min: u8) -> f32 {
    let magic = 8_388_608.0f32; // 2^23
    let t: Vec<f32> = y
        .iter()
        .zip(eq_min)
        .zip(w)
        .map(|((&y, &e), &w)| {
            let v = epilogue_weight(w, e);
            // The bits max(acc, 0x4B000000), acc = 0x4B000000 + y: 2^23 + max(y, 0).
            let x = f32::from_bits((0x4B00_0000i32 + y).max(0x4B00_0000) as u32);
            v.mul_add(x, -v * magic)
        })
        .collect();
    let l = super::logits::pairwise_f32(&t)
        * pow2_f32(ek_min as i32 - 127).expect("2^(e - 127) is an f32 for every byte");
    if l == 0.0 && w.iter().all(|w| w.is_sign_negative()) {
        -0.0
    } else {
        l
    }
}

/// The subnormal-operand form's bound on the weights' window (`docs/numerics.md` 6.8):
/// `f_hi - f_lo <= 104`, beside [`epilogue_admits`]: every nonzero term is then normal.
pub const EPI_MAX_V_SPREAD: u32 = 104;

/// Whether the subnormal-operand form ([`epilogue_logit_subnormal`]) admits one (row,
/// key): [`epilogue_admits`], and the weights' exponent fields within
/// [`EPI_MAX_V_SPREAD`] of each other.
pub fn epilogue_subnormal_admits(w: &[f32], v: &[f32], ek_min: u8) -> bool {
    let (lo, hi) = weight_window(w, v);
    epilogue_admits(w, v, ek_min) && (lo == 255 || hi <= lo + EPI_MAX_V_SPREAD)
}

/// The kernel's head epilogue in its subnormal-operand form (`docs/numerics.md` 6.8):
/// with `s = 254 - f_hi` ([`weight_window`]), `v'_h = v_h 2^s` (an exponent-field add,
/// zeros kept), `x_h` the bits of `max(y_h, 0)` read as an f32 (`max(y_h, 0) 2^-149`, a
/// subnormal or zero), `T_h = v'_h * x_h`, and
/// `L = P(T) * 2^(ek_min + f_hi - 232)` (the exponent field clamped to at least 1, which
/// only a row without a nonzero weight reaches, whose `P(T)` is a zero). No sign rule: a
/// zero term carries its weight's sign, as SPEC 4's `w_h * (+0)` does. Where
/// [`epilogue_subnormal_admits`] holds and every head's pair is admitted
/// ([`int8_pair_admits`]), this is SPEC 4's logit.
pub fn epilogue_logit_subnormal(y: &[i32], eq_min: &[u8], w: &[f32], ek_min: u8) -> f32 {
    let v: Vec<f32> = w
        .iter()
        .zip(eq_min)
        .map(|(&w, &e)| epilogue_weight(w, e))
        .collect();
    let (_, hi) = weight_window(w, &v);
    let s = 254 - hi as i32;
    let t: Vec<f32> = y
        .iter()
        .zip(&v)
        .map(|(&y, &v)| {
            let vs = if v == 0.0 {
                v
            } else {
                f32::from_bits(v.to_bits().wrapping_add((s as u32) << 23))
            };
            vs * f32::from_bits(y.max(0) as u32)
        })
        .collect();
    let field = (ek_min as i32 + hi as i32 - 105).max(1);
    super::logits::pairwise_f32(&t) * f32::from_bits((field as u32) << 23)
}
