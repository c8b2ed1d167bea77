//! Number formats of SPEC 2: E4M3, E2M1 (packed two per byte), UE8M0 block
//! scales, and the quantizers that produce them.
//!
//! Decoding is table-driven. Encoding rounds `x` on the format's grid of
//! representable values (round to nearest, ties to even, saturating), which is
//! exactly IEEE rounding because the grid spacing is a power of two within each
//! binade and the even grid point is the one with the even mantissa.

pub mod e2m1;
pub mod e4m3;
pub mod quant;
pub mod ue8m0;

pub use quant::{quantize_fp4_blocks, quantize_fp8_rows, Fp4Floor, Fp8Scale};

/// Round `x / quantum` to the nearest integer, ties to even. `quantum` is a
/// power of two, so the division is exact in f64.
pub(crate) fn round_half_even(v: f64) -> f64 {
    let f = v.floor();
    let diff = v - f;
    if diff > 0.5 || (diff == 0.5 && (f as i64) % 2 != 0) {
        f + 1.0
    } else {
        f
    }
}
