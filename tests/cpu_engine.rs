//! The fast CPU engine (`src/cpu.rs`) held bitwise to the reference's logits: random
//! problems, all four format pairs, H in {8, 16, 32, 64}, D in {32, 64, 128}, every
//! instruction set this CPU can run (the portable loop always among them).

use dsa_indexer::batch::Batch;
use dsa_indexer::cpu::{engine_logits, Isa};
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Queries, Role};
use dsa_indexer::reference;
use ndarray::{Array1, Array2, Array3};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

struct Case {
    batch: Batch,
    q8: Array3<u8>,
    q4: Array3<u8>,
    qs: Array3<u8>,
    k8: Array2<u8>,
    k8s: Array1<f32>,
    k4: Array2<u8>,
    k4s: Array2<u8>,
    w: Array2<f32>,
}

/// A random scale byte: mostly near 127, sometimes anywhere in 0..=254 (subnormal
/// products, overflow to infinity).
fn scale_byte(rng: &mut ChaCha8Rng, wide: bool) -> u8 {
    if wide && rng.gen_bool(0.2) {
        rng.gen_range(0..=254)
    } else {
        rng.gen_range(118..=136)
    }
}

fn e4m3_byte(rng: &mut ChaCha8Rng) -> u8 {
    loop {
        let b: u8 = rng.gen();
        if b & 0x7F != 0x7F {
            return b;
        }
    }
}

fn case(seed: u64, h: usize, d: usize, ratio: usize, wide: bool) -> Case {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let nreq = rng.gen_range(1..=3);
    let seq: Vec<usize> = (0..nreq).map(|_| rng.gen_range(0..=90)).collect();
    let q0: Vec<usize> = seq
        .iter()
        .map(|&s| s - rng.gen_range(0..=s.min(13)))
        .collect();
    let batch = Batch::contiguous(&seq, &q0, ratio).unwrap();
    let (t, l, g) = (batch.num_rows(), batch.num_keys(), d / 32);
    let q8 = Array3::from_shape_fn((t, h, d), |_| e4m3_byte(&mut rng));
    let q4 = Array3::from_shape_fn((t, h, d / 2), |_| rng.gen());
    let qs = Array3::from_shape_fn((t, h, g), |_| scale_byte(&mut rng, wide));
    let k8 = Array2::from_shape_fn((l, d), |_| e4m3_byte(&mut rng));
    let k8s = Array1::from_shape_fn(l, |_| rng.gen_range(1e-3f32..2.0));
    let k4 = Array2::from_shape_fn((l, d / 2), |_| rng.gen());
    let k4s = Array2::from_shape_fn((l, g), |_| scale_byte(&mut rng, wide));
    let w = Array2::from_shape_fn((t, h), |_| {
        if rng.gen_bool(0.1) {
            0.0
        } else {
            rng.gen_range(-2.0f32..2.0)
        }
    });
    Case {
        batch,
        q8,
        q4,
        qs,
        k8,
        k8s,
        k4,
        k4s,
        w,
    }
}

