//! Input synthesis: the tensors of a case, filled from its seed and value palettes
//! (small palettes give ties; non-finite weights and key scales are replaced, so only
//! a defect makes an input invalid), and the crate's views of them.

use ndarray::{Array1, Array2, Array3};

use dsa_indexer::problem::{Inputs, Keys, Queries};

use super::spec::Spec;
use crate::Rng;

/// The first `len % (N + 1)` entries of a palette.
fn used<T, const N: usize>(p: &(u8, [T; N])) -> &[T] {
    &p.1[..p.0 as usize % (N + 1)]
}

/// Owned inputs of one problem.
#[derive(Debug, Clone)]
pub struct Owned {
    /// E4M3 queries `[T, H, D]` or packed E2M1 `[T, H, D/2]`.
    pub q: Array3<u8>,
    /// UE8M0 query scales `[T, H, D/32]` (fp4 queries).
    pub q_scale: Option<Array3<u8>>,
    /// Weights `[T', H]`.
    pub w: Array2<f32>,
}

/// Keys shared by a source and its consumer.
#[derive(Debug, Clone)]
pub struct OwnedKeys {
    /// E4M3 `[L, D]` or packed E2M1 `[L, D/2]`.
    pub k: Array2<u8>,
    /// UE8M0 `[L, D/32]` (fp4 keys).
    pub k_scale: Option<Array2<u8>>,
    /// f32 `[L]` (E4M3 keys).
    pub kscale: Option<Array1<f32>>,
    /// `k_slots [L]`.
    pub slots: Option<Array1<i32>>,
}

impl Spec {
    fn e4m3(&self, rng: &mut Rng, palette: &(u8, [u8; 8])) -> u8 {
        let palette = used(palette);
        let b = rng.pick(palette, |r| r.next() as u8);
        if b & 0x7F == 0x7F {
            b ^ 1
        } else {
            b
        }
    }

    fn packed(&self, rng: &mut Rng, palette: &(u8, [u8; 8])) -> u8 {
        rng.pick(used(palette), |r| r.next() as u8)
    }

    fn scale(&self, rng: &mut Rng) -> u8 {
        let p = used(&self.scale_palette);
        let b = rng.pick(p, |r| 110 + r.below(36) as u8);
        b.min(254)
    }

    fn weight(&self, rng: &mut Rng) -> f32 {
        let p = used(&self.w_palette);
        let w = rng.pick(p, |r| (r.below(17) as f32 - 8.0) * 0.25);
        if w.is_finite() {
            w
        } else {
            0.5
        }
    }

    fn kscale(&self, rng: &mut Rng) -> f32 {
        let p = used(&self.kscale_palette);
        let s = rng.pick(p, |r| (1 + r.below(8)) as f32 * 0.125).abs();
        if s.is_finite() && s > 0.0 {
            s
        } else {
            1.0
        }
    }

    /// Queries and weights for `t` rows.
    pub fn queries(&self, rng: &mut Rng, t: usize, h: usize, d: usize) -> Owned {
        let (q, q_scale) = if self.q_fp4 {
            (
                Array3::from_shape_simple_fn((t, h, d / 2), || self.packed(rng, &self.q_palette)),
                Some(Array3::from_shape_simple_fn((t, h, d / 32), || {
                    self.scale(rng)
                })),
            )
        } else {
            (
                Array3::from_shape_simple_fn((t, h, d), || self.e4m3(rng, &self.q_palette)),
                None,
            )
        };
        let w = Array2::from_shape_simple_fn((t, h), || self.weight(rng));
        Owned { q, q_scale, w }
    }

    /// Keys for `l` flat keys.
    pub fn keys(&self, rng: &mut Rng, l: usize, d: usize) -> OwnedKeys {
        let (k, k_scale, kscale) = if self.k_fp4 {
            (
                Array2::from_shape_simple_fn((l, d / 2), || self.packed(rng, &self.k_palette)),
                Some(Array2::from_shape_simple_fn((l, d / 32), || {
                    self.scale(rng)
                })),
                None,
            )
        } else {
            (
                Array2::from_shape_simple_fn((l, d), || self.e4m3(rng, &self.k_palette)),
                None,
                Some(Array1::from_shape_simple_fn(l, || self.kscale(rng))),
            )
        };
        let slots = self
            .slots
            .then(|| Array1::from_shape_simple_fn(l, || rng.below(1 << 20) as i32));
        OwnedKeys {
            k,
            k_scale,
            kscale,
            slots,
        }
    }
}

/// Views of owned inputs.
pub fn inputs<'a>(q: &'a Owned, k: &'a OwnedKeys) -> Inputs<'a> {
    Inputs {
        q: match &q.q_scale {
            Some(s) => Queries::E2m1 {
                packed: q.q.view(),
                scale: s.view(),
            },
            None => Queries::E4m3(q.q.view()),
        },
        k: match (&k.k_scale, &k.kscale) {
            (Some(s), _) => Keys::E2m1 {
                packed: k.k.view(),
                scale: s.view(),
            },
            (None, Some(s)) => Keys::E4m3 {
                codes: k.k.view(),
                scale: s.view(),
            },
            (None, None) => unreachable!("keys have one scale form"),
        },
        weights: q.w.view(),
        k_slots: k.slots.as_ref().map(|s| s.view()),
    }
}
