//! The arithmetic identities the CUDA kernels rely on, checked on the host (no GPU):
//! each test restates one kernel's formula in Rust and compares it with the contract's
//! form over special values and many random ones. The kernels' own GPU tests compare
//! their outputs with the reference; these pin down why the shortcuts are exact, in the
//! CI that has no GPU.
//!
//! `cargo test --test kernel_arithmetic -- --ignored` runs the exhaustive versions
//! (every f32 bit pattern, about 10 s in release; every exponent position of the int8
//! path's model, a few minutes).

use dsa_indexer::reference::rank_key;
use rand::{Rng, SeedableRng};

/// `kernels/common.cuh`'s `rank_key`: `x + 0` (round to nearest) folds -0 into +0, NaN
/// becomes -inf, then one xor flips the sign.
fn rank_key_device(x: f32) -> u32 {
    let y = x + 0.0f32;
    let b = if y.is_nan() { 0xFF80_0000 } else { y.to_bits() };
    b ^ ((((b as i32) >> 31) as u32) | 0x8000_0000)
}

/// The value whose ranking key is `t` (`topk.cu`'s sampled pass: `ft`).
fn key_value(t: u32) -> f32 {
    f32::from_bits(if t & 0x8000_0000 != 0 {
        t & 0x7FFF_FFFF
    } else {
        !t
    })
}

/// Special values and the edges of every binade, both signs.
fn special_bits() -> Vec<u32> {
    let mut v = vec![
        0x0000_0000, // +0
        0x8000_0000, // -0
        0x0000_0001, // smallest subnormal
        0x8000_0001,
        0x007F_FFFF, // largest subnormal
        0x807F_FFFF,
        0x7F7F_FFFF, // largest finite
        0xFF7F_FFFF,
        0x7F80_0000, // +inf
        0xFF80_0000, // -inf
        0x7FC0_0000, // quiet NaN
        0xFFC0_0000,
        0x7F80_0001, // signalling NaN
        0xFF80_0001,
        0x7FFF_FFFF,
        0xFFFF_FFFF,
    ];
    for e in 0..256u32 {
        for m in [0u32, 1, 0x40_0000, 0x7F_FFFF] {
            v.push((e << 23) | m);
            v.push(0x8000_0000 | (e << 23) | m);
        }
    }
    v
}

fn random_bits(n: usize, seed: u64) -> Vec<u32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.gen()).collect()
}

#[test]
fn device_ranking_key_is_spec_5s_key() {
    let mut xs = special_bits();
    xs.extend(random_bits(1 << 20, 1));
    for b in xs {
        let x = f32::from_bits(b);
        assert_eq!(rank_key_device(x), rank_key(x), "bits {b:#010x}");
    }
}

#[test]
#[ignore = "every f32 bit pattern: run with --ignored (release: about 10 s)"]
fn device_ranking_key_is_spec_5s_key_for_every_f32() {
    for b in 0..=u32::MAX {
        let x = f32::from_bits(b);
        assert_eq!(rank_key_device(x), rank_key(x), "bits {b:#010x}");
    }
}

/// The sampled pass compares `x >= ft` in f32 instead of `rank_key(x) >= t`, for every
/// threshold above the key of -inf (the key of NaN too): the two agree for every x.
#[test]
fn sampled_pass_f32_compare_is_the_key_order() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let mut xs = special_bits();
    xs.extend(random_bits(1 << 11, 3));
    let keys: Vec<u32> = xs.iter().map(|&b| rank_key(f32::from_bits(b))).collect();
    let mut ts = keys.clone();
    ts.extend((0..256).map(|_| rng.gen::<u32>()));
    let key_neg_inf = rank_key(f32::NEG_INFINITY);
    let mut checked = 0u64;
    for &t in &ts {
        // Keys the ranking never produces: -0's (+0 has it) and the gaps of NaN.
        if t <= key_neg_inf || rank_key(key_value(t)) != t {
            continue;
        }
        let ft = key_value(t);
        for (&b, &k) in xs.iter().zip(&keys) {
            assert_eq!(f32::from_bits(b) >= ft, k >= t, "x {b:#010x}, t {t:#010x}");
            checked += 1;
        }
    }
    assert!(checked > 1_000_000, "{checked} pairs");
}

/// The short row's later digit passes bin a key at `(k - prefix) >> shift` and count it
/// only below `bins`: that is exactly "k's bits above the digit are the prefix's", and
/// then the bin is k's digit. Every real key is >= the key of -inf (bin 3 of the first
/// pass), so a found prefix is >= 3 << 21, and key 0 (not a candidate) never matches:
/// `0 - prefix` wraps to 2^23 or more.
#[test]
fn short_row_digit_bins_are_the_prefix_match() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    assert_eq!(rank_key(f32::NEG_INFINITY) >> 21, 3);
    assert_eq!(rank_key(f32::NAN) >> 21, 3);
    assert_eq!(rank_key(f32::INFINITY) >> 21, 2044);
    // (shift, bits above the digit, bins): the second and third passes.
    for (shift, above, bins) in [(10u32, 21u32, 2048u32), (0, 10, 1024)] {
        for _ in 0..2000 {
            // A prefix as the passes build it: digits above `above`, zeros below.
            let p: u32 = rng.gen_range(3u32 << 21..=0xFF80_0000);
            let prefix = p >> above << above;
            let mut keys: Vec<u32> = (0..64).map(|_| rng.gen()).collect();
            // Keys near the prefix, on both sides of its window.
            for d in [
                0u32,
                1,
                2,
                1 << shift,
                (1 << above) - 1,
                1 << above,
                1 << (above + 1),
            ] {
                keys.push(prefix.wrapping_add(d));
                keys.push(prefix.wrapping_sub(d));
            }
            keys.push(0);
            for k in keys {
                let d = k.wrapping_sub(prefix) >> shift;
                let matches = (k >> above) == (prefix >> above);
                assert_eq!(d < bins, matches, "k {k:#010x}, prefix {prefix:#010x}");
                if matches {
                    assert_eq!(d, (k >> shift) & (bins - 1), "k {k:#010x}");
                }
            }
        }
    }
}

