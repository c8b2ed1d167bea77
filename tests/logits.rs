//! SPEC 4 by hand: values worked out on paper, for the steps random data rarely hits
//! (IEEE overflow, NaN through relu, the f64 step of the tolerance class).

use dsa_indexer::batch::Batch;
use dsa_indexer::problem::{Inputs, Keys, Params, Problem, Queries, Role};
use dsa_indexer::reference;
use ndarray::{Array1, Array2, Array3};

/// The reference logits of an fp4 x fp4 plain layer with K = 1 over `batch`.
fn fp4_logits(
    batch: &Batch,
    q: &Array3<u8>,
    qs: &Array3<u8>,
    k: &Array2<u8>,
    ks: &Array2<u8>,
    w: &Array2<f32>,
) -> Vec<f32> {
    let inputs = Inputs {
        q: Queries::E2m1 {
            packed: q.view(),
            scale: qs.view(),
        },
        k: Keys::E2m1 {
            packed: k.view(),
            scale: ks.view(),
        },
        weights: w.view(),
        k_slots: None,
    };
    reference::logits(&Problem::new(batch, inputs, Params::new(1), Role::Plain).unwrap())
}

/// One row at position 1 (sees keys 0 and 1), H = 8, D = 64 (two groups).
fn fp4_case(q_scale: [u8; 2], k_scales: [[u8; 2]; 2], w: f32) -> Vec<f32> {
    let batch = Batch::contiguous(&[2], &[1], 1).unwrap();
    // q: every element 1.0 (code 2); k: every element 1.0 -> s_g = 32 per group.
    let q = Array3::from_elem((1, 8, 32), 0x22u8);
    let qs = Array3::from_shape_fn((1, 8, 2), |(_, _, g)| q_scale[g]);
    let k = Array2::from_elem((2, 32), 0x22u8);
    let ks = Array2::from_shape_fn((2, 2), |(j, g)| k_scales[j][g]);
    let wt = Array2::from_elem((1, 8), w);
    fp4_logits(&batch, &q, &qs, &k, &ks, &wt)
}

#[test]
fn exact_class_scales_and_sums() {
    // Key 0: s_g = 32, scales 1: a_h = 64, term = 0.5 * 64 = 32, 8 heads -> 256.
    // Key 1: group scales 2 and 1/2: a_h = 64 + 16 = 80, term 40 -> 320.
    assert_eq!(
        fp4_case([127, 127], [[127, 127], [128, 126]], 0.5),
        vec![256.0, 320.0]
    );
    // (32 * 2^-127) * 2^-1 = 2^-123 per group: subnormal steps kept, no flush.
    let v = fp4_case([0, 0], [[126, 126], [127, 127]], 1.0);
    assert_eq!(v[0], 8.0 * 2.0 * 32.0 * 2f32.powi(-128));
    assert!(v[0] > 0.0);
}

#[test]
fn overflow_to_infinity_and_nan_through_relu() {
    // (32 * 2^127) * 2^127 overflows to +inf in f32: the logit is +inf.
    let v = fp4_case([254, 254], [[254, 254], [127, 127]], 1.0);
    assert_eq!(v[0], f32::INFINITY);
    assert_eq!(v[1], 16.0 * 2f32.powi(127) * 8.0, "key 1: finite");
    // Negative weight: -inf.
    assert_eq!(
        fp4_case([254, 254], [[254, 254], [127, 127]], -1.0)[0],
        f32::NEG_INFINITY
    );
}

#[test]
fn nan_head_scores_become_positive_zero() {
    // Group 0: +32 * 2^127 * 2^127 = +inf; group 1: the key is negated -> -inf.
    // inf + -inf = NaN, relu(NaN) = +0, so every term is w * +0.
    let batch = Batch::contiguous(&[1], &[0], 1).unwrap();
    let q = Array3::from_elem((1, 8, 32), 0x22u8);
    let qs = Array3::from_elem((1, 8, 2), 254u8);
    let k = Array2::from_shape_fn((1, 32), |(_, b)| if b < 16 { 0x22u8 } else { 0xAA });
    let ks = Array2::from_elem((1, 2), 254u8);
    for (w, bits) in [(1.0f32, 0u32), (-1.0, 0x8000_0000)] {
        let wt = Array2::from_elem((1, 8), w);
        // w = -1: each term is -1 * +0 = -0, and -0 + -0 = -0.
        assert_eq!(
            fp4_logits(&batch, &q, &qs, &k, &ks, &wt)[0].to_bits(),
            bits,
            "w = {w}"
        );
    }
}

#[test]
fn tolerance_class_sums_groups_in_f64() {
    // fp4 queries x fp8 keys, D = 128 (four groups). Group scales make the group
    // terms 2^24, 1, 1, 0: pairwise in f64, (2^24 + 1) + (1 + 0) = 2^24 + 2, exact in
    // f32. Pairwise in f32 the first add would tie back to 2^24, giving 2^24.
    let batch = Batch::contiguous(&[1], &[0], 1).unwrap();
    // q: element 0 of groups 0..3 is 1.0 (code 2), the rest 0.
    let q = Array3::from_shape_fn(
        (1, 8, 64),
        |(_, _, b)| if b % 16 == 0 && b < 48 { 0x02u8 } else { 0 },
    );
    let qs = Array3::from_shape_fn((1, 8, 4), |(_, _, g)| [151u8, 127, 127, 127][g]);
    let k = Array2::from_elem((1, 128), 0x38u8); // 1.0
    let kscale = Array1::from_elem(1, 0.25f32);
    let wt = Array2::from_shape_fn((1, 8), |(_, h)| if h == 0 { 1.0 } else { 0.0 });
    let inputs = Inputs {
        q: Queries::E2m1 {
            packed: q.view(),
            scale: qs.view(),
        },
        k: Keys::E4m3 {
            codes: k.view(),
            scale: kscale.view(),
        },
        weights: wt.view(),
        k_slots: None,
    };
    let p = Problem::new(&batch, inputs, Params::new(1), Role::Plain).unwrap();
    assert_eq!(reference::logits(&p)[0], (16_777_218.0f32) * 0.25);
}
