//! SPEC 4's tolerance bound, per key and per row, and the reference's scores of a row.

use crate::cpu::Engine;
use crate::formats::{e2m1, e4m3, ue8m0};
use crate::problem::{KeyRef, Problem, Queries};

/// Row `i`'s scores over its visible keys, from the fast engine (bitwise the reference).
pub fn row_scores(p: &Problem, i: usize) -> Vec<f32> {
    let mut v = vec![0f32; p.batch.rows()[i].n];
    let mut e = Engine::new(p);
    e.rows(p, &[i], &mut [&mut v[..]]);
    v
}

/// SPEC 4's magnitude before cancellation `M_j` of row `i` against each visible key,
/// in f64: `kscale_j * sum_h |w_h| * sum_g c_g * sum_{d in g} |q_d k_d|`, with `c_g`
/// the product of the group scales present. Factored as
/// `sum_g c^k_g sum_d |k_d| A[d]`, `A[d] = sum_h |w_h| c^q_{h,g} |q_{h,d}|`.
pub fn magnitudes(p: &Problem, i: usize) -> Vec<f64> {
    let a = query_magnitudes(p, i);
    let d = p.dim;
    let row = p.batch.rows()[i];
    (0..row.n)
        .map(|j| match p.key(&row, j) {
            KeyRef::E4m3 { codes, scale } => {
                let s: f64 = (0..d)
                    .map(|e| (e4m3::decode(codes[e]) as f64).abs() * a[e])
                    .sum();
                s * scale as f64
            }
            KeyRef::E2m1 { packed, scale } => (0..d)
                .map(|e| {
                    let b = packed[e / 2];
                    let code = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                    (e2m1::decode(code) as f64).abs() * a[e] * ue8m0::decode(scale[e / 32]) as f64
                })
                .sum(),
        })
        .collect()
}

/// `A[d] = sum_h |w_h| c^q_{h,g} |q_{h,d}|` of row `i`.
fn query_magnitudes(p: &Problem, i: usize) -> Vec<f64> {
    let mut a = vec![0f64; p.dim];
    for hh in 0..p.heads {
        let w = (p.inputs.weights[[i, hh]] as f64).abs();
        for (e, ae) in a.iter_mut().enumerate() {
            let (q, c) = match p.inputs.q {
                Queries::E4m3(q) => (e4m3::decode(q[[i, hh, e]]) as f64, 1.0),
                Queries::E2m1 { packed, scale } => {
                    let b = packed[[i, hh, e / 2]];
                    let code = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                    (
                        e2m1::decode(code) as f64,
                        ue8m0::decode(scale[[i, hh, e / 32]]) as f64,
                    )
                }
            };
            *ae += w * c * q.abs();
        }
    }
    a
}

/// SPEC 4's tolerance bound of row `i` against each visible key:
/// `2^-8 * M_j + 2^-149 * (kscale_j * (G * sum_h |w_h| + H) + 2)`, the second term
/// the f32 rounding in the subnormal range (`kscale_j = 1` for E2M1 keys).
pub fn bounds(p: &Problem, i: usize) -> Vec<f64> {
    let row = p.batch.rows()[i];
    let sum_w: f64 = (0..p.heads)
        .map(|hh| (p.inputs.weights[[i, hh]] as f64).abs())
        .sum();
    let (g, h) = ((p.dim / 32) as f64, p.heads as f64);
    let ulp = f32::from_bits(1) as f64;
    magnitudes(p, i)
        .into_iter()
        .enumerate()
        .map(|(j, m)| {
            let kscale = p.key(&row, j).kscale() as f64;
            m / 256.0 + (kscale * (g * sum_w + h) + 2.0) * ulp
        })
        .collect()
}

/// The row's largest bound from SPEC 4 ([`bounds`]).
pub fn row_bound(p: &Problem, i: usize) -> f64 {
    bounds(p, i).into_iter().fold(0.0, f64::max)
}

/// Row `i`'s `M`: the largest [`magnitudes`] over its visible keys (0 without keys).
/// SPEC 9's tolerances of a row's selection are multiples of it.
pub fn row_magnitude(p: &Problem, i: usize) -> f64 {
    magnitudes(p, i).into_iter().fold(0.0, f64::max)
}