/// `mqa_logits_wgr` sums a group pair as `fma(X_g, C_g, t_h)` where the reference
/// rounds `X_g * C_g` and then the sum. `X_g = M 2^sq` (`|M| < 2^13`, `sq` in [-9, 5])
/// times a power of two `C_g = 2^c`, c in [-140, 109], is an f32 exactly, so the two
/// agree bit for bit; just outside the range the product can round.
#[test]
fn wgr_fma_is_the_rounded_sum_where_the_product_is_exact() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    let pow2 = |e: i32| 2f64.powi(e);
    for i in 0..1_000_000u32 {
        let m: i32 = rng.gen_range(-(1 << 13) + 1..1 << 13);
        let sq: i32 = rng.gen_range(-9..=5);
        let c: i32 = match i % 4 {
            0 => -140,
            1 => 109,
            _ => rng.gen_range(-140..=109),
        };
        let x = (m as f64 * pow2(sq)) as f32;
        assert_eq!(x as f64, m as f64 * pow2(sq), "X exact");
        let cf = pow2(c) as f32;
        assert_eq!(cf as f64, pow2(c), "C a power of two in f32");
        let exact = x as f64 * cf as f64;
        assert_eq!(
            (x * cf) as f64,
            exact,
            "m {m}, sq {sq}, c {c}: product rounded"
        );
        // The other group's product: any finite f32 (NaN and inf capped at the largest), either sign.
        let t: f32 = f32::from_bits(rng.gen::<u32>() & 0x7FFF_FFFF).min(f32::MAX)
            * if rng.gen() { 1.0 } else { -1.0 };
        let fused = x.mul_add(cf, t);
        let plain = x * cf + t;
        assert_eq!(
            fused.to_bits(),
            plain.to_bits(),
            "m {m}, sq {sq}, c {c}, t {t:e}"
        );
    }
    // Below the range: an odd M at sq = -9 times 2^-141 is M 2^-150, not an f32.
    let x = 3.0f32 * 2f32.powi(-9);
    let cf = f32::from_bits(0x0000_0100); // 2^-141
    assert_ne!((x * cf) as f64, x as f64 * cf as f64);
}

/// The kernel text of each formula restated above, so that a change to a kernel
/// without its Rust copy here fails this test (and then the restatement is updated, or
/// the change is wrong).
#[test]
fn restated_formulas_are_the_kernels_text() {
    const COMMON: &str = include_str!("../kernels/common.cuh");
    const TOPK: &str = include_str!("../kernels/topk.cu");
    const WGR: &str = include_str!("../kernels/logits_wgr.cuh");
    const WGI8: &str = include_str!("../kernels/mqa_logits_wgi8.cu");
    let pinned: [(&str, &str, &str); 15] = [
        ("common.cuh", COMMON, "const float y = __fadd_rn(x, 0.0f);"),
        (
            "common.cuh",
            COMMON,
            "const u32 b = y != y ? 0xFF800000u : __float_as_uint(y);",
        ),
        (
            "common.cuh",
            COMMON,
            "return b ^ ((u32)((int)b >> 31) | 0x80000000u);",
        ),
        (
            "topk.cu",
            TOPK,
            "const float ft = __uint_as_float((t & 0x80000000u) ? (t & 0x7FFFFFFFu) : ~t);",
        ),
        (
            "topk.cu",
            TOPK,
            "h[i] = q < n4 && x[i] >= ft && 4u * q + i < n;",
        ),
        (
            "topk.cu",
            TOPK,
            "atomicAdd(&sm.hist[min((k.x - prefix) >> shift, (u32)TK_BINS)], 1u);",
        ),
        (
            "logits_wgr.cuh",
            WGR,
            "cf[kk][g] >= __uint_as_float(0x00000200u) &&  // 2^-140 (subnormal)",
        ),
        (
            "logits_wgr.cuh",
            WGR,
            "cf[kk][g] <= __uint_as_float(0x76000000u);           // 2^109",
        ),
        // The subnormal-operand head epilogue, restated by
        // int8_path::epilogue_logit_subnormal and epilogue_subnormal_admits.
        ("mqa_logits_wgi8.cu", WGI8, "#define I8_MAX_V_SPREAD 104"),
        (
            "mqa_logits_wgi8.cu",
            WGI8,
            "f_hi - f_lo <= I8_MAX_V_SPREAD;",
        ),
        (
            "mqa_logits_wgi8.cu",
            WGI8,
            "if (v != 0.0f) *vp = __uint_as_float(__float_as_uint(v) + ((u32)(254 - f_hi) << 23));",
        ),
        ("mqa_logits_wgi8.cu", WGI8, "const u32 ec = (u32)(f_hi - 105);"),
        (
            "mqa_logits_wgi8.cu",
            WGI8,
            "const float ck = __uint_as_float((u32)max((odd ? kmin[1] : kmin[0]) + (int)ec, 1) << 23);",
        ),
        (
            "mqa_logits_wgi8.cu",
            WGI8,
            "const float x0 = __int_as_float(max(y[i], 0));",
        ),
        (
            "mqa_logits_wgi8.cu",
            WGI8,
            "s1[kk][a] = __fadd_rn(__fmul_rn(c.x, x0), __fmul_rn(c.y, x1));",
        ),
    ];
    for (file, text, line) in pinned {
        assert!(
            text.lines()
                .any(|l| l.trim() == line || l.trim().ends_with(line)),
            "kernels/{file} no longer has `{line}`: update the restatement in this file"
        );
    }
    // The window's ends are the powers of two the restatement uses.
    assert_eq!(f32::from_bits(0x0000_0200), 2f32.powi(-140));
    assert_eq!(f32::from_bits(0x7600_0000), 2f32.powi(109));
    assert!(WGR.contains("__fmaf_rn(x0[i], cf[kk][g2], __fmul_rn(x1[i], cf[kk][g2 + 1]))"));
    assert_eq!(dsa_indexer::reference::int8_path::EPI_MAX_V_SPREAD, 104);
}

// ==== the exact class on int8 tensor cores (reference::int8_path) ====
//
// The model of `docs/numerics.md` section 6 against the crate's reference head score
// (`reference::logits::{group_dot, exact_head_score}`, the functions `reference::logits`
// computes SPEC 4 steps 1 and 2 with). Codes are one E2M1 nibble per element here.

use dsa_indexer::formats::{e2m1, quantize_fp4_blocks, ue8m0, Fp4Floor};
use dsa_indexer::reference::int8_path::{
    block_max_exp_sum, int8_head_score, int8_pair_admits, int8_path_admits, shifted_codes,
    ScaleWindow, MAX_C_EXP_SUM, MAX_Q_EXP, MIN_EXP_SUM, S8_MAX_SPAN,
};
use dsa_indexer::reference::logits::{exact_head_score, group_dot};

/// One (head vector, key) pair: `G` group bytes per side and `32 G` codes per side.
#[derive(Clone, Debug)]
struct Pair {
    eq: Vec<u8>,
    ek: Vec<u8>,
    q: Vec<u8>,
    k: Vec<u8>,
}

fn span(v: &[u8]) -> u8 {
    v.iter().max().unwrap() - v.iter().min().unwrap()
}

fn min_sum(eq: &[u8], ek: &[u8]) -> i32 {
    *eq.iter().min().unwrap() as i32 + *ek.iter().min().unwrap() as i32
}

impl Pair {
    fn zeros(eq: &[u8], ek: &[u8]) -> Pair {
        Pair {
            eq: eq.to_vec(),
            ek: ek.to_vec(),
            q: vec![0; 32 * eq.len()],
            k: vec![0; 32 * eq.len()],
        }
    }

