//! The fast CPU logits engine: the same arithmetic as the reference (bitwise), laid out
//! for speed. Operands are decoded once per (row group, key) into per-worker buffers;
//! the exact class uses integer dot products of doubled E2M1 values (`4 * s_g` exactly),
//! the tolerance class exact f64 group sums. Nothing is allocated per row.

use crate::formats::{e2m1, e4m3, ue8m0};
use crate::problem::{Class, Keys, Problem, Queries};
use crate::reference::logits::{pairwise_f32, pairwise_f64, relu};

/// Rows scored together against each decoded key.
pub const ROW_GROUP: usize = 4;

/// Per-worker operand buffers.
#[derive(Debug)]
pub struct Engine {
    heads: usize,
    dim: usize,
    class: Class,
    /// Exact class: doubled query values `[R, H, D]`.
    q_i16: Vec<i16>,
    /// Tolerance class: query values `[R, H, D]`.
    q_f64: Vec<f64>,
    /// Query group scales `[R, H, G]` (fp4 queries).
    q_scale: Vec<f32>,
    /// Weights `[R, H]`.
    w: Vec<f32>,
    k_i16: Vec<i16>,
    k_f64: Vec<f64>,
    k_scale: Vec<f32>,
}

impl Engine {
    /// Buffers for problem `p`.
    pub fn new(p: &Problem) -> Self {
        let (h, d, g) = (p.heads, p.dim, p.dim / 32);
        let class = p.class();
        let exact = class == Class::Exact;
        Engine {
            heads: h,
            dim: d,
            class,
            q_i16: vec![0; if exact { ROW_GROUP * h * d } else { 0 }],
            q_f64: vec![0.0; if exact { 0 } else { ROW_GROUP * h * d }],
            q_scale: vec![0.0; ROW_GROUP * h * g],
            w: vec![0.0; ROW_GROUP * h],
            k_i16: vec![0; if exact { d } else { 0 }],
            k_f64: vec![0.0; if exact { 0 } else { d }],
            k_scale: vec![0.0; g],
        }
    }

    /// Heap bytes one engine holds for a problem of this shape.
    pub fn bytes(heads: usize, dim: usize, class: Class) -> usize {
        let (rhd, g) = (ROW_GROUP * heads * dim, dim / 32);
        let operands = match class {
            Class::Exact => rhd * 2 + dim * 2,
            Class::Tolerance => rhd * 8 + dim * 8,
        };
        operands + ROW_GROUP * heads * g * 4 + ROW_GROUP * heads * 4 + g * 4
    }

    fn load_rows(&mut self, p: &Problem, rows: &[usize]) {
        let (h, d, g) = (self.heads, self.dim, self.dim / 32);
        for (r, &i) in rows.iter().enumerate() {
            for hh in 0..h {
                self.w[r * h + hh] = p.inputs.weights[[i, hh]];
                let base = (r * h + hh) * d;
                match p.inputs.q {
                    Queries::E4m3(q) => {
                        for e in 0..d {
                            self.q_f64[base + e] = e4m3::decode(q[[i, hh, e]]) as f64;
                        }
                    }
                    Queries::E2m1 { packed, scale } => {
                        for e in 0..d {
                            let b = packed[[i, hh, e / 2]];
                            let c = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                            if self.class == Class::Exact {
                                self.q_i16[base + e] = e2m1::DOUBLED[c as usize] as i16;
                            } else {
                                self.q_f64[base + e] = e2m1::decode(c) as f64;
                            }
                        }
                        for gg in 0..g {
                            self.q_scale[(r * h + hh) * g + gg] = ue8m0::decode(scale[[i, hh, gg]]);
                        }
                    }
                }
            }
        }
    }

    fn load_key(&mut self, p: &Problem, x: usize) -> Option<f32> {
        let (d, g) = (self.dim, self.dim / 32);
        match p.inputs.k {
            Keys::E4m3 { codes, scale } => {
                for e in 0..d {
                    self.k_f64[e] = e4m3::decode(codes[[x, e]]) as f64;
                }
                Some(scale[x])
            }
            Keys::E2m1 { packed, scale } => {
                for e in 0..d {
                    let b = packed[[x, e / 2]];
                    let c = if e % 2 == 0 { b & 0xF } else { b >> 4 };
                    if self.class == Class::Exact {
                        self.k_i16[e] = e2m1::DOUBLED[c as usize] as i16;
                    } else {
                        self.k_f64[e] = e2m1::decode(c) as f64;
                    }
                }
                for gg in 0..g {
                    self.k_scale[gg] = ue8m0::decode(scale[[x, gg]]);
                }
                None
            }
        }
    }

