//! SPEC 4, as the formula reads: rows x visible keys x heads x groups.

use crate::batch::Row;
use crate::formats::{e2m1, e4m3, ue8m0};
use crate::problem::{KeyRef, Problem, Queries};

/// Pairwise sum `P` of a power-of-two count of f32 values, each step one f32 add.
pub fn pairwise_f32(x: &[f32]) -> f32 {
    match x.len() {
        0 => 0.0,
        1 => x[0],
        n => pairwise_f32(&x[..n / 2]) + pairwise_f32(&x[n / 2..]),
    }
}

/// Pairwise sum in f64.
pub fn pairwise_f64(x: &[f64]) -> f64 {
    match x.len() {
        0 => 0.0,
        1 => x[0],
        n => pairwise_f64(&x[..n / 2]) + pairwise_f64(&x[n / 2..]),
    }
}

/// `relu(x) = x > 0 ? x : +0.0`; NaN becomes +0.0.
#[inline]
pub fn relu(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// SPEC 4 step 1 for one group: `s_g = sum_d q_d * k_d` over the group's decoded
/// values, exact in f64 (every product and partial sum of 32 is). `s_g` is a real
/// number: a zero sum is +0, whatever the signs of zero among the products (Rust's
/// `f64` `Sum` starts from -0.0, which would make a group of -0 products -0).
pub fn group_dot(q: &[f64], k: &[f64]) -> f64 {
    q.iter().zip(k).fold(0.0, |acc, (x, y)| acc + x * y)
}

/// SPEC 4 step 2 in the exact class (E2M1 x E2M1), one head: from the group dots
/// `s` (exact in f32) and the decoded UE8M0 group scales `qs`, `ks` (`G` each),
/// `t_g = (s_g * qs_g) * ks_g`, two f32 multiplies in that order, and
/// `a_h = P(t_0 .. t_{G-1})`, the f32 pairwise sum. `G = s.len()` is 1, 2 or 4;
/// `qs` and `ks` hold at least `G` scales (later ones are not read).
pub fn exact_head_score(s: &[f32], qs: &[f32], ks: &[f32]) -> f32 {
    let mut t = [0f32; 4];
    let mut g = 0;
    for ((ti, &sg), (&q, &k)) in t.iter_mut().zip(s).zip(qs.iter().zip(ks)) {
        *ti = (sg * q) * k;
        g += 1;
    }
    pairwise_f32(&t[..g])
}

/// One side of the dot product, decoded: element values (no scales) and the group scales.
pub(crate) struct Decoded {
    /// Element values, `[H or 1, D]`.
    pub values: Vec<f64>,
    /// UE8M0 group scales `[H or 1, G]` (fp4), or `None` (E4M3: no group scale).
    pub scales: Option<Vec<f32>>,
}

/// Decode row `i`'s queries.
pub(crate) fn decode_query(p: &Problem, i: usize) -> Decoded {
    let (h, d) = (p.heads, p.dim);
    match p.inputs.q {
        Queries::E4m3(q) => Decoded {
            values: q
                .slice(ndarray::s![i, .., ..])
                .iter()
                .map(|&b| e4m3::decode(b) as f64)
                .collect(),
            scales: None,
        },
        Queries::E2m1 { packed, scale } => {
            let mut values = Vec::with_capacity(h * d);
            for hh in 0..h {
                let row = packed.slice(ndarray::s![i, hh, ..]);
                let row = row
                    .as_slice()
                    .map(|s| s.to_vec())
                    .unwrap_or_else(|| row.to_vec());
                values.extend((0..d).map(|e| e2m1::decode(e2m1::unpack(&row, e)) as f64));
            }
            Decoded {
                values,
                scales: Some(
                    scale
                        .slice(ndarray::s![i, .., ..])
                        .iter()
                        .map(|&e| ue8m0::decode(e))
                        .collect(),
                ),
            }
        }
    }
}

/// Decode key `j` of `row`'s request (flat or paged).
pub(crate) fn decode_key(p: &Problem, row: &Row, j: usize) -> Decoded {
    match p.key(row, j) {
        KeyRef::E4m3 { codes, .. } => Decoded {
            values: codes.iter().map(|&b| e4m3::decode(b) as f64).collect(),
            scales: None,
        },
        KeyRef::E2m1 { packed, scale } => {
            let row = packed.to_vec();
            Decoded {
                values: (0..p.dim)
                    .map(|e| e2m1::decode(e2m1::unpack(&row, e)) as f64)
                    .collect(),
                scales: Some(scale.iter().map(|&e| ue8m0::decode(e)).collect()),
            }
        }
    }
}

/// The logit of query row `q` (decoded) against key `k` (decoded), with row weights `w`
/// and the key's per-key scale (E4M3 keys) — SPEC 4 steps 1 to 4.
pub(crate) fn logit(
    q: &Decoded,
    k: &Decoded,
    w: &[f32],
    kscale: Option<f32>,
    heads: usize,
    dim: usize,
) -> f32 {
    let groups = dim / 32;
    let mut terms = [0f32; 64];
    let exact = q.scales.is_some() && k.scales.is_some();
    for h in 0..heads {
        let qv = &q.values[h * dim..(h + 1) * dim];
        // 1. Group dots, exact in f64 for every format pair.
        let mut s = [0f64; 4];
        for (g, sg) in s.iter_mut().enumerate().take(groups) {
            *sg = group_dot(&qv[g * 32..g * 32 + 32], &k.values[g * 32..g * 32 + 32]);
        }
        // 2. Head score.
        let a = if exact {
            let qs = q
                .scales
                .as_ref()
                .map(|v| &v[h * groups..(h + 1) * groups])
                .unwrap_or(&[]);
            let ks = k.scales.as_deref().unwrap_or(&[]);
            let mut sf = [0f32; 4];
            for g in 0..groups {
                // s_g is a multiple of 1/4 with |s_g| <= 1152: exact in f32.
                sf[g] = s[g] as f32;
            }
            exact_head_score(&sf[..groups], qs, ks)
        } else {
            let c: Vec<f64> = match (&q.scales, &k.scales) {
                (Some(qs), None) => qs[h * groups..(h + 1) * groups]
                    .iter()
                    .map(|&x| x as f64)
                    .collect(),
                (None, Some(ks)) => ks.iter().map(|&x| x as f64).collect(),
                _ => vec![1.0; groups],
            };
            let mut t = [0f64; 4];
            for g in 0..groups {
                t[g] = s[g] * c[g];
            }
            pairwise_f64(&t[..groups]) as f32
        };
        // 3. Weighted relu.
        terms[h] = w[h] * relu(a);
    }
    // 4. Sum over heads, then the per-key scale.
    let l = pairwise_f32(&terms[..heads]);
    match kscale {
        Some(s) => l * s,
        None => l,
    }
}

/// Row `i`'s logits over its visible keys, written to `out[..n]`.
pub fn row_logits(p: &Problem, i: usize, out: &mut [f32]) {
    let row = p.batch.rows()[i];
    let q = decode_query(p, i);
    let w = p.inputs.weights.row(i).to_vec();
    for (j, o) in out.iter_mut().enumerate().take(row.n) {
        let key = p.key(&row, j);
        let ks = match key {
            KeyRef::E4m3 { scale, .. } => Some(scale),
            KeyRef::E2m1 { .. } => None,
        };
        *o = logit(&q, &decode_key(p, &row, j), &w, ks, p.heads, p.dim);
    }
}