    /// SPEC 4's a_h by the crate's reference functions.
    fn reference(&self) -> f32 {
        let dec = |c: &[u8]| {
            c.iter()
                .map(|&x| e2m1::decode(x) as f64)
                .collect::<Vec<_>>()
        };
        let (qv, kv) = (dec(&self.q), dec(&self.k));
        let s: Vec<f32> = (0..self.eq.len())
            .map(|g| group_dot(&qv[32 * g..32 * g + 32], &kv[32 * g..32 * g + 32]) as f32)
            .collect();
        let qs: Vec<f32> = self.eq.iter().map(|&e| ue8m0::decode(e)).collect();
        let ks: Vec<f32> = self.ek.iter().map(|&e| ue8m0::decode(e)).collect();
        exact_head_score(&s, &qs, &ks)
    }

    /// The model: shifted s8 operands, one i32 sum, one multiply. `None` where the
    /// model cannot run (a span over 3, or C not an f32).
    fn int_path(&self) -> Option<f32> {
        let q = shifted_codes(&e2m1::pack(&self.q), &self.eq).unwrap()?;
        let k = shifted_codes(&e2m1::pack(&self.k), &self.ek).unwrap()?;
        int8_head_score(q.dot(&k)?, q.e_min, k.e_min)
    }

    /// `Y = sum_g 4 s_g 2^(shift_q,g + shift_k,g)`, computed apart from the model.
    fn y(&self) -> i64 {
        let (lq, lk) = (
            *self.eq.iter().min().unwrap(),
            *self.ek.iter().min().unwrap(),
        );
        (0..self.eq.len())
            .map(|g| {
                let x: i64 = (32 * g..32 * g + 32)
                    .map(|d| {
                        e2m1::DOUBLED[self.q[d] as usize] as i64
                            * e2m1::DOUBLED[self.k[d] as usize] as i64
                    })
                    .sum();
                x << ((self.eq[g] - lq) + (self.ek[g] - lk))
            })
            .sum()
    }

    /// The exact a_h rounded once to f32 (f64 holds `Y 2^E` exactly).
    fn rounded_once(&self) -> f32 {
        (self.y() as f64 * 2f64.powi(min_sum(&self.eq, &self.ek) - 256)) as f32
    }

    /// An int path guarded by the final range only multiplies by the f32 nearest to C.
    fn int_path_nearest_c(&self) -> f32 {
        self.y() as f32 * 2f64.powi(min_sum(&self.eq, &self.ek) - 256) as f32
    }
}

/// A guard on the final range only: spans within s8 and `G * 4608 * 2^(E_hi - 256)`
/// below `2^128`, nothing on the first product or the low end.
fn final_range_admits(eq: &[u8], ek: &[u8]) -> bool {
    let hi = *eq.iter().max().unwrap() as u32 + *ek.iter().max().unwrap() as u32;
    span(eq) <= S8_MAX_SPAN && span(ek) <= S8_MAX_SPAN && hi <= block_max_exp_sum(eq.len()).unwrap()
}

fn window(e: &[u8]) -> ScaleWindow {
    ScaleWindow::of(e, e.len()).unwrap()
}

/// Doubled E2M1 magnitude -> code index.
fn mag_code(m: i32) -> u8 {
    [0, 1, 2, 3, 4, 6, 8, 12]
        .iter()
        .position(|&x| x == m)
        .unwrap() as u8
}

/// Codes for group `g` whose integer dot `4 s_g` is `x` (greedy, largest product
/// first; the targets used here are all reachable). Queries positive, keys signed.
fn set_dot(p: &mut Pair, g: usize, x: i32) {
    const M: [i32; 8] = [0, 1, 2, 3, 4, 6, 8, 12];
    let mut r = x.abs();
    for d in 32 * g..32 * g + 32 {
        let (a, b) = match r {
            0 => (0, 0),
            144.. => (12, 12),
            _ => M
                .iter()
                .flat_map(|&a| M.iter().map(move |&b| (a, b)))
                .filter(|&(a, b)| a * b <= r)
                .max_by_key(|&(a, b)| (a * b, a))
                .unwrap(),
        };
        r -= a * b;
        p.q[d] = mag_code(a);
        p.k[d] = mag_code(b) | if x < 0 && b != 0 { 8 } else { 0 };
    }
    assert_eq!(r, 0, "4 s_g = {x} not reached");
}

/// The code patterns the sweeps try on one exponent configuration: random codes
/// (-0 included), every group at the largest magnitude with equal and alternating signs,
/// one group alone, odd unit dots (t_g at its lsb: subnormal near the low edge),
/// groups that cancel exactly across shifts, and a head of -0 products.
fn patterns(eq: &[u8], ek: &[u8], rng: &mut impl Rng, random: usize) -> Vec<Pair> {
    let g = eq.len();
    let mut out = Vec::new();
    for _ in 0..random {
        let mut p = Pair::zeros(eq, ek);
        p.q.iter_mut().for_each(|c| *c = rng.gen_range(0..16));
        p.k.iter_mut().for_each(|c| *c = rng.gen_range(0..16));
        out.push(p);
    }
    let dots = |xs: &[i32]| {
        let mut p = Pair::zeros(eq, ek);
        for (i, &x) in xs.iter().enumerate() {
            set_dot(&mut p, i, x);
        }
        p
    };
    out.push(dots(&vec![4608; g]));
    out.push(dots(
        &(0..g)
            .map(|i| if i % 2 == 0 { 4608 } else { -4608 })
            .collect::<Vec<_>>(),
    ));
    out.push(dots(
        &(0..g)
            .map(|i| if i == 0 { -4608 } else { 0 })
            .collect::<Vec<_>>(),
    ));
    out.push(dots(
        &(0..g)
            .map(|i| if i == g - 1 { 4096 } else { 0 })
            .collect::<Vec<_>>(),
    ));
    out.push(dots(
        &(0..g)
            .map(|i| if i % 2 == 0 { 1 } else { -1 })
            .collect::<Vec<_>>(),
    ));
    out.push(dots(&vec![-1; g]));
    // Two groups at 2^12 and a third pulling the sum back (a half sum of G = 4 that
    // reaches 2^128 while the exact a_h does not).
    if g == 4 {
        out.push(dots(&[4096, 4096, -4608, 0]));
        out.push(dots(&[0, -4608, 4096, 4096]));
    } else if g == 2 {
        out.push(dots(&[4096, -4608]));
    }
    if g >= 2 {
        // X_a 2^sh_a = -X_b 2^sh_b: the two groups cancel exactly (the largest and the
        // smallest shift sums).
        let sh: Vec<i32> = (0..g)
            .map(|i| {
                (eq[i] as i32 - *eq.iter().min().unwrap() as i32)
                    + (ek[i] - ek.iter().min().unwrap()) as i32
            })
            .collect();
        let a = (0..g).max_by_key(|&i| sh[i]).unwrap();
        let b = (0..g).min_by_key(|&i| sh[i]).unwrap();
        if a != b {
            for base in [1, 64] {
                let mut xs = vec![0; g];
                xs[a] = base;
                xs[b] = -(base << (sh[a] - sh[b]));
                out.push(dots(&xs));
            }
        }
    }
    // -0 queries against non-negative keys: every product is -0.
    let mut p = Pair::zeros(eq, ek);
    p.q.iter_mut().for_each(|c| *c = 8);
    p.k.iter_mut().for_each(|c| *c = rng.gen_range(0..8));
    out.push(p);
    out
}