    /// Logit of loaded row `r` against the loaded key (SPEC 4 steps 1 to 4).
    #[inline]
    fn logit(&self, r: usize, kscale: Option<f32>, q_fp4: bool) -> f32 {
        let (h, d, g) = (self.heads, self.dim, self.dim / 32);
        let mut terms = [0f32; 64];
        for (hh, term) in terms.iter_mut().enumerate().take(h) {
            let base = (r * h + hh) * d;
            let a = match self.class {
                Class::Exact => {
                    let mut t = [0f32; 4];
                    for (gg, tg) in t.iter_mut().enumerate().take(g) {
                        let qs = &self.q_i16[base + gg * 32..base + gg * 32 + 32];
                        let ks = &self.k_i16[gg * 32..gg * 32 + 32];
                        let acc: i32 = qs.iter().zip(ks).map(|(&a, &b)| (a * b) as i32).sum();
                        // acc = 4 * s_g exactly; s_g is exact in f32.
                        let s = acc as f32 * 0.25;
                        *tg = (s * self.q_scale[(r * h + hh) * g + gg]) * self.k_scale[gg];
                    }
                    pairwise_f32(&t[..g])
                }
                Class::Tolerance => {
                    let mut t = [0f64; 4];
                    for (gg, tg) in t.iter_mut().enumerate().take(g) {
                        let qs = &self.q_f64[base + gg * 32..base + gg * 32 + 32];
                        let ks = &self.k_f64[gg * 32..gg * 32 + 32];
                        // Every partial sum is exact in f64, so any order gives s_g.
                        let mut acc = [0f64; 4];
                        for c in 0..8 {
                            for l in 0..4 {
                                acc[l] += qs[c * 4 + l] * ks[c * 4 + l];
                            }
                        }
                        let s = (acc[0] + acc[1]) + (acc[2] + acc[3]);
                        let c = if q_fp4 {
                            self.q_scale[(r * h + hh) * g + gg] as f64
                        } else if kscale.is_none() {
                            self.k_scale[gg] as f64
                        } else {
                            1.0
                        };
                        *tg = s * c;
                    }
                    pairwise_f64(&t[..g]) as f32
                }
            };
            *term = self.w[r * h + hh] * relu(a);
        }
        let l = pairwise_f32(&terms[..h]);
        match kscale {
            Some(s) => l * s,
            None => l,
        }
    }

    /// Logits of up to [`ROW_GROUP`] rows: `out[r]` receives row `rows[r]`'s `n` scores.
    pub fn rows(&mut self, p: &Problem, rows: &[usize], out: &mut [&mut [f32]]) {
        debug_assert!(rows.len() <= ROW_GROUP && rows.len() == out.len());
        self.load_rows(p, rows);
        let q_fp4 = matches!(p.inputs.q, Queries::E2m1 { .. });
        let ns: [usize; ROW_GROUP] =
            std::array::from_fn(|r| rows.get(r).map_or(0, |&i| p.batch.rows()[i].n));
        let ks: [usize; ROW_GROUP] =
            std::array::from_fn(|r| rows.get(r).map_or(0, |&i| p.batch.rows()[i].ks));
        // Rows of one group may belong to different requests: walk each distinct key range.
        let mut done = [false; ROW_GROUP];
        for r0 in 0..rows.len() {
            if done[r0] {
                continue;
            }
            let same: [bool; ROW_GROUP] =
                std::array::from_fn(|r| r < rows.len() && !done[r] && ks[r] == ks[r0]);
            let nmax = (0..ROW_GROUP)
                .filter(|&r| same[r])
                .map(|r| ns[r])
                .max()
                .unwrap_or(0);
            for j in 0..nmax {
                let kscale = self.load_key(p, ks[r0] + j);
                for r in 0..rows.len() {
                    if same[r] && j < ns[r] {
                        out[r][j] = self.logit(r, kscale, q_fp4);
                    }
                }
            }
            for r in 0..ROW_GROUP {
                done[r] |= same[r];
            }
        }
    }
}