fn check(c: &Case, q_fp4: bool, k_fp4: bool) -> Result<(), TestCaseError> {
    let q = if q_fp4 {
        Queries::E2m1 {
            packed: c.q4.view(),
            scale: c.qs.view(),
        }
    } else {
        Queries::E4m3(c.q8.view())
    };
    let k = if k_fp4 {
        Keys::E2m1 {
            packed: c.k4.view(),
            scale: c.k4s.view(),
        }
    } else {
        Keys::E4m3 {
            codes: c.k8.view(),
            scale: c.k8s.view(),
        }
    };
    let inputs = Inputs {
        q,
        k,
        weights: c.w.view(),
        k_slots: None,
    };
    let p = Problem::new(&c.batch, inputs, Params::new(4), Role::Plain).unwrap();
    let want: Vec<u32> = reference::logits(&p).iter().map(|x| x.to_bits()).collect();
    for isa in Isa::available() {
        let got: Vec<u32> = engine_logits(&p, isa).iter().map(|x| x.to_bits()).collect();
        prop_assert_eq!(got.len(), want.len());
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            prop_assert!(
                false,
                "{} q_fp4={} k_fp4={}: logit {} differs: engine {:e} ({:#010x}), reference {:e} ({:#010x})",
                isa.name(),
                q_fp4,
                k_fp4,
                i,
                f32::from_bits(got[i]),
                got[i],
                f32::from_bits(want[i]),
                want[i]
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn engine_equals_reference_bitwise(
        seed in any::<u64>(),
        hi in 0usize..4,
        di in 0usize..3,
        ratio in prop::sample::select(vec![1usize, 2, 4]),
        wide in any::<bool>(),
    ) {
        let (h, d) = (8 << hi, 32 << di);
        let c = case(seed, h, d, ratio, wide);
        for (qf, kf) in [(true, true), (true, false), (false, true), (false, false)] {
            check(&c, qf, kf)?;
        }
    }
}

/// Every format pair and shape once, with more than one key block and row group.
#[test]
fn every_shape_once() {
    for hi in 0..4 {
        for di in 0..3 {
            let c = case(1000 + hi * 3 + di, 8 << hi, 32 << di, 1, true);
            for (qf, kf) in [(true, true), (true, false), (false, true), (false, false)] {
                check(&c, qf, kf).unwrap();
            }
        }
    }
}

#[test]
fn detected_isa_is_available() {
    assert!(Isa::available().contains(&Isa::detect()));
}

/// SPEC 4's f64 pairwise sum over groups, where the order decides the result:
/// `t = [2^60, 1, -2^60, 1]` sums to `(2^60 + 1) + (-2^60 + 1) = 0` in f64 pairwise
/// order, but to 1 left to right. Random problems almost never hit such a case.
#[test]
fn tolerance_group_sum_order_is_pairwise() {
    let batch = Batch::contiguous(&[1], &[0], 1).unwrap();
    let (h, d) = (8, 128);
    // E4M3 queries: 1.0 (0x38) at the first dim of each group, else 0.
    let q = Array3::from_shape_fn((1, h, d), |(_, _, e)| if e % 32 == 0 { 0x38u8 } else { 0 });
    // fp4 key: +1 (code 0x2) at dims 0, 32, 96 and -1 (code 0xA) at dim 64.
    let mut codes = vec![0u8; d];
    for e in [0, 32, 96] {
        codes[e] = 0x2;
    }
    codes[64] = 0xA;
    let k = Array2::from_shape_vec((1, d / 2), dsa_indexer::formats::e2m1::pack(&codes)).unwrap();
    // Group scales 2^60, 1, 2^60, 1.
    let ks = Array2::from_shape_vec((1, 4), vec![127 + 60, 127, 127 + 60, 127]).unwrap();
    let w = Array2::from_elem((1, h), 1.0f32);
    let inputs = Inputs {
        q: Queries::E4m3(q.view()),
        k: Keys::E2m1 {
            packed: k.view(),
            scale: ks.view(),
        },
        weights: w.view(),
        k_slots: None,
    };
    let p = Problem::new(&batch, inputs, Params::new(1), Role::Plain).unwrap();
    let want = reference::logits(&p);
    assert_eq!(
        want,
        vec![0.0],
        "the pairwise f64 sum cancels the large terms first"
    );
    for isa in Isa::available() {
        let got = engine_logits(&p, isa);
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{}",
            isa.name()
        );
    }
}

/// The tolerance class's group sums at the ends of E4M3's range: in every group,
/// `448 * 448` at its first dim, `-448 * 448` at its last and the smallest product,
/// `2^-9 * 2^-9`, at the 30 between. Exact, `s_g = 30 * 2^-18`; an accumulator of
/// fewer than 36 bits loses the small products next to the large ones, in any order the
/// engine's chains take (one per group, or `4 / G` per group over interleaved dims).
#[test]
fn tolerance_group_sums_are_exact_across_e4m3s_range() {
    let batch = Batch::contiguous(&[1], &[0], 1).unwrap();
    let h = 8;
    for d in [32, 64, 128] {
        let code = |e: usize, last: u8| match e % 32 {
            0 => 0x7E,  // 448
            31 => last, // +-448
            _ => 0x01,  // 2^-9
        };
        let q = Array3::from_shape_fn((1, h, d), |(_, _, e)| code(e, 0xFE));
        let k = Array2::from_shape_fn((1, d), |(_, e)| code(e, 0x7E));
        let ks = Array1::from_elem(1, 1.0f32);
        let w = Array2::from_elem((1, h), 1.0f32);
        let inputs = Inputs {
            q: Queries::E4m3(q.view()),
            k: Keys::E4m3 {
                codes: k.view(),
                scale: ks.view(),
            },
            weights: w.view(),
            k_slots: None,
        };
        let p = Problem::new(&batch, inputs, Params::new(1), Role::Plain).unwrap();
        let want = reference::logits(&p);
        let exact = (h * d / 32 * 30) as f32 * 2f32.powi(-18);
        assert_eq!(want, vec![exact], "D = {d}: the reference");
        for isa in Isa::available() {
            let got = engine_logits(&p, isa);
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                vec![exact.to_bits()],
                "D = {d}, {}",
                isa.name()
            );
        }
    }
}