/// Group shifts of one side with span `s`: the arrangements that put the largest
/// shifts together or apart, and one random arrangement.
fn arrangements(g: usize, s: u8, rng: &mut impl Rng) -> Vec<Vec<u8>> {
    if g == 1 {
        return vec![vec![0]];
    }
    let mut v = vec![
        (0..g)
            .map(|i| if i == 0 { s } else { 0 })
            .collect::<Vec<u8>>(),
        (0..g).map(|i| if i == 1 { s } else { 0 }).collect(),
        (0..g).map(|i| if i < 2 { s } else { 0 }).collect(),
        (0..g).map(|i| if i + 1 < g { s } else { 0 }).collect(),
    ];
    let mut r: Vec<u8> = (0..g).map(|_| rng.gen_range(0..=s)).collect();
    r[rng.gen_range(0..g)] = 0;
    let top = rng.gen_range(0..g);
    if r.iter().all(|&x| x == 0) || top != 0 {
        r[top] = s;
    }
    if span(&r) == s {
        v.push(r);
    }
    v.retain(|a| span(a) == s);
    v.sort();
    v.dedup();
    v
}

/// What one configuration showed.
#[derive(Default, Debug)]
struct Tally {
    configs_admitted: u64,
    configs_block_admitted: u64,
    admitted: u64,
    rejected: u64,
    rejected_differ: u64,
    block_admitted: u64,
}

/// Every pattern on one exponent configuration: where the pair guard admits, the model
/// equals the reference bitwise (and the once-rounded exact value); the block guard
/// (over this one pair) implies the pair guard.
fn check_config(eq: &[u8], ek: &[u8], rng: &mut impl Rng, random: usize, t: &mut Tally) {
    let adm = int8_pair_admits(eq, ek);
    let blk = int8_path_admits(window(eq), window(ek), eq.len());
    assert!(
        !blk || adm,
        "block guard admits what the pair guard rejects: {eq:?} {ek:?}"
    );
    t.configs_admitted += adm as u64;
    t.configs_block_admitted += blk as u64;
    for p in patterns(eq, ek, rng, random) {
        let r = p.reference();
        if adm {
            let m = p.int_path().expect("admitted pairs run the int path");
            assert_eq!(
                m.to_bits(),
                r.to_bits(),
                "eq {eq:?} ek {ek:?}: model {m:e} reference {r:e}\n{p:?}"
            );
            assert_eq!(p.rounded_once().to_bits(), r.to_bits());
            // The block guard also keeps every value of step 2 finite.
            assert!(!blk || r.is_finite(), "eq {eq:?} ek {ek:?}: a_h = {r}");
            t.admitted += 1;
            t.block_admitted += blk as u64;
        } else {
            t.rejected += 1;
            t.rejected_differ += (p.rounded_once().to_bits() != r.to_bits()) as u64;
        }
    }
}

/// Exponent positions (`eq_min`, `ek_min`) for spans `sq`, `sk`: both sides of every
/// edge of the guard (the low end, the first product, the group sums, C's top) and the
/// engines' range around 2^0.
fn positions(g: usize, sq: u8, sk: u8) -> Vec<(u8, u8)> {
    let (qm, km) = (254 - sq as i32, 254 - sk as i32);
    let mut v = Vec::new();
    let mut push = |a: i32, b: i32| {
        if (0..=qm).contains(&a) && (0..=km).contains(&b) {
            v.push((a as u8, b as u8));
        }
    };
    for lo in 103..=111 {
        for a in [0, 1, lo / 2, lo - 1, lo] {
            push(a, lo - a);
        }
    }
    for top in 241..=248 {
        for b in [0, 1, 60, 110, 120, 124, 125, 126, 127, 128, 131] {
            push(top - sq as i32, b);
        }
    }
    let ceiling = block_max_exp_sum(g).unwrap() as i32;
    for hi in ceiling - 5..=ceiling + 5 {
        for a in [117, 180, 240, 243, 244, 245] {
            push(a - sq as i32, hi - a - sk as i32);
        }
    }
    for hi in MAX_C_EXP_SUM as i32 - 3..=MAX_C_EXP_SUM as i32 + 3 {
        for a in [129, 200, 244, 254] {
            push(a, hi - a);
        }
    }
    for a in (118..=132).step_by(2) {
        for b in (118..=132).step_by(3) {
            push(a, b);
        }
    }
    v
}

#[test]
fn int8_path_matches_the_reference_wherever_the_guard_admits() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
    for g in [1usize, 2, 4] {
        let spans = if g == 1 { 0..=0 } else { 0..=S8_MAX_SPAN };
        let mut t = Tally::default();
        for sq in spans.clone() {
            for sk in spans.clone() {
                for (qm, km) in positions(g, sq, sk) {
                    for aq in arrangements(g, sq, &mut rng) {
                        for ak in arrangements(g, sk, &mut rng) {
                            let eq: Vec<u8> = aq.iter().map(|&s| qm + s).collect();
                            let ek: Vec<u8> = ak.iter().map(|&s| km + s).collect();
                            check_config(&eq, &ek, &mut rng, 2, &mut t);
                        }
                    }
                }
            }
        }
        println!("G = {g}: {t:?}");
        // Both sides of the guard were reached, and some rejected cases do differ.
        assert!(
            t.admitted > 1_000 && t.rejected > 100 && t.rejected_differ > 10,
            "{t:?}"
        );
    }
}

/// The sweep above at every exponent position: every `eq_min` and `ek_min` in 0..=254
/// for every span, the largest shifts of both sides in one group and one random
/// arrangement, one random draw besides the adversarial codes, and the witness of every
/// rejected configuration.
#[test]
#[ignore = "every exponent position: run with --ignored (a few minutes)"]
fn int8_path_every_exponent_position() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(20);
    for g in [1usize, 2, 4] {
        let spans = if g == 1 { 0..=0 } else { 0..=S8_MAX_SPAN };
        let mut t = Tally::default();
        for sq in spans.clone() {
            for sk in spans.clone() {
                for qm in 0..=254 - sq {
                    for km in 0..=254 - sk {
                        // The first arrangement and the last (the random one).
                        let two = |v: Vec<Vec<u8>>| [v[0].clone(), v[v.len() - 1].clone()];
                        let aq = two(arrangements(g, sq, &mut rng));
                        let ak = two(arrangements(g, sk, &mut rng));
                        for (a, b) in aq.iter().zip(&ak) {
                            let eq: Vec<u8> = a.iter().map(|&s| qm + s).collect();
                            let ek: Vec<u8> = b.iter().map(|&s| km + s).collect();
                            check_config(&eq, &ek, &mut rng, 1, &mut t);
                            let lo = min_sum(&eq, &ek) as u32;
                            if !int8_pair_admits(&eq, &ek)
                                && (MIN_EXP_SUM..=MAX_C_EXP_SUM).contains(&lo)
                            {
                                let p = witness(&eq, &ek).expect("a witness");
                                assert_ne!(
                                    p.reference().to_bits(),
                                    p.int_path().unwrap().to_bits()
                                );
                            }
                        }
                    }
                }
            }
        }
        println!("G = {g}: {t:?}");
    }
}

