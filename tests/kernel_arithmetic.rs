//! The arithmetic identities the CUDA kernels rely on, checked on the host (no GPU):
//! each test restates one kernel's formula in Rust and compares it with the contract's
//! form over special values and many random ones. The kernels' own GPU tests compare
//! their outputs with the reference; these pin down why the shortcuts are exact, in the
//! CI that has no GPU.
//!
//! `cargo test --test kernel_arithmetic -- --ignored` runs the exhaustive versions
//! (every f32 bit pattern; about 10 s in release).

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
    const WGR: &str = include_str!("../kernels/mqa_logits_wgr.cu");
    let pinned: [(&str, &str, &str); 8] = [
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
            "mqa_logits_wgr.cu",
            WGR,
            "cf[kk][g] >= __uint_as_float(0x00000200u) &&  // 2^-140 (subnormal)",
        ),
        (
            "mqa_logits_wgr.cu",
            WGR,
            "cf[kk][g] <= __uint_as_float(0x76000000u);           // 2^109",
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
}