/// Every configuration the pair guard rejects (with spans that fit s8 and C an f32)
/// has codes on which the reference and the int path differ: the witnesses of
/// `docs/numerics.md` 6.3, so the pair condition is exact, not only sufficient.
#[test]
fn int8_pair_guard_rejects_only_pairs_that_can_differ() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(17);
    for g in [1usize, 2, 4] {
        let spans = if g == 1 { 0..=0 } else { 0..=S8_MAX_SPAN };
        let mut witnessed = 0;
        for sq in spans.clone() {
            for sk in spans.clone() {
                for (qm, km) in positions(g, sq, sk) {
                    for aq in arrangements(g, sq, &mut rng) {
                        for ak in arrangements(g, sk, &mut rng) {
                            let eq: Vec<u8> = aq.iter().map(|&s| qm + s).collect();
                            let ek: Vec<u8> = ak.iter().map(|&s| km + s).collect();
                            let lo = min_sum(&eq, &ek) as u32;
                            if int8_pair_admits(&eq, &ek)
                                || !(MIN_EXP_SUM..=MAX_C_EXP_SUM).contains(&lo)
                            {
                                continue;
                            }
                            let p = witness(&eq, &ek)
                                .unwrap_or_else(|| panic!("no witness: {eq:?} {ek:?}"));
                            let (r, m) = (p.reference(), p.int_path().unwrap());
                            assert_ne!(r.to_bits(), m.to_bits(), "no difference: {eq:?} {ek:?}");
                            witnessed += 1;
                        }
                    }
                }
            }
        }
        assert!(witnessed > 20, "G = {g}: {witnessed}");
        println!("G = {g}: {witnessed} rejected configurations, each with a witness");
    }
}

/// The codes of the derivation that make a rejected configuration differ; `None` when
/// the derivation has none (then the guard rejected a pair it need not have).
fn witness(eq: &[u8], ek: &[u8]) -> Option<Pair> {
    let g = eq.len();
    let mut p = Pair::zeros(eq, ek);
    let e: Vec<i32> = (0..g).map(|i| eq[i] as i32 + ek[i] as i32).collect();
    // The first product overflows while t_g's exact value is finite.
    if let Some(i) = (0..g).find(|&i| eq[i] > MAX_Q_EXP && ek[i] < 127) {
        set_dot(&mut p, i, 1 << (257 - eq[i] as i32));
        return Some(p);
    }
    if g == 1 {
        return None;
    }
    // t_g reaches 2^128; another group pulls the exact sum back below (or to -inf).
    if let Some(i) = (0..g).find(|&i| e[i] > 371) {
        let f = e[i] - 256;
        set_dot(&mut p, i, if f <= 128 { 1 << (128 - f) } else { 1 });
        set_dot(&mut p, (i + 1) % g, -4608);
        return Some(p);
    }
    // G = 4: a half sum reaches 2^128 (both of its groups at 371).
    let h = (0..g / 2).find(|&h| g == 4 && e[2 * h] == 371 && e[2 * h + 1] == 371)?;
    set_dot(&mut p, 2 * h, 4096);
    set_dot(&mut p, 2 * h + 1, 4096);
    set_dot(&mut p, 2 - 2 * h, -4608);
    Some(p)
}

/// Spans of 4 and more do not fit s8 for every code: the largest code shifted by 4 is
/// 192. `shifted_codes` declines them.
#[test]
fn int8_spans_past_three_do_not_fit_s8() {
    assert_eq!(12i32 << S8_MAX_SPAN, 96);
    assert!(12i32 << (S8_MAX_SPAN + 1) > i8::MAX as i32);
    for s in 0..=8u8 {
        let eq = [120, 120 + s, 120, 120];
        let mut p = Pair::zeros(&eq, &eq);
        set_dot(&mut p, 1, 4608);
        let q = shifted_codes(&e2m1::pack(&p.q), &eq).unwrap();
        assert_eq!(q.is_some(), s <= S8_MAX_SPAN, "span {s}");
        if let Some(q) = q {
            assert_eq!(*q.codes.iter().max().unwrap() as i32, 12 << s);
        }
    }
}

/// The failures of a guard on the final range only, each one admitted by it,
/// different from the reference, and rejected by both guards of the model.
#[test]
fn int8_final_range_guard_admits_pairs_that_differ() {
    let rejected = |p: &Pair| {
        !int8_pair_admits(&p.eq, &p.ek)
            && !int8_path_admits(window(&p.eq), window(&p.ek), p.eq.len())
    };
    // The first product overflows: 1152 * 2^118 = inf, so SPEC 4 gives NaN (or inf)
    // where the exact a_h, and the int path, are finite.
    let mut p = Pair::zeros(&[245, 245], &[10, 10]);
    set_dot(&mut p, 0, 4608);
    set_dot(&mut p, 1, -4608);
    assert!(final_range_admits(&p.eq, &p.ek) && rejected(&p));
    assert!(p.reference().is_nan());
    assert_eq!(p.int_path_nearest_c(), 0.0);
    set_dot(&mut p, 1, 0);
    assert_eq!(p.reference(), f32::INFINITY);
    assert_eq!(p.int_path_nearest_c(), 2304.0);
    // The sign of an underflowed zero: t_0 = RN(-2^-156) = -0 and t_1 = +0 sum to +0;
    // the exact a_h rounds to -0, and so does f32(-1) times C's nearest f32 (0).
    let mut p = Pair::zeros(&[50, 50], &[50, 50]);
    set_dot(&mut p, 0, -1);
    assert!(final_range_admits(&p.eq, &p.ek) && rejected(&p));
    assert_eq!(p.reference().to_bits(), 0x0000_0000);
    assert_eq!(p.int_path_nearest_c().to_bits(), 0x8000_0000);
    assert_eq!(p.rounded_once().to_bits(), 0x8000_0000);
    // An underflowed value: C = 2^-151 rounds to 0, but group 0 (shifted by 6) has
    // t_0 = 2^-145 exactly.
    let mut p = Pair::zeros(&[56, 53], &[55, 52]);
    set_dot(&mut p, 0, 1);
    set_dot(&mut p, 1, 1);
    assert!(final_range_admits(&p.eq, &p.ek) && rejected(&p));
    assert_eq!(p.reference(), 2f32.powi(-145));
    assert_eq!(p.int_path_nearest_c(), 0.0);
}

/// A head of -0 products: SPEC 4's s_g is a real zero, so a_h is +0, as the int path
/// gives (`reference::logits::group_dot` starts its sum from +0).
#[test]
fn int8_path_zero_head_is_plus_zero_as_the_reference() {
    let mut p = Pair::zeros(&[127; 4], &[127; 4]);
    p.q.iter_mut().for_each(|c| *c = 8);
    p.k.iter_mut()
        .enumerate()
        .for_each(|(d, c)| *c = (d % 8) as u8);
    assert_eq!(p.reference().to_bits(), 0);
    assert_eq!(p.int_path().unwrap().to_bits(), 0);
}

/// The random 4-group experiment over the whole exponent range: exponents
/// uniform, spans 0..=3, random codes. No pair the guard admits differs; a guard on the
/// final range only admits pairs that do.
#[test]
fn int8_path_random_blocks_over_the_whole_range() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(18);
    let (mut final_adm, mut final_diff, mut adm, mut rej, mut rej_diff) = (0, 0, 0, 0, 0);
    for _ in 0..100_000 {
        let side = |rng: &mut rand_chacha::ChaCha8Rng| {
            let s = rng.gen_range(0..=S8_MAX_SPAN);
            let lo = rng.gen_range(0..=254 - s);
            let mut v: Vec<u8> = (0..4).map(|_| lo + rng.gen_range(0..=s)).collect();
            v[rng.gen_range(0..4)] = lo;
            v
        };
        let (eq, ek) = (side(&mut rng), side(&mut rng));
        let mut p = Pair::zeros(&eq, &ek);
        p.q.iter_mut().for_each(|c| *c = rng.gen_range(0..16));
        p.k.iter_mut().for_each(|c| *c = rng.gen_range(0..16));
        let r = p.reference();
        if final_range_admits(&eq, &ek) {
            final_adm += 1;
            final_diff += (p.int_path_nearest_c().to_bits() != r.to_bits()) as u64;
        }
        if int8_pair_admits(&eq, &ek) {
            adm += 1;
            assert_eq!(p.int_path().unwrap().to_bits(), r.to_bits(), "{p:?}");
        } else {
            rej += 1;
            rej_diff += (p.rounded_once().to_bits() != r.to_bits()) as u64;
        }
    }
    println!(
        "final range only: {final_diff} of {final_adm} differ; guard: {adm} admitted, \
         {rej} rejected, of which {rej_diff} differ from the once-rounded a_h"
    );
    assert!(final_diff > 100 && adm > 50_000 && rej_diff > 0);
    // Engine-like scales: bytes near 127 (a vector's smallest in 118..=132), spans 0..=3.
    let mut engine = 0;
    for _ in 0..100_000 {
        let side = |rng: &mut rand_chacha::ChaCha8Rng| {
            let (s, lo) = (rng.gen_range(0..=S8_MAX_SPAN), rng.gen_range(118..=132));
            let mut v: Vec<u8> = (0..4).map(|_| lo + rng.gen_range(0..=s)).collect();
            v[rng.gen_range(0..4)] = lo;
            v[rng.gen_range(0..4)] = lo + s;
            v
        };
        let (eq, ek) = (side(&mut rng), side(&mut rng));
        let mut p = Pair::zeros(&eq, &ek);
        p.q.iter_mut().for_each(|c| *c = rng.gen_range(0..16));
        p.k.iter_mut().for_each(|c| *c = rng.gen_range(0..16));
        if int8_path_admits(window(&eq), window(&ek), 4) {
            engine += 1;
            assert_eq!(p.int_path().unwrap().to_bits(), p.reference().to_bits());
        }
    }
    println!("engine-like scales: {engine} of 100000 admitted by the block guard");
    assert_eq!(engine, 100_000);
}

/// Box-Muller, as `dsa-indexer gen` draws.
fn normal(rng: &mut impl Rng) -> f32 {
    let u: f64 = rng.gen_range(f64::MIN_POSITIVE..1.0);
    let v: f64 = rng.gen();
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// The scale bytes of `n` engine-like vectors of `D = channels.len()`: normal f32
/// activations times a per-channel `2^u` (`u` uniform in [-2, 2], fixed per channel),
/// quantized by SPEC 2's block quantizer. `[n, D / 32]`.
fn engine_like_scales(rng: &mut impl Rng, n: usize, channels: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * channels.len() / 32);
    let mut x = vec![0f32; channels.len()];
    for _ in 0..n {
        for (v, &c) in x.iter_mut().zip(channels) {
            *v = normal(rng) * c;
        }
        out.extend(quantize_fp4_blocks(&x, Fp4Floor::AmaxFloor).unwrap().1);
    }
    out
}

/// What the int8 path admits on one set of scale bytes: the fractions of head vectors
/// and keys within span 3, of (row-head, key) pairs, of (row, key) pairs with every head
/// admitted, and of tiles of today's exact kernel (2 rows x 32 heads x 64 keys); and the
/// head vectors' span histogram (0..=6, then more).
struct Admission {
    fractions: [f64; 5],
    spans: [u64; 8],
}

/// `qs`: `[rows, heads, G]`; `ks`: `[keys, G]`.
fn admission(qs: &[u8], ks: &[u8], rows: usize, heads: usize, g: usize) -> Admission {
    let keys = ks.len() / g;
    let qv = |r: usize, h: usize| &qs[(r * heads + h) * g..(r * heads + h + 1) * g];
    let kv = |j: usize| &ks[j * g..(j + 1) * g];
    let mut spans = [0u64; 8];
    for v in qs.chunks(g) {
        spans[(span(v) as usize).min(7)] += 1;
    }
    let q_fit = qs.chunks(g).filter(|v| span(v) <= S8_MAX_SPAN).count();
    let k_fit = ks.chunks(g).filter(|v| span(v) <= S8_MAX_SPAN).count();
    let (mut pairs, mut row_keys, mut tiles, mut tiles_all) = (0u64, 0u64, 0u64, 0u64);
    for r in 0..rows {
        for j in 0..keys {
            let n = (0..heads)
                .filter(|&h| int8_pair_admits(qv(r, h), kv(j)))
                .count();
            pairs += n as u64;
            row_keys += (n == heads) as u64;
        }
    }
    // mqa_logits_wgi8's tiles: 8 rows (its block) x 64 keys.
    for r in (0..rows).step_by(8) {
        let qw = ScaleWindow::of(&qs[r * heads * g..(r + 8) * heads * g], g).unwrap();
        for j in (0..keys).step_by(64) {
            let kw = ScaleWindow::of(&ks[j * g..(j + 64) * g], g).unwrap();
            tiles += int8_path_admits(qw, kw, g) as u64;
            tiles_all += 1;
        }
    }
    Admission {
        fractions: [
            q_fit as f64 / (rows * heads) as f64,
            k_fit as f64 / keys as f64,
            pairs as f64 / (rows * heads * keys) as f64,
            row_keys as f64 / (rows * keys) as f64,
            tiles as f64 / tiles_all as f64,
        ],
        spans,
    }
}

/// What the int8 path admits on engine-like inputs (`docs/numerics.md` 6.6): V4.1's
/// `H = 32` at `D = 128` and `D = 64`, 256 rows against 2048 keys, quantized by SPEC 2's
/// block quantizer from normal activations with a per-channel `2^u`, `u` uniform in
/// [-2, 2] (and, for the margin, [-4, 4]); beside them today's `v41-*` draw, every
/// group byte uniform in 124..=130, whose admitted fraction is known in closed form.
#[test]
fn int8_path_admits_engine_like_inputs() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(19);
    let (rows, heads, keys) = (256usize, 32usize, 2048usize);
    for dim in [128usize, 64] {
        let g = dim / 32;
        for half_width in [2.0f32, 4.0] {
            let mut channels = |n: usize| -> Vec<f32> {
                (0..n)
                    .map(|_| 2f32.powf(rng.gen_range(-half_width..=half_width)))
                    .collect()
            };
            let (qc, kc) = (channels(heads * dim), channels(dim));
            let mut qs = Vec::with_capacity(rows * heads * g);
            for _ in 0..rows {
                for h in 0..heads {
                    qs.extend(engine_like_scales(&mut rng, 1, &qc[h * dim..(h + 1) * dim]));
                }
            }
            let ks = engine_like_scales(&mut rng, keys, &kc);
            let a = admission(&qs, &ks, rows, heads, g);
            println!(
                "D = {dim}, u in [-{half_width}, {half_width}]: {:.5?}, head vector spans {:?}",
                a.fractions, a.spans
            );
            if half_width == 2.0 {
                assert_eq!(
                    a.fractions, [1.0; 5],
                    "D = {dim}: every pair and tile admitted"
                );
            } else {
                assert!(
                    a.fractions[2] > 0.99 && a.fractions[4] < 1.0,
                    "{:?}",
                    a.fractions
                );
            }
        }
        // Every group byte uniform in 124..=130: a vector is within span 3 with
        // probability 781 / 2401 (G = 4) or 37 / 49 (G = 2).
        let qs: Vec<u8> = (0..rows * heads * g)
            .map(|_| rng.gen_range(124..=130))
            .collect();
        let ks: Vec<u8> = (0..keys * g).map(|_| rng.gen_range(124..=130)).collect();
        let a = admission(&qs, &ks, rows, heads, g);
        let p = if g == 4 { 781.0 / 2401.0 } else { 37.0 / 49.0 };
        println!("D = {dim}, bytes uniform in 124..=130: {:.5?}", a.fractions);
        assert!((a.fractions[0] - p).abs() < 0.02 && (a.fractions[1] - p).abs() < 0.04);
        assert!((a.fractions[2] - p * p).abs() < 0.03, "{:?}", a.fractions);
        assert_eq!(
            a.fractions[4], 0.0,
            "no tile of 256 vectors and 64 keys fits"
        );
    }
}

/// One draw of the head epilogue's tests: 32 heads' int32 sums `y`, `eq_min` and weights
/// `w` against one key's `ek_min`, with SPEC 4's logit from its steps 2 to 4
/// (`exact_head_score`, `w * relu(a)`, the pairwise head sum), or None where some head's
/// pair is not admitted (6.3). A base scale byte and weight exponent per sample with
/// small spreads per head (up to `w_spread` binades for the weights), the key byte
/// anywhere, group sums from 0 to +-4608, weights of either sign, zeros among them, and
/// samples whose weights all have the sign bit set (some with no positive head score).
struct EpilogueSample {
    y: Vec<i32>,
    eq_min: Vec<u8>,
    w: Vec<f32>,
    /// The heads' `v_h = w_h 2^(eq_min,h - 129)` (`int8_path::epilogue_weight`).
    v: Vec<f32>,
    ek_min: u8,
    want: f32,
}

impl EpilogueSample {
    /// Sample `n`'s model logit `got` is SPEC 4's, bit for bit.
    fn assert_model(&self, n: usize, got: f32) {
        assert_eq!(
            got.to_bits(),
            self.want.to_bits(),
            "sample {n}: model {got:e}, reference {:e}; ek_min {} eq_min {:?} w {:?} y {:?}",
            self.want,
            self.ek_min,
            self.eq_min,
            self.w,
            self.y
        );
    }
}

fn epilogue_sample(rng: &mut impl Rng, n: usize, w_spread: i32) -> Option<EpilogueSample> {
    use dsa_indexer::reference::int8_path::{epilogue_weight, int8_pair_admits, pow2_f32};
    use dsa_indexer::reference::logits::{exact_head_score, pairwise_f32, relu};
    let heads = 32usize;
    let g = [2usize, 4][n % 2];
    let ek: Vec<u8> = {
        let lo = rng.gen_range(0..=251u8);
        (0..g).map(|_| lo + rng.gen_range(0..=3)).collect()
    };
    let ek_min = *ek.iter().min().unwrap();
    let (eq0, x0) = (rng.gen_range(0..=238u8), rng.gen_range(-150..=130i32));
    // Every weight's sign bit set, and (with it, one sample in 35) every group sum
    // <= 0: logits of all-zero terms, SPEC 4's -0.
    let (all_neg, non_pos) = (n.is_multiple_of(7), n.is_multiple_of(5));
    let (mut y, mut eq_min, mut w, mut want_terms) = (vec![], vec![], vec![], vec![]);
    let mut pairs_ok = true;
    for _ in 0..heads {
        let eq: Vec<u8> = {
            let lo = eq0 + rng.gen_range(0..=6);
            (0..g).map(|_| lo + rng.gen_range(0..=3)).collect()
        };
        let e_min = *eq.iter().min().unwrap();
        pairs_ok = pairs_ok && int8_pair_admits(&eq, &ek);
        // Group sums X_g = 4 s_g: zero, small, or anywhere in range.
        let x: Vec<i32> = (0..g)
            .map(|_| match rng.gen_range(0..4) {
                0 => 0,
                1 => rng.gen_range(-8..=8),
                _ => rng.gen_range(-4608..=4608),
            })
            .map(|v: i32| if non_pos { -v.abs() } else { v })
            .collect();
        let yh: i32 = (0..g)
            .map(|i| x[i] << ((eq[i] - e_min) + (ek[i] - ek_min)))
            .sum();
        let wh = match rng.gen_range(0..16) {
            0 => 0.0f32,
            _ => {
                let m: f32 = rng.gen_range(1.0..2.0);
                let e = (x0 - rng.gen_range(0..=w_spread)).clamp(-149, 127);
                m * pow2_f32(e).unwrap()
            }
        };
        let wh = if all_neg || rng.gen_bool(0.3) {
            -wh
        } else {
            wh
        };
        let s: Vec<f32> = x.iter().map(|&v| v as f32 / 4.0).collect();
        let qs: Vec<f32> = eq
            .iter()
            .map(|&e| pow2_f32(e as i32 - 127).unwrap())
            .collect();
        let ks: Vec<f32> = ek
            .iter()
            .map(|&e| pow2_f32(e as i32 - 127).unwrap())
            .collect();
        want_terms.push(wh * relu(exact_head_score(&s, &qs, &ks)));
        y.push(yh);
        eq_min.push(e_min);
        w.push(wh);
    }
    pairs_ok.then(|| EpilogueSample {
        want: pairwise_f32(&want_terms),
        v: w.iter()
            .zip(&eq_min)
            .map(|(&w, &e)| epilogue_weight(w, e))
            .collect(),
        y,
        eq_min,
        w,
        ek_min,
    })
}

/// The head epilogue's fma form (`int8_path::epilogue_logit`, `docs/numerics.md` 6.7, the
/// int8 kernel's before the subnormal form, whose guard rests on this one: one fma per
/// head from the accumulator's bits, the pairwise head sum, one multiply by the key's
/// scale, the sign of a zero from the weights) against SPEC 4's steps 2 to 4 over 32 heads
/// ([`epilogue_sample`]): wherever every head's pair and the epilogue's guard admit
/// (`docs/numerics.md` 6.7), bitwise. Draws cover the whole exponent range.
#[test]
fn int8_epilogue_matches_the_reference_wherever_its_guard_admits() {
    use dsa_indexer::reference::int8_path::{epilogue_admits, epilogue_logit};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(67);
    let samples = 40_000usize;
    let (mut admitted, mut rejected, mut rejected_differ, mut neg_zero) = (0, 0, 0, 0);
    for n in 0..samples {
        let Some(p) = epilogue_sample(&mut rng, n, 6) else {
            continue;
        };
        let got = epilogue_logit(&p.y, &p.eq_min, &p.w, p.ek_min);
        if epilogue_admits(&p.w, &p.v, p.ek_min) {
            p.assert_model(n, got);
            admitted += 1;
            neg_zero += (p.want.to_bits() == 0x8000_0000) as u32;
        } else {
            rejected += 1;
            rejected_differ += (got.to_bits() != p.want.to_bits()) as u32;
        }
    }
    println!(
        "admitted {admitted}, rejected {rejected} ({rejected_differ} differ), -0 logits {neg_zero}"
    );
    // Both sides reached, the sign rule exercised, and the guard not vacuous: some
    // samples it rejects do differ.
    assert!(
        admitted > 1_000 && rejected > 1_000 && rejected_differ > 100 && neg_zero > 10,
        "admitted {admitted}, rejected {rejected} ({rejected_differ} differ), -0 {neg_zero}"
    );
}

/// SPEC 4's logit (steps 2 to 4) of 32 heads at `G = 2` whose query bytes are all `eq`
/// and key bytes all `ek`, head `h`'s group sums `(y[h], 0)` (`|y| <= 4608`).
fn epilogue_reference(y: &[i32], eq: u8, w: &[f32], ek: u8) -> f32 {
    use dsa_indexer::reference::int8_path::pow2_f32;
    use dsa_indexer::reference::logits::{exact_head_score, pairwise_f32, relu};
    let (qs, ks) = (
        pow2_f32(eq as i32 - 127).unwrap(),
        pow2_f32(ek as i32 - 127).unwrap(),
    );
    let terms: Vec<f32> = y
        .iter()
        .zip(w)
        .map(|(&y, &w)| w * relu(exact_head_score(&[y as f32 / 4.0, 0.0], &[qs; 2], &[ks; 2])))
        .collect();
    pairwise_f32(&terms)
}

/// The head epilogue's subnormal-operand form (`int8_path::epilogue_logit_subnormal`:
/// one integer max and one multiply per head, the weights scaled by `2^(254 - f_hi)` and
/// the sums read as subnormals, no sign rule) against SPEC 4 as above: wherever every
/// head's pair and its guard (`docs/numerics.md` 6.8) admit, bitwise. Half the samples
/// spread their weights over up to 120 binades, so that the spread bound is reached; and
/// at its edge, a row whose one positive head has the smallest weight and a sum of 1: at
/// a spread of 104 binades its term is normal and the form is exact, at 105 it is
/// subnormal and the form rounds it where SPEC 4 does not.
#[test]
fn int8_epilogue_subnormal_form_matches_the_reference_wherever_its_guard_admits() {
    use dsa_indexer::reference::int8_path::{
        epilogue_admits, epilogue_logit_subnormal, epilogue_subnormal_admits, epilogue_weight,
        pow2_f32, weight_window, EPI_MAX_V_SPREAD,
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(68);
    let samples = 40_000usize;
    let (mut admitted, mut neg_zero, mut wide_admitted) = (0, 0, 0);
    let (mut spread_rejected, mut spread_differ) = (0, 0);
    for n in 0..samples {
        let w_spread = if n % 4 < 2 { 6 } else { 120 };
        let Some(p) = epilogue_sample(&mut rng, n, w_spread) else {
            continue;
        };
        let got = epilogue_logit_subnormal(&p.y, &p.eq_min, &p.w, p.ek_min);
        if epilogue_subnormal_admits(&p.w, &p.v, p.ek_min) {
            p.assert_model(n, got);
            admitted += 1;
            wide_admitted += (w_spread > 6) as u32;
            neg_zero += (p.want.to_bits() == 0x8000_0000) as u32;
        } else if epilogue_admits(&p.w, &p.v, p.ek_min) {
            spread_rejected += 1;
            spread_differ += (got.to_bits() != p.want.to_bits()) as u32;
        }
    }
    println!(
        "admitted {admitted} ({wide_admitted} of wide weights), -0 logits {neg_zero}; \
         rejected for the spread alone {spread_rejected} ({spread_differ} differ)"
    );
    assert!(
        admitted > 1_000 && wide_admitted > 100 && neg_zero > 10 && spread_rejected > 100,
        "admitted {admitted} ({wide_admitted} wide), -0 {neg_zero}, spread-rejected \
         {spread_rejected}"
    );
    // The edge: head 0 the largest weight and a negative sum, head 1 a weight `spread`
    // binades below with an odd significand and a sum of 1, the other heads zero.
    let (eq, ek) = (127u8, 127u8);
    let mut y = vec![0i32; 32];
    (y[0], y[1]) = (-100, 1);
    for spread in [EPI_MAX_V_SPREAD as i32, EPI_MAX_V_SPREAD as i32 + 1] {
        let mut w = vec![0.0f32; 32];
        w[0] = 1.5 * pow2_f32(20).unwrap();
        w[1] = f32::from_bits(0x3F80_0001) * pow2_f32(20 - spread).unwrap();
        let v: Vec<f32> = w.iter().map(|&w| epilogue_weight(w, eq)).collect();
        let (lo, hi) = weight_window(&w, &v);
        assert_eq!(hi - lo, spread as u32);
        assert!(
            epilogue_admits(&w, &v, ek),
            "the three-operation form admits it"
        );
        let got = epilogue_logit_subnormal(&y, &[eq; 32], &w, ek);
        let want = epilogue_reference(&y, eq, &w, ek);
        let admits = epilogue_subnormal_admits(&w, &v, ek);
        assert_eq!(admits, spread as u32 <= EPI_MAX_V_SPREAD);
        assert_eq!(
            got.to_bits() == want.to_bits(),
            admits,
            "spread {spread}: model {got:e}, reference {want:e}"
        );
    }
}
